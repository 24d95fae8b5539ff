"""`forespark models build`: tokenizer, target and drafter from Python text every machine has, deterministically.

Writes `<out>/target` (Hugging Face Llama + tokenizer), `<out>/drafter` (vLLM
DFlash checkpoint), `<out>/build_report.json` (held-out perplexity and bits per
character per domain against a unigram baseline, offline per-position
acceptance per domain, greedy and at T=1, the corpus' packages and licences)
and `<out>/SHA256SUMS`.

With a checkpoint folder the build is resumable: it writes the full state
(`checkpoint.py`) there every `checkpoint_minutes` and at the end of each phase
(target -> continuations -> drafter -> [polish: unlikelihood ->
polish_continuations -> polish_drafter] -> evaluation), on SIGTERM/SIGINT too, plus
a compact copy at the end of each phase (`<phase>-done.compact.pt`), and
`progress.jsonl` (loss, learning rate, periodic held-out evaluation). `resume`
continues from the folder's state (when it has one, even with `resume_from`); `resume_from` from a
(compact) checkpoint file.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel
from tqdm import tqdm

from replicas.models import checkpoint as ckpt
from replicas.models.corpus import DOMAINS, load_corpus
from replicas.models.data import TokenStreams, streams_key
from replicas.models.dflash import DFlashDrafter, target_features
from replicas.models.distill import (
    DrafterTrainer,
    continuation_batches,
    continuation_plan,
    continue_batch,
    offline_acceptance,
    offline_acceptance_sampled,
    target_continuations,
)
from replicas.models.spec import BuildSpec, TrainSpec
from replicas.models.target import TargetTrainer, decay_start, held_out_perplexity, new_target
from replicas.models.tokenizer import EOS, MASK, save_hf_tokenizer, tokenizer_training_texts, train_tokenizer
from replicas.models.unlikelihood import UnlikelihoodTrainer, continuation_loop_share, greedy_continuations, loop_share

from replicas.models import WEIGHTS_DIR  # noqa: E402,F401 (where the build writes and callers find the pair)
from replicas.models.report import BuildReport, DomainQuality  # noqa: E402,F401 (what a build writes)
PHASES = ("target", "continuations", "drafter", "unlikelihood", "polish_continuations", "polish_drafter", "evaluation")
POLISH_PHASES = PHASES[3:6]


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


class Interrupted(RuntimeError):
    """The build stopped on SIGTERM/SIGINT after saving its state."""


class _StopSignals:
    """Turns SIGTERM/SIGINT into a flag checked between steps (so the state saved is a consistent one)."""

    def __init__(self, active: bool) -> None:
        self.active, self.requested, self.previous = active, False, {}

    def __enter__(self) -> "_StopSignals":
        if self.active:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self.previous[sig] = signal.signal(sig, self._handler)
                except ValueError:  # not the main thread
                    pass
        return self

    def _handler(self, signum, _frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _spec_differences(a: BuildSpec, b: BuildSpec) -> list[str]:
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _drafter_phase_setting(name: str) -> bool:
    """Settings that only the drafter phase reads: the drafter's shape and its training."""
    return name.startswith(("drafter.", "train.drafter_")) or name == "train.kl_weight"


def _drafter_extended(saved: TrainSpec, new: TrainSpec, changed: list[str]) -> bool:
    """The new drafter schedule continues the saved one: every step the saved run could have taken has the same
    learning rate and data under both (the saved end becomes a warm restart)."""
    cycles = len(saved.drafter_restarts) + 1
    per_cycle = (TrainSpec.drafter_code_share, TrainSpec.drafter_kl_weight)
    return (set(changed) <= {"train.drafter_steps", "train.drafter_restarts", "train.drafter_cycle_code_shares",
                             "train.drafter_cycle_kl_weights"}
            and new.drafter_steps > saved.drafter_steps and saved.drafter_steps in new.drafter_restarts
            and new.drafter_restarts[:len(saved.drafter_restarts)] == saved.drafter_restarts
            and all(setting(new, i) == setting(saved, i) for setting in per_cycle for i in range(cycles)))


def check_resumable(state: dict, spec: BuildSpec) -> None:
    """A checkpoint continues under the spec that wrote it. These changes are allowed: more (or fewer)
    `train.target_steps` for a `wsd` schedule with explicit `warmup_steps` while the run is still in the
    constant part under both step counts; any drafter-phase setting (`drafter.*`, `train.drafter_*`,
    `train.kl_weight`) before the drafter phase has started, and after it a longer drafter run that restarts
    its schedule where the saved one ends (`_drafter_extended`), until the polish stage starts; any `polish.*`
    setting until the polish stage starts (a finished build takes it on)."""
    saved = BuildSpec.model_validate(state["spec"])
    diffs = {d.split(":")[0]: d for d in _spec_differences(saved, spec)}
    # bfloat16 autocast is a speed setting (emulated, ~10x slower, on a CPU without AVX512-BF16) and the weights' storage
    # type applies to the finished models only: any resume may change either.
    other = [d for k, d in diffs.items()
             if k not in ("train.target_steps", "train.bf16_autocast", "weights_dtype") and not _drafter_phase_setting(k) and not k.startswith("polish.")]
    if other:
        raise ValueError("the checkpoint was written under another spec: " + "; ".join(other))
    phase = state["phase"]
    polish_started = phase in POLISH_PHASES or "polish" in state
    polish_changed = [k for k in diffs if k.startswith("polish.")]
    if polish_changed and polish_started:
        raise ValueError(f"polish settings ({', '.join(polish_changed)}) can change only before the polish stage starts")
    drafter_started = PHASES.index(phase) > PHASES.index("drafter") or (phase == "drafter" and "drafter" in state)
    changed = [k for k in diffs if _drafter_phase_setting(k)]
    if changed and drafter_started and (polish_started or not _drafter_extended(saved.train, spec.train, changed)):
        raise ValueError(f"drafter-phase settings ({', '.join(changed)}) can change only before the drafter phase, "
                         "except a longer run whose restarts add the saved run's last step, before the polish stage")
    if saved.train.target_steps != spec.train.target_steps:
        if phase != "target":
            raise ValueError("train.target_steps can change only while the target trains")
        step = int(state["target"]["step"])
        if spec.train.lr_schedule != "wsd" or spec.train.warmup_steps is None:
            raise ValueError("train.target_steps can change only under the wsd schedule with explicit warmup_steps")
        limit = min(decay_start(saved.train), decay_start(spec.train))
        if step > limit:
            raise ValueError(f"the checkpoint (step {step}) is past the constant learning rate of one of the schedules (step {limit})")


@torch.no_grad()
def estimate_seconds(spec: BuildSpec, eos_id: int, mask_id: int, repeats: int = 2) -> dict[str, float]:
    """Seconds per target step, drafter step, continuation token and prefill, timed here on throwaway
    models (random weights and tokens: the cost does not depend on them); the global RNGs are untouched."""
    t = spec.train
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        target = new_target(spec.target, eos_id, 12345)
        drafter = DFlashDrafter(spec.drafter, spec.target.hidden_size)
        v = spec.target.vocab_size
        batch = torch.randint(0, v, (t.target_batch, t.seq_len))

        def timed(fn, times: int = repeats) -> float:
            fn()  # warm-up
            t0 = time.perf_counter()
            for _ in range(times):
                fn()
            return (time.perf_counter() - t0) / times

        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.bf16_autocast)  # noqa: E731

        def target_step():
            with torch.enable_grad(), autocast():
                target(input_ids=batch, labels=batch).loss.backward()
            target.zero_grad(set_to_none=True)

        length = t.distill_prompt_len + t.distill_new_tokens
        seqs = torch.randint(0, v, (t.drafter_batch, length))

        def drafter_step():
            from replicas.models.distill import distill_loss

            with autocast():
                logits, aux = target_features(target, seqs, spec.drafter.target_layer_ids)
                anchors = torch.randint(t.distill_prompt_len - 1, length - spec.drafter.block - 1, (t.drafter_batch, t.drafter_anchors))
                with torch.enable_grad():
                    distill_loss(drafter, seqs, logits.float(), aux, anchors, target.get_input_embeddings().weight.detach(),
                                 spec.drafter, mask_id, t.kl_weight, t.drafter_labels, t.drafter_position_decay).backward()
            drafter.zero_grad(set_to_none=True)

        prompts = torch.randint(0, v, (min(t.distill_gen_batch, t.distill_prompts), t.distill_prompt_len))

        def gen(n: int):
            return lambda: greedy_continuations(target, prompts, n)

        def per_token_and_prefill(n4, n12) -> tuple[float, float]:
            g4, g12 = timed(n4, 1), timed(n12, 1)
            per_token = max(0.0, (g12 - g4) / 8)
            return per_token, max(0.0, g4 - 4 * per_token)

        target.train()
        step = timed(target_step)
        target.eval()
        dstep = timed(drafter_step)
        out = {"target_step": step, "drafter_step": dstep}
        out["gen_token"], out["gen_prefill"] = per_token_and_prefill(gen(4), gen(12))
        if spec.polish.active:  # the polish stage continues a few prefixes at a time: cheaper per token than a full batch
            prompts = prompts[: spec.polish.unlikelihood_prefixes]
            out["polish_gen_token"], out["polish_gen_prefill"] = per_token_and_prefill(gen(4), gen(12))
    return out


def format_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def polish_drafter_train(spec: BuildSpec) -> TrainSpec:
    """The polish stage's drafter schedule: one cycle of `polish.drafter_steps` at `polish.drafter_lr`, at the code
    share (unless `polish.drafter_code_share`) and KL weight of the main schedule's last cycle."""
    t, p, last = spec.train, spec.polish, len(spec.train.drafter_restarts)
    share = t.drafter_code_share(last) if p.drafter_code_share is None else p.drafter_code_share
    return t.model_copy(update={
        "drafter_steps": p.drafter_steps, "drafter_lr": p.drafter_lr, "drafter_restarts": [],
        "drafter_cycle_code_shares": [share], "drafter_cycle_kl_weights": [t.drafter_kl_weight(last)],
    })


def remaining_estimate(spec: BuildSpec, unit: dict[str, float], phase: str, target_step: int = 0, drafter_step: int = 0) -> dict[str, float]:
    """Seconds left per phase from `unit` (estimate_seconds) at a position of the build (the step counts are those of
    the phase under way)."""
    t, p = spec.train, spec.polish
    batches = math.ceil(t.distill_prompts * (1 - t.distill_sampled_share) / t.distill_gen_batch) + math.ceil(
        t.distill_prompts * t.distill_sampled_share / t.distill_gen_batch
    )
    gen = batches * unit["gen_prefill"] + batches * t.distill_new_tokens * unit["gen_token"]
    order = PHASES.index(phase)
    # A polish step: a likelihood batch, a greedy continuation of its prefixes, and the unlikelihood pass over them.
    ul_step = unit["target_step"] * (p.unlikelihood_mle_batch * t.seq_len + p.unlikelihood_prefixes
                                     * (p.unlikelihood_prefix_len + p.unlikelihood_new_tokens)) / (t.target_batch * t.seq_len)
    prefill, per_token = unit.get("polish_gen_prefill", unit["gen_prefill"]), unit.get("polish_gen_token", unit["gen_token"])
    ul_step += prefill + p.unlikelihood_new_tokens * per_token
    out = {
        "target": (t.target_steps - target_step) * unit["target_step"] if order == 0 else 0.0,
        "continuations": gen if order <= 1 else 0.0,
        "drafter": (t.drafter_steps - drafter_step) * unit["drafter_step"] if order <= 2 else 0.0,
        "unlikelihood": (p.unlikelihood_steps - (target_step if order == 3 else 0)) * ul_step if p.active and order <= 3 else 0.0,
        "polish_continuations": gen if p.active and order <= 4 else 0.0,
        "polish_drafter": (p.drafter_steps - (drafter_step if order == 5 else 0)) * unit["drafter_step"] if p.active and order <= 5 else 0.0,
        # two domains: 32 greedy + 32 sampled continuations each, perplexity windows, acceptance
        "evaluation": 4 * (unit["gen_prefill"] + t.distill_new_tokens * unit["gen_token"]) * 32 / min(t.distill_gen_batch, t.distill_prompts)
        + 8 * unit["target_step"],
    }
    if t.eval_every and order == 0:
        out["target"] += (t.target_steps - target_step) // t.eval_every * unit["target_step"] * t.eval_windows / t.target_batch
    return out


def claim_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Refuse a folder that another live build process writes to (its pid in `build.pid`), then claim it."""
    import os

    lock = checkpoint_dir / "build.pid"
    if lock.is_file():
        try:
            pid = int(lock.read_text().split()[0])
        except (ValueError, IndexError):
            pid = None
        if pid and pid != os.getpid():
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
            if alive:
                raise RuntimeError(
                    f"build process {pid} is using {checkpoint_dir} (stopped or running); end it first "
                    f"(kill -TERM {pid} saves its state; kill -CONT first if it is stopped)"
                )
    lock.write_text(f"{os.getpid()}\n")


def build(
    out_dir: Path,
    spec: BuildSpec | None = None,
    reuse_target: bool = False,
    *,
    checkpoint_dir: Path | None = None,
    checkpoint_minutes: float = 10.0,
    resume: bool = False,
    resume_from: Path | None = None,
    estimate_only: bool = False,
    log: Callable[[str], None] = print,
    stop_after: Callable[[str, int], bool] | None = None,
) -> BuildReport | None:
    """Everything, or with `reuse_target` only the drafter against the target already in `out_dir`.

    With `checkpoint_dir` the state is saved there (see the module docstring); `resume` continues
    from it, `resume_from` from a checkpoint file. `estimate_only` prints how long the build would
    take and returns None. `stop_after(phase, step)` (tests) stops like a signal would, after saving.
    """
    spec = spec or BuildSpec()
    torch.manual_seed(spec.train.seed)
    np.random.seed(spec.train.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        claim_checkpoint_dir(checkpoint_dir)
    state = None
    # `resume` with a state in the folder wins over `resume_from`: an interrupted build is continued by its
    # own command plus --resume, and that command may name the checkpoint it first started from.
    if resume and checkpoint_dir is not None and (checkpoint_dir / ckpt.STATE_FILE).is_file():
        state = ckpt.load(checkpoint_dir / ckpt.STATE_FILE)
    elif resume_from is not None:
        state = ckpt.load(Path(resume_from))
    elif resume:
        log(f"no checkpoint in {checkpoint_dir}: building from the start")
    if state is not None:
        check_resumable(state, spec)
        if state["phase"] == "evaluation":
            done_at = int(state["drafter"].get("step", BuildSpec.model_validate(state["spec"]).train.drafter_steps))
            if done_at < spec.train.drafter_steps:  # a longer drafter run: back to its training (`_drafter_extended`)
                state = {**state, "phase": "drafter", "drafter": {**state["drafter"], "finished": True, "step": done_at}}
            elif spec.polish.active and "polish" not in state:  # a finished build takes on the polish stage
                state = {**state, "phase": "unlikelihood"}
        where = state["phase"] + (f" step {state['target']['step']}" if state["phase"] == "target" else "")
        where += f" step {state['drafter']['step']}" if state["phase"] == "drafter" and "drafter" in state else ""
        part = {"unlikelihood": "unlikelihood", "polish_drafter": "drafter"}.get(state["phase"])
        where += f" step {state['polish'][part]['step']}" if part and part in state.get("polish", {}) else ""
        log(f"resuming at {where}" + (" (from a compact checkpoint: AdamW first moments re-warm)" if state.get("resumed_from_compact") else ""))
    seconds: dict[str, float] = dict(state["seconds"]) if state else {}
    resumes = int(state.get("resumes", 0)) + 1 if state else 0
    mark = time.time()

    def tick(name: str) -> None:
        nonlocal mark
        now = time.time()
        seconds[name] = seconds.get(name, 0.0) + now - mark
        mark = now

    corpus = load_corpus(spec.corpus)
    for source in corpus.sources:
        if not source.used:
            log(f"corpus: {source.name}=={source.version} not used: {source.note}")
    previous = None
    if reuse_target:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out_dir / "target" / "tokenizer.json"))
        previous = BuildReport.model_validate_json((out_dir / "build_report.json").read_text())
        if previous.spec.target != spec.target:
            raise ValueError("the target in the output folder was built from another target spec")
    elif state is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(state["tokenizer"])
    else:
        texts = tokenizer_training_texts(
            corpus.docs["code"]["train"] + corpus.docs["prose"]["train"], spec.train.tokenizer_train_chars
        )
        tok = train_tokenizer(texts, spec.target.vocab_size)
    if not reuse_target:
        save_hf_tokenizer(tok, out_dir / "target")
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)
    key = streams_key(corpus, tok.to_str())
    cache = checkpoint_dir / "streams.npz" if checkpoint_dir is not None else None
    streams = TokenStreams.load(cache, key) if cache is not None else None
    if streams is None:
        streams = TokenStreams.encode(corpus, tok, eos_id)
        if cache is not None:
            streams.save(cache, key)
    tick("corpus_and_tokenizer")

    phase = state["phase"] if state else ("continuations" if reuse_target else "target")
    unit = estimate_seconds(spec, eos_id, mask_id)
    left = remaining_estimate(
        spec, unit, phase,
        target_step=int(state["target"]["step"]) if state and phase == "target"
        else int(state["polish"]["unlikelihood"]["step"]) if state and phase == "unlikelihood" and "unlikelihood" in state.get("polish", {}) else 0,
        drafter_step=int(state["drafter"]["step"]) if state and phase == "drafter" and "drafter" in state
        else int(state["polish"]["drafter"]["step"]) if state and phase == "polish_drafter" and "drafter" in state.get("polish", {}) else 0,
    )
    log(
        f"estimated time left on {torch.get_num_threads()} thread(s): "
        + ", ".join(f"{k} {format_duration(v)}" for k, v in left.items() if v)
        + f"; total {format_duration(sum(left.values()))}"
        + f" (target step {unit['target_step']:.2f} s, drafter step {unit['drafter_step']:.2f} s)"
    )
    if estimate_only:
        return None
    mark = time.time()

    clock = ckpt.Clock(checkpoint_minutes)
    progress_path = checkpoint_dir / "progress.jsonl" if checkpoint_dir is not None else None

    def record(entry: dict) -> None:
        if progress_path is not None:
            with progress_path.open("a") as f:
                f.write(json.dumps({"time": time.time(), **entry}) + "\n")

    def snapshot(phase_now: str, **parts) -> dict:
        return {
            "format": ckpt.FORMAT, "kind": "full", "spec": spec.model_dump(mode="json"), "phase": phase_now,
            "tokenizer": tok.to_str(), "torch_rng": torch.get_rng_state(), "seconds": dict(seconds),
            "resumes": resumes, **parts,
        }

    def save(phase_now: str, stage_done: str | None = None, **parts) -> None:
        if checkpoint_dir is None:
            return
        tick(phase_now if stage_done is None else stage_done)
        state_now = snapshot(phase_now, **parts)
        ckpt.save(state_now, checkpoint_dir / ckpt.STATE_FILE)
        if stage_done is not None:
            ckpt.save(ckpt.compact(state_now), checkpoint_dir / f"{stage_done}-done.compact.pt")
        record({"event": "checkpoint", "phase": phase_now})
        clock.reset()

    if reuse_target:
        from replicas.models.embedded import load_target

        target = load_target(out_dir / "target")
        target_losses = [previous.target_loss_last]
        seconds["target"] = previous.seconds["target"]
    else:
        target = new_target(spec.target, eos_id, spec.train.seed)
    if state is not None:
        torch.set_rng_state(state["torch_rng"])

    with _StopSignals(checkpoint_dir is not None) as stop:

        def should_stop(phase_now: str, step: int) -> bool:
            return stop.requested or (stop_after is not None and stop_after(phase_now, step))

        def run_trainer(trainer, phase_now: str, total: int, save_with: Callable[[dict], None],
                        after_step: Callable[[tqdm, float], None] | None = None) -> None:
            """Steps `trainer` to its end, saving its state through `save_with` on the clock and on a stop request."""
            with tqdm(total=total, initial=trainer.step, desc=phase_now, unit="step", smoothing=0.02) as bar:
                while not trainer.done:
                    loss = trainer.run_step()
                    bar.update()
                    bar.set_postfix(loss=f"{loss:.3f}")
                    if trainer.step % 25 == 0:
                        record({"phase": phase_now, "step": trainer.step, "loss": float(np.mean(trainer.losses[-25:])),
                                "lr": float(trainer.opt.opt.param_groups[0]["lr"]),
                                "seconds": seconds.get(phase_now, 0.0) + time.time() - mark})
                    if after_step is not None:
                        after_step(bar, loss)
                    stopping = should_stop(phase_now, trainer.step)
                    if trainer.done:
                        break
                    if clock.due() or stopping:
                        save_with(trainer.state_dict())
                    if stopping:
                        raise Interrupted(f"stopped at {phase_now} step {trainer.step}; state in {checkpoint_dir}")

        def run_continuations(phase_now: str, done: dict, save_with: Callable[[dict], None]) -> tuple[torch.Tensor, torch.Tensor]:
            """The target's continuations of the drafter's training prompts; `done` holds batches from a checkpoint."""
            done = {k: v.long() for k, v in done.items() if isinstance(k, int)}
            prompts, sampled = continuation_plan(streams, spec.train)
            n_batches = len(continuation_batches(prompts, sampled, spec.train.distill_gen_batch))

            def on_batch(b: int, seqs: torch.Tensor) -> None:
                done[b] = seqs
                stopping = should_stop(phase_now, len(done))
                if len(done) < n_batches and (clock.due() or stopping):
                    save_with(dict(done))
                if stopping and len(done) < n_batches:
                    raise Interrupted(f"stopped after {len(done)} of {n_batches} continuation batches; state in {checkpoint_dir}")

            with tqdm(total=len(prompts), desc=f"{phase_now} (target)", unit="seq") as bar:
                return target_continuations(target, streams, spec.train, bar.update, done=done, on_batch=on_batch)

        if phase == "target":
            trainer = TargetTrainer(target, streams, spec.train)
            if state is not None:
                trainer.load_state_dict(state["target"])
            unigram = streams.unigram_log_probs(spec.target.vocab_size) if spec.train.eval_every else None

            def target_eval(bar: tqdm, _loss: float) -> None:
                bar.set_postfix(loss=f"{_loss:.3f}", lr=f"{trainer.lr:.2e}")
                if spec.train.eval_every and trainer.step % spec.train.eval_every == 0:
                    q = held_out_perplexity(target, streams, spec.train.seq_len, spec.train.eval_windows, unigram=unigram)
                    record({"phase": "target", "step": trainer.step, "eval": q})
                    bar.write(f"step {trainer.step}: held-out " + ", ".join(
                        f"{d} perplexity {v['perplexity']:.2f} ({v.get('bits_per_char', float('nan')):.3f} bits/char)" for d, v in q.items()))

            run_trainer(trainer, "target", spec.train.target_steps, lambda part: save("target", target=part), target_eval)
            target.eval()
            target_losses = trainer.losses
            phase = "continuations"
            save(phase, stage_done="target", target={"weights": target.state_dict(), "losses": target_losses})
        elif not reuse_target:
            target.load_state_dict(state["target"]["weights"])
            target.eval()
            target_losses = list(state["target"]["losses"])
        if not reuse_target:
            target.save_pretrained(str(out_dir / "target"), safe_serialization=True)
        target_part = {"weights": target.state_dict(), "losses": target_losses} if not reuse_target else None

        if phase == "continuations":
            sequences, sampled = run_continuations(
                "continuations", (state or {}).get("continuations", {}),
                lambda done: save("continuations", target=target_part, continuations=done),
            )
            phase = "drafter"
            save(phase, stage_done="continuations", target=target_part, continuations={"sequences": sequences, "sampled": sampled})
        else:
            sequences = state["continuations"]["sequences"].long()
            sampled = state["continuations"]["sampled"]

        drafter = DFlashDrafter(spec.drafter, spec.target.hidden_size)
        if spec.drafter.init_from_target:
            with torch.no_grad():
                drafter.norm.weight.copy_(target.model.norm.weight)
        continuations_part = {"sequences": sequences, "sampled": sampled}
        if phase == "drafter":
            trainer = DrafterTrainer(drafter, target, sequences, spec.drafter, spec.train, mask_id, streams)
            if state is not None and state["phase"] == "drafter" and "drafter" in state:
                part = state["drafter"]
                if part.get("finished"):
                    trainer.continue_finished(part["weights"], part["step"], part["losses"])
                else:
                    trainer.load_state_dict(part)
                torch.set_rng_state(state["torch_rng"])
            run_trainer(trainer, "drafter", spec.train.drafter_steps,
                        lambda part: save("drafter", target=target_part, continuations=continuations_part, drafter=part))
            drafter.eval()
            drafter_part = {"weights": drafter.state_dict(), "losses": trainer.losses, "step": trainer.step}
            phase = "unlikelihood" if spec.polish.active else "evaluation"
            save(phase, stage_done="drafter", target=target_part, continuations=continuations_part, drafter=drafter_part)
        else:
            drafter_part = state["drafter"]
            drafter.load_state_dict(drafter_part["weights"])
            drafter.eval()
        drafter_losses = list(drafter_part["losses"])

        if spec.polish.active:
            polish = spec.polish
            polished = dict((state or {}).get("polish", {}))

            def save_polish(phase_now: str, stage_done: str | None = None, **parts) -> None:
                save(phase_now, stage_done, target=target_part, continuations=continuations_part, drafter=drafter_part,
                     polish={**polished, **parts})

            if phase == "unlikelihood":
                trainer = UnlikelihoodTrainer(target, streams, polish, spec.train)
                if "unlikelihood" in polished:
                    trainer.load_state_dict(polished["unlikelihood"])

                def polish_eval(bar: tqdm | None = None, _loss: float = 0.0) -> None:
                    if bar is not None:
                        bar.set_postfix(loss=f"{_loss:.3f}", repeated=f"{trainer.repeated[-1]:.2f}")
                    if polish.eval_every and trainer.step % polish.eval_every == 0:
                        q, loops = held_out_perplexity(target, streams, spec.train.seq_len, spec.train.eval_windows), loop_share(target, streams, polish)
                        record({"phase": "unlikelihood", "step": trainer.step, "eval": q, "loops": loops})
                        (bar.write if bar is not None else log)(f"step {trainer.step}: held-out " + ", ".join(
                            f"{d} perplexity {q[d]['perplexity']:.2f}, repeated 4-grams {loops[d]:.1%}" for d in q))

                if trainer.step == 0:
                    polish_eval()  # where the stage starts from
                run_trainer(trainer, "unlikelihood", polish.unlikelihood_steps, lambda part: save_polish("unlikelihood", unlikelihood=part),
                            polish_eval)
                target.eval()
                polished = {"target": {"weights": target.state_dict(), "losses": trainer.losses, "repeated": trainer.repeated}}
                phase = "polish_continuations"
                save_polish(phase, stage_done="unlikelihood")
            else:
                target.load_state_dict(polished["target"]["weights"])
                target.eval()
            target.save_pretrained(str(out_dir / "target"), safe_serialization=True)

            if phase == "polish_continuations":
                sequences, sampled = run_continuations(
                    "polish_continuations", polished.get("continuations", {}),
                    lambda done: save_polish("polish_continuations", continuations=done),
                )
                polished["continuations"] = {"sequences": sequences, "sampled": sampled}
                phase = "polish_drafter"
                save_polish(phase, stage_done="polish_continuations")
            else:
                sequences = polished["continuations"]["sequences"].long()

            if phase == "polish_drafter":
                trainer = DrafterTrainer(drafter, target, sequences, spec.drafter, polish_drafter_train(spec), mask_id, streams)
                if "drafter" in polished:
                    trainer.load_state_dict(polished["drafter"])
                    torch.set_rng_state(state["torch_rng"])
                run_trainer(trainer, "polish_drafter", polish.drafter_steps, lambda part: save_polish("polish_drafter", drafter=part))
                drafter.eval()
                polished["drafter"] = {"weights": drafter.state_dict(), "losses": trainer.losses, "step": trainer.step}
                phase = "evaluation"
                save_polish(phase, stage_done="polish_drafter")
            else:
                drafter.load_state_dict(polished["drafter"]["weights"])
                drafter.eval()
            drafter_losses = drafter_losses + list(polished["drafter"]["losses"])
    if spec.weights_dtype != "float32":
        round_weights(target, spec.weights_dtype)
        round_weights(drafter, spec.weights_dtype)
        target.save_pretrained(str(out_dir / "target"), safe_serialization=True)
    drafter.save(out_dir / "drafter", vocab_size=spec.target.vocab_size, mask_token_id=mask_id, max_positions=spec.target.max_positions)
    for part in ("target", "drafter"):
        store_weights(out_dir / part / "model.safetensors", spec.weights_dtype)

    mark = time.time()
    quality = evaluate_models(target, drafter, streams, spec, mask_id)
    tick("evaluation")
    report = BuildReport(
        spec=spec,
        python=platform.python_version(),
        torch=torch.__version__,
        corpus_chars={d: {s: corpus.size(d, s) for s in ("train", "held_out")} for d in DOMAINS},
        domains=quality,
        target_loss_last=float(np.mean(target_losses[-20:])),
        drafter_loss_last=float(np.mean(drafter_losses[-20:])),
        seconds=seconds,
        corpus_tokens={d: {s: int(len(a)) for s, a in streams.streams[d].items()} for d in DOMAINS} if spec.corpus.packages else {},
        corpus_sources=corpus.sources,
        resumes=resumes,
    )
    (out_dir / "build_report.json").write_text(report.model_dump_json(indent=2) + "\n")
    write_checksums(out_dir)
    record({"event": "done", "out": str(out_dir)})
    return report


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: str) -> None:
    """Round `model`'s float32 parameters to `dtype`'s values in place (they stay float32 tensors)."""
    for p in model.parameters():
        p.copy_(p.to(getattr(torch, dtype)).float())


def store_weights(path: Path, dtype: str) -> None:
    """Rewrite a safetensors file with its floating-point tensors stored as `dtype` (exact after `round_weights`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    want = getattr(torch, dtype)
    if all(t.dtype == want or not t.is_floating_point() for t in tensors.values()):
        return
    save_file({k: t.to(want) if t.is_floating_point() else t for k, t in tensors.items()}, str(path), metadata=metadata)


@torch.no_grad()
def evaluate_models(
    target, drafter: DFlashDrafter, streams: TokenStreams, spec: BuildSpec, mask_id: int
) -> dict[str, DomainQuality]:
    """Held-out perplexity (and bits per character), offline greedy acceptance on the target's greedy
    continuations of held-out prompts, and offline T=1 acceptance on its sampled continuations of them."""
    ppl = held_out_perplexity(target, streams, spec.train.seq_len)
    rng = np.random.default_rng(spec.train.seed + 5)
    out = {}
    for domain in DOMAINS:
        prompts = torch.from_numpy(streams.windows(domain, "held_out", spec.train.distill_prompt_len, 32, rng))
        seqs = greedy_continuations(target, prompts, spec.train.distill_new_tokens)
        served = greedy_continuations(target, prompts, spec.train.distill_new_tokens, stop_at_end=True)
        loops = continuation_loop_share(served[:, spec.train.distill_prompt_len:].tolist(), target.config.eos_token_id)
        acc = offline_acceptance(drafter, target, seqs, spec.drafter, mask_id, start=spec.train.distill_prompt_len - 1)
        sampled = continue_batch(target, prompts, spec.train.model_copy(update={"distill_temperature": 1.0}), True,
                                 seed=spec.train.seed + 7 + DOMAINS.index(domain))
        acc_t1 = offline_acceptance_sampled(drafter, target, sampled, spec.drafter, mask_id, start=spec.train.distill_prompt_len - 1)
        out[domain] = DomainQuality(
            **ppl[domain], offline_acceptance=acc.tolist(), offline_acceptance_t1=acc_t1.tolist(),
            chars_per_token=streams.chars_per_token(domain, "held_out") if streams.chars else None,
            greedy_repeated_4grams=loops,
        )
    return out



def evaluate_checkpoint(path: Path) -> tuple[str, dict[str, DomainQuality]]:
    """A drafter-phase checkpoint (a build folder's state, or a compact file) evaluated as the build's last phase
    evaluates its models: where it stands and the quality per domain, mid-training. The encoded corpus is the
    build folder's own (`streams.npz` beside the state), so a compact file must sit in its build folder."""
    from tokenizers import Tokenizer

    state = ckpt.load(path)
    if state["phase"] != "drafter" or "drafter" not in state:
        raise ValueError(f"{path} is at phase {state['phase']!r}: only a drafter-phase checkpoint has both models")
    cache = path.parent / "streams.npz"
    if not cache.is_file():
        raise FileNotFoundError(f"no encoded corpus at {cache} (the build folder's streams.npz)")
    with np.load(cache) as f:
        key = str(f["key"])
    spec = BuildSpec.model_validate(state["spec"])
    tok = Tokenizer.from_str(state["tokenizer"])
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)
    streams = TokenStreams.load(cache, key)
    target = new_target(spec.target, eos_id, spec.train.seed)
    target.load_state_dict(state["target"]["weights"])
    target.eval()
    drafter = DFlashDrafter(spec.drafter, spec.target.hidden_size)
    part = state["drafter"]
    drafter.load_state_dict(part["model"] if "model" in part else part["weights"])
    drafter.eval()
    return f"drafter step {part.get('step', spec.train.drafter_steps)}", evaluate_models(target, drafter, streams, spec, mask_id)


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
