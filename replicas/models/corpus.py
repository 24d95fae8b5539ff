"""Training text every machine has: the running Python's standard library, and optionally the
Python sources and documentation of pinned, permissively licensed installed packages.

Two domains of different predictability:
- `code`: Python sources (tests, vendored and generated-looking files excluded);
- `prose`: docstrings of those sources, pydoc's topic help, the packages' long
  descriptions (their README) and their .md/.rst/.txt documents.

Files are split into train and held-out by a hash of their path (for packages,
`name/path`), so the held-out text (perplexity, workload prompts) never appears
in training. The package part is a deterministic function of the pins in the
spec (`name==version`): a package installed at another version stops the load
with a clear message, or is skipped with a note when the spec says so; a
package whose licence is not on the allow-list (`licences.py`) is excluded with
a note. Each package's use is recorded (`CorpusSource`) for the build report.
"""

from __future__ import annotations

import ast
import email
import hashlib
import importlib.metadata
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from replicas.models.licences import licence_of
from replicas.models.spec import CorpusSpec

DOMAINS = ("code", "prose")
HELD_OUT_BUCKETS = 10  # one file in ten is held out
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo", "encodings"}
# Folders of installed packages that hold other projects' code (their own licences) or tests and fixtures.
_PACKAGE_SKIP_PARTS = _SKIP_PARTS | {
    "_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty", "_thirdparty", "externals", "extern",
    "_extern", "testing", "testdata", "test_data", "fixtures", "benchmarks", "examples",
}
_VENDORED_MARKS = ("vendor", "thirdparty", "third_party", "externals")
_DOC_NAMES = ("license", "licence", "copying", "notice", "authors", "entry_points", "top_level", "requires",
              "requirements", "sources", "dependency_links", "installer", "record", "wheel")


class VersionMismatch(RuntimeError):
    """A pinned package is missing or installed at another version than the spec pins."""


class CorpusSource(BaseModel):
    """What one pinned package contributed (or why it did not)."""

    name: str
    version: str  # the pinned version
    installed: str | None  # the installed version, None when missing
    licence: str
    licence_source: str
    used: bool
    note: str = ""
    code_files: int = 0
    prose_docs: int = 0
    code_chars: int = 0
    prose_chars: int = 0
    sha256: str = ""  # over the keys and texts used, in order


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


@dataclass
class Corpus:
    """Documents per domain and split: {domain: {"train": [...], "held_out": [...]}}."""

    docs: dict[str, dict[str, list[str]]] = field(
        default_factory=lambda: {d: {"train": [], "held_out": []} for d in DOMAINS}
    )
    sources: list[CorpusSource] = field(default_factory=list)

    def add(self, domain: str, key: str, text: str) -> None:
        self.docs[domain]["held_out" if is_held_out(key) else "train"].append(text)

    def size(self, domain: str, split: str) -> int:
        return sum(len(t) for t in self.docs[domain][split])


def _docstrings(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                out.append(doc)
    return out


def source_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not (_SKIP_PARTS & set(p.relative_to(root).parts))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def parse_pin(pin: str) -> tuple[str, str]:
    name, sep, version = pin.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise ValueError(f"a package pin is name==version, not {pin!r}")
    return name.strip(), version.strip()


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def find_distribution(name: str, search_path: list[str] | None = None):
    """The installed distribution called `name` (first on the path), or None."""
    for dist in importlib.metadata.distributions(path=search_path) if search_path else importlib.metadata.distributions():
        if _canonical(dist.metadata["Name"] or "") == _canonical(name):
            return dist
    return None


def _prose_like(text: str) -> bool:
    """A .txt document worth reading as prose (not a word list, table or data dump)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 3:
        return False
    mean_len = sum(len(line) for line in lines) / len(lines)
    letters = sum(c.isalpha() or c == " " for c in text) / len(text)
    return 25 <= mean_len <= 200 and letters >= 0.75


def _package_files(dist, spec: CorpusSpec) -> list[tuple[str, Path]]:
    """(key, path) of the package's own .py/.md/.rst/.txt files, in path order."""
    out = []
    for f in dist.files or []:
        rel = f.as_posix()
        parts = rel.split("/")
        if any(p.endswith((".dist-info", ".egg-info", ".data")) for p in parts[:-1]) or parts[0] == "..":
            continue
        folders = [p.lower() for p in parts[:-1]]
        if set(folders) & _PACKAGE_SKIP_PARTS or any(m in f for f in folders for m in _VENDORED_MARKS):
            continue
        stem = parts[-1].rsplit(".", 1)[0].lower()
        suffix = parts[-1].rsplit(".", 1)[-1].lower() if "." in parts[-1] else ""
        if suffix not in ("py", "md", "rst", "txt") or stem.startswith("test_") or stem.endswith("_test"):
            continue
        if suffix != "py" and stem.startswith(_DOC_NAMES):
            continue
        out.append((f"{dist.metadata['Name']}/{rel}", Path(dist.locate_file(f))))
    return sorted(out)


def _add_package(
    corpus: Corpus, name: str, version: str, spec: CorpusSpec, search_path: list[str] | None, seen: set[str]
) -> CorpusSource:
    dist = find_distribution(name, search_path)
    installed = dist.version if dist is not None else None
    licence = licence_of(dist.metadata) if dist is not None else None
    source = CorpusSource(
        name=name, version=version, installed=installed, used=False,
        licence=licence.expression if licence else "UNKNOWN", licence_source=licence.source if licence else "none",
    )
    if dist is None:
        source.note = "not installed"
        return source
    if installed != version:
        source.note = f"installed version {installed} differs from the pinned {version}"
        return source
    if not licence.permitted:
        source.note = f"licence {licence.expression!r} ({licence.source}) is not on the allow-list"
        return source
    digest = hashlib.sha256()
    code_budget = spec.max_package_code_chars

    def add(domain: str, key: str, text: str) -> None:
        corpus.add(domain, key, text)
        digest.update(f"{domain}\x00{key}\x00{text}\x00".encode())
        if domain == "code":
            source.code_files += 1
            source.code_chars += len(text)
        else:
            source.prose_docs += 1
            source.prose_chars += len(text)

    description = dist.metadata.get("Description") or (
        dist.metadata.get_payload() if isinstance(dist.metadata, email.message.Message) else None
    )
    if description and len(description.strip()) >= 200:
        add("prose", f"{dist.metadata['Name']}/METADATA", description.strip())
    # The code cap picks files in an order fixed by their key's hash (spread over the package), read in path order.
    files = _package_files(dist, spec)
    texts = {}
    for key, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or len(text) > spec.max_file_chars:
            continue
        h = hashlib.sha1(text.encode()).hexdigest()
        if h in seen:  # the same file shipped twice (copies across packages or folders)
            continue
        seen.add(h)
        texts[key] = text
    code_keys = {k for k in texts if k.endswith(".py")}
    chosen, total = set(), 0
    for key in sorted(code_keys, key=lambda k: hashlib.sha1(k.encode()).hexdigest()):
        if total >= code_budget:
            break
        chosen.add(key)
        total += len(texts[key])
    for key, text in sorted(texts.items()):
        if key.endswith(".py"):
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            if key in chosen and max(map(len, text.splitlines() or [""])) <= spec.max_line_chars:
                add("code", key, text)
            for doc in _docstrings(tree):
                add("prose", key, doc)
        elif key.endswith((".md", ".rst")) or _prose_like(text):
            add("prose", key, text)
    source.used = True
    source.sha256 = digest.hexdigest()
    return source


def load_corpus(spec: CorpusSpec | None = None, search_path: list[str] | None = None) -> Corpus:
    """Deterministic for a given Python installation and pins (files in path order).

    `spec` defaults to the shipped corpus (the standard library only). `search_path`
    looks for the pinned packages there instead of on `sys.path` (tests).
    """
    import pydoc_data.topics

    spec = spec or CorpusSpec()
    corpus = Corpus()
    if spec.stdlib:
        root = stdlib_root()
        code_chars = 0
        for path in source_files(root):
            key = path.relative_to(root).as_posix()
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (UnicodeDecodeError, SyntaxError, ValueError):
                continue
            if code_chars < spec.max_stdlib_code_chars:
                corpus.add("code", key, text)
                code_chars += len(text)
            for doc in _docstrings(tree):
                corpus.add("prose", key, doc)
        for name in sorted(pydoc_data.topics.topics):
            corpus.add("prose", f"topic:{name}", pydoc_data.topics.topics[name])
    pins = [parse_pin(p) for p in spec.packages]
    if spec.on_version_mismatch == "fail":
        problems = []
        for name, version in pins:
            dist = find_distribution(name, search_path)
            if dist is None or dist.version != version:
                problems.append(f"{name}=={version} (installed: {dist.version if dist else 'none'})")
        if problems:
            raise VersionMismatch(
                "the corpus is pinned to package versions that are not installed: " + ", ".join(problems)
                + ". Install them (pip install 'name==version') or build with on_version_mismatch='skip'"
                " (a different corpus, so different models)."
            )
    seen: set[str] = set()
    for name, version in pins:
        corpus.sources.append(_add_package(corpus, name, version, spec, search_path, seen))
    return corpus
