"""Token streams per domain and split, and seeded window sampling for training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replicas.models.corpus import DOMAINS, Corpus


@dataclass
class TokenStreams:
    """{domain: {split: int32 token ids}}, documents joined by the end-of-text token."""

    streams: dict[str, dict[str, np.ndarray]]
    eos_id: int

    @classmethod
    def encode(cls, corpus: Corpus, tokenizer, eos_id: int) -> "TokenStreams":
        streams: dict[str, dict[str, np.ndarray]] = {}
        for domain in DOMAINS:
            streams[domain] = {}
            for split, docs in corpus.docs[domain].items():
                encoded = tokenizer.encode_batch(docs)
                ids = []
                for enc in encoded:
                    ids.extend(enc.ids)
                    ids.append(eos_id)
                streams[domain][split] = np.asarray(ids, dtype=np.int32)
        return cls(streams, eos_id)

    def windows(self, domain: str, split: str, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
        stream = self.streams[domain][split]
        starts = rng.integers(0, len(stream) - length, count)
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
