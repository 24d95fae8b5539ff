"""Tensor parallelism: every rank must draft the same widths, or the drafter's collectives disagree on shapes.

Rank 0 of the tensor-parallel group decides; the others take its decision (the
widths and the plan the verify lengths are later cut from), so every rank's
counters describe what was really drafted.
(Verify lengths need no sharing: the executor takes the drafts of one output
rank and the scheduler sends the same verify work to every rank.)
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

T = TypeVar("T")


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
