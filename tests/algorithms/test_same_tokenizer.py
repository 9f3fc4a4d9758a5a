"""The same-tokenizer host path (SPEC §9): the character vocabulary, the pair check (one line
naming the first difference, before any model loads), reused sampled ids (first EOS trained,
anything after masked), dataset responses with file:line errors, the response-source collector
and the teacher_base refusal."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ctopd_jax.algorithms  # noqa: F401  (heavy imports at collection, not inside a test)
from ctopd_jax.algorithms import get_objective
from ctopd_jax.collect.collector import SameTokenizerCollector, same_tokenizer_batch
from ctopd_jax.common.records import RecordError
from ctopd_jax.config import load_config
from ctopd_jax.data.prompts import load_response_prompts, response_text
from ctopd_jax.loop import build
from ctopd_jax.rollout.base import RolloutResult
from ctopd_jax.tokenization import char_vocab, same_pair
from ctopd_jax.tokenization.side import load_tokenizer_side

ROOT = Path(__file__).resolve().parents[2]
SAME = ROOT / "configs" / "tiny_cpu_same.yaml"


@pytest.fixture(scope="module")
def char():
    return load_tokenizer_side("char")


def test_committed_char_vocabulary_is_what_the_builder_writes(tmp_path):
    out = char_vocab.write(tmp_path / "char")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_text() == (char_vocab.tokenizer_dir() / name).read_text()


def test_char_vocabulary_ids_are_the_documented_ones(char):
    assert char.vocab_size == 104 and char.kind == "byte_level"
    assert (char.pad_id, char.bos_id, char.eos_id) == (0, 1, 2)
    for c in "\t\n":
        assert char.encode(c) == [7 + "\t\n".index(c)]
    text = "".join(chr(c) for c in range(0x20, 0x7F))
    assert char.encode(text) == [9 + ord(c) - 0x20 for c in text]
    assert char.decode(char.encode(text)) == text
    assert [char.token_bytes[i] for i in char.encode("a b")] == [b"a", b" ", b"b"]
    rendered = char.render_prompt("Compute 1 + 2 - 3.")
    assert rendered == "<|bos|><|user|>Compute 1 + 2 - 3.<|end|><|assistant|>"
    assert char.encode(rendered)[:2] == [1, 4] and char.encode(rendered)[-2:] == [2, 5]


def char_with_template(folder, edit):
    """The character tokenizer copied to `folder` with `edit` applied to its chat template."""
    shutil.copytree(char_vocab.tokenizer_dir(), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = edit(cfg["chat_template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer_side(str(folder))


def test_pair_check_names_the_first_difference(char, tmp_path):
    assert same_pair.same_tokenizer_mismatch(char, char) is None
    bpe = load_tokenizer_side("tiny_bpe")
    assert "teacher vocabulary has 800 tokens, the student's 104" in same_pair.same_tokenizer_mismatch(bpe, char)
    other = char_with_template(tmp_path / "other", lambda t: t.replace("<|end|>' }}", "<|end|>\n' }}"))
    msg = same_pair.same_tokenizer_mismatch(other, char)
    assert msg.startswith("the chat templates render a 1-message conversation differently at "
                          "character 36 ") and "\n" not in msg.replace("\\n", ""), msg
    with pytest.raises(ValueError, match=r"^model\.teacher / model\.student: algorithm\.name=opd reuses"):
        same_pair.check_same_tokenizer(bpe, char, "opd")


def test_templates_that_differ_only_where_no_run_renders_are_one_template(char, tmp_path):
    """Text in a branch no probe conversation takes (Qwen2.5-Coder-0.5B's and 1.5B's templates
    differ in their tool-call instructions) is no difference; a change to what a user turn
    renders is."""
    tools = char_with_template(tmp_path / "tools",
                               lambda t: "{%- if tools %}{{ '<|tools|>' }}{%- endif %}" + t)
    assert tools.chat_template != char.chat_template
    assert same_pair.same_tokenizer_mismatch(tools, char) is None
    user = char_with_template(tmp_path / "user", lambda t: t.replace("'|>' + message", "'|> ' + message"))
    assert user.render_prompt("x") == "<|bos|><|user|> x<|end|><|assistant|>"
    assert "render a 1-message conversation differently at character 15" in \
        same_pair.same_tokenizer_mismatch(user, char)


def test_sampled_ids_are_reused_first_eos_trained_rest_masked(char):
    prompt = char.encode(char.render_prompt("Compute 1 + 2 - 3."))
    a = char.encode("(1+2)=3") + [char.eos_id] + char.encode("junk")   # EOS then junk
    b = char.encode("(1+2)=3, 3-3")                                     # truncated
    lps = [[-0.1 * (i + 1) for i in range(len(a))], [-0.2] * len(b)]
    rt, (values, weights) = same_tokenizer_batch(char, [prompt, prompt], [a, b], lps, eos_ids=())
    body = char.encode("(1+2)=3")
    assert rt.input_ids[0, :len(prompt) + len(body) + 1].tolist() == prompt + body + [char.eos_id]
    assert rt.attention_mask[0].sum() == len(prompt) + len(body) + 1    # junk after the EOS unseen
    assert rt.response_lens.tolist() == [len(body) + 1, len(b) + 1]
    rows = np.flatnonzero(rt.loss_mask[0])
    assert rows.tolist() == list(range(len(prompt) - 1, len(prompt) + len(body)))  # every response position
    assert rt.labels[0, rows].tolist() == body + [char.eos_id]                      # the first EOS is trained
    assert rt.input_ids[1, len(prompt) + len(b)] == char.eos_id                    # appended (SPEC §1)
    n0 = len(body) + 1
    np.testing.assert_allclose(values[:n0], lps[0][:len(body) + 1])   # sampled EOS keeps its log-prob
    assert weights[:n0].tolist() == [1.0] * n0
    assert weights[n0:].tolist() == [1.0] * len(b) + [0.0]              # the appended EOS has none
    assert rt.resp_bytes[0] == b"(1+2)=3"


class FakeEngine:
    """Returns fixed continuations; records what it was asked."""
    eos_ids = (2,)
    pad_id = 0

    def __init__(self, side, text):
        self.side, self.text, self.calls = side, text, []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n))
        ids = self.side.encode(self.text) + [2, 40, 41]
        n = params.n
        return RolloutResult(prompt_ids=[list(p) for p in prompts for _ in range(n)],
                             token_ids=[ids[:ids.index(2) + 1] for _ in prompts for _ in range(n)],
                             logprobs=[[-0.5] * (ids.index(2) + 1) for _ in prompts for _ in range(n)],
                             finish_reasons=["stop"] * (len(prompts) * n),
                             prompt_index=[i for i in range(len(prompts)) for _ in range(n)])

    def update_weights(self, model):
        pass


class Timer:
    def __call__(self, name):
        import contextlib
        return contextlib.nullcontext()


def _prompts():
    from ctopd_jax.data.prompts import Prompt
    return [Prompt(({"role": "user", "content": f"Compute {i} + 1 - 1."},), f"f.jsonl:{i + 1}",
                   {"response": f"({i}+1)={i + 1}, {i + 1}-1={i}. The answer is {i}."}) for i in range(4)]


def test_collector_sources_student_teacher_dataset(char):
    config = load_config(SAME, ["algorithm.name=gkd", "algorithm.gkd_lambda=0.5", "algorithm.seq_kd=true",
                                "algorithm.gkd_lambda_granularity=micro_batch", "rollout.rollout_batch_size=4",
                                "optimizer.train_batch_size=4", "optimizer.micro_batch_size=1"])
    objective = get_objective(config.algorithm)
    student, teacher = FakeEngine(char, "S"), FakeEngine(char, "TT")
    collector = SameTokenizerCollector(char, student, config.rollout, objective, teacher_engine=teacher,
                                            train_batch_size=4, micro_batch_size=1)
    batch = collector.collect(_prompts(), seed=1, timer=Timer())
    u = np.random.Generator(np.random.PCG64(0)).uniform(size=4)
    want = ["student" if x <= 0.5 else "teacher" for x in u]
    assert batch.sources == want and len(set(want)) == 2
    assert batch.student is batch.teacher
    texts = {"student": "S", "teacher": "TT"}
    assert batch.responses == [texts[s] for s in want]
    lp_w = np.split(batch.rollout_logprobs[1], np.cumsum(batch.student.response_lens)[:-1])
    assert [bool(w.all()) for w in lp_w] == [s == "student" for s in want]  # π_old only for the student
    arrays = objective.prepare(batch, 0, 4)
    assert np.array_equal(arrays.teacher_rows, arrays.response_rows)
    assert np.array_equal(arrays.teacher_ids, arrays.student_ids)
    assert batch.alignment.num_pairs == int(batch.student.response_lens.sum())  # identical sides

    config = load_config(SAME, ["algorithm.name=gkd", "algorithm.gkd_lambda=0.0", "rollout.rollout_batch_size=4",
                                "optimizer.train_batch_size=4", "optimizer.micro_batch_size=4"])
    collector = SameTokenizerCollector(char, student, config.rollout, get_objective(config.algorithm),
                                            train_batch_size=4, micro_batch_size=4)
    batch = collector.collect(_prompts(), seed=1, timer=Timer())
    assert batch.responses == [p.extra["response"] for p in _prompts()]
    assert not batch.rollout_logprobs[1].any()


def test_dataset_response_rows(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Compute 1 + 1 - 1.", "completion": "(1+1)=2"}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "Q"},
                                             {"role": "assistant", "content": "A"}]}) + "\n")
    prompts = load_response_prompts(good)
    assert [response_text(p) for p in prompts] == ["(1+1)=2", "A"]
    assert prompts[1].messages == ({"role": "user", "content": "Q"},)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "response": "y"}) + "\n\n" + json.dumps({"prompt": "z"}) + "\n")
    with pytest.raises(RecordError, match=rf"^{bad}:3: no dataset response: the row needs"):
        load_response_prompts(bad)


def _tok_dir(tmp_path, name, source):
    d = tmp_path / name
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(source) / f, d / f)
    return d


def test_mismatched_pair_refused_before_any_model_loads(tmp_path, monkeypatch):
    from ctopd_jax.loop.trainer import Trainer, TrainerSetupError

    monkeypatch.setattr(build, "load_side", lambda *a, **k: pytest.fail("a model was loaded"))
    config = load_config(SAME, [f"output_dir={tmp_path}", "algorithm.name=opd_full",
                                "model.student=demo:student", "model.teacher=demo:teacher"])  # the cross pair
    with pytest.raises(TrainerSetupError, match=r"^model\.teacher / model\.student: algorithm\.name=opd_full "
                                                r"reuses the sampled ids .*but the teacher vocabulary has 800 tokens, "
                                                r"the student's 901; use a same-tokenizer pair"):
        Trainer(config)


def test_bad_teacher_base_refused_in_one_line(tmp_path, monkeypatch):
    from ctopd_jax.loop.trainer import Trainer, TrainerSetupError

    monkeypatch.setattr(build, "load_side", lambda *a, **k: pytest.fail("a model was loaded"))
    same = _tok_dir(tmp_path, "s", char_vocab.tokenizer_dir())
    base = _tok_dir(tmp_path, "b", ROOT / "ctopd_jax" / "assets" / "tokenizers" / "tiny_bpe")
    args = [f"output_dir={tmp_path / 'run'}", "algorithm.name=opd2", f"model.student={same}",
            f"model.teacher={same}"]
    with pytest.raises(TrainerSetupError, match=r"^model\.teacher_base / model\.student: algorithm\.name=opd2 "
                                                r".*the teacher vocabulary has 800 tokens, the student's 104"):
        Trainer(load_config(SAME, args + [f"model.teacher_base={base}"]))
    with pytest.raises(TrainerSetupError, match=r"^model\.teacher_base: algorithm\.name=opd2 needs"):
        Trainer(load_config(SAME, args + ["model.teacher_base="]))


@pytest.mark.slow
def test_trainer_step_on_the_char_pair(tmp_path):
    """The real loop with the same-tokenizer collector: teacher = the student's own checkpoint,
    so the sampled gap is 0 (loss 0), the engine's π_old equals the trainer's recomputation
    (logprob_gap ~ 0) and every response token is supervised (coverage 1)."""
    from ctopd_jax.loop.trainer import Trainer

    student = ROOT / "ctopd_jax" / "assets" / "demo_char" / "student"
    config = load_config(SAME, [f"output_dir={tmp_path}", "steps=1", "rollout.rollout_batch_size=8",
                                "optimizer.train_batch_size=8", "optimizer.micro_batch_size=4",
                                f"model.teacher={student}", "logging.progress=false",
                                "logging.tensorboard=false", "checkpoint.export_hf=false",
                                "evaluation.dataset=''"])
    metrics = Trainer(config).train().last_metrics
    assert abs(metrics["opd_loss"]) < 1e-6 and abs(metrics["opd_gap"]) < 1e-5
    assert metrics["logprob_gap"] < 1e-4
    assert metrics["coverage_student"] == 1.0 and metrics["strict_pairs"] == metrics["student_response_tokens"]


def test_demo_picks_the_pair_and_times_iterations(tmp_path):
    from ctopd_jax.demo import compare

    assert {n: compare.is_same_tokenizer(n) for n in ("strict", "topk_strict", "gkd", "opd", "opd2")} == {
        "strict": False, "topk_strict": False, "gkd": True, "opd": True, "opd2": True}
    opd = compare.config_tree("opd")
    assert opd["model"]["student"] == "demo:char_student" and "ctkd_topk" not in opd["algorithm"]
    assert compare.config_tree("opd2")["rollout"]["temperature"] == 0.7
    assert compare.config_tree("topk_strict")["algorithm"]["ctkd_topk"] == 16
    assert {n: compare.pair_of(n) for n in ("strict", "opd", "tcod", "sod", "sage_opd")} == {
        "strict": "cross", "opd": "char", "tcod": "tools", "sod": "tools", "sage_opd": "tools"}
    sage = compare.config_tree("sage_opd")
    assert sage["algorithm"]["sage_judge"] == "proxy" and sage["rollout"]["environment"] == "calculator"
    assert compare.jobs(["opd", "sod", "tcod"]) == [("strict", "cross"), ("opd", "char"), ("opd", "char_lora"),
                                                    ("opd", "tools"), ("sod", "tools"), ("tcod", "tools")]
    assert compare.jobs(["gkd"]) == [("strict", "cross"), ("gkd", "char")]   # LoRA row: with opd only
    lora = compare.config_tree("opd", pair="char_lora")
    assert lora["lora"]["rank"] > 0 and lora["model"]["student"] == opd["model"]["student"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(
        json.dumps({"step": s, "elapsed_s": e}) for s, e in ((1, 30.0), (2, 32.0), (3, 35.0), (4, 37.5))))
    assert compare.iteration_seconds(tmp_path) == 2.5   # median of 2, 3, 2.5; step 1 (compile) left out
    with pytest.raises(ValueError, match=r"^--algorithm 'nope' is not registered; choose one of"):
        compare.is_same_tokenizer("nope")
