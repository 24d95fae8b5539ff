"""A byte-level BPE tokenizer trained on the corpus, saved in Hugging Face format for vLLM."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS = "<|endoftext|>"
MASK = "<|mask|>"  # the DFlash drafter's mask token; never produced by text
SPECIAL_TOKENS = [EOS, MASK]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_training_texts(docs: list[str], max_chars: int) -> list[str]:
    """A deterministic subset of `docs` of about `max_chars` characters (all when 0): documents taken
    in the order of their text's hash, so the subset spreads over packages and domains."""
    if not max_chars or sum(map(len, docs)) <= max_chars:
        return docs
    import hashlib

    out, total = [], 0
    for doc in sorted(docs, key=lambda d: hashlib.sha1(d.encode()).digest()):
        if total >= max_chars:
            break
        out.append(doc)
        total += len(doc)
    return out


def save_hf_tokenizer(tok, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json, loadable with AutoTokenizer (and so by vLLM)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.model_max_length = 1024
    fast.save_pretrained(str(out_dir))


def load_hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
