"""The sections of a run's configuration: frozen dataclasses, one per YAML section.

Every field has a comment (docs/config.md is generated from them by ctopd_jax.config_doc); a
section's `validate` raises one ConfigError naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ctopd_jax.config.algorithm_settings import algorithm_class
from ctopd_jax.config.errors import ConfigError, require
from ctopd_jax.config.served import TeacherServiceSettings, TeacherSettingError
from ctopd_jax.kernels import losses
from ctopd_jax.models.config import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES


@dataclass(frozen=True)
class ModelSection:
    """Student and teacher: an HF checkpoint directory or a preset name (`tiny_llama`, ...)."""
    student: str = "demo:student"    # checkpoint directory, named source or preset
    teacher: str = "demo:teacher"    # the same for the teacher
    # Tokenizer directory or name (tiny_bpe, tiny_unigram, qwen2.5, llama3); "" = the model's dir.
    student_tokenizer: str = ""
    teacher_tokenizer: str = ""      # the same for the teacher
    # Compute dtype. bfloat16 on a CPU with AVX512-BF16: about twice the float32 matmul rate
    # (the projections sum in float32, models/projection.py); slower on a CPU without it.
    dtype: Literal["float32", "bfloat16"] = "float32"
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
    # auto (cuDNN for bf16 on a GPU without a KV cache; einsum over at most intermediate /
    # heads keys; else blockwise) | einsum (reference)
    # | blockwise | cudnn (bf16 and rollout.engine=vllm only: it cannot decode with a KV cache)
    attention: str = "auto"

    def validate(self) -> None:
        """Impossible execution options, one ConfigError naming the field; the allowed values
        are ModelConfig's own (models/config.py), so the two lists cannot drift apart."""
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
    # auto (adapter for a LoRA student, else disk) | disk | adapter | nccl | ipc (GPU servers:
    # rollout/weight_transfer.py, never run here)
    weight_sync: str = "auto"
    server_gpus: int = 1                 # nccl: GPUs of each server (the group is these + the trainer)
    transfer_address: str = ""           # sglang_server + nccl: host:port of the trainer's rendezvous
    sync_dir: str = ""                   # folder the servers read pushed weights from ("" = temp)
    logprob_check_rows: int = 4          # rows the server re-scores after each push
    # generation overlapped with training (served engines; rollout/async_rollouts.py); `rollout.async`
    # reads as this field (a keyword cannot be one). The next iteration's responses are
    # generated while this one trains, from the weights before its update (async_staleness 1)
    # or after its push (0: the same numbers as without async; only metrics, evaluation and
    # checkpoints overlap)
    async_rollouts: bool = False
    async_staleness: int = 1             # updates between the generating and the trained weights
    async_tis_cap: float = 2.0           # truncated importance weight's cap (objectives using "tis")
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
    # modules to import for objectives of your own (e.g. [my_pkg.my_objective]; each registers
    # its class, docs/objectives.md); the package's own objectives are always found
    modules: tuple[str, ...] = ()
    # the divergence D of the distillation terms (SPEC §5)
    kd_loss_fn: Literal["kl", "rkl", "jsd", "skl", "srkl", "akl", "tvd", "top1_ce"] = "rkl"
    kd_ratio: float = 1.0                # (1 - kd_ratio) * CE + kd_ratio * KD
    kd_temperature: float = 1.0          # τ: logits are divided by it in the divergence
    jsd_beta: float = 0.5                # β of jsd, in (0, 1)
    skl_lambda: float = 0.1              # λ of skl / srkl, in (0, 1)
    akl_alpha: float = 0.5               # α of akl: the tail's probability mass, in (0, 1)
    # strict kernels (kernels/strict/api.py); auto: per kernel and device from
    # kernels/<kernel>/measured.json (kernels/choices.py)
    implementation: Literal["reference", "xla", "pallas", "auto"] = "xla"
    chunked_loss_size: int = 2048        # rows per lm_head/loss chunk
    # Gradient diagnostics (SPEC §6) for objectives with a strict part: every N steps (and at
    # step 0) on a fixed, seeded replay set of `diagnostics_prompts` prompts; 0 = off.
    diagnostics_every: int = 0
    diagnostics_prompts: int = 8         # size of the replay set of the diagnostics

    def validate(self) -> None:
        """Impossible values, one ConfigError naming the field (the objective's own checks
        extend this). Divergence ranges come from kernels/losses.py: one place for both."""
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
    # packed rows (algorithms/packed_rows.py): a micro-batch is the consecutive responses that fit,
    # several per row, rows of this many tokens in all, on both models' sides. auto:
    # micro_batch_size x the longest row (rollout.max_prompt_len + generate_max_len + 1, rounded
    # up to 64), so a packed micro-batch never holds more tokens than an unpacked one can;
    # 0: one row per response, micro_batch_size of them. Objectives that cannot pack (packs
    # false) keep micro_batch_size rows of one sample, and the run says so in one line
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
    """When a run stops as diverged (`ctopd_jax.common.run_guard.DivergenceGuard`, checked per step).

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
