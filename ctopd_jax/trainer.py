"""The on-policy loop of SPEC §1, nothing else.

    prompts (data.PromptStream) -> render twice (student / teacher chat templates)
    -> engine.generate (student policy) -> decode -> re-tokenize both sides -> strict alignment
    -> per optimizer batch, per micro-batch: teacher scoring [R, V∩] -> student gradient
    -> optax update -> engine.update_weights -> metrics -> checkpoint

Decisions where SPEC is silent:
- One iteration = one rollout of rollout_batch_size * n_samples_per_prompt responses, split into
  optimizer batches of train_batch_size (usually one) and those into micro-batches of
  micro_batch_size; `steps` counts iterations and the schedule counts optimizer updates.
- Prompts whose student rendering is longer than rollout.max_prompt_len are dropped once at
  start-up (with a warning naming the count and the first one), so the data order is fixed.
- The RNG key is split once per iteration; the sampling seed of that iteration comes from it.
- A step whose loss or gradient norm is not finite is not applied; the run stops with
  `TrainingDiverged` naming the step and the last good checkpoint (already on disk).
- Multi-process (jax.distributed): every process runs the same host work on the same data
  (prompts, decoded text, alignment), device arrays are assembled from that identical host data,
  and the embedded sampler runs per process on a gathered local copy of the student.
- Teacher scoring uses `algorithms.step.teacher_scores` on the packed micro-batch (same padded
  arrays as the student, globally sharded), rather than `teacher.TeacherScorer`, which re-pads
  per call and assembles results with host-local index arrays.
"""
from __future__ import annotations

import functools
import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax import mesh as mesh_lib
from ctopd_jax.algorithms import AlgorithmSettings, get_algorithm
from ctopd_jax.algorithms.pack import slice_micro_batch
from ctopd_jax.algorithms.step import add_trees, make_apply_update, micro_grad, scalar, teacher_scores
from ctopd_jax.checkpoint import Checkpointer, export_student_hf
from ctopd_jax.config import TrainConfig
from ctopd_jax.data import PromptStream, load_prompts, resolve_named_source
from ctopd_jax.metrics import MetricsLogger, StepTimer
from ctopd_jax.optimizer import make_optimizer, settings_from_config

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN/inf; the update was not applied."""


class TrainerSetupError(ValueError):
    """A model, tokenizer or data setting that cannot be used (raised before training)."""


# ----------------------------------------------------------------------------- loading

def _model_dir(spec: str) -> Path | None:
    if spec.startswith("demo:"):
        from ctopd_jax.demo.data import checkpoint_dir
        return checkpoint_dir(spec.split(":", 1)[1])
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


@functools.partial(nnx.jit, static_argnums=(0,))
def _init_decoder(cfg, seed):
    """A randomly initialised Decoder; compiled once per config (cached across trainers)."""
    from ctopd_jax.models import Decoder
    return Decoder(cfg, rngs=nnx.Rngs(jax.random.key(seed)))


def load_side(spec: str, tokenizer_spec: str, model_section, mesh, seed: int, role: str):
    """(Decoder on the mesh, TokenizerSide) for `model.student` / `model.teacher`."""
    from ctopd_jax.models import PRESETS, Decoder
    from ctopd_jax.tokenization.side import load_tokenizer_side

    directory = _model_dir(spec)
    name = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    if directory is None and name not in PRESETS:
        raise TrainerSetupError(
            f"model.{role}={spec!r}: not a checkpoint directory, demo:<role>, or a preset "
            f"({', '.join(sorted(PRESETS))})")
    tok_spec = tokenizer_spec or (str(directory) if directory is not None else "")
    if not tok_spec:
        raise TrainerSetupError(f"model.{role}_tokenizer: a preset model ({spec}) needs a tokenizer; "
                                f"set model.{role}_tokenizer (e.g. tiny_bpe)")
    tokenizer = load_tokenizer_side(tok_spec)
    param_dtype = model_section.param_dtype
    if role == "teacher" and getattr(model_section, "teacher_param_dtype", ""):
        param_dtype = model_section.teacher_param_dtype
    kwargs = dict(dtype=model_section.dtype, param_dtype=param_dtype,
                  remat=model_section.remat if role == "student" else False)
    if directory is not None:
        from ctopd_jax.models.weights import load_hf_checkpoint
        model, _ = load_hf_checkpoint(directory, mesh=mesh, **kwargs)  # placed on its shardings
    else:
        cfg = PRESETS[name](vocab_size=tokenizer.vocab_size, **kwargs)
        model = _init_decoder(cfg, seed)
        place_module(model, mesh)
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise TrainerSetupError(
            f"model.{role}: vocabulary {model.cfg.vocab_size} is smaller than its tokenizer's "
            f"{tokenizer.vocab_size}; pair the model with the tokenizer it was trained with")
    return model, tokenizer


def place_module(module, mesh) -> None:
    """Put every parameter on its logical sharding, from host values (works multi-process)."""
    state = nnx.state(module)
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state)
    nnx.update(module, jax.device_put(host, mesh_lib.module_shardings(module, mesh)))


def to_global(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Identical host arrays on every process -> global arrays (batch dim sharded when it divides)."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    out = {}
    for key, value in batch.items():
        if value.ndim >= 1 and value.shape[0] % shards == 0:
            sharding = mesh_lib.batch_sharding(mesh, value.ndim)
        else:
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
    return out


def on_mesh(x, mesh):
    """x itself when it already lives on a mesh sharding, else replicated over `mesh`."""
    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
        return x
    value = np.asarray(jax.device_get(x))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(value.shape, replicated, lambda idx: value[idx])


def local_copy(module):
    """A single-device copy of a (possibly multi-process sharded) module, for per-process work."""
    from jax.experimental import multihost_utils

    graphdef, state = nnx.split(module)
    device = jax.local_devices()[0]
    gathered = jax.tree.map(
        lambda x: jax.device_put(np.asarray(multihost_utils.process_allgather(x, tiled=True)), device), state)
    return nnx.merge(graphdef, gathered)


class _ProcessLocalEngine:
    """Wraps an engine so that, with several processes, it samples from a local student copy."""

    def __init__(self, make_engine: Callable[[Any], Any], student):
        self._make = make_engine
        self.engine = make_engine(local_copy(student))

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def update_weights(self, model) -> None:
        self.engine.update_weights(local_copy(model))


# ----------------------------------------------------------------------------- trainer

@functools.lru_cache(maxsize=8)
def _update_fns(settings, donate: bool):
    """(tx, schedule, jitted update) per optimizer settings, so equal runs share the compile."""
    tx, schedule = make_optimizer(settings)
    return tx, schedule, make_apply_update(tx, schedule, donate=donate)


@dataclass
class TrainResult:
    final_step: int
    run_dir: Path
    checkpoint_dir: Path
    hf_dir: Path | None
    last_metrics: dict[str, Any]


class Trainer:
    """Builds everything from a TrainConfig (or takes injected parts) and runs `train()`."""

    def __init__(self, config: TrainConfig, mesh=None, *, engine=None, student=None, teacher=None,
                 student_tokenizer=None, teacher_tokenizer=None):
        self.config = config
        self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(
            {k: v for k, v in vars(config.mesh).items()})
        self.run_dir = Path(config.output_dir)
        self.is_writer = jax.process_index() == 0
        if student is None:
            student, student_tokenizer = load_side(config.model.student, config.model.student_tokenizer,
                                                   config.model, self.mesh, config.seed, "student")
        if teacher is None:
            teacher, teacher_tokenizer = load_side(config.model.teacher, config.model.teacher_tokenizer,
                                                   config.model, self.mesh, config.seed + 1, "teacher")
        self.student, self.teacher = student, teacher
        self.s_tok, self.t_tok = student_tokenizer, teacher_tokenizer
        self._setup_objective()
        self._setup_data()
        self._setup_engine(engine)
        self._setup_optimizer()

    # -- setup -------------------------------------------------------------------------
    def _setup_objective(self):
        from ctopd_jax.tokenization.overlap import overlap_map

        a = self.config.algorithm
        self.algorithm = get_algorithm(a.name, AlgorithmSettings.from_config(a))
        self.overlap = overlap_map(self.t_tok, self.s_tok)
        self.algorithm.check_vocab(self.overlap.shared)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.overlap_arrays = {
            k: jax.make_array_from_callback(v.shape, replicated, lambda idx, v=v: v[idx])
            for k, v in (("s_ids", self.overlap.s_ids.astype(np.int32)),
                         ("t_ids", self.overlap.t_ids.astype(np.int32)))}

    def _render(self, side, prompt) -> str:
        return side.render_chat(list(prompt.messages), add_generation_prompt=True)

    def _setup_data(self):
        d, r = self.config.data, self.config.rollout
        path = d.path
        if ":" in path and not Path(path).exists():
            path = resolve_named_source(path)
        prompts = load_prompts(path, d.prompt_key, d.system_prompt)
        encoded = self.s_tok.tokenizer.encode_batch([self._render(self.s_tok, p) for p in prompts],
                                                    add_special_tokens=False)
        fits = [len(e.ids) <= r.max_prompt_len for e in encoded]
        kept = [p for p, ok in zip(prompts, fits) if ok]
        if len(kept) < len(prompts):
            first = prompts[fits.index(False)]
            warnings.warn(f"data: dropped {len(prompts) - len(kept)} of {len(prompts)} prompts longer than "
                          f"rollout.max_prompt_len={r.max_prompt_len} student tokens (first: {first.source})",
                          RuntimeWarning, stacklevel=2)
        if not kept:
            raise TrainerSetupError(f"data.path {path}: no prompt fits rollout.max_prompt_len={r.max_prompt_len}")
        self.stream = PromptStream(kept, r.rollout_batch_size, seed=d.seed, shuffle=d.shuffle)

    def _setup_engine(self, engine):
        r = self.config.rollout
        if engine is not None:
            self.engine = engine
            return

        def make(model):
            if r.engine == "vllm":
                from ctopd_jax.rollout.vllm_engine import VllmEngine
                return VllmEngine.from_config(model, self.s_tok, r)
            from ctopd_jax.rollout.jax_sampler import JaxSampler
            mesh = self.mesh if jax.process_count() == 1 else None
            return JaxSampler(model, eos_ids=self.s_tok.eos_id, pad_id=self.s_tok.pad_id, mesh=mesh,
                              max_prompt_len=r.max_prompt_len)

        self.engine = make(self.student) if jax.process_count() == 1 else _ProcessLocalEngine(make, self.student)

    def _setup_optimizer(self):
        c = self.config
        responses = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
        self.updates_per_iteration = responses // c.optimizer.train_batch_size
        settings = settings_from_config(c.optimizer, c.steps * self.updates_per_iteration)
        self.tx, self.schedule, self.apply_update = _update_fns(settings, jax.default_backend() != "cpu")
        self.graphdef, params, self.rest = nnx.split(self.student, nnx.Param, ...)
        self.params = params
        # scalars of the optimizer state (step counts) come out of init on one device: put them
        # on the mesh too, so saved and restored states carry mesh shardings throughout
        self.opt_state = jax.tree.map(lambda x: on_mesh(x, self.mesh), jax.jit(self.tx.init)(params))
        self.t_graphdef, self.t_state = nnx.split(self.teacher)
        self.rng = jax.random.key(c.seed)

    # -- checkpoint state -----------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state,
                "rng": on_mesh(jax.random.key_data(self.rng), self.mesh)}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.rng = jax.random.wrap_key_data(jnp.asarray(jax.device_get(
            state["rng"].addressable_data(0) if not state["rng"].is_fully_addressable else state["rng"])))
        nnx.update(self.student, self.params)

    # -- one iteration --------------------------------------------------------------------
    def _sampling_params(self, seed: int):
        from ctopd_jax.rollout.base import SamplingParams

        r = self.config.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=max(0, r.top_k),
                              max_new_tokens=r.generate_max_len, n=r.n_samples_per_prompt, seed=seed)

    def _rollout_logprobs(self, result, student_rt):
        """Engine log-probs per response row where the re-tokenized response equals the samples."""
        values, weights = [], []
        eos = set(getattr(self.engine, "eos_ids", (self.s_tok.eos_id,))) | {self.s_tok.eos_id}
        for b, (tokens, lps) in enumerate(zip(result.token_ids, result.logprobs)):
            n = int(student_rt.response_lens[b])
            resp = student_rt.resp_ids[student_rt.resp_offsets[b]:student_rt.resp_offsets[b + 1]]
            sampled = list(tokens)
            ended = bool(sampled) and sampled[-1] in eos
            body = sampled[:-1] if ended else sampled
            v, w = np.zeros(n, np.float32), np.zeros(n, np.float32)
            if len(body) == len(resp) and np.array_equal(np.asarray(body), resp):
                v[:len(body)] = lps[:len(body)]
                w[:len(body)] = 1.0
                if ended:
                    v[n - 1], w[n - 1] = lps[-1], 1.0
            values.append(v)
            weights.append(w)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.float32)
        return cat(values), cat(weights)

    def iteration(self, step: int, timer: StepTimer) -> tuple[dict[str, Any], list[dict]]:
        from ctopd_jax.align import strict_align
        from ctopd_jax.tokenization.retokenize import retokenize_pair

        c = self.config
        prompts = self.stream.next_batch()
        s_texts = [self._render(self.s_tok, p) for p in prompts]
        t_texts = [self._render(self.t_tok, p) for p in prompts]
        self.rng, sub = jax.random.split(self.rng)
        seed = int(jax.random.randint(sub, (), 0, 2 ** 31 - 1))
        with timer("rollout"):
            result = self.engine.generate([self.s_tok.encode(t) for t in s_texts], self._sampling_params(seed))
        with timer("align"):
            responses = [self.s_tok.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
            idx = result.prompt_index
            t_rt, s_rt = retokenize_pair(self.t_tok, self.s_tok, [t_texts[i] for i in idx],
                                         [s_texts[i] for i in idx], responses, pad_to_multiple=64)
            alignment = strict_align(t_rt, s_rt)
            rollout_lp = self._rollout_logprobs(result, s_rt)
        coverage = self.coverage.update(alignment)

        o = c.optimizer
        micro = o.micro_batch_size
        accumulation = o.train_batch_size // micro
        totals = {"loss": 0.0, "kd_sum": 0.0, "ce_sum": 0.0, "gap_sum": 0.0, "gap_count": 0.0}
        infos = []
        for u in range(self.updates_per_iteration):
            first = u * o.train_batch_size
            total_tokens = np.float32(s_rt.response_lens[first:first + o.train_batch_size].sum())
            grads, loss = None, 0.0
            for m in range(accumulation):
                start = first + m * micro
                packed = slice_micro_batch(s_rt, t_rt, alignment, start, start + micro, rollout_lp)
                batch = to_global(packed, self.mesh)
                with timer("teacher"):
                    teacher_rows = teacher_scores(self.t_graphdef, self.t_state, batch, self.overlap_arrays["t_ids"],
                                                  chunk=c.algorithm.chunked_loss_size,
                                                  out_dtype=self.teacher.cfg.compute_dtype)
                    teacher_rows.block_until_ready()
                with timer("student"):
                    l, aux, g = micro_grad(self.params, self.rest, batch, teacher_rows, self.overlap_arrays,
                                           total_tokens, graphdef=self.graphdef, accumulation=accumulation,
                                           algorithm=self.algorithm, kd_ratio=float(c.algorithm.kd_ratio),
                                           chunk=c.algorithm.chunked_loss_size)
                    grads = g if grads is None else add_trees(grads, g)
                    loss = loss + l
                    for key, name in (("kd_sum", "kd_sum"), ("ce_sum", "ce_sum"), ("gap_sum", "logprob_gap_sum"),
                                      ("gap_count", "logprob_gap_count")):
                        totals[key] += scalar(aux[name]) / (1.0 if "gap" in key else float(total_tokens or 1.0))
            with timer("student"):
                self.params, self.opt_state, info = self.apply_update(
                    self.params, self.opt_state, grads, loss, np.int32(self.update_count))
                self.update_count += 1
                infos.append({k: scalar(v) for k, v in info.items()})
                totals["loss"] += scalar(loss)
        with timer("sync"):
            nnx.update(self.student, self.params)
            self.engine.update_weights(self.student)

        n_upd = self.updates_per_iteration
        metrics = {
            "loss": totals["loss"] / n_upd,
            "kd_loss": totals["kd_sum"] / n_upd,
            "ce_loss": totals["ce_sum"] / n_upd,
            "lr": infos[-1]["lr"], "grad_norm": infos[-1]["grad_norm"],
            "update_applied": min(i["update_applied"] for i in infos),
            "response_length": float(np.mean(s_rt.response_lens)),
            "truncated_samples": sum(r == "length" for r in result.finish_reasons),
            "student_response_tokens": int(s_rt.response_lens.sum()),
            "strict_pairs": alignment.num_pairs,
            **coverage,
        }
        if totals["gap_count"]:  # only when some re-tokenized response equals the sampled ids
            metrics["logprob_gap"] = totals["gap_sum"] / totals["gap_count"]
        samples = [{"kind": "byte_mismatch", "response": responses[b],
                    "student_bytes": s_rt.resp_bytes[b].decode("utf-8", "replace"),
                    "teacher_bytes": t_rt.resp_bytes[b].decode("utf-8", "replace")}
                   for b in np.flatnonzero(alignment.byte_mismatch)[:2]]
        return metrics, samples

    # -- the loop ---------------------------------------------------------------------------
    def _checkpoint_meta(self, step: int) -> dict[str, Any]:
        cov = self.coverage
        return {"data": self.stream.state(), "config": self.config.to_dict(),
                "update_count": self.update_count,
                "coverage": {k: getattr(cov, k) for k in ("pairs", "student_tokens", "teacher_tokens",
                                                          "mismatched", "samples")}}

    def train(self, resume: bool = False) -> TrainResult:
        from ctopd_jax.align import CoverageMeter

        c = self.config
        ck_dir = Path(c.checkpoint.dir) if c.checkpoint.dir else self.run_dir / "checkpoints"
        checkpointer = Checkpointer(ck_dir, every=c.checkpoint.every, keep=c.checkpoint.keep,
                                    async_save=c.checkpoint.async_save)
        self.coverage = CoverageMeter()
        self.update_count = 0
        start = 0
        if resume:
            restored = checkpointer.restore_latest(self._state())
            if restored is not None:
                self._load_state(restored.state)
                self.stream.restore(restored.meta["data"])
                self.update_count = int(restored.meta["update_count"])
                for k, v in restored.meta["coverage"].items():
                    setattr(self.coverage, k, v)
                start = restored.step
                self.engine.update_weights(self.student)
        elif checkpointer.steps():
            checkpointer.close()
            raise TrainerSetupError(f"{ck_dir} already holds checkpoints {checkpointer.steps()}; pass --resume "
                                    "to continue that run or choose another output_dir")
        if self.is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(self.config.to_json())
        lg = c.logging
        logger = MetricsLogger(self.run_dir, c.steps, start_step=start, jsonl=lg.jsonl,
                               tensorboard=lg.tensorboard, progress=lg.progress, is_writer=self.is_writer)
        if start == 0:
            logger.write(f"overlap: {json.dumps(self.overlap.summary())}")
        last_saved = start if start else None
        record: dict[str, Any] = {}
        try:
            for step in range(start + 1, c.steps + 1):
                timer = StepTimer()
                began = time.perf_counter()
                metrics, samples = self.iteration(step, timer)
                if not metrics["update_applied"]:
                    raise TrainingDiverged(
                        f"step {step}: loss {metrics['loss']} / grad norm {metrics['grad_norm']} is not finite; "
                        f"the update was not applied and training stopped. Last good checkpoint: "
                        f"{'step ' + str(last_saved) if last_saved else 'none'} in {ck_dir}. "
                        "Lower optimizer.lr or inspect the data of this step.")
                if checkpointer.should_save(step, c.steps):
                    with timer("checkpoint"):
                        checkpointer.save(step, self._state(), self._checkpoint_meta(step))
                    last_saved = step
                elapsed = time.perf_counter() - began
                metrics.update(timer.as_metrics())
                metrics["tokens_per_s"] = metrics["student_response_tokens"] / max(elapsed, 1e-9)
                eval_metrics = self._maybe_evaluate(step)
                metrics.update(eval_metrics)
                if step % lg.log_every == 0 or step == c.steps:
                    record = logger.log(step, metrics, samples)
        finally:
            checkpointer.close()
            logger.close()
        hf_dir = None
        if c.checkpoint.export_hf:
            hf_dir = self.export_hf(self.run_dir / "hf_student")
        return TrainResult(c.steps, self.run_dir, ck_dir, hf_dir, record)

    def _maybe_evaluate(self, step: int) -> dict[str, float]:
        e = self.config.evaluation
        if not e.dataset or not (step == self.config.steps or (e.every and step % e.every == 0)):
            return {}
        from ctopd_jax.datasets import load_dataset
        from ctopd_jax.evaluate import evaluate_model

        dataset = load_dataset(e.dataset, limit=e.max_problems or None)
        report = evaluate_model(self.student, self.s_tok, dataset, engine=self.engine, k=e.samples,
                                greedy=e.greedy, temperature=self.config.rollout.temperature,
                                top_p=self.config.rollout.top_p,
                                max_new_tokens=self.config.rollout.generate_max_len, seed=step,
                                out_dir=self.run_dir / "eval" / f"step_{step}" if self.is_writer else None)
        return {"eval_mean_at_k": report.mean_at_k, "eval_pass_at_k": report.pass_at_k}

    def export_hf(self, out_dir: Path) -> Path | None:
        model = self.student if jax.process_count() == 1 else local_copy(self.student)
        if not self.is_writer:
            return None
        extra = {"eos_token_id": self.s_tok.eos_id, "pad_token_id": self.s_tok.pad_id}
        if self.s_tok.bos_id is not None:
            extra["bos_token_id"] = self.s_tok.bos_id
        return export_student_hf(model, out_dir, tokenizer_dir=self.s_tok.path, extra_config=extra)
