"""Where a long build stands: its held-out curve from `progress.jsonl`, and when it would reach a target.

The extrapolation fits log-perplexity per domain as a saturating power law of the
step, log ppl(s) = E + A * s^-alpha (least squares on the evaluations from
`min_step` on), and solves it for the target perplexity. Early in a run the fit
is loose (the irreducible term E is poorly determined), so the answer is given
with the fit's own spread over alpha in [0.5x, 2x] of the best value as a range.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel

TARGETS = {"code": 12.0, "prose": 25.0}  # issue 24: held-out perplexity


class DomainFit(BaseModel):
    domain: str
    points: int
    last_step: int
    last_perplexity: float
    last_bits_per_char: float | None
    target: float
    floor_perplexity: float | None = None  # exp(E): where the curve levels off
    alpha: float | None = None
    step_at_target: float | None = None  # None: the fitted floor is above the target, or too few points
    note: str = ""


def read_progress(path: Path) -> tuple[list[dict], list[dict]]:
    """(train-loss records, evaluation records) of the target phase."""
    losses, evals = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("phase") != "target" or "step" not in rec:  # checkpoint events carry no step
            continue
        (evals if "eval" in rec else losses).append(rec)
    return losses, evals


def _fit(steps: np.ndarray, logppl: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """E, A and the squared error of the least-squares line logppl = E + A * steps^-alpha."""
    x = steps ** -alpha
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, logppl, rcond=None)
    err = float(((design @ coef - logppl) ** 2).sum())
    return float(coef[0]), float(coef[1]), err


def fit_domain(evals: list[dict], domain: str, target: float, min_step: int = 500) -> DomainFit:
    pts = [(r["step"], r["eval"][domain]["perplexity"]) for r in evals if r["step"] >= min_step]
    last = evals[-1]["eval"][domain] if evals else {}
    out = DomainFit(
        domain=domain, points=len(pts), last_step=evals[-1]["step"] if evals else 0,
        last_perplexity=last.get("perplexity", float("nan")), last_bits_per_char=last.get("bits_per_char"), target=target,
    )
    if len(pts) < 4:
        out.note = f"needs 4 evaluations from step {min_step} on (has {len(pts)})"
        return out
    steps = np.array([p[0] for p in pts], dtype=float)
    logppl = np.log([p[1] for p in pts])
    alphas = np.linspace(0.05, 2.0, 400)
    fits = [(a, *_fit(steps, logppl, a)) for a in alphas]
    a, e, amp, _ = min(fits, key=lambda f: f[3])
    out.alpha, out.floor_perplexity = float(a), math.exp(e)
    if amp <= 0 or e >= math.log(target):
        out.note = "the fitted curve levels off above the target"
        return out
    out.step_at_target = float((amp / (math.log(target) - e)) ** (1 / a))
    return out


def format_progress(path: Path, steps_total: int | None = None, min_step: int = 500) -> str:
    losses, evals = read_progress(path)
    lines = []
    if not evals:
        return f"{path}: no held-out evaluation yet ({len(losses)} loss records)"
    sec_per_step = None  # median over recent intervals: a paused or resumed run has outliers
    recent = losses[-41:]
    rates = [(b["seconds"] - a["seconds"]) / (b["step"] - a["step"]) for a, b in zip(recent, recent[1:]) if b["step"] > a["step"]]
    if rates:
        sec_per_step = float(np.median(rates))
    lines.append("step   " + "  ".join(f"{d:>6} ppl  bits/char" for d in evals[-1]["eval"]))
    for r in evals:
        lines.append(f"{r['step']:>6} " + "  ".join(
            f"{v['perplexity']:>10.2f}  {v.get('bits_per_char', float('nan')):9.3f}" for v in r["eval"].values()))
    if sec_per_step:
        lines.append(f"recent speed: {sec_per_step:.2f} s/step")
    for domain, target in TARGETS.items():
        if domain not in evals[-1]["eval"]:
            continue
        fit = fit_domain(evals, domain, target, min_step=min_step)
        if fit.step_at_target is None:
            lines.append(f"{domain}: target perplexity {target:g}: {fit.note}"
                         + (f" (fitted floor {fit.floor_perplexity:.1f}, alpha {fit.alpha:.2f})" if fit.alpha else ""))
            continue
        eta = ""
        if sec_per_step:
            left = max(0.0, fit.step_at_target - fit.last_step) * sec_per_step
            eta = f", about {left / 3600:.1f} h from now at {sec_per_step:.2f} s/step"
        lines.append(f"{domain}: target perplexity {target:g} at step ~{fit.step_at_target:,.0f} by the fit "
                     f"(floor {fit.floor_perplexity:.1f}, alpha {fit.alpha:.2f}){eta}"
                     + (f"; the spec stops at {steps_total:,}" if steps_total else "")
                     + " (constant learning rate; the final decay lowers the curve further)")
    return "\n".join(lines)
