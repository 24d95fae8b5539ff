"""Token streams per domain and split, and seeded window sampling for training."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replicas.models.corpus import DOMAINS, Corpus


@dataclass
class TokenStreams:
    """{domain: {split: int32 token ids}}, documents joined by the end-of-text token."""

    streams: dict[str, dict[str, np.ndarray]]
    eos_id: int
    chars: dict[str, dict[str, int]] = field(default_factory=dict)  # characters of text behind each stream

    @classmethod
    def encode(cls, corpus: Corpus, tokenizer, eos_id: int, chunk: int = 2000) -> "TokenStreams":
        streams: dict[str, dict[str, np.ndarray]] = {}
        for domain in DOMAINS:
            streams[domain] = {}
            for split, docs in corpus.docs[domain].items():
                parts = []
                for start in range(0, len(docs), chunk):  # in chunks: Encoding objects are large
                    ids = []
                    for enc in tokenizer.encode_batch(docs[start : start + chunk]):
                        ids.extend(enc.ids)
                        ids.append(eos_id)
                    parts.append(np.asarray(ids, dtype=np.int32))
                streams[domain][split] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        chars = {d: {s: corpus.size(d, s) for s in corpus.docs[d]} for d in DOMAINS}
        return cls(streams, eos_id, chars)

    def chars_per_token(self, domain: str, split: str) -> float:
        return self.chars[domain][split] / max(1, len(self.streams[domain][split]))

    def save(self, path: Path, key: str) -> None:
        """A cache of the encoded corpus (uint16 when the vocabulary fits), tagged with `key`."""
        dtype = np.uint16 if max(int(a.max(initial=0)) for d in self.streams.values() for a in d.values()) < 2**16 else np.int32
        arrays = {f"{d}/{s}": a.astype(dtype) for d, splits in self.streams.items() for s, a in splits.items()}
        chars = {f"chars:{d}:{s}": np.asarray(self.chars[d][s]) for d, splits in self.streams.items() for s in splits}
        arrays = {f"tokens:{name.replace('/', ':')}": a for name, a in arrays.items()}
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, key=np.asarray(key), eos_id=np.asarray(self.eos_id), **chars, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str) -> "TokenStreams | None":
        """The cached streams, or None when there is no cache or it was made from other text or tokenizer."""
        if not path.is_file():
            return None
        with np.load(path) as f:
            if str(f["key"]) != key:
                return None
            streams: dict[str, dict[str, np.ndarray]] = {}
            chars: dict[str, dict[str, int]] = {}
            for name in f.files:
                if name.startswith("tokens:"):
                    _, d, s = name.split(":")
                    streams.setdefault(d, {})[s] = f[name].astype(np.int32)
                    chars.setdefault(d, {})[s] = int(f[f"chars:{d}:{s}"])
            return cls(streams, int(f["eos_id"]), chars)

    def windows(self, domain: str, split: str, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
        stream = self.streams[domain][split]
        starts = rng.integers(0, len(stream) - length, count)
        if count == 0:
            return np.zeros((0, length), dtype=np.int64)
        return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)

    def mixed_windows(self, length: int, count: int, code_share: float, rng: np.random.Generator) -> np.ndarray:
        n_code = int(rng.binomial(count, code_share))
        batch = np.concatenate(
            [self.windows("code", "train", length, n_code, rng), self.windows("prose", "train", length, count - n_code, rng)]
        )
        return batch[rng.permutation(count)]

    def unigram_log_probs(self, vocab_size: int) -> np.ndarray:
        """Add-one smoothed unigram log-probabilities over all training tokens (the perplexity baseline)."""
        counts = np.ones(vocab_size)
        for domain in DOMAINS:
            counts += np.bincount(self.streams[domain]["train"], minlength=vocab_size)
        return np.log(counts / counts.sum())


def streams_key(corpus: Corpus, tokenizer_json: str) -> str:
    """Identifies the encoded corpus: the text (every document, per domain and split) and the tokenizer."""
    h = hashlib.sha256(tokenizer_json.encode())
    for domain in DOMAINS:
        for split, docs in corpus.docs[domain].items():
            h.update(f"{domain}/{split}/{len(docs)}".encode())
            for doc in docs:
                h.update(hashlib.sha1(doc.encode()).digest())
    return h.hexdigest()
