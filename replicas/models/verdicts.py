"""Count the rejection sampler's verdicts of an in-process vLLM engine (offline tools and tests).

vLLM's Prometheus counters follow only the newest engine in a process; this
hook counts one engine's verifications directly: one row per request that
had drafts verified in a step, with its drafted and accepted counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class VerdictCounter:
    llm: object
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, verified, accepted)

    def __post_init__(self) -> None:
        from replicas.engine import model_runner

        runner = model_runner(self.llm)
        sample = runner._sample

        def counted(logits, spec_decode_metadata):
            out = sample(logits, spec_decode_metadata)
            if spec_decode_metadata is not None:
                verified = np.asarray(spec_decode_metadata.num_draft_tokens)
                emitted = (out.sampled_token_ids.cpu() >= 0).sum(dim=1).numpy()
                for rid, v, e in zip(runner.input_batch.req_ids, verified, emitted):
                    if v > 0:
                        self.rows.append((rid, int(v), int(min(e - 1, v))))
            return out

        runner._sample = counted

    def counters(self, since: int = 0):
        """vLLM-style speculative counters over rows[since:]."""
        from replicas.models.bench import SpecCounters

        rows = self.rows[since:]
        k = max((r[1] for r in rows), default=0)
        accepted = np.array([r[2] for r in rows], dtype=np.int64)
        return SpecCounters(
            drafts=len(rows),
            draft_tokens=int(sum(r[1] for r in rows)),
            accepted=int(accepted.sum()),
            accepted_per_pos=[int((accepted >= j).sum()) for j in range(1, k + 1)],
        )

    def first_accepted(self, since: int = 0) -> list[int]:
        """Accepted drafts of each request's first verification among rows[since:]."""
        first: dict[str, int] = {}
        for rid, _v, acc in self.rows[since:]:
            first.setdefault(rid, acc)
        return list(first.values())
