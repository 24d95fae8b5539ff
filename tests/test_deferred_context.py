"""Bookkeeping of the drafter context that draft-free steps defer (replicas/wcs/proposer.py).

The engine tests show deferred context keeps drafts as good as storing it every step; here the
rules are pinned down on a bare proposer whose drafter model is a recorder of what would be
stored (a stand-in: only the bookkeeping is under test, not the K/V projection).
"""

import numpy as np
import torch

from replicas.wcs import proposer
from replicas.wcs.proposer import RaggedDFlashProposer


class RecordingModel:
    def __init__(self):
        self.stored = []

    def combine_hidden_states(self, hidden):
        return hidden

    def precompute_and_store_context_kv(self, hidden, positions, slots):
        self.stored.append((hidden[:, 0].tolist(), positions.tolist(), slots.tolist()))


def bare_proposer():
    p = object.__new__(RaggedDFlashProposer)
    p.model = RecordingModel()
    return p


def defer(p, req_ids, lengths, slots, tag):
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    n = int(qsl[-1])
    hidden = torch.full((n, 2), float(tag))
    p.defer_context(req_ids, qsl, hidden, torch.arange(n), torch.tensor(slots))


def test_flush_stores_every_deferred_token_once_with_the_latest_write_per_slot():
    p = bare_proposer()
    defer(p, ["a", "b"], [2, 1], [10, 11, 20], tag=1)
    defer(p, ["a", "b"], [1, 1], [11, 21], tag=2)  # a's slot 11 is written again (a recomputed position)
    p.flush_context()
    (hidden, _, slots), = p.model.stored
    assert sorted(zip(slots, hidden)) == [(10, 1.0), (11, 2.0), (20, 1.0), (21, 2.0)]
    p.flush_context()  # nothing left
    assert len(p.model.stored) == 1


def test_dropped_requests_are_left_out_and_a_resumed_one_starts_afresh():
    p = bare_proposer()
    defer(p, ["a", "b"], [1, 1], [10, 20], tag=1)
    p.drop_context(["a"])  # finished or preempted: slot 10 may be someone else's now
    defer(p, ["a"], [1], [30], tag=2)  # "a" resumed with new slots
    p.flush_context()
    (_, _, slots), = p.model.stored
    assert sorted(slots) == [20, 30]


def test_a_request_without_drafts_for_too_long_loses_its_context(monkeypatch):
    monkeypatch.setattr(proposer, "MAX_DEFERRED_STEPS", 3)
    p = bare_proposer()
    for step in range(4):
        defer(p, ["a"] + (["b"] if step == 3 else []), [1] + ([1] if step == 3 else []), [step] + ([100] if step == 3 else []), tag=step)
    assert p.context_lost == {"a"}
    assert len(p._deferral.steps) == 3  # the oldest step was let go
    p.flush_context()
    (_, _, slots), = p.model.stored
    assert slots == [100]  # only b's tokens: a's context is incomplete and is not stored
    p.drop_context(["a"])
    assert p.context_lost == set()


def test_the_row_store_keeps_every_live_step_through_growth_and_compaction():
    """Deferred hidden states are copied into one preallocated store (not cloned per step); when it fills, the live
    steps move to the front or to a larger store. Whatever the moves, a flush stores each live row's own values."""
    p = bare_proposer()
    rng = np.random.default_rng(0)
    slot = 0
    live = []  # (slot, tag) of the rows of the steps still kept
    for step in range(400):
        n = int(rng.integers(1, 700))  # (a step with prefill chunks is long)
        defer(p, ["a"], [n], list(range(slot, slot + n)), tag=step)
        live.append([(s, float(step)) for s in range(slot, slot + n)])
        live = live[-proposer.MAX_DEFERRED_STEPS :]
        slot += n
    store = p._deferral.rows
    assert store.shape[0] < 4 * sum(map(len, live))  # compacted: not every row ever deferred
    p._deferral.lost.clear()  # ("a" lost its oldest steps: keep its rows in the flush, to check them)
    p.flush_context()
    (hidden, _, slots), = p.model.stored
    assert sorted(zip(slots, hidden)) == sorted(x for step in live for x in step)
