"""Which installed distributions the corpus may read: an explicit allow-list of permissive licences.

A distribution's licence is read from its metadata, in this order:
1. `License-Expression` (PEP 639, an SPDX expression);
2. `License ::` trove classifiers (several classifiers mean a choice: joined with OR);
3. the free-text `License` field, when it is a short name (full licence texts are not guessed at).

The expression is then judged against `ALLOWED`: `A OR B` needs one side allowed,
`A AND B` needs both, `A WITH exception` needs A allowed and the exception in
`ALLOWED_EXCEPTIONS`. Anything unknown, copyleft (GPL, LGPL, MPL, ...) or
proprietary is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# SPDX ids (plus "BSD", the generic BSD classifier) whose terms allow training on the text.
ALLOWED = frozenset(
    {
        "MIT", "MIT-0", "MIT-CMU", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0",
        "ISC", "PSF-2.0", "Python-2.0", "CNRI-Python", "Unlicense", "CC0-1.0", "Zlib", "BSL-1.0",
    }
)
ALLOWED_EXCEPTIONS = frozenset({"LLVM-exception"})

_CLASSIFIERS = {
    "MIT License": "MIT",
    "MIT No Attribution License (MIT-0)": "MIT-0",
    "BSD License": "BSD",
    "Apache Software License": "Apache-2.0",
    "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC",
    "The Unlicense (Unlicense)": "Unlicense",
    "zlib/libpng License": "Zlib",
    "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
    "Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "GNU General Public License (GPL)": "GPL",
    "GNU General Public License v2 (GPLv2)": "GPL-2.0",
    "GNU General Public License v3 (GPLv3)": "GPL-3.0",
    "GNU Lesser General Public License v2 (LGPLv2)": "LGPL-2.0",
    "GNU Lesser General Public License v3 (LGPLv3)": "LGPL-3.0",
    "GNU Affero General Public License v3": "AGPL-3.0",
    "Other/Proprietary License": "LicenseRef-Proprietary",
}

_FREE_TEXT = {
    "mit": "MIT",
    "mit license": "MIT",
    "the mit license": "MIT",
    "bsd": "BSD",
    "bsd license": "BSD",
    "new bsd": "BSD-3-Clause",
    "new bsd license": "BSD-3-Clause",
    "3-clause bsd license": "BSD-3-Clause",
    "bsd 3-clause license": "BSD-3-Clause",
    "bsd 3-clause": "BSD-3-Clause",
    "bsd-3-clause": "BSD-3-Clause",
    "bsd-2-clause": "BSD-2-Clause",
    "apache 2.0": "Apache-2.0",
    "apache-2.0": "Apache-2.0",
    "apache 2": "Apache-2.0",
    "apache 2.0 license": "Apache-2.0",
    "apache license 2.0": "Apache-2.0",
    "apache license, version 2.0": "Apache-2.0",
    "apache software license": "Apache-2.0",
    "psf": "PSF-2.0",
    "psf-2.0": "PSF-2.0",
    "psf license": "PSF-2.0",
    "isc": "ISC",
    "isc license": "ISC",
    "unlicense": "Unlicense",
    "zlib": "Zlib",
}


@dataclass(frozen=True)
class Licence:
    expression: str  # SPDX-like expression, or "UNKNOWN"
    source: str  # "License-Expression", "Classifier", "License" or "none"
    permitted: bool


def _tokens(expression: str) -> list[str]:
    return re.findall(r"\(|\)|[^\s()]+", expression)


def expression_permitted(expression: str) -> bool:
    """True when the SPDX expression is satisfiable with allowed licences only (unknown ids refuse)."""
    tokens = _tokens(expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"truncated licence expression: {expression!r}")
        pos += 1
        return tokens[pos - 1]

    def factor() -> bool:
        tok = take()
        if tok == "(":
            value = disjunction()
            if take() != ")":
                raise ValueError(f"unbalanced licence expression: {expression!r}")
            return value
        ok = tok.rstrip("+") in ALLOWED
        if peek() == "WITH":
            take()
            ok = ok and take() in ALLOWED_EXCEPTIONS
        return ok

    def conjunction() -> bool:
        value = factor()
        while peek() == "AND":
            take()
            value = factor() and value
        return value

    def disjunction() -> bool:
        value = conjunction()
        while peek() == "OR":
            take()
            value = conjunction() or value
        return value

    try:
        value = disjunction()
        return value and pos == len(tokens)
    except ValueError:
        return False


def licence_of(metadata) -> Licence:
    """The licence a distribution's metadata (`importlib.metadata` message) declares."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        return Licence(expression, "License-Expression", expression_permitted(expression))
    classifiers = [c.split("::")[-1].strip() for c in (metadata.get_all("Classifier") or []) if c.startswith("License ::")]
    ids = sorted({_CLASSIFIERS.get(c, f"LicenseRef-{c.replace(' ', '-')}") for c in classifiers if c != "OSI Approved"})
    if ids:
        expression = " OR ".join(ids)
        return Licence(expression, "Classifier", expression_permitted(expression))
    text = (metadata.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 60:
        spdx = _FREE_TEXT.get(text.lower(), text)  # else taken as an SPDX expression, e.g. "MPL-2.0 AND MIT"
        return Licence(spdx, "License", expression_permitted(spdx))
    return Licence("UNKNOWN", "none", False)
