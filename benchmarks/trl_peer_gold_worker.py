"""The TRL side of benchmarks/trl_peer_gold.py: TRL's GOLDTrainer (cross-tokenizer, ULD loss) on
the real demo's pair, one run.

    .venv-trl/bin/python benchmarks/trl_peer_gold_worker.py SPEC.json   # (make trl-venv), started by trl_peer_gold.py

Runs in its own venv (torch CPU, transformers, trl; Makefile `trl-venv`) and imports nothing from
ctopd_jax. SPEC.json (written by trl_peer_gold.py) names the student and teacher HF folders, the
prompt rows (chat `messages`: system, user, assistant; the assistant turn only marks where the
prompt ends, every step is on-policy), the GOLDConfig keyword arguments (`gold_args`, below) and
the torch thread count. Trains, saves the student and its tokenizer to spec["save_dir"]
(trainer.save_model), and prints one line `RESULT {json}`: step-end times, response tokens per
step, peak RSS, the settings GOLD ran with.

GOLD at its fastest documented settings on a CPU (`gold_args`): gradient_checkpointing False (the
SFTConfig default is True, which recomputes every activation in the backward and, with the model
in training mode, makes every generated token re-run the whole sequence: transformers turns the
KV cache off under checkpointing); generation with the KV cache (the student loaded with
use_cache=True, checked after the trainer is built); transformers' `model.generate` (GOLD's
non-vLLM path; vLLM is not installed); float32 weights and no bf16 (SFTConfig's bf16 default is
True). Importing this module needs no torch or trl (tests/test_trl_peer.py reads `gold_args`).
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time


def vm_rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gold_args(spec: dict) -> dict:
    """GOLDConfig's keyword arguments: the run's hyper-parameters (spec["hyper"]), identical to
    ours, and GOLD's fastest documented CPU settings. The ULD options are left at GOLDConfig's
    defaults (use_extended_uld True, uld_token_merge_strategy "observed", no hybrid loss,
    cross-entropy weight 0, distillation weight 1, both ULD temperatures 1, EOS skipped on both
    sides); lmbda 1.0 makes every step on-policy (the student samples each batch)."""
    h = spec["hyper"]
    return dict(
        output_dir=spec["output_dir"], max_steps=h["steps"], per_device_train_batch_size=h["batch"],
        gradient_accumulation_steps=1, num_generations=1,
        learning_rate=h["lr"], adam_beta1=h["betas"][0], adam_beta2=h["betas"][1],
        adam_epsilon=h["eps"], weight_decay=h["weight_decay"], max_grad_norm=h["max_grad_norm"],
        # transformers' get_cosine_with_min_lr_schedule_with_warmup: the schedule ours follows
        # (ctopd_jax/step/optimizer.py), warmup ceil(steps x warmup_ratio) updates as ours
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": h["min_lr"]},
        warmup_steps=math.ceil(h["steps"] * h["warmup_ratio"]),
        lmbda=1.0, temperature=h["temperature"], top_p=h["top_p"], top_k=0,
        max_completion_length=h["max_new_tokens"],
        max_length=h["max_prompt_len"] + h["max_new_tokens"],   # prompts budgeted to max_prompt_len, as ours
        use_uld_loss=True, teacher_tokenizer_name_or_path=spec["teacher"],
        # use_cache: TrainingArguments' (False by default), which the Trainer copies into the student's
        # config; generate then decodes one token per forward over the KV cache (GOLD's training
        # forwards pass use_cache=False themselves)
        use_cache=True, model_init_kwargs={"dtype": "float32"},
        teacher_model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False, use_vllm=False, bf16=False, fp16=False, use_cpu=True,
        seed=spec["seed"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)


ULD_FIELDS = ("use_extended_uld", "uld_token_merge_strategy", "uld_use_hybrid_loss", "uld_crossentropy_weight",
              "uld_distillation_weight", "uld_student_temperature", "uld_teacher_temperature",
              "uld_skip_student_eos", "uld_skip_teacher_eos", "beta")


def main(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.gold import GOLDConfig, GOLDTrainer
    from trl.trainer.utils import RepeatSampler

    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    rss = {"imports": vm_rss()}

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends, self.rss, self.peaks = [], [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.rss.append(vm_rss())
            self.peaks.append(peak_rss())

    args = GOLDConfig(**gold_args(spec))
    tok = AutoTokenizer.from_pretrained(spec["student"])
    data = Dataset.from_list([json.loads(line) for line in open(spec["trl_prompts"]) if line.strip()])
    ends = StepEnds()
    trainer = GOLDTrainer(model=spec["student"], teacher_model=spec["teacher"], args=args, train_dataset=data,
                          processing_class=tok, callbacks=[ends])
    student = trainer.model
    if student.is_gradient_checkpointing or not student.config.use_cache \
            or student.generation_config.use_cache is False:
        raise SystemExit("gold_args: GOLD must run without gradient checkpointing and generate with the KV cache "
                         f"({student.is_gradient_checkpointing=}, {student.config.use_cache=}, "
                         f"{student.generation_config.use_cache=})")
    decoded = {"forwards": 0, "cached": 0}   # the student's generation forwards; those of one new token over the cache

    def watch(module, a, k):
        ids = k.get("input_ids", a[0] if a else None)
        if not torch.is_grad_enabled() and ids is not None:
            decoded["forwards"] += 1
            decoded["cached"] += ids.shape[1] == 1 and k.get("past_key_values") is not None

    student.register_forward_pre_hook(watch, with_kwargs=True)
    # the prompts in file order, as ours reads them (data.shuffle false): GOLD's own sampler, unshuffled
    trainer._get_train_sampler = lambda *_: RepeatSampler(
        data_source=trainer.train_dataset, mini_repeat_count=1, batch_size=args.generation_batch_size,
        repeat_count=1, shuffle=False)
    tokens = []   # response tokens the loss covers, per on-policy batch (one per step)
    generate = trainer.generate_on_policy_outputs

    def counted(*a, **k):
        out = generate(*a, **k)
        tokens.append(int((out[2] != -100).sum()))
        return out

    trainer.generate_on_policy_outputs = counted
    rss["trainer"] = vm_rss()
    start = time.perf_counter()
    trainer.train()
    trained_peak = ends.peaks[-1]
    trainer.save_model(spec["save_dir"])   # the student's safetensors and config, and the tokenizer
    optimizer = trainer.optimizer
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    size = lambda tensors: int(sum(t.numel() * t.element_size() for t in tensors))
    result = {
        "step_ends": [start] + ends.ends, "rss_steps": ends.rss, "rss": rss, "tokens": tokens,
        "peak_rss": trained_peak, "peak_rss_with_save": peak_rss(),
        "bytes": {"student params": size(student.parameters()),
                  "teacher params": size(trainer.teacher_model.parameters()),
                  "optimizer state": size(state)},
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "lrs": [row["learning_rate"] for row in trainer.state.log_history if "learning_rate" in row],
        "settings": {"gradient_checkpointing": bool(student.is_gradient_checkpointing),
                     "use_cache": bool(student.config.use_cache), "generate_forwards": decoded["forwards"],
                     "of_them_one_token_over_kv_cache": decoded["cached"],
                     "optim": str(getattr(args.optim, "value", args.optim)),
                     "dtype": str(next(student.parameters()).dtype), "use_vllm": args.use_vllm,
                     "lmbda": args.lmbda, **{k: getattr(args, k) for k in ULD_FIELDS}},
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "trl": sys.modules["trl"].__version__,
                     "transformers": sys.modules["transformers"].__version__},
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
