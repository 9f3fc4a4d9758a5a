"""Packed rows against one row per sample: the same samples of a collected batch, through the
trainer's own micro-batch step (prepare, teacher rows, student gradient), give the same loss
and gradient (fp32, 1e-6 relative) for every objective that packs (`packs`); the ones that
cannot pack say so and keep one row per sample. The oracle is the unpacked step (each sample in
a right-padded row of its own), which the objective tests check against their references.

Pairs: the tiny random cross-tokenizer pair (tests/trainer/conftest.py) and the demo's char
pair (configs/tiny_cpu_same.yaml) for the same-tokenizer objectives; the served objectives on
the demo pairs behind the fake vLLM server of test_served_teacher_training. Batches: the
prompts' sampled responses, and for every objective a long-tail batch (5 responses of lengths
8..2,048, in the slow suite; 8..256 for strict in the default one) that the real collector
builds from a scripted engine's responses (tests/scripted_engine.py). Also: the 8 test
devices' batch shards, the packing layout (hand-written cases) and a resume across a change of
micro-batching."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml

from ctopd_jax.algorithms import packed_rows, registry
from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.algorithms.packed_rows import PackingError, micro_ranges, pack_rows
from ctopd_jax.common.metrics import StepTimer
from ctopd_jax.config import from_dict, load_config
from ctopd_jax.loop import teacher_batches
from ctopd_jax.loop.build import make_collector
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.preflight import preflight
from ctopd_jax.step.grad import zero_grads

from conftest import subprocess_env, tiny_tree
from scripted_engine import long_tail_engine

SAME = ("opd", "opd_full", "opd2", "gkd", "vopd", "sod", "sage_opd", "tcod")
CROSS = ("strict", "topk_strict", "span", "simct", "mp_opd")
SERVED = ("teacher_topk_strict", "topk_gkd")   # need a served teacher (the fake vLLM server)
ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_objective_is_covered_here():
    assert set(registry()) == set(SAME + CROSS + SERVED)


def trainer_for(name, tmp_path, *extra, budget=512, samples=7, served=None, checked=True):
    """A trainer whose packed micro-batch of 7 samples spreads over several rows of the budget;
    `served`: the fake vLLM server of its teacher (the served objectives), built after
    preflight's checks when `checked` (the long tail's are not: its responses pass the demo
    models' 256 positions, which preflight refuses for a run; RoPE computes any position)."""
    if name in SAME or served is not None:
        teacher = () if served is None else ("teacher.engine=vllm_server", f"teacher.url={served.url}",
                                             f"teacher.model={served.model}", "teacher.top_k=8")
        config = load_config("configs/tiny_cpu.yaml" if name == "teacher_topk_strict" else "configs/tiny_cpu_same.yaml", [
            f"algorithm.name={name}", f"output_dir={tmp_path / name}", f"rollout.rollout_batch_size={samples}",
            f"optimizer.train_batch_size={samples}", f"optimizer.micro_batch_size={samples}", "evaluation.dataset=",
            f"optimizer.micro_batch_tokens={budget}", "rollout.generate_max_len=24",
            "logging.tensorboard=false", *teacher, *extra])
        return Trainer(config, preflight=preflight(config) if served is not None and checked else None)
    tree = tiny_tree(tmp_path / name, **{"rollout.rollout_batch_size": samples, "rollout.n_samples_per_prompt": 1,
                                          "optimizer.train_batch_size": samples, "optimizer.micro_batch_size": samples,
                                          "optimizer.micro_batch_tokens": budget})
    tree["algorithm"] = {"name": name, "chunked_loss_size": 64}
    for item in extra:   # section.key=value
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        tree[section][field] = yaml.safe_load(value)
    return Trainer(from_dict(tree))


def loss_and_grads(trainer, host, packed):
    """The step of the batch as one micro-batch (7 samples do not divide over the 8 test
    devices, so they are one unit packed into rows of the budget; 16 are 8 batch shards)."""
    name = next(iter(trainer.teachers))
    loss, _, _, grads = trainer.micro_batch(trainer.teachers[name], host, 0, host.size,
                                            host.tokens(0, host.size), 1, zero_grads(trainer.params),
                                            StepTimer(), None, packed)
    return float(loss), jax.tree.leaves(jax.device_get(grads))


def collect(trainer, rollout_index=0):
    """The host batch of the trainer's next prompts, as its iteration `rollout_index` collects it."""
    host, = teacher_batches.collect(trainer.teachers, trainer.config, trainer.objective,
                                    trainer.stream.next_batch(), 5, StepTimer(), rollout_index).values()
    return host


# The policy-gradient objectives' gradient, Σ (log π_T − log π_S) ∇ log π_S over 2,048-token
# responses, cancels: float32 summation order alone moves it by ~1e-6 relative on this batch
# (the unpacked step split into one micro-batch per sample: 9.4e-7 for opd), and the packed
# rows' attention, in tiles of 128 instead of 512, sums in another order again: packed against
# unpacked reads 2.6-3.0e-6 for these four (their loss stays within 1e-6; every other objective's
# gradient within 1e-6). On the demo pair's sampled responses opd read 1.04e-6 once on a loaded
# machine. A row in the wrong place reads 1e-3 and more (the batch-shard width bug
# of stack_shards: 1e-2 on the loss).
GRADIENT_FLOOR = {"opd": 5e-6, "vopd": 5e-6, "sod": 5e-6, "tcod": 5e-6}


def assert_same(trainer, samples=7):
    host = collect(trainer)
    assert host.size == samples
    ref_loss, ref = loss_and_grads(trainer, host, packed=False)
    got_loss, got = loss_and_grads(trainer, host, packed=True)
    assert_close(got_loss, ref_loss, got, ref, GRADIENT_FLOOR.get(trainer.config.algorithm.name, 1e-6))


def assert_close(got_loss, ref_loss, got, ref, gradient_tolerance=1e-6):
    """Loss and gradient (as one vector) equal to 1e-6 relative (the gradient to
    `gradient_tolerance`)."""
    assert ref_loss != 0.0
    assert abs(got_loss - ref_loss) <= 1e-6 * abs(ref_loss)
    norm = np.sqrt(sum(float(np.sum(np.square(r, dtype=np.float64))) for r in ref))
    diff = np.sqrt(sum(float(np.sum(np.square(g - r, dtype=np.float64))) for g, r in zip(got, ref)))
    assert norm > 0 and diff <= gradient_tolerance * norm, (diff, norm)


slow = pytest.mark.slow


# One objective per pair on the prompts' sampled responses; every objective that packs runs on
# the long-tail batch of the same pairs (LONG_TAIL, slow), which holds short responses too.
@pytest.mark.parametrize("name,extra", [("strict", ()), ("opd", ())])
def test_packed_rows_give_the_unpacked_loss_and_gradient(tmp_path, name, extra):
    trainer = trainer_for(name, tmp_path, *extra)
    assert trainer.objective.packs
    assert_same(trainer)


@pytest.fixture(scope="module")
def served_teachers():
    """name -> the fake vLLM server (test_served_teacher_training) of the objective's pair,
    answering with the local demo teachers' own forward."""
    from test_served_teacher_training import CHAR_TEACHER, DEMO_TEACHER, LocalModelScores, LocalModelVllmServer

    servers = {"topk_gkd": LocalModelVllmServer("vllm", LocalModelScores(CHAR_TEACHER, 20), model="char-teacher",
                                                max_model_len=4096, max_logprobs=20),
               "teacher_topk_strict": LocalModelVllmServer("vllm", LocalModelScores(DEMO_TEACHER, 20),
                                                           model="demo-teacher", max_model_len=4096, max_logprobs=20)}
    yield servers
    for server in servers.values():
        server.close()


@slow
@pytest.mark.parametrize("name", SERVED)
def test_served_objectives_pack_to_the_unpacked_loss_and_gradient(tmp_path, served_teachers, name):
    """The served teacher's scores (token log-probs and top-8) come with the host batch and are
    read through the moved teacher rows."""
    trainer = trainer_for(name, tmp_path, served=served_teachers[name])
    assert trainer.default_parts.served is not None and trainer.objective.packs
    assert_same(trainer)


def test_packed_rows_on_a_mesh_give_the_unpacked_loss_and_gradient(tmp_path):
    """16 long-tail samples (8..256 tokens) over the 8 test devices' batch shards: each shard
    packs its own 2 samples (rows enough for them), against one row per sample. The shards'
    parts have different widths either way (their samples fall in different length buckets),
    which stacking them must not let move any row index (step.shards.stack_shards)."""
    trainer = long_tail_trainer("strict", tmp_path, 256, samples=16)
    assert trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"] == 8
    assert_same(trainer, samples=16)


@pytest.mark.parametrize("name,extra", [
    ("mp_opd", ("algorithm.mp_opd_mode=grass_chunk",)),
    pytest.param("sage_opd", ("algorithm.sage_judge=proxy",), marks=slow)])
def test_an_objective_that_cannot_pack_falls_back_alone(tmp_path, name, extra):
    """Its loss depends on the micro-batch boundaries: one row per sample, micro_batch_size of
    them, whatever the budget. On the long-tail batch (lengths 8..2,048) with a budget of 3,072
    tokens, which packing would cut into several micro-batches."""
    trainer = long_tail_trainer(name, tmp_path, 2048, *extra, budget=3072)
    assert not trainer.objective.packs
    assert not trainer.packing
    host = collect(trainer)
    assert len(packed_rows.host_micro_ranges(host, 0, 5, 3072)) > 1
    assert trainer.micro_ranges(host, 0, 5) == [(0, 5)]


def test_rows_move_to_their_sample_in_the_packed_row():
    """Samples of lengths 3, 1, 4 (arrays of 64 per sample) -> one row of 16 (the narrowest
    width bucket): offsets 0, 3, 4 (hand-written)."""
    mask = np.arange(64)[None] < np.array([3, 1, 4])[:, None]
    ids = np.where(mask, np.arange(1, 193).reshape(3, 64), 0).astype(np.int32)
    out = pack_rows(MicroBatch(student_ids=ids, student_mask=mask,
                               response_rows=np.array([1, 64, 128, 131], np.int32)), 64)
    assert out.student_ids.shape == (1, 16)
    assert out.student_ids[0, :9].tolist() == [1, 2, 3, 65, 129, 130, 131, 132, 0]
    assert out.student_mask[0, :9].tolist() == [1, 1, 1, 2, 3, 3, 3, 3, 0]
    assert out.response_rows.tolist() == [1, 3, 4, 7]
    with pytest.raises(PackingError, match="past its sample"):
        pack_rows(MicroBatch(student_ids=ids, student_mask=mask, response_rows=np.array([65])), 64)


def test_samples_go_first_fit_into_rows_of_their_bucket():
    """Lengths 40, 30, 8 (width bucket 48), budget 128: two rows; 40 -> row 0, 30 does not fit
    beside it -> row 1, 8 fits after the 40 -> row 0 at 40 (hand-written)."""
    mask = np.arange(64)[None] < np.array([40, 30, 8])[:, None]
    ids = np.where(mask, 7, 0).astype(np.int32)
    rows = np.array([0, 39, 64, 64 + 29, 128, 128 + 7], np.int32)   # first and last of each
    out = pack_rows(MicroBatch(student_ids=ids, student_mask=mask, response_rows=rows), 128)
    assert out.student_mask.shape == (2, 48)
    assert out.response_rows.tolist() == [0, 39, 48, 48 + 29, 40, 47]
    assert (out.student_mask[0] == np.repeat([1, 3], [40, 8])).all()
    assert (out.student_mask[1, :30] == 2).all() and not out.student_mask[1, 30:].any()
    # 40, 30 fill the two rows of 48; 20 and 50 (rows of 64) start the next micro-batch
    assert micro_ranges(np.array([[40, 40], [30, 30], [20, 20], [50, 10]]), 10, 128, (64, 64)) == [
        (10, 12), (12, 14)]


def test_micro_batches_are_first_fit_decreasing_bins_of_the_whole_batch():
    """Lengths 30, 10, 50, 20, 40, budget 128 (rows of 64, two of them): the bin of 50 takes 40
    (row 1), not 30 (fits no row), 20 (beside 40), 10 (beside 50); 30 is a bin of its own
    (hand-written). In length order alone the first micro-batch would stop at 30."""
    lengths = np.array([[30, 30], [10, 10], [50, 50], [20, 20], [40, 40]])
    order = packed_rows.order(lengths, 128, (64, 64))
    assert order.tolist() == [2, 4, 3, 1, 0]
    assert micro_ranges(lengths[order], 0, 128, (64, 64)) == [(0, 4), (4, 5)]
    assert micro_ranges(lengths[[2, 4, 0, 3, 1]], 0, 128, (64, 64)) == [(0, 2), (2, 5)]


def test_packed_rows_round_to_a_few_shapes():
    """Rows used -> 1, 2, 3, 4, 6, 8, 12, ...; widths step by 16 up to 128, by 64 up to 512,
    never past unpacked's bucket or the side's padded length (hand-written)."""
    assert [packed_rows.row_count(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    width = lambda n, cap=4096: packed_rows.place([n], 4096, cap)[1]
    assert [width(n) for n in (1, 33, 100, 129, 250, 257, 500, 513, 1000)] == [
        16, 48, 112, 192, 256, 320, 512, 768, 1024]
    assert width(700, cap=704) == 704
    rows, _, row, offset = packed_rows.place([30] * 7, 1024, 4096)   # 7 rows of 32 used of 32 allowed
    assert (rows, row.tolist(), offset.tolist()) == (8, list(range(7)), [0] * 7)
    assert packed_rows.place([600, 600], 1024, 4096) is None     # one row of 768 holds one of them


def test_the_auto_budget_is_micro_batch_size_rows_of_the_longest_sequence(tmp_path):
    """micro_batch_size 4 x (prompt 100 + generated 200 + EOS 1, rounded up to 64 = 320)."""
    tree = tiny_tree(tmp_path, **{"optimizer.micro_batch_size": 4, "optimizer.train_batch_size": 8,
                                  "rollout.max_prompt_len": 100, "rollout.generate_max_len": 200})
    assert packed_rows.budget(from_dict(tree)) == 4 * 320
    tree["optimizer"]["micro_batch_tokens"] = 0
    assert packed_rows.budget(from_dict(tree)) == 0


def long_tail_trainer(name, tmp_path, longest, *extra, samples=5, budget=None, served=None):
    """trainer_for with its collectors' engine scripted (scripted_engine.long_tail_engine), so
    that each objective's host data (atoms, alignment, rollout log-probs, turns) comes from the
    real collector, as in a run; the default budget holds the samples in one micro-batch."""
    trainer = trainer_for(name, tmp_path, f"rollout.generate_max_len={longest}", *extra, samples=samples,
                          budget=budget or samples * 4 * longest, served=served, checked=False)
    engine = long_tail_engine(trainer.s_tok, np.random.default_rng(longest), samples, longest)
    for t in trainer.teachers.values():
        t.collector = make_collector(trainer.config, trainer.objective, trainer.s_tok, t.tokenizer, engine,
                                     t.model, trainer.mesh)
    return trainer


# The rollout batch the long-tail cases collect: TCOD's f2b curriculum (tcod_period 1) lets the
# student play 1 + 8 turns there, the longest response's 8 paragraphs; no other objective reads it.
LONG_TAIL_INDEX = 8


def long_tail_steps(case: dict) -> None:
    """One long-tail case (`case`: out, name, longest, extra, served: {url, model} or None):
    the unpacked then the packed step's loss and gradient leaves, to the npz `out`."""
    out = Path(case["out"])
    served = SimpleNamespace(**case["served"]) if case["served"] else None
    trainer = long_tail_trainer(case["name"], out.parent, case["longest"], *case["extra"], served=served)
    assert trainer.objective.packs
    host = collect(trainer, LONG_TAIL_INDEX)
    lengths = host.student.response_lens
    assert host.size == 5 and lengths.min() <= 16 and lengths.max() >= case["longest"] // 2, lengths
    (ref_loss, ref), (got_loss, got) = (loss_and_grads(trainer, host, packed) for packed in (False, True))
    np.savez(out, losses=[ref_loss, got_loss], **{f"ref{i}": r for i, r in enumerate(ref)},
             **{f"got{i}": g for i, g in enumerate(got)})


def assert_long_tail_packs(tmp_path, compile_cache, name, longest, extra, served=None):
    """long_tail_steps on one device, in a process of its own: 5 samples do not divide over the
    8 test devices, so each of them would compute the whole micro-batch (several times the
    work on a 2-core machine)."""
    out = tmp_path / "steps.npz"
    case = {"out": str(out), "name": name, "longest": longest, "extra": list(extra),
            "served": None if served is None else {"url": served.url, "model": served.model}}
    subprocess.run([sys.executable, __file__, json.dumps(case)], check=True, cwd=ROOT, timeout=600,
                   env=subprocess_env(compile_cache, devices=1,
                                      PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])))
    steps = np.load(out)
    ref_loss, got_loss = steps["losses"]
    leaves = range(len(steps.files) // 2)   # ref0.., got0.. and the losses
    assert_close(got_loss, ref_loss, [steps[f"got{i}"] for i in leaves], [steps[f"ref{i}"] for i in leaves],
                 GRADIENT_FLOOR.get(name, 1e-6))


LONG_TAIL = [  # (objective, settings): every registered one that packs, local teacher
    ("strict", ()), ("topk_strict", ("algorithm.ctkd_topk=8",)), ("span", ()), ("simct", ()),
    ("mp_opd", ("algorithm.mp_opd_mode=atomic",)), ("mp_opd", ("algorithm.mp_opd_mode=align",)),
    ("opd", ()), ("opd_full", ()), ("opd2", ()),
    ("gkd", ("algorithm.gkd_lambda=1.0",)), ("vopd", ()), ("sod", ()), ("tcod", ("algorithm.tcod_period=1",))]


@pytest.mark.parametrize("name,extra,longest", [("strict", (), 256)] + [
    pytest.param(name, extra, 2048, marks=slow) for name, extra in LONG_TAIL])
def test_a_long_tail_batch_packs_to_the_unpacked_loss_and_gradient(tmp_path, compile_cache, name, extra, longest):
    """5 responses of lengths 8..2,048 (8..256 in the default suite) in one micro-batch."""
    assert_long_tail_packs(tmp_path, compile_cache, name, longest, extra)


@slow
@pytest.mark.parametrize("name", SERVED)
def test_a_long_tail_batch_packs_with_a_served_teacher(tmp_path, compile_cache, served_teachers, name):
    """The served teacher's scores of 8..2,048-token responses, read through the moved teacher rows."""
    assert_long_tail_packs(tmp_path, compile_cache, name, 2048, ("algorithm.gkd_lambda=1.0",) * (name == "topk_gkd"),
                           served_teachers[name])


class _StopAfterFirstStep:
    """run_guard.SignalGuard's face: a stop requested at the first step boundary."""
    signum = 15

    def requested_everywhere(self):
        return True


@slow   # two tiny runs and a resume (~1-3 min on 2 cores)
def test_a_checkpoint_resumes_bit_exactly_under_another_micro_batching(tmp_path):
    """Step 1 one row per sample, checkpointed; resumed with packed micro-batches of 96 tokens,
    step 2 ends bit-exactly where a run that switched micro-batching in memory ends."""
    import dataclasses

    from ctopd_jax.common.run_guard import Stopped

    def config(out, tokens):
        tree = tiny_tree(out, **{"steps": 2, "checkpoint.every": 1, "optimizer.micro_batch_tokens": tokens})
        return from_dict(tree)

    def state(trainer):
        return jax.tree.leaves(jax.tree.map(np.asarray, trainer._state()))

    straight = Trainer(config(tmp_path / "straight", 0))
    straight.step(1, StepTimer())
    straight.config = dataclasses.replace(straight.config, optimizer=dataclasses.replace(
        straight.config.optimizer, micro_batch_tokens=96))
    for t in straight.teachers.values():   # the collector orders batches into packed micro-batches
        t.collector = make_collector(straight.config, straight.objective, straight.s_tok, t.tokenizer,
                                     straight.engine, t.model, straight.mesh)
    assert straight.packing and straight.default_parts.collector.budget == 96
    straight.step(2, StepTimer())

    with pytest.raises(Stopped):
        Trainer(config(tmp_path / "resumed", 0)).train(stop=_StopAfterFirstStep())
    resumed = Trainer(config(tmp_path / "resumed", 96))
    assert resumed.train(resume=True).final_step == 2
    for a, b in zip(state(straight), state(resumed)):
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":   # one long-tail case (assert_long_tail_packs)
    long_tail_steps(json.loads(sys.argv[1]))
