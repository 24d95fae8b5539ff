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
    defer(p, ["a", "b"], [1, 1], [30, 21], tag=2)  # "a" resumed with new slots, in a batch like the last one
    p.flush_context()
    (_, _, slots), = p.model.stored
    assert sorted(slots) == [20, 21, 30]


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


def test_the_ring_keeps_every_live_step_through_growth_and_wrapping():
    """Deferred rows are copied into preallocated rings (not cloned per step); the oldest step is let go in place,
    a step may wrap around the ring's end, and a full ring grows. Whatever the moves, a flush stores each live
    row's own values."""
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
    assert p._deferral.capacity < 4 * sum(map(len, live))  # a ring: not every row ever deferred
    p._deferral.lost.clear()  # ("a" lost its oldest steps: keep its rows in the flush, to check them)
    p.flush_context()
    (hidden, _, slots), = p.model.stored
    assert sorted(zip(slots, hidden)) == sorted(x for step in live for x in step)


def test_a_step_split_across_the_ring_end_keeps_its_rows_and_the_layers_side_by_side(monkeypatch):
    """The target hands its layers' hidden states over apart: they are laid side by side in the ring, also for a
    step whose rows wrap from the ring's end to its front (a long hold at a steady load wraps every few steps)."""
    monkeypatch.setattr(proposer, "MAX_DEFERRED_STEPS", 5)
    p = bare_proposer()
    slot, live = 0, []
    for step in range(60):
        n = 150 + 7 * (step % 5)  # ~800 rows kept: the 1,024-row ring wraps every few steps without growing
        parts = [torch.full((n, 1), float(step)), torch.full((n, 2), step + 0.5)]
        p.defer_context(["a"], np.array([0, n]), parts, torch.arange(n), torch.arange(slot, slot + n))
        live = (live + [[(s, float(step)) for s in range(slot, slot + n)]])[-5:]
        slot += n
    assert p._deferral.capacity == 1024 and p.pending_rows == sum(map(len, live))
    p._deferral.lost.clear()
    stored = []
    p.model.precompute_and_store_context_kv = lambda hidden, positions, slots: stored.append((hidden, slots))
    p.flush_context()
    (hidden, slots), = stored
    assert sorted(zip(slots.tolist(), hidden[:, 0].tolist())) == sorted(x for step in live for x in step)
    assert torch.equal(hidden[:, 1:], hidden[:, :1].expand(-1, 2) + 0.5)  # each row's second layer beside its first


def test_a_batch_held_on_unchanged_loses_context_step_by_step_as_its_steps_are_let_go(monkeypatch):
    """A batch that runs on unchanged keeps one runs array, answered once when its first step is let go; a request
    that joins later loses its context only when its own first step is let go (not with the batch before it)."""
    monkeypatch.setattr(proposer, "MAX_DEFERRED_STEPS", 3)
    p = bare_proposer()
    answered = []
    let_go = proposer._Deferral.let_go_oldest
    monkeypatch.setattr(proposer._Deferral, "let_go_oldest", lambda d: answered.append(let_go(d)) or answered[-1])
    lost = []
    for step in range(7):
        batch = ["a"] if step < 3 else ["a", "b"]
        defer(p, batch, [1] * len(batch), list(range(10 * step, 10 * step + len(batch))), tag=step)
        lost.append(set(p.context_lost))
    assert lost[:3] == [set()] * 3
    assert lost[3:6] == [{"a"}] * 3  # b's first step (step 3) is still kept
    assert lost[6] == {"a", "b"}
    assert [len(r) for r in answered] == [1, 0, 0, 2]  # steps 1 and 2 repeat step 0's runs
