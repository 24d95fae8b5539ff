"""Tensor parallelism: every rank must draft the same widths, or the drafter's collectives disagree on shapes.

Rank 0 of the tensor-parallel group decides; the others take its decision (the
widths and the plan the verify lengths are later cut from), so every rank's
counters describe what was really drafted.
(Verify lengths need no sharing: the executor takes the drafts of one output
rank and the scheduler sends the same verify work to every rank.)
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable, Protocol, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger(__name__)

RANK_FAILURE_EXIT_CODE = 70  # a worker that ends itself after a failed step (EX_SOFTWARE)


class Group(Protocol):
    world_size: int

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any: ...


def share_from_first_rank(value: T, group: Group | None = None) -> T:
    """The first rank's `value` on every rank of the group (the tensor-parallel group by default)."""
    if group is None:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    if group.world_size == 1:
        return value
    return group.broadcast_object(value, src=0)


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    return get_tp_group().rank_in_group if model_parallel_is_initialized() else 0


def failure_ends_other_ranks(method: F, rank: Callable[[], int] = _tensor_parallel_rank) -> F:
    """A step that raises on a rank other than the first ends that rank's process.

    vLLM's multiprocess executor returns only the output rank's exceptions; another rank's are logged and its
    RPC loop goes on to the next step, out of step with the rest of the group (the next collective hangs, or the
    ranks draft different widths). A worker process that dies is what vLLM's worker monitor turns into a failed
    engine, so the failure reaches the clients and the replica's health check instead of a hang. The first
    rank's exceptions travel as vLLM sends them.
    """

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception:
            r = rank()
            if r == 0:
                raise
            logger.exception("a WCS step failed on tensor-parallel rank %d: ending this worker so that the engine fails", r)
            sys.stderr.flush()
            os._exit(RANK_FAILURE_EXIT_CODE)

    return guarded  # type: ignore[return-value]
