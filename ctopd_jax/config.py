"""Run configuration: frozen dataclass sections, YAML files, `--set a.b=c` and `--mesh` overrides.

Every field is typed; `load_config` rejects unknown keys, values of the wrong type and impossible
values with one `ConfigError` that names the field (`optimizer.lr`) and says how to fix it,
before any model is loaded. Values given on the command line are parsed as YAML scalars
(`--set optimizer.lr=1e-5`, `--set rollout.engine=vllm`, `--set optimizer.betas=[0.9,0.95]`).
Numbers are read as people write them (`1e-5`, `1E5`, `.5`, `-2e-6`; see `YamlLoader`), in
files and `--set` alike; a float field rejects `.inf` / `nan`, an integer field takes `1e3`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from ctopd_jax.teacher_service.settings import TeacherServiceSettings, TeacherSettingError


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and the fix."""


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads numbers as people write them.

    YAML 1.1 (PyYAML) only takes a float with a dot and a signed exponent (`1.0e-5`), so
    `1e-5`, `1E5`, `.5e3` and `1.0e38` come back as strings. This loader adds a float resolver
    for every decimal form Python's `float()` reads, and is used for config files and `--set`
    values alike (`load_yaml`)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                  |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice; PyYAML would silently keep the last one, so a run
    would train with values the file's first section did not say."""


def _refuse_duplicate_keys(node: yaml.Node, prefix: str = "") -> None:
    """Walk the composed node tree; the first key seen twice in one mapping raises
    DuplicateKeyError naming the dotted key and both lines (1-based)."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                name = f"{prefix}{key}"
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise DuplicateKeyError(
                        f"line {line}: key {name!r} appears twice (first on line "
                        f"{first_line[key]}); keep one of them (YAML would silently use the last)")
                first_line[key] = line
                _refuse_duplicate_keys(value_node, name + ".")
            else:
                _refuse_duplicate_keys(value_node, prefix)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, prefix)


def load_yaml(text: str) -> Any:
    """Parse YAML text with `YamlLoader` (numbers such as 1e-5 are floats); a key given twice
    in one mapping raises DuplicateKeyError."""
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


@dataclass(frozen=True)
class ModelSection:
    """Student and teacher: an HF checkpoint directory or a preset name (`tiny_llama`, ...)."""
    student: str = "demo:student"    # checkpoint directory, named source or preset
    teacher: str = "demo:teacher"    # the same for the teacher
    # Tokenizer directory or name (tiny_bpe, tiny_unigram, qwen2.5, llama3); "" = the model's dir.
    student_tokenizer: str = ""
    teacher_tokenizer: str = ""      # the same for the teacher
    dtype: Literal["float32", "bfloat16"] = "float32"        # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # storage dtype of the weights
    remat: bool = False                                      # gradient checkpointing per layer
    # The frozen teacher's storage dtype; "" = param_dtype. bf16 halves its memory, while the
    # student keeps float32 master weights (lr 1e-6 updates vanish in bf16).
    teacher_param_dtype: Literal["", "float32", "bfloat16"] = ""
    # OPD² (algorithm.name=opd2): the teacher's own pre-tuning base π_B, same tokenizer as the
    # teacher (a checkpoint directory or named source); "" = none.
    teacher_base: str = ""
    # Execution options of the decoder (ModelConfig in models/config.py, which decoder.py and
    # attention.py read): they change memory and speed, not the numbers beyond float rounding.
    # The defaults are the unrolled, unchunked path with the `auto` attention.

    # remat_policy: "" follows `remat` (true = "full"); a non-empty value wins over `remat`.
    # remat, remat_policy and scan_layers apply to the student only: they shape the backward
    # pass, which the frozen teacher never runs (for a forward alone the scan only adds its
    # stacked copy of the layer weights). attention and mlp_chunk apply to every model.
    remat_policy: str = ""
    scan_layers: bool = False     # layers under lax.scan: where XLA honours remat (decoder.py)
    mlp_chunk: int = 0            # tokens per rematerialised MLP chunk; 0 = the whole sequence
    # auto (cuDNN for bf16 on a GPU without a KV cache, else blockwise) | einsum (reference)
    # | blockwise | cudnn (bf16 and rollout.engine=vllm only: it cannot decode with a KV cache)
    attention: str = "auto"

    def validate(self) -> None:
        """Impossible execution options, one ConfigError naming the field; the allowed values
        are ModelConfig's own (models/config.py), so the two lists cannot drift apart."""
        from ctopd_jax.models.config import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES

        policies = ("",) + REMAT_POLICIES
        require(self.remat_policy in policies, "model.remat_policy",
                 f"{self.remat_policy!r} is not one of {', '.join(repr(p) for p in policies)} "
                 "(\"\" = follow model.remat)")
        require(self.attention in ATTENTION_IMPLEMENTATIONS, "model.attention",
                 f"{self.attention!r} is not one of "
                 f"{', '.join(repr(a) for a in ATTENTION_IMPLEMENTATIONS)}")
        require(self.mlp_chunk >= 0, "model.mlp_chunk",
                 f"{self.mlp_chunk} must be >= 0 (0 = no chunking)")
        require(self.attention != "cudnn" or self.dtype == "bfloat16", "model.attention",
                 "'cudnn' needs model.dtype: bfloat16; use 'auto' (it picks cuDNN when it can)")

    def execution_options(self, role: str) -> dict[str, Any]:
        """The ModelConfig execution fields of one side (`build.load_side`, role "student" or
        "teacher", which model.teacher_base also loads as): every side gets the attention and
        the MLP chunking; the backward-pass options (remat, remat_policy, scan_layers) only the
        student, as `remat` always did."""
        options = dict(attention=self.attention, mlp_chunk=self.mlp_chunk)
        if role == "student":
            options.update(remat=self.remat, remat_policy=self.remat_policy,
                           scan_layers=self.scan_layers)
        return options


@dataclass(frozen=True)
class TeacherSection(TeacherServiceSettings):
    """Where the teacher runs (`teacher:`): `engine: local` (the default, today's path: the
    teacher model on the trainer's mesh) or behind a server (`vllm_server`, `sglang_server`,
    at `url`), scored through ctopd_jax.teacher_service. The fields and their checks are the
    client's own (TeacherServiceSettings.validate, docs/served_teacher.md), so the config and
    the client cannot disagree on what a valid setting is."""

    def validate(self, prefix: str = "teacher") -> "TeacherSection":
        try:
            return super().validate(prefix)
        except TeacherSettingError as err:   # one ConfigError line, like every other section
            raise ConfigError(str(err)) from None


@dataclass(frozen=True)
class NamedTeacherSection(TeacherSection):
    """One entry of `teachers:` (several teachers in one run): a name that data rows pick it by
    (`data.teacher_key`), its model and tokenizer (as model.teacher / model.teacher_tokenizer)
    and where it runs (the `teacher:` fields). Each gets its own tokenizer side, overlap map,
    alignment and metrics (`<name>/...`)."""
    name: str = ""                  # what data rows name it by (data.teacher_key)
    checkpoint: str = ""            # a checkpoint directory, named source or preset
    tokenizer: str = ""             # "" = the checkpoint's own

    def validate(self, prefix: str = "teachers") -> "NamedTeacherSection":
        where = f"teachers[{self.name}]"
        require(bool(self.checkpoint), f"{where}.checkpoint", "is empty; give the teacher's "
                "checkpoint directory, named source (demo:teacher) or preset")
        return super().validate(where)


@dataclass(frozen=True)
class MeshSection:
    """Mesh axis sizes; one may be -1 to take the remaining devices."""
    data: int = -1                       # data parallelism (batch split across devices)
    fsdp: int = 1                        # parameters and optimizer state sharded (FSDP)
    tensor: int = 1                      # tensor parallelism inside layers


@dataclass(frozen=True)
class RolloutSection:
    # the native JAX sampler, vLLM in process, or a vLLM / SGLang server of the student's own
    engine: Literal["jax", "vllm", "vllm_server", "sglang_server"] = "jax"
    rollout_batch_size: int = 8          # prompts per iteration
    n_samples_per_prompt: int = 1        # responses sampled per prompt
    temperature: float = 1.0             # sampling temperature; 0 = greedy
    top_p: float = 1.0                   # nucleus sampling; 1 = off
    top_k: int = -1                      # -1 disables top-k filtering
    generate_max_len: int = 64           # max new tokens
    max_prompt_len: int = 256            # longest rendered prompt, in tokens (longer ones are dropped)
    vllm_gpu_memory_utilization: float = 0.5  # pair with XLA_PYTHON_CLIENT_MEM_FRACTION <= 0.95 - it
    vllm_sleep_between_rollouts: bool = False  # GPU: free vLLM memory while the student trains
    # the student on a server of its own (engine: vllm_server | sglang_server; rollout/served.py)
    url: str | tuple[str, ...] = ""      # http://host:port, or a list of servers sharing the prompts
    launch: bool = False                 # the run starts (and stops) its own vLLM server
    launch_python: str = ""              # the Python with vLLM that runs it; "" = the trainer's
    timeout_s: float = 600.0             # one request (a prompt's n samples, or a weight push)
    max_concurrency: int = 8             # requests in flight per server
    retries: int = 3                     # extra tries after a time-out, a dropped connection, 5xx
    backoff_s: float = 0.5               # first retry waits this long, then 2x, 4x, ...
    weight_sync: str = "auto"            # auto | disk (full weights) | adapter (LoRA students)
    sync_dir: str = ""                   # folder the servers read pushed weights from ("" = temp)
    logprob_check_rows: int = 4          # rows the server re-scores after each push
    jax_decode_slots: int = 256          # JaxSampler: samples decoded together (refilled)
    jax_kv_cache_budget_gb: float = 8.0  # JaxSampler: page pool + slot buffers (GB); sizes the pool
    jax_page_size: int = 16              # JaxSampler: tokens per KV cache page
    # turn-structured objectives (tcod, sod, sage_opd): "" = single-turn responses split into
    # paragraph turns; "calculator" / "text_world" = multi-turn episodes with that environment
    environment: str = ""
    max_turns: int = 8                   # student turns per episode (with an environment)
    step_timeout_s: float = 10.0         # one environment step's time limit (then the episode ends)


@dataclass(frozen=True)
class AlgorithmSection:
    """Fields every objective shares. An objective's own config section extends this class
    with its fields and checks (`algorithms/<name>.py`, `settings_class`); `algorithm.name`
    picks the class, so `algorithm.span_lambda` is known exactly when the objective is `span`."""
    name: str = "topk_strict"            # registry name, see ctopd_jax.algorithms
    # the divergence D of the distillation terms (SPEC §5)
    kd_loss_fn: Literal["kl", "rkl", "jsd", "skl", "srkl", "akl", "tvd", "top1_ce"] = "rkl"
    kd_ratio: float = 1.0                # (1 - kd_ratio) * CE + kd_ratio * KD
    kd_temperature: float = 1.0          # τ: logits are divided by it in the divergence
    jsd_beta: float = 0.5                # β of jsd, in (0, 1)
    skl_lambda: float = 0.1              # λ of skl / srkl, in (0, 1)
    akl_alpha: float = 0.5               # α of akl: the tail's probability mass, in (0, 1)
    # strict kernels (kernels/api.py); auto: per kernel and device from
    # kernels/<kernel>/measured.json (kernels/choices.py)
    implementation: Literal["reference", "xla", "pallas", "auto"] = "xla"
    chunked_loss_size: int = 2048        # rows per lm_head/loss chunk
    # Gradient diagnostics (SPEC §6) for objectives with a strict part: every N steps (and at
    # step 0) on a fixed, seeded replay set of `diagnostics_prompts` prompts; 0 = off.
    diagnostics_every: int = 0
    diagnostics_prompts: int = 8         # size of the replay set of the diagnostics

    def validate(self) -> None:
        """Impossible values, one ConfigError naming the field (the objective's own checks
        extend this). Divergence ranges come from losses.py: one place for both."""
        from ctopd_jax import losses

        require(0 <= self.kd_ratio <= 1, "algorithm.kd_ratio", f"{self.kd_ratio} must be in [0, 1]")
        require(self.chunked_loss_size >= 1, "algorithm.chunked_loss_size", "must be >= 1")
        require(self.diagnostics_every >= 0, "algorithm.diagnostics_every", "must be >= 0 (0 = off)")
        require(self.diagnostics_prompts >= 1, "algorithm.diagnostics_prompts", "must be >= 1")
        try:
            losses.check_divergence_args(self.kd_loss_fn, temperature=self.kd_temperature,
                                         jsd_beta=self.jsd_beta, skl_lambda=self.skl_lambda,
                                         akl_alpha=self.akl_alpha)
        except ValueError as err:
            raise ConfigError(f"algorithm.{err}") from None


# algorithm.name -> that objective's settings class (its config section). Each objective
# registers its class here (algorithms.base.register), so config never imports the objectives;
# importing the package `ctopd_jax` registers them all (ctopd_jax/__init__.py).
_ALGORITHM_SETTINGS: dict[str, type] = {}


def register_algorithm_settings(name: str, settings_class: type) -> None:
    """Make `algorithm.name: <name>` read its section as `settings_class`."""
    _ALGORITHM_SETTINGS[name] = settings_class


def algorithm_class(name: Any) -> type:
    """The settings class of the objective `algorithm.name` (its own config section)."""
    if name not in _ALGORITHM_SETTINGS:
        raise ConfigError(f"algorithm.name: {name!r} is not a registered objective; choose one of "
                          f"{', '.join(sorted(_ALGORITHM_SETTINGS))}")
    return _ALGORITHM_SETTINGS[name]


def objectives_defining(key: str) -> list[str]:
    """The registered objectives whose config section has the field `key` (sorted)."""
    return sorted(name for name, cls in _ALGORITHM_SETTINGS.items()
                  if key in {f.name for f in dataclasses.fields(cls)})


def _drop_other_objectives_keys(tree: dict, file_algorithm: Mapping[str, Any],
                                set_keys: set[str]) -> None:
    """Switching the objective on the command line (`--set algorithm.name=X` over a file that
    names another one) drops the FILE's algorithm keys that X does not define but another
    registered objective does, e.g. tiny_cpu.yaml's `ctkd_topk` (topk_strict's k) under
    `--set algorithm.name=simct`: those keys were written for the file's objective.

    The rule a user sees: the keys of the objective a config file names must belong to it, and
    so must every `--set algorithm.*` key; only the base file's keys for the objective it named
    give way when the command line picks another one. A key no objective defines is still
    refused (a typo), and so is another objective's key in a file that names the objective
    itself or given with `--set` (`_build` then says which objectives the key belongs to).
    (Chosen over moving `ctkd_topk` out of tiny_cpu.yaml, the demo's own top-k config, and over
    ignoring every foreign key, which would hide a `--set` that does nothing.)"""
    section = tree.get("algorithm")
    if not isinstance(section, dict):
        return
    name = section.get("name", AlgorithmSection.name)
    if name == file_algorithm.get("name", AlgorithmSection.name):
        return
    if name not in _ALGORITHM_SETTINGS:
        return  # `_build` reports the unknown algorithm.name
    own = {f.name for f in dataclasses.fields(_ALGORITHM_SETTINGS[name])}
    for key in file_algorithm:
        if key not in own and key not in set_keys and key in section and objectives_defining(key):
            del section[key]


@dataclass(frozen=True)
class OptimizerSection:
    lr: float = 1e-6                     # peak learning rate (AdamW)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW β1, β2
    eps: float = 1e-8                    # AdamW ε
    weight_decay: float = 0.0            # never applied to biases or norm scales
    max_grad_norm: float = 1.0           # clip the gradient at this global norm
    schedule: Literal["cosine_with_min_lr", "constant"] = "cosine_with_min_lr"  # lr schedule
    warmup_ratio: float = 0.05           # linear warmup over ceil(updates * warmup_ratio)
    min_lr: float = 1e-8                 # the cosine schedule's floor
    train_batch_size: int = 8            # responses per optimizer step
    micro_batch_size: int = 8            # responses per forward/backward
    # packed rows (algorithms/packing.py): a micro-batch is the consecutive responses that fit,
    # several per row, rows of this many tokens in all, on both models' sides. auto:
    # micro_batch_size x the longest row (rollout.max_prompt_len + generate_max_len + 1, rounded
    # up to 64), so a packed micro-batch never holds more tokens than an unpacked one can;
    # 0: one row per response, micro_batch_size of them. Objectives that cannot pack (packed_rows
    # None) keep micro_batch_size rows of one sample, and the run says so in one line
    micro_batch_tokens: int | Literal["auto"] = "auto"
    mu_dtype: Literal["float32", "bfloat16"] = "float32"  # AdamW first moment (bf16 halves it)
    offload_during_rollout: bool = False  # AdamW state in host memory while the rollout runs


@dataclass(frozen=True)
class DataSection:
    path: str = "demo:train"             # jsonl / parquet file, or a named set
    prompt_key: str = "prompt"           # string prompt or chat `messages` list
    system_prompt: str = ""              # added to rows that have no system message
    teacher_key: str = "teacher"         # with `teachers:`: the row field naming its teacher
    default_teacher: str = ""            # the teacher of rows without it; "" = the first one
    shuffle: bool = True                 # shuffle the prompts (each epoch)
    seed: int = 0                        # seed of the shuffle


@dataclass(frozen=True)
class CheckpointSection:
    dir: str = ""                        # "" = <output_dir>/checkpoints
    every: int = 10                      # steps between checkpoints; 0 = only the last
    save: bool = True                    # false: no checkpoints at all (throwaway runs, the GPU check)
    keep: int = 3                        # checkpoints kept on disk (the newest)
    async_save: bool = True              # write checkpoints while training goes on
    export_hf: bool = True               # write the final student as HF safetensors
    export_merged: bool = False          # with lora.rank > 0: also the merged HF model


@dataclass(frozen=True)
class LoggingSection:
    jsonl: bool = True                   # metrics.jsonl in output_dir
    tensorboard: bool = True             # TensorBoard scalars in output_dir
    progress: bool = True                # a progress bar on the terminal
    log_every: int = 1                   # steps between logged metrics (the last is always)
    wandb: bool = False                  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "ctopd_jax"     # Weights & Biases project
    wandb_entity: str = ""               # Weights & Biases entity; "" = your default
    wandb_mode: Literal["online", "offline"] = "online"  # offline: log locally, sync later


@dataclass(frozen=True)
class EvaluationSection:
    dataset: str = ""                    # "" disables evaluation inside training
    samples: int = 1                     # K responses per problem (mean@K)
    greedy: bool = True                  # temperature 0 when samples is 1
    every: int = 0                       # evaluate every N steps (0 = only at the end)
    max_problems: int = 0                # 0 = all


@dataclass(frozen=True)
class GuardSection:
    """When a run stops as diverged (`ctopd_jax.run_guard.DivergenceGuard`, checked per step).

    A NaN/inf loss or gradient norm always stops the run (the update is not applied). The other
    two rules catch a run that is wrecked while its numbers stay finite (e.g. lr 1e6): the
    gradient norm exactly 0.0 for `zero_grad_norm_steps` steps in a row, or a loss above
    `loss_jump_factor` times the median of the last `loss_jump_window` losses (judged once
    `loss_jump_warmup` losses are known). 0 switches a rule off."""
    zero_grad_norm_steps: int = 3        # stop after this many steps of gradient norm 0; 0 = off
    loss_jump_factor: float = 10.0       # stop at a loss above this × the recent median; 0 = off
    loss_jump_window: int = 20           # losses in that median
    loss_jump_warmup: int = 5            # losses known before the jump rule applies


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSection:
    """LoRA on the student (ctopd_jax/models/lora.py); rank 0 = full fine-tuning."""
    rank: int = 0                        # adapter rank r; 0 = full fine-tuning
    alpha: float = 16.0                  # the update is scaled by alpha / rank (as PEFT)
    dropout: float = 0.0                 # on the adapters' input, training forwards only
    target_modules: tuple[str, ...] = LORA_TARGETS  # projections that get adapters
    init_adapter: str = ""               # a PEFT adapter folder to start from


@dataclass(frozen=True)
class TrainConfig:
    run_name: str = "run"                # named in the run's first log line (and loggers)
    output_dir: str = "runs/run"         # metrics, checkpoints, exports (one run per folder)
    seed: int = 0                        # model init and rollout sampling
    steps: int = 10                      # on-policy iterations (optimizer steps)
    model: ModelSection = field(default_factory=ModelSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    # several named teachers (each prompt picks one); () = the one of model.teacher + teacher:
    teachers: tuple[NamedTeacherSection, ...] = ()
    mesh: MeshSection = field(default_factory=MeshSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    # the default objective's own section (its settings class), as a file without `algorithm:` gets
    algorithm: AlgorithmSection = field(default_factory=lambda: algorithm_class(AlgorithmSection.name)())
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    guard: GuardSection = field(default_factory=GuardSection)
    lora: LoraSection = field(default_factory=LoraSection)


    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# ----------------------------------------------------------------------------- building

_NON_FINITE = ("nan", "inf", "infinity")


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check `value` against the type hint `hint`, converting only lossless cases."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise ConfigError(f"{name}: {value!r} is not one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: {value!r} does not have type {hint}")
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"{name}: expected a list, got {value!r}")
            return tuple(_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{name}: expected a list of {len(args)} values like "
                              f"[{', '.join(a.__name__ for a in args)}], got {value!r}")
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{name}: expected null, got {value!r}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        # 1e3 and 1000.0 are integers written as floats: lossless, so accepted
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in _NON_FINITE:
            value = float("nan")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number (e.g. 1e-5), got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name}: {value!r} is not a finite number; give a finite value")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, name)
    raise ConfigError(f"{name}: unsupported type {hint}")


def _build(cls: type, values: Any, prefix: str = "") -> Any:
    where = prefix or "config"
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys, got {values!r}")
    if cls is AlgorithmSection:
        cls = algorithm_class(values.get("name", AlgorithmSection.name))
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    not_names = [k for k in values if not isinstance(k, str)]
    if not_names:  # `1: x` or `null: x` in YAML: sorting them with the names would crash
        raise ConfigError(f"{where}: key {not_names[0]!r} is not a name; use one of the known "
                          f"keys of {where}: {', '.join(sorted(known))}")
    # an absent section is built from {} too: `algorithm` then gets its objective's class
    values = {**{f.name: {} for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(hints[f.name]) and f.name not in values}, **values}
    unknown = sorted(set(values) - known)
    if unknown and issubclass(cls, AlgorithmSection):
        owned = {k: objectives_defining(k) for k in unknown}
        if all(owned.values()):  # keys of other objectives: say whose they are
            name = values.get("name", AlgorithmSection.name)
            raise ConfigError("; ".join(
                f"algorithm.{k} belongs to {', '.join(owners)}; remove it when "
                f"algorithm.name={name}" for k, owners in owned.items()))
    if unknown:
        dotted = ", ".join(f"{prefix + '.' if prefix else ''}{k}" for k in unknown)
        raise ConfigError(f"unknown config key(s) {dotted}; known keys of {where}: "
                          f"{', '.join(sorted(known))}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix + '.' if prefix else ''}{k}")
              for k, v in values.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if "[" in key:  # teachers[math].url: the list entry with that name
            node = _named_entry(node, key, dotted)
            continue
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _named_entry(node: dict, key: str, dotted: str) -> dict:
    """`teachers[math]` in a --set key: the entry of the `teachers` list whose name is math."""
    section, _, rest = key.partition("[")
    name = rest[:-1] if rest.endswith("]") else ""
    entries = node.get(section)
    if not name or not isinstance(entries, list):
        raise ConfigError(f"--set {dotted}: {key!r} names no list entry; write "
                          f"{section}[NAME].field=value for an entry of the file's {section}:")
    for entry in entries:
        if isinstance(entry, dict) and str(entry.get("name")) == name:
            return entry
    names = ", ".join(str(e.get("name")) for e in entries if isinstance(e, dict))
    raise ConfigError(f"--set {dotted}: no {section}: entry is named {name!r}; the file's "
                      f"entries are {names or 'none'}")


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", yaml-parsed c)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: write section.key=value, e.g. --set optimizer.lr=1e-5")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {_one_line(err)}") from None
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                mesh: str | None = None) -> TrainConfig:
    """Read a YAML file, apply `--set` overrides and a `--mesh` flag, build and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: file not found; pass a YAML file such as "
                              "configs/tiny_cpu.yaml")
        try:
            tree = load_yaml(path.read_text(encoding="utf-8")) or {}
        except DuplicateKeyError as err:
            raise ConfigError(f"--config {path}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"--config {path}: not valid YAML: {_one_line(err)}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: not a UTF-8 text file; pass a YAML file") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    file_algorithm = dict(tree["algorithm"]) if isinstance(tree.get("algorithm"), dict) else {}
    set_algorithm_keys = set()
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        if key.startswith("algorithm."):
            set_algorithm_keys.add(key.split(".", 2)[1])
    _drop_other_objectives_keys(tree, file_algorithm, set_algorithm_keys)
    if "teachers" in tree and not tree["teachers"]:   # `teachers: []` would silently mean one
        raise ConfigError("teachers: is empty; list at least one teacher (each with name and "
                          "checkpoint), or remove the key to train with model.teacher")
    if mesh:
        from ctopd_jax.mesh import MeshError, parse_mesh
        try:
            tree["mesh"] = {**{"data": 1}, **parse_mesh(mesh)}
        except MeshError as err:
            raise ConfigError(f"--mesh {mesh}: {err}") from None
    return _finish(_build(TrainConfig, tree))


# String fields that name a file or folder: a leading `~` is the user's home, as in a shell
# (Path() alone would create a folder literally named `~` in the current directory).
PATH_FIELDS = frozenset({
    "output_dir", "checkpoint.dir", "data.path", "evaluation.dataset", "lora.init_adapter",
    "model.student", "model.teacher", "model.student_tokenizer", "model.teacher_tokenizer",
    "model.teacher_base"})


def _expand_home(section: Any, prefix: str = "") -> Any:
    changes = {}
    for f in dataclasses.fields(section):
        value, dotted = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            expanded = _expand_home(value, dotted + ".")
            if expanded is not value:
                changes[f.name] = expanded
        elif dotted in PATH_FIELDS and isinstance(value, str) and value.startswith("~"):
            changes[f.name] = os.path.expanduser(value)
    return dataclasses.replace(section, **changes) if changes else section


def _finish(config: TrainConfig) -> TrainConfig:
    config = _expand_home(config)
    validate(config)
    return config


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def from_dict(tree: Mapping[str, Any]) -> TrainConfig:
    return _finish(_build(TrainConfig, dict(tree)))


def require(condition: bool, field_name: str, message: str) -> None:
    """One ConfigError naming `field_name` unless `condition` (objectives' validate() use it too)."""
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def validate(config: TrainConfig, device_count: int | None = None) -> None:
    """Impossible values; with `device_count`, also that the mesh fits the devices."""
    r, a, o = config.rollout, config.algorithm, config.optimizer
    require(config.output_dir.strip() != "", "output_dir", "is empty, which would write the run "
             "into the current directory; name a folder for it, e.g. runs/my_run")
    _check_seeds(config)
    require(config.steps >= 1, "steps", f"{config.steps} must be >= 1")
    require(r.rollout_batch_size >= 1, "rollout.rollout_batch_size", "must be >= 1")
    require(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1")
    require(r.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy)")
    require(0 < r.top_p <= 1, "rollout.top_p", f"{r.top_p} must be in (0, 1]")
    require(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", "must be -1 (off) or >= 1")
    require(r.generate_max_len >= 1, "rollout.generate_max_len", "must be >= 1")
    require(r.max_prompt_len >= 1, "rollout.max_prompt_len", "must be >= 1")
    require(r.jax_decode_slots >= 1, "rollout.jax_decode_slots", "must be >= 1")
    require(r.jax_kv_cache_budget_gb > 0, "rollout.jax_kv_cache_budget_gb", "must be > 0 (GB)")
    require(r.jax_page_size >= 1, "rollout.jax_page_size", "must be >= 1 token")
    from ctopd_jax.envs import ENVIRONMENTS
    require(r.environment in ("",) + ENVIRONMENTS, "rollout.environment",
             f"{r.environment!r} is unknown; use one of {ENVIRONMENTS} or '' (single-turn)")
    require(r.max_turns >= 1, "rollout.max_turns", "must be >= 1 turn")
    require(r.step_timeout_s > 0, "rollout.step_timeout_s", "must be > 0 seconds")
    require(0 < r.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization",
             f"{r.vllm_gpu_memory_utilization} must be in (0, 1] (a fraction of the GPU's memory)")
    config.model.validate()
    _check_rollout_server(r)
    config.teacher.validate()
    _check_teachers(config)
    require(config.model.attention != "cudnn" or r.engine != "jax", "model.attention",
             "'cudnn' cannot decode with a KV cache, which rollout.engine=jax does with the same "
             "model; use 'auto' (cuDNN where it can, blockwise for decoding)")
    a.validate()
    require(o.lr > 0, "optimizer.lr", "must be > 0")
    require(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "each must be in [0, 1)")
    require(o.eps > 0, "optimizer.eps", f"{o.eps} must be > 0 (AdamW divides by it)")
    require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    require(o.max_grad_norm > 0, "optimizer.max_grad_norm", "must be > 0")
    require(0 <= o.warmup_ratio < 1, "optimizer.warmup_ratio", "must be in [0, 1)")
    require(0 <= o.min_lr <= o.lr, "optimizer.min_lr", "must be in [0, optimizer.lr]")
    require(o.micro_batch_size >= 1, "optimizer.micro_batch_size", "must be >= 1")
    require(o.micro_batch_tokens == "auto" or o.micro_batch_tokens >= 0, "optimizer.micro_batch_tokens",
            "must be auto or >= 0 (0: one row per response, micro_batch_size of them)")
    require(o.train_batch_size >= 1, "optimizer.train_batch_size", "must be >= 1")
    require(o.train_batch_size % o.micro_batch_size == 0, "optimizer.train_batch_size",
             f"{o.train_batch_size} must be a multiple of optimizer.micro_batch_size "
             f"{o.micro_batch_size}")
    responses = r.rollout_batch_size * r.n_samples_per_prompt
    require(responses % o.train_batch_size == 0, "optimizer.train_batch_size",
             f"rollout_batch_size * n_samples_per_prompt = {responses} responses per iteration "
             f"must be a multiple of train_batch_size {o.train_batch_size}")
    require(config.checkpoint.every >= 0, "checkpoint.every", "must be >= 0")
    require(config.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    require(config.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    e = config.evaluation
    require(e.samples >= 1, "evaluation.samples", "must be >= 1")
    require(e.every >= 0, "evaluation.every", f"{e.every} must be >= 0 (0 = only at the end)")
    require(e.max_problems >= 0, "evaluation.max_problems", f"{e.max_problems} must be >= 0 "
             "(0 = all problems)")
    lo = config.lora
    require(lo.rank >= 0, "lora.rank", f"{lo.rank} must be >= 0 (0 = full fine-tuning)")
    require(lo.alpha > 0, "lora.alpha", f"{lo.alpha} must be > 0")
    require(0 <= lo.dropout < 1, "lora.dropout", f"{lo.dropout} must be in [0, 1)")
    require(lo.dropout == 0 or lo.rank > 0, "lora.dropout", f"{lo.dropout} applies to the "
             "adapters only: set lora.rank > 0 or lora.dropout: 0.0")
    require(not lo.init_adapter or lo.rank > 0, "lora.init_adapter", "loads adapters: set "
             "lora.rank to the adapter's r (0 = full fine-tuning has none)")
    require(bool(lo.target_modules) and set(lo.target_modules) <= set(LORA_TARGETS),
             "lora.target_modules", f"{list(lo.target_modules)} must be a non-empty subset of "
             f"{list(LORA_TARGETS)}")
    g = config.guard
    require(g.zero_grad_norm_steps >= 0, "guard.zero_grad_norm_steps", "must be >= 0 (0 = off)")
    require(g.loss_jump_factor == 0 or g.loss_jump_factor > 1, "guard.loss_jump_factor",
             "must be 0 (off) or > 1")
    require(g.loss_jump_window >= 1, "guard.loss_jump_window", "must be >= 1")
    require(g.loss_jump_warmup >= 1, "guard.loss_jump_warmup", "must be >= 1")
    for axis in ("data", "fsdp", "tensor"):
        size = getattr(config.mesh, axis)
        require(size == -1 or size >= 1, f"mesh.{axis}", "must be >= 1 or -1 (fill)")
    if device_count is not None:
        from ctopd_jax.mesh import MeshError, resolve_mesh_shape
        try:
            resolve_mesh_shape(dataclasses.asdict(config.mesh), device_count)
        except MeshError as err:
            raise ConfigError(f"{err}{device_count_hint(device_count)}") from None


def _check_rollout_server(rollout: RolloutSection) -> None:
    from ctopd_jax.rollout.served import check_settings
    try:
        check_settings(rollout)
    except ValueError as err:   # TeacherSettingError: one ConfigError line like the rest
        raise ConfigError(str(err)) from None


def _check_teachers(config: TrainConfig) -> None:
    """`teachers:` entries: names, settings, the default; the single-teacher fields unset."""
    if not config.teachers:
        return
    from ctopd_jax.routing import check_teacher_names
    try:
        check_teacher_names([t.name for t in config.teachers],
                            config.data.default_teacher or None, field="teachers")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for t in config.teachers:
        t.validate()
    require(config.teacher == TeacherSection(), "teacher",
            "is set beside teachers:; give each teacher's engine, url, ... in its teachers: entry")
    require(not config.model.teacher_tokenizer, "model.teacher_tokenizer",
            "is set beside teachers:; give each teacher's tokenizer in its teachers: entry")


def teacher_views(config: TrainConfig) -> dict[str, TrainConfig]:
    """name -> the run's config as one teacher sees it (model.teacher, model.teacher_tokenizer
    and `teacher:` from its entry), so every single-teacher check and builder serves each of
    several teachers unchanged. Without `teachers:`, the one teacher, named "teacher"."""
    if not config.teachers:
        return {"teacher": config}
    return {t.name: dataclasses.replace(
        config, teachers=(),
        model=dataclasses.replace(config.model, teacher=t.checkpoint, teacher_tokenizer=t.tokenizer),
        teacher=TeacherSection(**{f.name: getattr(t, f.name) for f in dataclasses.fields(TeacherSection)}))
        for t in config.teachers}


def default_teacher(config: TrainConfig) -> str:
    """The name of the teacher of rows that name none (data.default_teacher, else the first)."""
    return config.data.default_teacher or next(iter(teacher_views(config)))


SEED_LIMIT = 2 ** 32   # numpy's and the data loader's seeds are unsigned 32-bit


def _check_seeds(section: Any, prefix: str = "") -> None:
    """Every field named `seed` or `*_seed`, in any section or objective: in [0, 2**32)."""
    for f in dataclasses.fields(section):
        value, dotted = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_seeds(value, dotted + ".")
        elif f.name == "seed" or f.name.endswith("_seed"):
            require(0 <= value < SEED_LIMIT, dotted, f"{value} must be in [0, 2**32)")


def device_count_hint(device_count: int) -> str:
    """On CPU, how to get more (virtual) devices; "" elsewhere."""
    import jax

    if jax.default_backend() != "cpu":
        return ""
    return (f" (on CPU, {device_count} device(s) are present: start with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N for N virtual devices)")
