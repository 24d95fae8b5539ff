"""The build pipeline of the embedded pair: corpus pins and licences, resumable training, sampled distillation.

Fast (seconds): synthetic distributions in a temporary site folder, tiny models, a tiny corpus.
"""

import io
import json
import textwrap

import numpy as np
import pytest
import torch

from replicas.models import build as build_mod
from replicas.models import checkpoint as ckpt
from replicas.models import distill as distill_mod
from replicas.models.corpus import Corpus, VersionMismatch, is_held_out, load_corpus
from replicas.models.data import TokenStreams
from replicas.models.distill import (
    DrafterTrainer,
    continuation_batches,
    continuation_is_code,
    continuation_plan,
    distill_loss,
    drafter_lr_factor,
    target_continuations,
)
from replicas.models.dflash import DFlashDrafter
from replicas.models.licences import expression_permitted, licence_of
from replicas.models.spec import BuildSpec, CorpusSpec, DrafterSpec, PolishSpec, TargetSpec, TrainSpec, load_spec
from replicas.models.target import TargetTrainer, new_target
from replicas.models.unlikelihood import continuation_loop_share, greedy_continuations, repeated_ngram_mask, unlikelihood_loss

torch.set_num_threads(1)

# --- corpus: pins and licences ------------------------------------------------------------------

CODE = '''\
"""{name}: a module of the {pkg} package used to test the corpus loader, with a docstring long enough to be prose."""


def {name}_add(a, b):
    """Add two numbers and return their sum; this docstring is long enough to count as prose text too."""
    return a + b
'''


def make_dist(site, name, version, metadata_lines, files):
    """A wheel-style installed distribution: files plus <name>-<version>.dist-info with METADATA and RECORD."""
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    body = "Long description. " * 20
    (info / "METADATA").write_text(
        "Metadata-Version: 2.4\n" + f"Name: {name}\nVersion: {version}\n" + "".join(l + "\n" for l in metadata_lines) + "\n" + body
    )
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files) + f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture()
def site(tmp_path):
    site = tmp_path / "site"
    files = {f"goodpkg/mod{i}.py": CODE.format(name=f"mod{i}", pkg="goodpkg") for i in range(12)}
    files.update({
        "goodpkg/__init__.py": CODE.format(name="init", pkg="goodpkg"),
        "goodpkg/guide.md": "# Guide\n\nThis guide explains how the good package adds numbers together, at length.\n",
        "goodpkg/tests/test_mod0.py": "def test_secret_tests():\n    assert True  # TESTS-MARKER\n",
        "goodpkg/_vendor/other.py": "VENDORED_MARKER = 'someone else code under another licence'\n",
        "goodpkg/data.txt": "0 1 2 3\n4 5 6 7\n8 9 10 11\n",
    })
    make_dist(site, "goodpkg", "1.0", ["License-Expression: MIT"], files)
    make_dist(site, "gplpkg", "2.0", ["License: GPL-3.0-or-later"], {"gplpkg/core.py": "GPL_MARKER = 1\n" * 10})
    make_dist(
        site, "classpkg", "0.3",
        ["Classifier: License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)"],
        {"classpkg/core.py": "LGPL_MARKER = 1\n" * 10},
    )
    return site


def corpus_text(corpus: Corpus) -> str:
    return "\x00".join(t for d in corpus.docs.values() for split in d.values() for t in split)


def test_licence_expressions():
    assert expression_permitted("MIT")
    assert expression_permitted("Apache-2.0 OR BSD-3-Clause")
    assert expression_permitted("BSD-2-Clause AND Apache-2.0 WITH LLVM-exception")
    assert expression_permitted("(MIT OR GPL-3.0-only) AND ISC")
    assert not expression_permitted("MPL-2.0 AND MIT")  # tqdm's: one copyleft part is enough to refuse
    assert not expression_permitted("GPL-2.0-only")
    assert not expression_permitted("LGPL-2.1-only")
    assert not expression_permitted("Apache-2.0 WITH Classpath-exception-2.0")
    assert not expression_permitted("Copyright (c) somebody, all rights reserved")
    assert not expression_permitted("")


def test_licence_of_reads_expression_classifiers_and_short_free_text():
    from email.message import Message

    def meta(**fields):
        m = Message()
        for k, vs in fields.items():
            for v in vs if isinstance(vs, list) else [vs]:
                m[k.replace("_", "-")] = v
        return m

    assert licence_of(meta(License_Expression="BSD-3-Clause")).permitted
    lic = licence_of(meta(Classifier=["License :: OSI Approved :: BSD License", "Programming Language :: Python"]))
    assert lic.permitted and lic.source == "Classifier"
    assert licence_of(meta(License="Apache 2.0")).expression == "Apache-2.0"
    assert not licence_of(meta(License="Copyright (c) 2005 X.\n All rights reserved.\n Redistribution ...")).permitted
    assert not licence_of(meta(Classifier="License :: Other/Proprietary License")).permitted
    assert not licence_of(meta()).permitted  # no licence at all: refused


def test_corpus_uses_permitted_packages_and_excludes_the_others(site):
    spec = CorpusSpec(stdlib=False, packages=["goodpkg==1.0", "gplpkg==2.0", "classpkg==0.3"])
    corpus = load_corpus(spec, search_path=[str(site)])
    by_name = {s.name: s for s in corpus.sources}
    assert by_name["goodpkg"].used and by_name["goodpkg"].licence == "MIT"
    assert by_name["goodpkg"].code_files == 13
    for excluded in ("gplpkg", "classpkg"):
        assert not by_name[excluded].used and "not on the allow-list" in by_name[excluded].note
    text = corpus_text(corpus)
    assert "mod3_add" in text and "how the good package adds numbers" in text and "Long description." in text
    for marker in ("GPL_MARKER", "LGPL_MARKER", "TESTS-MARKER", "VENDORED_MARKER", "8 9 10 11"):
        assert marker not in text, marker


def test_corpus_is_deterministic_and_split_by_file(site):
    spec = CorpusSpec(stdlib=False, packages=["goodpkg==1.0"])
    a, b = load_corpus(spec, search_path=[str(site)]), load_corpus(spec, search_path=[str(site)])
    assert a.docs == b.docs and a.sources == b.sources and a.sources[0].sha256
    for i in range(12):
        split = "held_out" if is_held_out(f"goodpkg/goodpkg/mod{i}.py") else "train"
        assert any(f"def mod{i}_add" in t for t in a.docs["code"][split])
        assert any(f"mod{i}: a module" in t for t in a.docs["prose"][split])  # its docstrings follow the file
    assert a.docs["code"]["held_out"] and a.docs["code"]["train"]  # 12 files: both splits used


def test_corpus_code_cap_is_deterministic(site):
    spec = CorpusSpec(stdlib=False, packages=["goodpkg==1.0"], max_package_code_chars=600)
    a, b = load_corpus(spec, search_path=[str(site)]), load_corpus(spec, search_path=[str(site)])
    assert a.docs == b.docs
    assert 600 <= a.sources[0].code_chars < 600 + 2 * len(CODE) + 40 and a.sources[0].code_files < 13


def test_corpus_refuses_a_version_other_than_the_pinned_one(site):
    with pytest.raises(VersionMismatch, match=r"goodpkg==1\.1 \(installed: 1\.0\)"):
        load_corpus(CorpusSpec(stdlib=False, packages=["goodpkg==1.1"]), search_path=[str(site)])
    with pytest.raises(VersionMismatch, match="missingpkg"):
        load_corpus(CorpusSpec(stdlib=False, packages=["missingpkg==1.0"]), search_path=[str(site)])
    skipped = load_corpus(
        CorpusSpec(stdlib=False, packages=["goodpkg==1.1"], on_version_mismatch="skip"), search_path=[str(site)]
    )
    assert not skipped.sources[0].used and "differs from the pinned 1.1" in skipped.sources[0].note
    assert corpus_text(skipped) == ""  # nothing read


def test_named_specs():
    from replicas.models.build import WEIGHTS_DIR, BuildReport

    shipped = BuildReport.model_validate_json((WEIGHTS_DIR / "build_report.json").read_text()).spec
    assert load_spec("shipped") == shipped  # what replicas/models/weights was built with
    assert load_spec("first") == BuildSpec()  # the first pair: the defaults that tiny test specs inherit
    nxt = load_spec("next")
    assert nxt.corpus.packages and all("==" in p for p in nxt.corpus.packages)
    # `next` extends `shipped`: the same corpus and training, plus the polish stage, stored in float32.
    assert nxt.model_copy(update={"polish": shipped.polish, "weights_dtype": shipped.weights_dtype}) == shipped
    assert nxt.polish.active and not shipped.polish.active and nxt.weights_dtype == "float32"
    assert nxt.train.distill_sampled_share > 0 and nxt.drafter.causal
    assert max(nxt.drafter.target_layer_ids) < nxt.target.num_layers
    with pytest.raises(FileNotFoundError, match="named specs"):
        load_spec("no-such-spec")


def test_spec_extends_merges_objects_key_by_key_and_refuses_a_cycle(tmp_path):
    (tmp_path / "base.json").write_text(json.dumps({"train": {"seed": 3, "target_steps": 7}, "corpus": {"packages": ["a==1"]}}))
    (tmp_path / "child.json").write_text(json.dumps(
        {"extends": str(tmp_path / "base.json"), "train": {"target_steps": 9}, "corpus": {"packages": ["b==2"]}}))
    child = load_spec(str(tmp_path / "child.json"))
    assert (child.train.seed, child.train.target_steps) == (3, 9)  # an object merges: seed kept, steps replaced
    assert child.corpus.packages == ["b==2"]  # a list is replaced, not appended to
    assert load_spec(str(tmp_path / "base.json")).train.target_steps == 7  # control: the base is itself
    (tmp_path / "a.json").write_text(json.dumps({"extends": str(tmp_path / "b.json")}))
    (tmp_path / "b.json").write_text(json.dumps({"extends": str(tmp_path / "a.json")}))
    with pytest.raises(ValueError, match="extends itself"):
        load_spec(str(tmp_path / "a.json"))


# --- resumable training -------------------------------------------------------------------------

TINY_TARGET = TargetSpec(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_positions=128)
TINY_DRAFTER = DrafterSpec(block=4, num_layers=1, num_heads=2, intermediate_size=64, target_layer_ids=[0, 1])
TINY_TRAIN = TrainSpec(
    seq_len=32, target_steps=6, target_batch=4, target_lr=3e-3, lr_schedule="wsd", warmup_steps=2, eval_every=3, eval_windows=2,
    distill_prompts=8, distill_prompt_len=8, distill_new_tokens=12, distill_sampled_share=0.5, distill_gen_batch=2,
    drafter_steps=5, drafter_batch=2, drafter_anchors=3,
)


def random_streams(vocab=300, seed=0) -> TokenStreams:
    rng = np.random.default_rng(seed)
    streams = {d: {s: rng.integers(1, vocab, 2000).astype(np.int32) for s in ("train", "held_out")} for d in ("code", "prose")}
    return TokenStreams(streams, 0, {d: {"train": 6000, "held_out": 6000} for d in streams})


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("bf16", [False, True])
def test_target_resume_takes_the_same_next_step_as_an_uninterrupted_run(bf16):
    streams = random_streams()
    train = TINY_TRAIN.model_copy(update={"bf16_autocast": bf16})
    full = TargetTrainer(new_target(TINY_TARGET, 0, 0), streams, train)
    for _ in range(4):
        full.run_step()

    first = TargetTrainer(new_target(TINY_TARGET, 0, 0), streams, train)
    for _ in range(2):
        first.run_step()
    saved = roundtrip(first.state_dict())
    resumed = TargetTrainer(new_target(TINY_TARGET, 0, 99), streams, train)  # other init: the state must overwrite it
    resumed.load_state_dict(saved)
    for _ in range(2):
        resumed.run_step()
    assert resumed.step == full.step == 4 and resumed.losses == full.losses
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.rng.bit_generator.state == full.rng.bit_generator.state
    assert resumed.lr == full.lr

    # Negative control: without the optimiser moments the same two steps land elsewhere.
    blank = TargetTrainer(new_target(TINY_TARGET, 0, 0), streams, train)
    partial = {k: v for k, v in saved.items() if k != "optimizer"}
    blank.model.load_state_dict(partial["model"])
    blank.rng.bit_generator.state = partial["rng"]
    blank.step = partial["step"]
    for _ in range(2):
        blank.run_step()
    assert not torch.equal(blank.model.lm_head.weight, full.model.lm_head.weight)


@pytest.mark.parametrize("bf16,corpus_share", [(False, 0.0), (True, 0.0), (False, 0.5)])
def test_drafter_resume_takes_the_same_next_step(bf16, corpus_share):
    train = TINY_TRAIN.model_copy(update={"bf16_autocast": bf16, "drafter_corpus_share": corpus_share,
                                          "drafter_labels": "target_argmax" if corpus_share else "sequence"})
    torch.manual_seed(0)
    target = new_target(TINY_TARGET, 0, 0).eval()
    seqs = torch.randint(1, 300, (6, 20))
    streams = random_streams()

    def trainer():
        torch.manual_seed(5)
        return DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, train, mask_token_id=1,
                              streams=streams)

    full = trainer()
    for _ in range(4):
        full.run_step()
    first = trainer()
    for _ in range(2):
        first.run_step()
    resumed = trainer()
    resumed.load_state_dict(roundtrip(first.state_dict()))
    for _ in range(2):
        resumed.run_step()
    assert resumed.losses == full.losses
    for a, b in zip(full.drafter.parameters(), resumed.drafter.parameters()):
        assert torch.equal(a, b)


def _loss_inputs(seed: int = 0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(TINY_DRAFTER, 32)
    b, t, v = 2, 20, 300
    teacher = torch.randn(b, t, v) * 3
    aux = torch.randn(b, t, 64)
    anchors = torch.tensor([[3, 7, 10], [4, 8, 12]])
    embed = torch.randn(v, 32)
    return drafter, teacher, aux, anchors, embed


def test_distill_loss_labels_and_position_weights():
    drafter, teacher, aux, anchors, embed = _loss_inputs()
    args = (aux, anchors, embed, TINY_DRAFTER, 1)
    # The target's argmax chain as the sequence: both kinds of labels are the same tokens.
    chain = torch.cat([torch.zeros(2, 1, dtype=torch.long), teacher.argmax(-1)[:, :-1]], dim=1)
    same = distill_loss(drafter, chain, teacher, *args, 0.5, labels="sequence")
    assert torch.allclose(same, distill_loss(drafter, chain, teacher, *args, 0.5, labels="target_argmax"))
    # Control: on other text the labels differ, and so does the loss.
    other = torch.randint(1, 300, (2, 20))
    assert not torch.allclose(distill_loss(drafter, other, teacher, *args, 0.5, labels="sequence"),
                              distill_loss(drafter, other, teacher, *args, 0.5, labels="target_argmax"))
    # Off the greedy chain a later slot has no label: text changed past the first token the target would not
    # have chosen leaves the loss as it was (control: as labels, the text's own tokens change it).
    off = chain.clone()
    off[0, 4] = (off[0, 4] + 1) % 300  # anchor 3: slot 1 keeps its label, slots 2-4 leave the chain
    later = off.clone()
    later[0, 6] = (later[0, 6] + 7) % 300
    assert torch.allclose(distill_loss(drafter, off, teacher, *args, 0.5, labels="target_argmax"),
                          distill_loss(drafter, later, teacher, *args, 0.5, labels="target_argmax"))
    assert not torch.allclose(distill_loss(drafter, off, teacher, *args, 0.5, labels="sequence"),
                              distill_loss(drafter, later, teacher, *args, 0.5, labels="sequence"))
    # Position weights: with a decay the first position dominates (its CE, computed alone, recovers the loss).
    block = torch.full((*anchors.shape, 5), 1, dtype=torch.long)
    block[..., 0] = torch.gather(other, 1, anchors)
    log_q = torch.log_softmax(drafter(aux, block, anchors, embed), -1).detach()
    labels = torch.gather(other, 1, (anchors[..., None] + torch.arange(1, 5)).flatten(1)).view(2, 3, 4)
    ce = -torch.gather(log_q, -1, labels[..., None]).squeeze(-1).mean(dim=(0, 1))  # per position
    w = torch.exp(-torch.arange(4.0) / 0.5)
    expected = float((ce * w / w.mean()).mean())
    got = float(distill_loss(drafter, other, teacher, *args, 0.0, labels="sequence", position_decay=0.5))
    assert got == pytest.approx(expected, rel=1e-5)
    assert float(distill_loss(drafter, other, teacher, *args, 0.0)) == pytest.approx(float(ce.mean()), rel=1e-5)


def test_drafter_batches_mix_training_text_in_at_the_configured_share():
    target = new_target(TINY_TARGET, 0, 0).eval()
    seqs = torch.full((6, 20), 7)  # continuations of a single token: training text is anything else
    train = TINY_TRAIN.model_copy(update={"drafter_batch": 4, "drafter_corpus_share": 0.5, "drafter_corpus_min_context": 2})
    trainer = DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, train, 1, random_streams())
    rows, anchors = trainer.batch()
    assert rows.shape == (4, 20) and anchors.shape == (4, 3)
    assert [bool((r == 7).all()) for r in rows] == [True, True, False, False]
    assert int(anchors[2:].min()) >= 2 and int(anchors[:2].min()) >= trainer.lo
    control = DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, TINY_TRAIN, 1)
    assert bool((control.batch()[0] == 7).all())
    with pytest.raises(ValueError, match="token streams"):
        DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, train, 1)


def test_a_drafter_cycle_draws_its_batches_at_its_own_code_share():
    """`drafter_cycle_code_shares`: a cycle at share 1 (or 0) draws only code (or prose) continuations and training
    text; a null cycle draws as every build did."""
    target = new_target(TINY_TARGET, 0, 0).eval()
    train = TrainSpec.model_validate({**TINY_TRAIN.model_dump(), "drafter_steps": 10, "drafter_restarts": [5],
                                      "drafter_batch": 4, "drafter_corpus_share": 0.5,
                                      "drafter_cycle_code_shares": [None, 1.0]})
    is_code = continuation_is_code(train)
    assert 0 < is_code.sum() < len(is_code)
    seqs = torch.arange(len(is_code))[:, None].repeat(1, 20)  # row i is all i: its domain is is_code[i]
    streams, text_shares = random_streams(), []
    windows = streams.mixed_windows
    streams.mixed_windows = lambda n, count, share, rng: text_shares.append(share) or windows(n, count, share, rng)

    def drawn(trainer: DrafterTrainer, step: int, batches: int = 12) -> set[bool]:
        trainer.step = step
        return {bool(is_code[int(r[0])]) for _ in range(batches) for r in trainer.batch()[0][:2]}

    trainer = DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, train, 1, streams)
    assert drawn(trainer, 5) == {True} and text_shares[-1] == 1.0
    assert drawn(trainer, 0) == {True, False} and text_shares[-1] == train.distill_code_share  # control: the null cycle
    prose = train.model_copy(update={"drafter_cycle_code_shares": [None, 0.0]})
    assert drawn(DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, prose, 1, streams), 5) == {False}
    with pytest.raises(ValueError, match="one share"):
        TrainSpec(drafter_steps=10, drafter_restarts=[5], drafter_cycle_code_shares=[1.0])


def test_a_finished_drafter_continues_into_a_cycle_with_its_own_code_share():
    saved = BuildSpec(train=TrainSpec(drafter_steps=100, drafter_restarts=[40]))
    state = {"spec": saved.model_dump(mode="json"), "phase": "evaluation"}

    def longer(shares):
        return BuildSpec(train=TrainSpec(drafter_steps=150, drafter_restarts=[40, 100], drafter_cycle_code_shares=shares))

    build_mod.check_resumable(state, longer([None, None, 0.9]))
    with pytest.raises(ValueError, match="drafter_cycle_code_shares"):  # the saved cycles drew otherwise
        build_mod.check_resumable(state, longer([0.9, None, 0.9]))

    def weighted(weights):
        return BuildSpec(train=TrainSpec(drafter_steps=150, drafter_restarts=[40, 100], drafter_cycle_kl_weights=weights))

    build_mod.check_resumable(state, weighted([None, 0.5, 2.0]))  # 0.5 is kl_weight: the saved cycles' own
    with pytest.raises(ValueError, match="drafter_cycle_kl_weights"):  # a trained cycle's weight changed
        build_mod.check_resumable(state, weighted([None, 1.0, 2.0]))


def test_a_drafter_cycle_weighs_kl_at_its_own_weight(monkeypatch):
    """`drafter_cycle_kl_weights`: each step's loss gets its cycle's KL weight; a null cycle gets kl_weight."""
    target = new_target(TINY_TARGET, 0, 0).eval()
    train = TrainSpec.model_validate({**TINY_TRAIN.model_dump(), "drafter_steps": 4, "drafter_restarts": [2],
                                      "kl_weight": 0.25, "drafter_cycle_kl_weights": [None, 3.0]})
    seqs = torch.randint(2, 32, (6, train.distill_prompt_len + TINY_DRAFTER.block + 4))
    used: list[float] = []
    loss = distill_mod.distill_loss
    monkeypatch.setattr(distill_mod, "distill_loss", lambda *a, **k: used.append(a[8]) or loss(*a, **k))
    trainer = DrafterTrainer(DFlashDrafter(TINY_DRAFTER, 32), target, seqs, TINY_DRAFTER, train, 1)
    while not trainer.done:
        trainer.run_step()
    assert used == [0.25, 0.25, 3.0, 3.0]
    with pytest.raises(ValueError, match="one weight"):
        TrainSpec(drafter_steps=10, drafter_restarts=[5], drafter_cycle_kl_weights=[1.0])


def test_drafter_settings_change_only_before_the_drafter_phase():
    spec = BuildSpec()
    new = spec.model_copy(update={
        "drafter": spec.drafter.model_copy(update={"num_layers": 3}),
        "train": spec.train.model_copy(update={"drafter_labels": "target_argmax", "kl_weight": 0.1}),
    })
    build_mod.check_resumable({"spec": spec.model_dump(mode="json"), "phase": "drafter"}, new)  # not started
    started = {"spec": spec.model_dump(mode="json"), "phase": "drafter", "drafter": {"step": 3}}
    with pytest.raises(ValueError, match="drafter.num_layers"):
        build_mod.check_resumable(started, new)
    build_mod.check_resumable(started, spec)  # control: the same spec resumes


def test_compact_checkpoint_is_small_and_resumes_close_to_the_full_one():
    streams = random_streams()
    tr = TargetTrainer(new_target(TINY_TARGET, 0, 0), streams, TINY_TRAIN)
    for _ in range(3):
        tr.run_step()
    full = {"format": ckpt.FORMAT, "kind": "full", "phase": "target", "target": tr.state_dict()}
    small = ckpt.compact(full)
    assert ckpt.nbytes(small) < 0.33 * ckpt.nbytes(full)  # 3 bytes a parameter instead of 12, plus overheads
    back = ckpt.expand(roundtrip(small))
    for k, v in full["target"]["model"].items():
        torch.testing.assert_close(back["target"]["model"][k], v, rtol=1e-3, atol=1e-4)
    for idx, s in full["target"]["optimizer"]["state"].items():
        b = back["target"]["optimizer"]["state"][idx]
        assert torch.count_nonzero(b["exp_avg"]) == 0  # dropped: re-warms
        v, w = s["exp_avg_sq"], b["exp_avg_sq"]
        assert torch.equal(v == 0, w == 0)
        assert float(((w - v).abs() / v.clamp_min(1e-30))[v > 0].max()) < 0.1
    assert back["target"]["rng"] == full["target"]["rng"] and back["target"]["step"] == 3
    resumed = TargetTrainer(new_target(TINY_TARGET, 0, 0), streams, TINY_TRAIN)
    resumed.load_state_dict(back["target"])
    loss = resumed.run_step()
    tr.run_step()
    assert abs(loss - tr.losses[-1]) < 0.05


def test_the_wsd_schedule_can_be_extended_only_before_its_decay():
    spec = BuildSpec(train=TrainSpec(target_steps=100, lr_schedule="wsd", warmup_steps=10, decay_fraction=0.2))
    longer = spec.model_copy(update={"train": spec.train.model_copy(update={"target_steps": 200})})
    state = {"spec": spec.model_dump(mode="json"), "phase": "target", "target": {"step": 50}}
    build_mod.check_resumable(state, longer)  # step 50 < 80: the constant part of both
    with pytest.raises(ValueError, match="past the constant learning rate"):
        build_mod.check_resumable({**state, "target": {"step": 90}}, longer)
    other = spec.model_copy(update={"train": spec.train.model_copy(update={"target_lr": 1.0})})
    with pytest.raises(ValueError, match="train.target_lr"):
        build_mod.check_resumable(state, other)


# --- sampled distillation data ------------------------------------------------------------------

def test_sampled_continuations_shape_mix_and_determinism():
    streams = random_streams()
    target = new_target(TINY_TARGET, 0, 0).eval()
    train = TINY_TRAIN
    prompts, sampled = continuation_plan(streams, train)
    assert prompts.shape == (8, 8) and sampled.tolist() == [False] * 4 + [True] * 4
    batches = continuation_batches(prompts, sampled, train.distill_gen_batch)
    assert [(a, b, s) for a, b, s in batches] == [(0, 2, False), (2, 4, False), (4, 6, True), (6, 8, True)]

    seqs, flags = target_continuations(target, streams, train)
    assert seqs.shape == (8, 8 + 12) and torch.equal(flags, torch.from_numpy(sampled))
    assert torch.equal(seqs[:, :8], torch.from_numpy(prompts))
    # Greedy rows are the argmax chain; sampled rows (T=1) are not.
    with torch.no_grad():
        logits = target(input_ids=seqs).logits
    follows_argmax = (logits[:, 7:-1].argmax(-1) == seqs[:, 8:]).all(-1)
    assert follows_argmax[:4].all() and not follows_argmax[4:].any()
    again, _ = target_continuations(target, streams, train)
    assert torch.equal(seqs, again)
    # A run that resumes with some batches done produces the same data.
    resumed, _ = target_continuations(target, streams, train, done={0: seqs[:2], 2: seqs[4:6]})
    assert torch.equal(seqs, resumed)
    # Without sampling, the shipped plan: code prompts then prose prompts, all greedy.
    greedy_only = train.model_copy(update={"distill_sampled_share": 0.0})
    p0, s0 = continuation_plan(streams, greedy_only)
    rng = np.random.default_rng(train.seed + 1)
    half = int(round(8 * train.distill_code_share))
    want = np.concatenate([streams.windows("code", "train", 8, half, rng), streams.windows("prose", "train", 8, 8 - half, rng)])
    assert np.array_equal(p0, want) and not s0.any()
    # Which prompts are code, in the sampled plan's order (`continuation_is_code`).
    code_windows = {tuple(w) for w in want[:half]}
    is_code = continuation_is_code(train)
    assert [tuple(p) in code_windows for p in prompts] == is_code.tolist()
    assert not np.array_equal(is_code, np.arange(8) < half)  # control: the plan reordered them


# --- the whole build, interrupted in every phase --------------------------------------------------

def tiny_corpus(_spec=None) -> Corpus:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "value", "result", "index", "count", "the", "of", "and", "returns"]
    corpus = Corpus()
    for i in range(40):
        names = rng.choice(words, 6)
        code = textwrap.dedent(f"""\
            def {names[0]}_{i}({names[1]}, {names[2]}):
                {names[3]} = {names[1]} + {names[2]} * {i}
                return {names[3]}
            """) * 3
        prose = " ".join(rng.choice(words, 60)) + "."
        corpus.add("code", f"code{i}", code)
        corpus.add("prose", f"prose{i}", prose)
    return corpus


def tiny_spec() -> BuildSpec:
    return BuildSpec(target=TINY_TARGET, drafter=TINY_DRAFTER, train=TINY_TRAIN)


def test_build_interrupted_in_each_phase_resumes_to_the_same_models(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    quiet = lambda _msg: None  # noqa: E731
    ref = build_mod.build(tmp_path / "ref", tiny_spec(), checkpoint_dir=tmp_path / "ref-ckpt", log=quiet)

    out, cdir = tmp_path / "out", tmp_path / "ckpt"
    for stop in (("target", 3), ("continuations", 2), ("drafter", 2)):
        with pytest.raises(build_mod.Interrupted):
            build_mod.build(out, tiny_spec(), checkpoint_dir=cdir, resume=True, log=quiet, stop_after=lambda p, s, stop=stop: (p, s) == stop)
        assert ckpt.load(cdir / ckpt.STATE_FILE)["phase"] == stop[0]
    report = build_mod.build(out, tiny_spec(), checkpoint_dir=cdir, resume=True, log=quiet)

    for f in ("target/model.safetensors", "drafter/model.safetensors", "target/tokenizer.json"):
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    assert report.domains == ref.domains and report.resumes == 3
    assert report.domains["code"].offline_acceptance_t1 and report.domains["code"].bits_per_char > 0
    for stage in ("target", "continuations", "drafter"):
        assert (cdir / f"{stage}-done.compact.pt").is_file()
    assert (cdir / "progress.jsonl").read_text().count('"eval"') >= 2

    # A compact checkpoint resumes too (float16 weights, re-warmed moments): close, not identical.
    out2 = tmp_path / "from-compact"
    report2 = build_mod.build(out2, tiny_spec(), resume_from=cdir / "continuations-done.compact.pt", log=quiet)
    assert abs(report2.domains["code"].perplexity - ref.domains["code"].perplexity) < 0.02 * ref.domains["code"].perplexity

    # Interrupted, such a build goes on from its folder's state when run again with --resume, though its
    # command still names the checkpoint it started from. Control: its first run started from that checkpoint.
    compact, cdir3, said = cdir / "continuations-done.compact.pt", tmp_path / "ckpt3", []
    with pytest.raises(build_mod.Interrupted):
        build_mod.build(tmp_path / "o3", tiny_spec(), checkpoint_dir=cdir3, resume_from=compact, log=said.append,
                        stop_after=lambda p, s: (p, s) == ("drafter", 2))
    assert any("resuming at drafter (from a compact checkpoint" in m for m in said), said
    # Mid-training, the interrupted build's models are evaluated as its last phase would (`models evaluate`).
    where, quality = build_mod.evaluate_checkpoint(cdir3 / ckpt.STATE_FILE)
    assert where == "drafter step 2" and len(quality["code"].offline_acceptance) == tiny_spec().drafter.block
    with pytest.raises(ValueError, match="only a drafter-phase checkpoint"):  # control: no drafter yet
        build_mod.evaluate_checkpoint(cdir / "target-done.compact.pt")
    said.clear()
    build_mod.build(tmp_path / "o3", tiny_spec(), checkpoint_dir=cdir3, resume=True, resume_from=compact, log=said.append)
    assert any("resuming at drafter step 2" in m for m in said), said


def test_a_finished_drafter_trains_on_through_a_warm_restart(tmp_path, monkeypatch):
    """A finished build's drafter continues under a longer spec that restarts its schedule where the finished run
    ended, and lands where that longer spec lands when built from the start."""
    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    quiet = lambda _msg: None  # noqa: E731

    def with_drafter(steps: int, restarts: list[int]) -> BuildSpec:
        spec = tiny_spec()
        spec.train = spec.train.model_copy(update={"drafter_steps": steps, "drafter_restarts": restarts})
        return BuildSpec.model_validate(spec.model_dump())  # validated

    cdir = tmp_path / "ckpt"
    build_mod.build(tmp_path / "short", with_drafter(5, []), checkpoint_dir=cdir, log=quiet)
    with pytest.raises(ValueError, match="except a longer run"):  # no restart at the old end: refused
        build_mod.check_resumable(ckpt.load(cdir / ckpt.STATE_FILE), with_drafter(9, []))
    said: list[str] = []
    build_mod.build(tmp_path / "continued", with_drafter(9, [5]), checkpoint_dir=cdir, resume=True, log=said.append)
    assert any("resuming at drafter step 5" in m for m in said), said
    build_mod.build(tmp_path / "fresh", with_drafter(9, [5]), log=quiet)
    build_mod.build(tmp_path / "one-cycle", with_drafter(9, []), log=quiet)

    weights = lambda name: (tmp_path / name / "drafter" / "model.safetensors").read_bytes()  # noqa: E731
    assert weights("continued") == weights("fresh")
    assert weights("continued") != weights("short")  # control: it did train on
    assert weights("fresh") != weights("one-cycle")  # control: the restart changes the schedule
    assert (tmp_path / "continued" / "target" / "model.safetensors").read_bytes() == \
        (tmp_path / "short" / "target" / "model.safetensors").read_bytes()


def with_polish(unlikelihood_steps: int = 3) -> BuildSpec:
    spec = tiny_spec()
    spec.polish = PolishSpec(unlikelihood_steps=unlikelihood_steps, unlikelihood_prefixes=2, unlikelihood_prefix_len=6,
                             unlikelihood_new_tokens=10, unlikelihood_mle_batch=2, eval_every=2, drafter_steps=3)
    return spec


def test_a_finished_build_takes_on_the_polish_stage_and_lands_where_a_build_with_it_lands(tmp_path, monkeypatch):
    """The polish stage (the target's unlikelihood training, its new continuations, the drafter trained on) runs on a
    finished build with --resume, survives an interruption in each of its phases, and gives the models a build with
    the stage from the start gives."""
    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    quiet = lambda _msg: None  # noqa: E731
    cdir = tmp_path / "ckpt"
    build_mod.build(tmp_path / "plain", tiny_spec(), checkpoint_dir=cdir, log=quiet)
    for stop in (("unlikelihood", 2), ("polish_continuations", 2), ("polish_drafter", 1)):
        with pytest.raises(build_mod.Interrupted):
            build_mod.build(tmp_path / "polished", with_polish(), checkpoint_dir=cdir, resume=True, log=quiet,
                            stop_after=lambda p, s, stop=stop: (p, s) == stop)
        assert ckpt.load(cdir / ckpt.STATE_FILE)["phase"] == stop[0]
    with pytest.raises(ValueError, match="polish settings"):  # once the stage has started its settings hold
        build_mod.check_resumable(ckpt.load(cdir / ckpt.STATE_FILE), with_polish(unlikelihood_steps=4))
    said: list[str] = []
    report = build_mod.build(tmp_path / "polished", with_polish(), checkpoint_dir=cdir, resume=True, log=said.append)
    assert any("resuming at polish_drafter step 1" in m for m in said), said
    fresh = build_mod.build(tmp_path / "fresh", with_polish(), log=quiet)

    weights = lambda name, part: (tmp_path / name / part / "model.safetensors").read_bytes()  # noqa: E731
    for part in ("target", "drafter"):
        assert weights("polished", part) == weights("fresh", part), part
        assert weights("polished", part) != weights("plain", part), part  # control: the stage changed both models
    assert report.domains == fresh.domains and report.domains["code"].greedy_repeated_4grams is not None
    progress = (cdir / "progress.jsonl").read_text()
    assert '"loops"' in progress and '"phase": "unlikelihood"' in progress
    for stage in ("unlikelihood", "polish_continuations", "polish_drafter"):
        assert (cdir / f"{stage}-done.compact.pt").is_file()
    # A compact checkpoint of the stage resumes too (float16 weights): close to the full run, not identical.
    close = build_mod.build(tmp_path / "from-compact", with_polish(), resume_from=cdir / "polish_continuations-done.compact.pt", log=quiet)
    assert abs(close.domains["code"].perplexity - report.domains["code"].perplexity) < 0.02 * report.domains["code"].perplexity


def test_repeated_ngram_mask_marks_the_repeated_grams_after_the_prompt():
    seqs = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert repeated_ngram_mask(seqs, start=0).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8]  # control row: no repeat
    assert repeated_ngram_mask(seqs, start=6).tolist() == [[0, 0, 0, 0, 0, 0, 1, 1], [0] * 8]
    assert repeated_ngram_mask(torch.tensor([[9, 1, 2, 3, 4, 1, 2, 3]]), start=0).tolist() == [[0] * 8]  # 3 tokens: no 4-gram


def test_the_loop_share_stops_where_serving_stops_and_weighs_by_length():
    loop, fresh = [5, 6, 7, 8] * 4, list(range(10, 26))
    assert continuation_loop_share([fresh], eos_id=0) == 0.0
    assert continuation_loop_share([[0] + loop], eos_id=0) == 0.0  # the end token first: nothing follows
    assert continuation_loop_share([fresh + [0] + loop], eos_id=0) == 0.0  # the loop after the end is not served
    both = continuation_loop_share([loop, fresh[:8]], eos_id=0)
    assert both == pytest.approx(9 / 18)  # 9 of the loop's 13 grams repeat (4 distinct); 13 + 5 grams in all


def test_loop_shares_are_measured_on_continuations_that_the_end_token_stops():
    """A model whose every logit is 0 chooses the end token (id 0) first: serving stops there, and so does the
    loop share's continuation; control: the unlikelihood stage's continuations never choose it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, eos_token_id=0, bos_token_id=0, pad_token_id=0))
    torch.nn.init.zeros_(model.model.norm.weight)
    prefixes = torch.tensor([[3, 4, 5]])
    served = greedy_continuations(model, prefixes, 6, stop_at_end=True)[:, 3:].tolist()
    assert served == [[0]] and continuation_loop_share(served, eos_id=0) == 0.0
    forced = greedy_continuations(model, prefixes, 6)[:, 3:].tolist()
    assert len(forced[0]) == 6 and 0 not in forced[0]


def test_the_unlikelihood_step_lowers_the_repeated_tokens_probability():
    """One gradient step on the unlikelihood loss makes the model less likely to repeat a loop; control: a step on
    the same sequence's likelihood makes it more likely."""
    seqs = torch.tensor([[7, 8, 9] + [11, 12, 13, 14] * 4])
    mask = repeated_ngram_mask(seqs, start=3)[:, 1:].bool()

    def repeat_probability(model) -> float:
        with torch.no_grad():
            p = torch.softmax(model(input_ids=seqs).logits[:, :-1], -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
        return float(p[mask].mean())

    moved = {}
    for name in ("unlikelihood", "likelihood"):
        model = new_target(TINY_TARGET, 0, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        before = repeat_probability(model)
        loss = unlikelihood_loss(model, seqs, start=3)[0] if name == "unlikelihood" else model(input_ids=seqs, labels=seqs).loss
        loss.backward()
        opt.step()
        moved[name] = repeat_probability(model) - before
    assert moved["unlikelihood"] < 0 < moved["likelihood"], moved


def test_drafter_restarts_restart_the_schedule_inside_the_run():
    train = TrainSpec(drafter_steps=100, drafter_restarts=[40])
    f = drafter_lr_factor(train)
    cycle = lambda n: drafter_lr_factor(TrainSpec(drafter_steps=n))  # noqa: E731
    assert [f(s) for s in range(40)] == [cycle(40)(s) for s in range(40)]
    assert [f(s) for s in range(40, 100)] == [cycle(60)(s) for s in range(60)]
    assert f(39) < 0.15 < f(45) and f(30) != cycle(100)(30)  # control: one cycle of 100 decays otherwise
    for bad in ([0], [100], [50, 40], [40, 40]):
        with pytest.raises(ValueError, match="drafter_restarts"):
            TrainSpec(drafter_steps=100, drafter_restarts=bad)


def test_resume_refuses_another_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    cdir = tmp_path / "ckpt"
    with pytest.raises(build_mod.Interrupted):
        build_mod.build(tmp_path / "o", tiny_spec(), checkpoint_dir=cdir, log=lambda _m: None, stop_after=lambda p, s: p == "target" and s == 2)
    other = tiny_spec()
    other.train.target_lr = 1.0
    with pytest.raises(ValueError, match="train.target_lr"):
        build_mod.build(tmp_path / "o", other, checkpoint_dir=cdir, resume=True, log=lambda _m: None)


def test_sigterm_saves_the_state_and_stops(tmp_path, monkeypatch):
    import os
    import signal

    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    before = signal.getsignal(signal.SIGTERM)

    def send_sigterm_at_step_2(phase, step):
        if (phase, step) == ("target", 2):
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    cdir = tmp_path / "ckpt"
    with pytest.raises(build_mod.Interrupted, match="target step 3"):
        build_mod.build(tmp_path / "o", tiny_spec(), checkpoint_dir=cdir, log=lambda _m: None, stop_after=send_sigterm_at_step_2)
    state = ckpt.load(cdir / ckpt.STATE_FILE)
    assert state["phase"] == "target" and state["target"]["step"] == 3
    assert signal.getsignal(signal.SIGTERM) == before  # the build's handler is gone again


def test_progress_fit_finds_where_a_known_curve_reaches_the_target(tmp_path):
    import json
    import math

    from replicas.models.progress import fit_domain, format_progress

    # log ppl = 2.0 + 40 * s^-0.5: perplexity 12 (log 2.4849) at s = (40 / 0.4849)^2 = 6805
    path = tmp_path / "progress.jsonl"
    with path.open("w") as f:
        for step in range(250, 3001, 250):
            ppl = math.exp(2.0 + 40 * step**-0.5)
            f.write(json.dumps({"phase": "target", "step": step, "loss": 1.0, "seconds": step * 3.0}) + "\n")
            f.write(json.dumps({"event": "checkpoint", "phase": "target"}) + "\n")
            f.write(json.dumps({"phase": "target", "step": step, "eval": {"code": {"perplexity": ppl}, "prose": {"perplexity": 2 * ppl}}}) + "\n")
    from replicas.models.progress import read_progress

    fit = fit_domain(read_progress(path)[1], "code", 12.0)
    assert fit.step_at_target == pytest.approx(6805, rel=0.03) and fit.alpha == pytest.approx(0.5, abs=0.02)
    prose = fit_domain(read_progress(path)[1], "prose", 12.0)  # floor 2 x e^2 = 14.8 > 12: never
    assert prose.step_at_target is None and "levels off" in prose.note
    code_line = next(line for line in format_progress(path).splitlines() if line.startswith("code:"))
    assert "about 3.2 h from now at 3.00 s/step" in code_line  # (6805 - 3000) steps x 3 s


def test_a_checkpoint_folder_in_use_by_a_live_build_is_refused(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(build_mod, "load_corpus", tiny_corpus)
    cdir = tmp_path / "ckpt"
    cdir.mkdir()
    (cdir / "build.pid").write_text(f"{os.getppid()}\n")  # a live process that is not this one
    with pytest.raises(RuntimeError, match=f"build process {os.getppid()} is using"):
        build_mod.build(tmp_path / "o", tiny_spec(), checkpoint_dir=cdir, resume=True, log=lambda _m: None, estimate_only=True)
    (cdir / "build.pid").write_text("999999999\n")  # stale: no such process
    assert build_mod.build(tmp_path / "o", tiny_spec(), checkpoint_dir=cdir, resume=True, log=lambda _m: None, estimate_only=True) is None
    assert (cdir / "build.pid").read_text().strip() == str(os.getpid())
