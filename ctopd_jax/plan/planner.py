"""Memory and time planner: `python -m ctopd_jax.plan --config X --device h100|h200|b200 [--gpus N]`.

Reads a TrainConfig, resolves the student and teacher shapes (an HF directory's config.json, a
preset name, or a directory name that matches a preset: `checkpoints/Llama-3.2-3B-Instruct` ->
llama3_2_3b; `--student-preset/--teacher-preset` force one), and prints per device:

  rollout engine share   vLLM takes rollout.vllm_gpu_memory_utilization of the WHOLE device
                         (outside the XLA pool); the JAX sampler's KV cache is counted instead
  student parameters     param_dtype, sharded over fsdp x tensor (data replicates)
  gradients              2 x parameters: the accumulator plus one micro-batch's gradients
                         (trainer.py adds them after `micro_grad` returns)
  optimizer state        AdamW m and v in the parameter dtype (m in optimizer.mu_dtype; `--mu-dtype` overrides)
  teacher weights        teacher_param_dtype (or param_dtype), sharded like the student
  student activations    one micro-batch (per device), see `activation_bytes`
  loss chunk             chunked_loss_size rows of student and teacher logits, see `loss_chunk_bytes`
  teacher scoring        the prefill's working set; a separate jit, so the transient part is
                         max(student activations + loss chunk, teacher scoring)

A teacher behind a server (`teacher.engine` vllm_server / sglang_server) has neither weights
nor scoring on the trainer's devices, and the loss chunk holds no teacher logits (3 x V_S: the
served objectives read token log-probs or a top-k, never a V_T or V∩ row). The plan then
lists no teacher rows and shows, after the total, the row "saved by the served teacher": the
teacher weights plus the drop of the transient peak, max(student step with the teacher's
loss-chunk share, teacher scoring) - the student step without it. The server's own memory is
not planned here.

Several teachers (`teachers:`): one weights row per teacher on the mesh, none for a served one;
one teacher's micro-batch runs at a time, so the loss chunk and the scoring are the largest
teacher's; the time estimate counts the first (default) teacher.

Budget: the device's memory (h100 80 GB, h200 141 GB, b200 180 GB; GB = 1e9 bytes). The XLA pool
is `XLA_PYTHON_CLIENT_MEM_FRACTION` of that; the planner assumes (and prints) the fraction
`1 - vllm share - 0.05` with vLLM (0.05 for the CUDA context, NCCL and cuDNN workspaces outside
both pools), or 0.90 with the JAX sampler, unless `--xla-mem-fraction` says otherwise. Verdict:
fits, or the first item at which the running total passes the budget, with the setting to change.
Exit 0 fits, 1 does not fit, 2 bad config or arguments (one line, no traceback).

Activations (per token per layer, compute dtype c bytes, float32 4 bytes; checked against XLA's
compile-only memory analysis on CPU in tests/test_plan.py):
- without remat every layer keeps what its backward needs: the two norm inputs in float32, the
  normed inputs, q/k/v before and q/k after RoPE, the attention output, and the MLP's gate, up,
  silu(gate) and their product: c*(3H + 2(nq+2nkv)d - nkv d + nq d + 4I) + 4*2H;
- with remat (`model.remat`) each layer keeps only its input (c*H) and ONE layer's full set is
  live during its recomputed backward, plus half as much again of that layer's gradient
  transients (REMAT_LIVE_LAYERS = 1.5, read off a scanned-layer probe on CPU);
- einsum attention (the model's `attention` setting; "einsum" when the model has no such
  setting) adds, per token and layer, the [heads, T] rows of scores and softmax in float32
  and the probabilities in c: nq*T*(8 + c); cuDNN adds O(T) only (the per-row log-sum-exp);
  blockwise adds its float32 output and dq/dk/dv accumulators and BLOCKWISE_TILES float32
  [heads, block, block] score tiles a layer, so no [T, T] term either.
Tensor parallelism divides the head and MLP terms by `tensor`; a micro-batch is split over
data x fsdp and a micro_batch_size that does not divide by it is reported (every device would
then hold the whole micro-batch).

Time (rough): FLOPs at an assumed model-FLOPs utilisation, printed with the estimate:
training 6 x params x tokens (8 x with remat: the forward runs twice) plus attention, teacher
prefill 2 x params x tokens plus attention. The rollout is memory-bound, so its time is the
decode floor of decode.py (bytes per step / HBM bandwidth, with the samples the cache
holds decoded together); the notes give the pages, the concurrent samples and the tok/s floor,
and for the JAX sampler the samples that fit beside the trainer's state during the rollout,
with and without the optimizer state offloaded. Every response is taken at its full length
(`--fill` scales the sequence length: 0.5 = responses average half of generate_max_len).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

from ctopd_jax.common.cli import Parser, UserError, at_least, fraction
from ctopd_jax.config import default_teacher, load_config, teacher_views
from ctopd_jax.mesh.device_mesh import MeshError, resolve_mesh_shape
from ctopd_jax.models.config import ModelConfig
from ctopd_jax.plan.decode import (decode_floor, kv_bytes_per_token,  # noqa: F401 (re-exported)
                                   rollout_floor)
from ctopd_jax.plan.model import (DEVICES, DTYPE_BYTES, GB, HEADROOM, SAMPLER_POOL,
                                  VLLM_OVERHEAD_GB, activation_bytes, attention_kind,
                                  estimate_time, inference_bytes, lora_param_count,
                                  loss_chunk_bytes, param_count, resolve_model)
from ctopd_jax.plan.rows import Plan, Row, format_plan, live_during_rollout


# ----------------------------------------------------------------------------- the plan
def _mesh_for(config, gpus: int) -> dict:
    try:
        return resolve_mesh_shape(dataclasses.asdict(config.mesh), gpus)
    except MeshError as err:
        raise UserError(f"{err} (planning for --gpus {gpus})") from None


def make_plan(config, device: str, gpus: int | None = None, *, student_preset=None,
              teacher_preset=None, attention=None, mu_dtype=None, xla_mem_fraction=None,
              vocab_shared: int | None = None, mfu: float = 0.35, prefill_mfu: float = 0.45,
              fill: float = 1.0) -> Plan:
    if device not in DEVICES:
        raise UserError(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    dev = DEVICES[device]
    m = config.model
    if gpus is None:
        sizes = [s for s in dataclasses.asdict(config.mesh).values()]
        if -1 in sizes:
            raise UserError("--gpus: the config's mesh has a -1 (fill) axis; say how many GPUs "
                            "to plan for, e.g. --gpus 8")
        gpus = math.prod(sizes)
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be >= 1")
    if not 0 < fill <= 1:
        raise UserError(f"--fill {fill}: must be in (0, 1]")
    mesh = _mesh_for(config, gpus)
    shard = mesh["fsdp"] * mesh["tensor"]
    batch_shards = mesh["data"] * mesh["fsdp"]
    student, s_src = resolve_model(m.student, student_preset, "student", m.dtype, m.param_dtype)
    t_param_dtype = m.teacher_param_dtype or m.param_dtype
    attention = attention or getattr(m, "attention", None)   # a config-level switch, if any
    attn = attention_kind(student, attention, gpu=True)
    # every teacher of the run (`teachers:`, else model.teacher): name -> (ModelConfig, source,
    # served); the first is the one the time estimate counts
    teachers = {name: (*resolve_model(view.model.teacher, teacher_preset, "teacher", m.dtype,
                                      t_param_dtype), view.teacher.served)
                for name, view in teacher_views(config).items()}
    teacher, t_src, _ = teachers[default_teacher(config)]
    t_attn = attention_kind(teacher, attention, gpu=True)
    r, a, o = config.rollout, config.algorithm, config.optimizer
    seq = max(1, int(round(r.max_prompt_len + fill * r.generate_max_len))) + 1  # + EOS
    t_srcs = t_src if not config.teachers else "; ".join(f"{n} {src}" for n, (_, src, _) in teachers.items())
    notes = [f"student: {s_src}; teacher: {t_srcs}; attention: {attn}",
             f"sequence: {r.max_prompt_len} prompt + {fill:g} x {r.generate_max_len} generated "
             f"+ EOS = {seq} tokens"]
    if o.micro_batch_size % batch_shards:
        per_dev_batch = o.micro_batch_size
        notes.append(f"optimizer.micro_batch_size {o.micro_batch_size} does not divide by "
                     f"data x fsdp = {batch_shards}: the batch is then replicated, every device "
                     f"holds all {o.micro_batch_size} sequences; use a multiple of {batch_shards}")
    else:
        per_dev_batch = o.micro_batch_size // batch_shards

    ps = param_count(student)
    pbytes = DTYPE_BYTES[m.param_dtype]
    mu_dtype = mu_dtype or o.mu_dtype  # --mu-dtype overrides optimizer.mu_dtype
    mu_bytes = DTYPE_BYTES[mu_dtype]
    rows: list[Row] = []
    if r.engine == "vllm":
        share = r.vllm_gpu_memory_utilization * dev.memory_gb * GB
        rows.append(Row("rollout engine (vLLM share)", share,
                        f"gpu_memory_utilization {r.vllm_gpu_memory_utilization:g} of the device",
                        "rollout.vllm_gpu_memory_utilization", in_pool=False))
        pool_fraction = xla_mem_fraction or round(1 - r.vllm_gpu_memory_utilization - HEADROOM, 4)
        weights = ps * 2 / mesh["tensor"]
        kv_tok = kv_bytes_per_token(student) / mesh["tensor"]
        kv_room = share - weights - VLLM_OVERHEAD_GB * GB
        seqs = kv_room / (kv_tok * seq) if kv_room > 0 else 0.0
        per_engine = r.rollout_batch_size * r.n_samples_per_prompt * mesh["tensor"] / gpus
        notes.append(f"vLLM share: {weights / GB:.1f} GB bf16 student weights, "
                     f"{max(kv_room, 0) / GB:.1f} GB KV cache = {seqs:.1f} full-length sequences "
                     f"at once of {per_engine:g} per engine")
        vllm_short = seqs < 1
    else:
        rows.append(Row("rollout engine (JAX sampler page pool)", r.jax_kv_cache_budget_gb * GB,
                        f"at most rollout.jax_kv_cache_budget_gb, in pages of "
                        f"{r.jax_page_size} tokens", "rollout.jax_kv_cache_budget_gb",
                        rollout_only=True))
        if DTYPE_BYTES[m.param_dtype] > DTYPE_BYTES[m.dtype]:
            rows.append(Row("decode weights (compute-dtype copy)",
                            param_count(student) * DTYPE_BYTES[m.dtype] / mesh["tensor"],
                            f"{m.dtype} copy of the student for the sampler, during the rollout",
                            "model.param_dtype", rollout_only=True))
        pool_fraction = xla_mem_fraction or SAMPLER_POOL
        vllm_short = False
    if not 0 < pool_fraction <= 1:
        raise UserError(f"XLA pool fraction {pool_fraction:g} is not in (0, 1]: lower "
                        "rollout.vllm_gpu_memory_utilization or pass --xla-mem-fraction")
    lo = getattr(config, "lora", None)
    trained = ps  # parameters with gradients and optimizer state
    if lo is not None and lo.rank > 0:
        trained = lora_param_count(student, lo.rank, lo.target_modules)
        rows.append(Row("LoRA adapters", trained * pbytes / shard,
                        f"rank {lo.rank}: {trained / 1e6:.2f} M x {pbytes} B / {shard}",
                        "lora.rank or lora.target_modules"))
        notes.append(f"LoRA rank {lo.rank}: {trained / 1e6:.2f} M trained parameters = "
                     f"{trained / ps:.4f} x full fine-tuning (gradients, optimizer state); vLLM "
                     f"sync sends the {trained * pbytes / 1e6:.1f} MB adapter where vLLM serves LoRA, "
                     f"else the merged weights ({ps * 2 / GB:.2f} GB bf16)")
    rows += [
        Row("student parameters", ps * pbytes / shard,
            f"{ps / 1e9:.2f} B x {pbytes} B ({m.param_dtype}) / fsdp x tensor {shard}",
            "mesh.fsdp (shard more) or model.param_dtype"),
        Row("gradients (accumulator + micro-batch)", 2 * trained * pbytes / shard,
            f"2 x {trained / 1e9:.3f} B x {pbytes} B / {shard}", "mesh.fsdp"),
        Row("optimizer state (AdamW m, v)", trained * (mu_bytes + pbytes) / shard,
            f"m {mu_dtype or m.param_dtype}, v {m.param_dtype}", "mesh.fsdp or optimizer.mu_dtype=bfloat16"),
    ]
    # each teacher's weights on the mesh; a served one's stay on its server
    t_bytes = DTYPE_BYTES[t_param_dtype]
    weights = {name: Row("teacher weights" + (f" ({name})" if config.teachers else ""),
                         param_count(cfg) * t_bytes / shard,
                         f"{param_count(cfg) / 1e9:.2f} B x {t_bytes} B ({t_param_dtype}) / {shard}",
                         "model.teacher_param_dtype: bfloat16, or mesh.fsdp")
               for name, (cfg, _, _) in teachers.items()}
    rows += [weights[name] for name, (_, _, served) in teachers.items() if not served]
    # A config-level remat_policy, if the model section has one: "full" is remat; the "dots"
    # policies keep the matmul outputs, most of a layer's set, so they are planned as no remat.
    policy = getattr(m, "remat_policy", "") or ("full" if m.remat else "none")
    remat = policy == "full"
    if policy not in ("full", "none"):
        notes.append(f"remat policy {policy}: planned as no remat (it keeps the matmul outputs)")
    act = activation_bytes(student, per_dev_batch, seq, remat=remat, attention=attn,
                           tensor=mesh["tensor"])
    chunk_rows = min(a.chunked_loss_size, per_dev_batch * seq)

    def loss_and_scoring(cfg, served):
        """A teacher's loss chunk (a served one's holds the student's columns only, 3 V_S) and
        its scoring working set (0 when served) on each device."""
        if served:
            return loss_chunk_bytes(chunk_rows, student.vocab_size, 0, 0), 0.0
        v_shared = min(vocab_shared or student.vocab_size, student.vocab_size, cfg.vocab_size)
        return (loss_chunk_bytes(chunk_rows, student.vocab_size, cfg.vocab_size, v_shared),
                inference_bytes(cfg, per_dev_batch, seq, attention=attention_kind(cfg, attention, gpu=True),
                                tensor=mesh["tensor"]))

    # one teacher's micro-batch at a time: the transient peak is the largest of them
    actual = [loss_and_scoring(cfg, served) for cfg, _, served in teachers.values()]
    if_local = [loss_and_scoring(cfg, False) for cfg, _, _ in teachers.values()]
    loss, teach = max(x[0] for x in actual), max(x[1] for x in actual)
    served_names = [name for name, (_, _, served) in teachers.items() if served]
    saved = None
    if served_names:
        local_transient = max(act + max(x[0] for x in if_local), max(x[1] for x in if_local))
        saved = Row("saved by serving the teacher" + ("s" if len(served_names) > 1 else ""),
                    sum(weights[n].bytes for n in served_names) + local_transient - max(act + loss, teach),
                    f"teacher weights {sum(weights[n].bytes for n in served_names) / GB:.2f} GB + "
                    f"transient peak {local_transient / GB:.2f} -> {max(act + loss, teach) / GB:.2f} GB",
                    "teacher.engine")
        where = (f"teacher served at {config.teacher.url}" if not config.teachers else
                 f"teachers served: {', '.join(served_names)}")
        notes.append(f"{where}: its weights and scoring are on the server (not planned here); "
                     f"the time estimate still counts its prefill, which the loop waits for")
    served = len(served_names) == len(teachers)
    step_label = f"{per_dev_batch} seq x {seq} tok, remat {'on' if remat else 'off'}"
    if act + loss >= teach:
        transient = "student step"
        rows += [Row("student activations (micro-batch)", act, step_label,
                     "optimizer.micro_batch_size, model.remat: true, blockwise attention"),
                 Row("loss chunk working set", loss,
                     f"{chunk_rows} rows x " + ("3 V_S" if served else "(3 V_S + 2 V_T + 2 V∩)")
                     + " x 4 B" + (", the largest teacher's" if len(teachers) > 1 else ""),
                     "algorithm.chunked_loss_size")]
        other = "no teacher scoring (served)" if served else \
            f"teacher scoring {teach / GB:.2f} GB (separate jit, smaller)"
    else:
        transient = "teacher scoring"
        rows.append(Row("teacher scoring (prefill)", teach, f"{per_dev_batch} seq x {seq} tok",
                        "optimizer.micro_batch_size, blockwise attention"))
        other = f"student step {(act + loss) / GB:.2f} GB (separate jit, smaller)"
    notes.append(f"transient peak: {transient}; {other}")

    budget = dev.memory_gb * GB
    pool = pool_fraction * budget
    total, pool_used, first = 0.0, 0.0, None
    for row in rows:   # the training step's peak: the rollout's own rows are gone by then
        if row.rollout_only:
            continue
        total += row.bytes
        if row.in_pool:
            pool_used += row.bytes
        if first is None and (total > budget or pool_used > pool):
            first = row
    rollout_used = live_during_rollout(rows)
    if first is None and vllm_short:
        first = rows[0]
        verdict = ("DOES NOT FIT: the vLLM share does not hold one full-length sequence's KV "
                   "cache; raise rollout.vllm_gpu_memory_utilization")
    elif first is None and rollout_used > pool:
        first = rows[0]
        verdict = (f"DOES NOT FIT: during the rollout {rollout_used / GB:.1f} GB (page pool, "
                   f"decode copy, persistent state) pass the {pool / GB:.1f} GB XLA pool; lower "
                   f"rollout.jax_kv_cache_budget_gb")
    elif first is None:
        verdict = (f"FITS: {pool_used / GB:.1f} GB of the {pool / GB:.1f} GB XLA pool "
                   f"({pool_fraction:g} x {dev.memory_gb:g} GB)"
                   + (f"; {rollout_used / GB:.1f} GB during the rollout" if rollout_used > pool_used else ""))
    else:
        where = "the XLA pool" if pool_used > pool else "device memory"
        verdict = (f"DOES NOT FIT: '{first.item}' passes {where}; change {first.setting}")
    floor = _rollout_floor(config, student, dev, gpus, mesh, pool, rows, notes, fill,
                           seqs if r.engine == "vllm" else None)
    time = estimate_time(student, teacher, config, dev, gpus, seq, attn, t_attn,
                         mfu=mfu, prefill_mfu=prefill_mfu, rollout_s=floor.seconds, fill=fill)
    return Plan(dev, gpus, mesh, pool_fraction, rows, transient, verdict,
                first is None and not vllm_short, notes, time, saved)


def _rollout_floor(config, student, dev, gpus, mesh, pool, rows, notes, fill, vllm_seqs):
    """plan_decode.rollout_floor with this plan's numbers (its lines go to `notes`)."""
    optimizer = sum(row.bytes for row in rows if row.item.startswith("optimizer state"))
    live = live_during_rollout(rows) - (0 if vllm_seqs is not None
                                        else config.rollout.jax_kv_cache_budget_gb * GB)
    return rollout_floor(config.rollout, student, DTYPE_BYTES[config.model.dtype], dev.name,
                         param_count(student), gpus, mesh["tensor"], fill, notes,
                         vllm_seqs=vllm_seqs, pool=pool, live=live, optimizer=optimizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m ctopd_jax.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="training config YAML")
    parser.add_argument("--device", required=True, choices=sorted(DEVICES))
    parser.add_argument("--gpus", type=at_least(1), default=None,
                        help="devices to plan for (default: the config's mesh product)")
    parser.add_argument("--set", action="append", default=[], metavar="a.b=c",
                        help="config override, as for training")
    parser.add_argument("--mesh", default=None, help="mesh override, e.g. data=1,fsdp=8,tensor=1")
    parser.add_argument("--student-preset", default=None)
    parser.add_argument("--teacher-preset", default=None)
    parser.add_argument("--attention", default=None,
                        help="attention implementation to plan for (default: the model's "
                             "`attention` setting, else einsum)")
    parser.add_argument("--mu-dtype", choices=("float32", "bfloat16"), default=None,
                        help="AdamW first moment dtype (default: the parameter dtype)")
    parser.add_argument("--xla-mem-fraction", type=fraction, default=None)
    parser.add_argument("--vocab-shared", type=at_least(1), default=109_567,
                        help="|V∩| (default: Qwen2.5 x Llama-3, SPEC §10)")
    parser.add_argument("--mfu", type=fraction, default=0.35)
    parser.add_argument("--prefill-mfu", type=fraction, default=0.45)
    parser.add_argument("--fill", type=fraction, default=1.0,
                        help="mean response length as a fraction of generate_max_len")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set, args.mesh)
    plan = make_plan(config, args.device, args.gpus, student_preset=args.student_preset,
                     teacher_preset=args.teacher_preset, attention=args.attention,
                     mu_dtype=args.mu_dtype, xla_mem_fraction=args.xla_mem_fraction,
                     vocab_shared=args.vocab_shared, mfu=args.mfu,
                     prefill_mfu=args.prefill_mfu, fill=args.fill)
    if args.json:
        print(json.dumps({"fits": plan.fits, "verdict": plan.verdict, "mesh": plan.mesh,
                          "pool_fraction": plan.pool_fraction,
                          "rows": [dataclasses.asdict(r) for r in plan.rows],
                          "saved": dataclasses.asdict(plan.saved) if plan.saved else None,
                          "notes": plan.notes, "time": plan.time}, indent=2))
    else:
        print(format_plan(plan, f"plan for {args.config}"))
    return 0 if plan.fits else 1
