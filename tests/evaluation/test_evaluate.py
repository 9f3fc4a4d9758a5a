"""mean@K / pass@K against hand computation, and end-to-end evaluation of a tiny checkpoint.

The end-to-end checkpoint is a hand-built "bigram machine" in the HF Llama layout: every
attention and MLP output projection is zero, so the residual stream at a position is the
embedding of its token, and the lm_head maps chosen tokens to chosen successors. After the
chat template's final "\\n" it writes "\\boxed{", then "7" (p ~ 0.69) or "8" (p ~ 0.31), then
"}" and the end-of-turn token. The test grades the written samples with its own oracle (an
exact regex on that known output shape), independent of the grader under test.
"""
import json
import math
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from ctopd_jax import evaluate
from ctopd_jax.loop import mean_at_k
from ctopd_jax.loop.mean_at_k import pass_at_k, summarize
from ctopd_jax.models.config import tiny_llama
from ctopd_jax.tokenization.side import load_tokenizer_side


def test_pass_at_k_matches_combinatorics():
    # n=5, c=2, k=2: P(at least one of 2 draws w/o replacement is correct) = 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_mean_and_pass_at_k_by_hand():
    verdicts = {"a": [1, 0, 0, 1], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1]}
    samples = [{"id": pid, "problem": pid, "answer": "1", "correct": bool(v)}
               for pid, vs in verdicts.items() for v in vs]
    rows, mean, passed, k = summarize(samples)
    assert k == 4
    assert mean == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert passed == pytest.approx(2 / 3)
    assert [r["n_correct"] for r in rows] == [2, 0, 4]


def test_grade_only_file(tmp_path):
    rows = [
        {"id": "p1", "problem": "1/2?", "answer": "\\frac{1}{2}", "response": "so \\boxed{0.5}"},
        {"id": "p1", "problem": "1/2?", "answer": "\\frac{1}{2}", "response": "\\boxed{2}"},
        {"id": "p2", "problem": "x", "answer": "(1,2)", "response": "\\boxed{(1, 2)}"},
        {"id": "p2", "problem": "x", "answer": "(1,2)", "response": "no box: answer is (1,2)"},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = evaluate.main(["--grade-only", str(path), "--out", str(tmp_path / "out")])
    # p1: 1 of 2, p2: 1 of 2 (the unboxed one does not count without fallbacks)
    assert report.mean_at_k == pytest.approx(0.5)
    assert report.pass_at_k == pytest.approx(1.0)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mean@2"] == pytest.approx(0.5)
    with_fallbacks = evaluate.main(["--grade-only", str(path), "--answer-fallbacks"])
    assert with_fallbacks.mean_at_k == pytest.approx(0.75)


def test_grade_only_rejects_rows_without_response(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"s\.jsonl:1: field 'response'"):
        evaluate.main(["--grade-only", str(path)])


def _bigram_checkpoint(directory, tokenizer):
    cfg = tiny_llama(vocab_size=tokenizer.vocab_size)
    h, v = cfg.hidden_size, cfg.vocab_size
    newline = tokenizer.encode("\n")[-1]
    backslash, boxed, lbrace, seven, rbrace = tokenizer.encode("\\boxed{7}")
    eight = tokenizer.encode("8")[0]
    eos = tokenizer.eos_id
    rng = np.random.default_rng(0)
    embed = rng.normal(0, 0.02, (v, h)).astype(np.float32)
    lm_head = np.zeros((v, h), np.float32)
    # successor table: token -> {next token: weight}; logit = 8 * weight after RMSNorm
    table = {newline: {backslash: 4.0}, backslash: {boxed: 4.0}, boxed: {lbrace: 4.0},
             lbrace: {seven: 1.6, eight: 1.5}, seven: {rbrace: 4.0}, eight: {rbrace: 4.0},
             rbrace: {eos: 4.0}}
    for direction, (token, successors) in enumerate(table.items()):
        embed[token] = 0.0
        embed[token, direction] = 1.0
        for nxt, weight in successors.items():
            lm_head[nxt, direction] = weight
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head,
               "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "self_attn.q_proj.weight": rng.normal(0, 0.02, (q_out, h)).astype(np.float32),
            pre + "self_attn.k_proj.weight": rng.normal(0, 0.02, (kv_out, h)).astype(np.float32),
            pre + "self_attn.v_proj.weight": rng.normal(0, 0.02, (kv_out, h)).astype(np.float32),
            pre + "self_attn.o_proj.weight": np.zeros((h, q_out), np.float32),
            pre + "mlp.gate_proj.weight": rng.normal(0, 0.02, (cfg.intermediate_size, h)).astype(np.float32),
            pre + "mlp.up_proj.weight": rng.normal(0, 0.02, (cfg.intermediate_size, h)).astype(np.float32),
            pre + "mlp.down_proj.weight": np.zeros((h, cfg.intermediate_size), np.float32),
            pre + "input_layernorm.weight": np.ones(h, np.float32),
            pre + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return directory


# Problem answers: "7"-samples are right on the first two, "8"-samples on the third, none on
# the fourth. Answers are spelled differently from the model's output on purpose.
PROBLEMS = [("What is 3+4?", "7"), ("Half of 14?", "\\frac{14}{2}"), ("2^3?", "8.0"),
            ("3^2?", "9")]


def _oracle(response: str, answer: str) -> bool:
    m = re.fullmatch(r"\\boxed\{(\d)\}", response.strip())
    value = {"7": 7, "\\frac{14}{2}": 7, "8.0": 8, "9": 9}[answer]
    return m is not None and int(m.group(1)) == value


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tokenizer = load_tokenizer_side("tiny_bpe")
    ckpt = _bigram_checkpoint(root / "ckpt", tokenizer)
    data = root / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a, "unique_id": f"q{i}"}) + "\n"
                            for i, (p, a) in enumerate(PROBLEMS)))
    return root, ckpt, data


def test_end_to_end_sampled_mean_at_k_matches_independent_grading(tiny_run):
    root, ckpt, data = tiny_run
    k = 8
    report = evaluate.main(["--checkpoint", str(ckpt), "--tokenizer", "tiny_bpe",
                            "--dataset", str(data), "--samples", str(k), "--no-greedy",
                            "--max-new-tokens", "8", "--seed", "3", "--out", str(root / "out")])
    samples = [json.loads(line) for line in (root / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == k * len(PROBLEMS)
    by_problem: dict[str, list[bool]] = {}
    for s in samples:
        by_problem.setdefault(s["id"], []).append(_oracle(s["response"], s["answer"]))
    expected_mean = sum(sum(v) / len(v) for v in by_problem.values()) / len(by_problem)
    expected_pass = sum(any(v) for v in by_problem.values()) / len(by_problem)
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary[f"mean@{k}"] == pytest.approx(expected_mean)
    assert summary[f"pass@{k}"] == pytest.approx(expected_pass)
    assert report.mean_at_k == pytest.approx(expected_mean)
    # The sampler really sampled: both branches occur (P(all 32 alike) < 1e-5).
    assert {s["response"] for s in samples} == {"\\boxed{7}", "\\boxed{8}"}
    # The problem the model can never solve scores 0; re-grading the file gives the same report.
    assert by_problem["q3"] == [False] * k
    regraded = evaluate.main(["--grade-only", str(root / "out" / "samples.jsonl")])
    assert regraded.mean_at_k == pytest.approx(expected_mean)


@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,tensor=2"])
def test_end_to_end_greedy_by_hand(tiny_run, mesh):
    root, ckpt, data = tiny_run
    report = evaluate.main(["--checkpoint", str(ckpt), "--tokenizer", "tiny_bpe",
                            "--dataset", str(data), "--samples", "1", "--greedy",
                            "--max-new-tokens", "8"] + (["--mesh", mesh] if mesh else []))
    # Greedy always writes \boxed{7}: right on q0 and q1 only.
    assert [s["response"] for s in report.samples] == ["\\boxed{7}"] * 4
    assert report.mean_at_k == pytest.approx(0.5)
    assert report.pass_at_k == pytest.approx(0.5)
    assert [r["n_correct"] for r in report.per_problem] == [1, 1, 0, 0]
    assert math.isclose(report.pass_at_k, 2 / 4)


@pytest.mark.vllm
def test_end_to_end_greedy_with_vllm_engine(tiny_run):
    pytest.importorskip("vllm")
    root, ckpt, data = tiny_run
    report = evaluate.main(["--checkpoint", str(ckpt), "--tokenizer", "tiny_bpe",
                            "--dataset", str(data), "--samples", "1", "--greedy",
                            "--max-new-tokens", "8", "--set", "rollout.engine=vllm"])
    assert [s["response"] for s in report.samples] == ["\\boxed{7}"] * 4
    assert report.mean_at_k == pytest.approx(0.5)


class _ScriptedEngine:
    """A rollout engine returning fixed responses (the trainer passes its own engine)."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.responses, self.calls = tokenizer, responses, []

    def generate(self, prompts, params):
        from ctopd_jax.rollout.base import RolloutResult

        self.calls.append((prompts, params))
        n = params.n
        tokens = [self.tokenizer.encode(self.responses[i % len(self.responses)])
                  for i in range(len(prompts) * n)]
        return RolloutResult(prompt_ids=[p for p in prompts for _ in range(n)], token_ids=tokens,
                             logprobs=[[0.0] * len(t) for t in tokens],
                             finish_reasons=["stop"] * len(tokens),
                             prompt_index=[i for i in range(len(prompts)) for _ in range(n)])


def test_evaluate_model_with_injected_engine_and_task_grader():
    from ctopd_jax.data.eval_sets import load_dataset
    from ctopd_jax.demo import task

    tokenizer = load_tokenizer_side("tiny_bpe")
    demo = load_dataset("demo", limit=3)
    answers = [int(p.answer) for p in demo.problems]
    # per problem: sample 0 right ("The answer is N."), sample 1 wrong (N+1)
    engine = _ScriptedEngine(tokenizer, ["placeholder"])
    engine.responses = [f"The answer is {a + d}." for a in answers for d in (0, 1)]
    report = mean_at_k.evaluate_model(None, tokenizer, demo, engine=engine, k=2, greedy=True,
                                     max_new_tokens=16)
    prompts, params = engine.calls[0]
    assert params.n == 2 and params.temperature == 0.0 and params.max_new_tokens == 16
    assert prompts[0] == tokenizer.encode(tokenizer.render_prompt(task.split("held_out")[0].prompt))
    assert [s["correct"] for s in report.samples] == [True, False] * 3
    assert {s["method"] for s in report.samples} == {"task_grader"}
    assert report.mean_at_k == pytest.approx(0.5) and report.pass_at_k == pytest.approx(1.0)
