"""`forespark models build`: tokenizer, target and drafter from the standard library, deterministically.

Writes `<out>/target` (Hugging Face Llama + tokenizer), `<out>/drafter` (vLLM
DFlash checkpoint), `<out>/build_report.json` (held-out perplexity per domain
against a unigram baseline, offline per-position acceptance per domain) and
`<out>/SHA256SUMS`.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel
from tqdm import tqdm

from replicas.models.corpus import DOMAINS, load_corpus
from replicas.models.data import TokenStreams
from replicas.models.dflash import DFlashDrafter
from replicas.models.distill import offline_acceptance, target_continuations, train_drafter
from replicas.models.spec import BuildSpec
from replicas.models.target import held_out_perplexity, new_target, train_target
from replicas.models.tokenizer import EOS, MASK, save_hf_tokenizer, train_tokenizer

WEIGHTS_DIR = Path(__file__).parent / "weights"


class DomainQuality(BaseModel):
    perplexity: float
    unigram_perplexity: float
    offline_acceptance: list[float]  # P(first j drafts match the target's greedy tokens), j = 1..block

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts + the bonus token, greedy, full width."""
        return 1.0 + float(sum(self.offline_acceptance))


class BuildReport(BaseModel):
    spec: BuildSpec
    python: str
    torch: str
    corpus_chars: dict[str, dict[str, int]]
    domains: dict[str, DomainQuality]
    target_loss_last: float
    drafter_loss_last: float
    seconds: dict[str, float]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_checksums(out_dir: Path) -> None:
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{_sha256(p)}  {p.relative_to(out_dir).as_posix()}" for p in files]
    (out_dir / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def verify_checksums(out_dir: Path) -> list[str]:
    """Files whose hash differs from SHA256SUMS (empty when all match)."""
    bad = []
    for line in (out_dir / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        path = out_dir / name
        if not path.is_file() or _sha256(path) != digest:
            bad.append(name)
    return bad


def build(out_dir: Path, spec: BuildSpec | None = None, reuse_target: bool = False) -> BuildReport:
    """Everything, or with `reuse_target` only the drafter against the target already in `out_dir`."""
    spec = spec or BuildSpec()
    torch.manual_seed(spec.train.seed)
    np.random.seed(spec.train.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.time()

    corpus = load_corpus()
    if reuse_target:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out_dir / "target" / "tokenizer.json"))
        previous = BuildReport.model_validate_json((out_dir / "build_report.json").read_text())
        if previous.spec.target != spec.target:
            raise ValueError("the target in the output folder was built from another target spec")
    else:
        tok = train_tokenizer(corpus.docs["code"]["train"] + corpus.docs["prose"]["train"], spec.target.vocab_size)
        save_hf_tokenizer(tok, out_dir / "target")
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)
    streams = TokenStreams.encode(corpus, tok, eos_id)
    seconds["corpus_and_tokenizer"] = time.time() - t0

    t0 = time.time()
    if reuse_target:
        from replicas.models.embedded import load_target

        target = load_target(out_dir / "target")
        target_loss = previous.target_loss_last
        seconds["target"] = previous.seconds["target"]
    else:
        target = new_target(spec.target, eos_id, spec.train.seed)
        with tqdm(total=spec.train.target_steps, desc="target", unit="step") as bar:
            losses = train_target(
                target, streams, spec.train, lambda _s, loss: (bar.update(), bar.set_postfix(loss=f"{loss:.3f}"))
            )
        target.save_pretrained(str(out_dir / "target"), safe_serialization=True)
        target_loss = float(np.mean(losses[-20:]))
        seconds["target"] = time.time() - t0

    t0 = time.time()
    with tqdm(total=spec.train.distill_prompts, desc="target continuations", unit="seq") as bar:
        sequences = target_continuations(target, streams, spec.train, bar.update)
    drafter = DFlashDrafter(spec.drafter, spec.target.hidden_size)
    with tqdm(total=spec.train.drafter_steps, desc="drafter", unit="step") as bar:
        drafter_losses = train_drafter(
            drafter, target, sequences, spec.drafter, spec.train, mask_id,
            lambda _s, loss: (bar.update(), bar.set_postfix(loss=f"{loss:.3f}")),
        )
    drafter.save(out_dir / "drafter", vocab_size=spec.target.vocab_size, mask_token_id=mask_id, max_positions=spec.target.max_positions)
    seconds["drafter"] = time.time() - t0

    t0 = time.time()
    quality = evaluate_models(target, drafter, streams, spec, mask_id)
    seconds["evaluation"] = time.time() - t0
    report = BuildReport(
        spec=spec,
        python=platform.python_version(),
        torch=torch.__version__,
        corpus_chars={d: {s: corpus.size(d, s) for s in ("train", "held_out")} for d in DOMAINS},
        domains=quality,
        target_loss_last=target_loss,
        drafter_loss_last=float(np.mean(drafter_losses[-20:])),
        seconds=seconds,
    )
    (out_dir / "build_report.json").write_text(report.model_dump_json(indent=2) + "\n")
    write_checksums(out_dir)
    return report


@torch.no_grad()
def evaluate_models(
    target, drafter: DFlashDrafter, streams: TokenStreams, spec: BuildSpec, mask_id: int
) -> dict[str, DomainQuality]:
    """Held-out perplexity, and offline acceptance on the target's continuations of held-out prompts."""
    ppl = held_out_perplexity(target, streams, spec.train.seq_len)
    rng = np.random.default_rng(spec.train.seed + 5)
    out = {}
    for domain in DOMAINS:
        prompts = torch.from_numpy(streams.windows(domain, "held_out", spec.train.distill_prompt_len, 32, rng))
        seqs = target.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=spec.train.distill_new_tokens,
            min_new_tokens=spec.train.distill_new_tokens, do_sample=False, pad_token_id=target.config.eos_token_id,
        )
        acc = offline_acceptance(drafter, target, seqs, spec.drafter, mask_id, start=spec.train.distill_prompt_len - 1)
        out[domain] = DomainQuality(**ppl[domain], offline_acceptance=acc.tolist())
    return out



def compare_reports(reference: BuildReport, rebuilt: BuildReport, tolerance: float = 0.15) -> list[str]:
    """Where a rebuild's quality departs from the reference by more than `tolerance` (relative)."""
    problems = []
    for domain, ref in reference.domains.items():
        new = rebuilt.domains.get(domain)
        if new is None:
            problems.append(f"{domain}: missing from the rebuild")
            continue
        for name, a, b in (
            ("perplexity", ref.perplexity, new.perplexity),
            ("mean accepted length", ref.mean_accepted_length, new.mean_accepted_length),
        ):
            if abs(b - a) > tolerance * a:
                problems.append(f"{domain} {name}: reference {a:.3f}, rebuild {b:.3f}")
        if new.perplexity >= new.unigram_perplexity:
            problems.append(f"{domain}: rebuild does not beat the unigram baseline")
    return problems
