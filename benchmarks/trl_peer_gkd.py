"""The TRL side of benchmarks/trl_peer.py: TRL's GKDTrainer on the character pair, one run.

    .venv-trl/bin/python benchmarks/trl_peer_gkd.py SPEC.json     # (make trl-venv), started by trl_peer.py

Runs in its own venv (torch CPU, transformers, trl; Makefile `trl-venv`), so it imports nothing
from ctopd_jax. SPEC.json (written by trl_peer.py) names the student and teacher HF checkpoints,
the prompt file (chat `messages`, the same rows as ours reads) and the hyper-parameters. The λ
draws are the project's (numpy PCG64 seeded by gkd_seed, one per step), so both trainers take the
same on-/off-policy steps. Prints one line `RESULT {json}`: step-end times, peak RSS and what the
process holds.
"""
from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.gkd import gkd_trainer


def vm_rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class SameDraws:
    """Stands in for the `random` module GKDTrainer draws λ from: the project's draws."""

    def __init__(self, seed: int):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def random(self) -> float:
        return float(self._rng.uniform())


class StepEnds(TrainerCallback):
    def __init__(self):
        self.ends, self.rss = [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.rss.append(vm_rss())


def tensor_bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    h = spec["hyper"]
    rss = {"imports": vm_rss()}
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["student"])
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
    rss["models"] = vm_rss()
    gkd_trainer.random = SameDraws(h["gkd_seed"])
    args = GKDConfig(**spec["trl_args"])   # trl_peer.trl_args: its fastest settings
    if args.gradient_checkpointing:
        raise SystemExit("trl_args: gradient_checkpointing must be off (TRL's fastest settings)")
    data = load_dataset("json", data_files=spec["trl_prompts"], split="train")
    ends = StepEnds()
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data,
                         processing_class=tok, callbacks=[ends])
    # the prompts in file order, as ours reads them (data.shuffle false)
    trainer._get_train_sampler = lambda *_: torch.utils.data.SequentialSampler(data)
    rss["trainer"] = vm_rss()
    start = time.perf_counter()
    trainer.train()
    optimizer = trainer.optimizer
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    result = {
        "step_ends": [start] + ends.ends, "rss_steps": ends.rss, "rss": rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bytes": {"student params": tensor_bytes(student.parameters()),
                  "teacher params": tensor_bytes(teacher.parameters()),
                  "optimizer state": tensor_bytes(state)},
        "losses": losses, "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "trl": sys.modules["trl"].__version__,
                     "transformers": sys.modules["transformers"].__version__},
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
