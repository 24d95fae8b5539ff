"""Training text every machine has: the running Python's standard library.

Two domains of different predictability:
- `code`: the standard library's own sources (tests excluded);
- `prose`: pydoc's topic help plus the docstrings of those sources.

Files are split into train and held-out by a hash of their path, so the
held-out text (perplexity, workload prompts) never appears in training.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

DOMAINS = ("code", "prose")
HELD_OUT_BUCKETS = 10  # one file in ten is held out
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo", "encodings"}


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


def load_corpus(max_code_chars: int = 8_000_000) -> Corpus:
    """Deterministic for a given Python installation (files in path order)."""
    import pydoc_data.topics

    root = stdlib_root()
    corpus = Corpus()
    code_chars = 0
    for path in source_files(root):
        key = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if code_chars < max_code_chars:
            corpus.add("code", key, text)
            code_chars += len(text)
        for doc in _docstrings(tree):
            corpus.add("prose", key, doc)
    for name in sorted(pydoc_data.topics.topics):
        corpus.add("prose", f"topic:{name}", pydoc_data.topics.topics[name])
    return corpus
