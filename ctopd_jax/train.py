"""Train a student by cross-tokenizer on-policy distillation.

    python -m ctopd_jax.train --config configs/X.yaml [--mesh data=2,fsdp=2,tensor=2]
        [--set section.key=value ...] [--resume [--allow-config-change]] [--debug]

Order of work: read the config (YAML + --set + --mesh), then every cheap check
(`ctopd_jax.preflight`: data file and rows, tokenizers and their shared vocabulary, algorithm,
mesh against the devices, checkpoint headers, the checkpoint directory and --resume), and only
then load the models and train. Outputs go to `output_dir`: metrics.jsonl, checkpoints/,
hf_student/, plots/, config.json (and config_changes.jsonl when a resume changed the config).

One writer per output: the run holds `<output_dir>/.run.lock` and `<checkpoint.dir>/.run.lock`
(pid and host); a second run on either folder is refused in one line, a lock left by a killed
run is taken over with a warning.

Exit status: 0 done; 2 bad input, or an output folder that refuses writes (no space, read-only:
one line naming the field or file and the fix; --debug shows the traceback); 3 training diverged (the message names the step, the values and the last
good checkpoint); 143 / 130 stopped by SIGTERM / SIGINT, in one line at any moment: while
starting (the locks released, nothing written that a fresh start would not redo), in the loop
after checkpointing the step in flight (continue with --resume), after the loop once the
export and plots are whole; a second signal exits at once.

Multi-process (one process per host): set CTOPD_COORDINATOR=host:port, CTOPD_NUM_PROCESSES and
CTOPD_PROCESS_ID (see launch/multi_host.sh); `jax.distributed.initialize` runs before anything
else touches JAX, and the mesh spans the devices of all processes. On CPU, more (virtual)
devices for --mesh: XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""
from __future__ import annotations

import contextlib
import json
import sys

import jax

from ctopd_jax.common.cli import Parser, run
from ctopd_jax.common.run_dir import RunLock, write_error
from ctopd_jax.common.run_guard import SIGNAL_NAMES, SignalGuard
from ctopd_jax.config import load_config
from ctopd_jax.loop import trainer as trainer_module   # Trainer read at call time: tests stand it in
from ctopd_jax.loop.checkpoint import CheckpointWriteError
from ctopd_jax.mesh.device_mesh import initialize_distributed
from ctopd_jax.plot import plot_after_training
from ctopd_jax.preflight import preflight, start_served_teachers
from ctopd_jax.preflight.resume_config import record_config_changes

PROG = "python -m ctopd_jax.train"


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. data=2,fsdp=2,tensor=2 (one may "
                   "be -1: the remaining devices)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                   help="override one config value, e.g. --set optimizer.lr=1e-5 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint of output_dir")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept a config that differs from the saved one in "
                        "fields that matter (the changes are logged to config_changes.jsonl)")
    return p


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.allow_config_change and not args.resume:
        raise SystemExit("--allow-config-change only applies with --resume")
    initialize_distributed()

    config = load_config(args.config, args.overrides, args.mesh)
    # `with`: a teacher server the run starts itself (teacher.launch) stops whenever the run ends
    with preflight(config, resume=args.resume, allow_config_change=args.allow_config_change,
                   device_count=jax.device_count()) as pre:
        start_served_teachers(pre)   # after every cheap check: the one that talks to a server
        writer = jax.process_index() == 0
        # one writer per output: the writing process holds <output_dir>/.run.lock and
        # <checkpoint.dir>/.run.lock throughout (another run may share either folder alone)
        try:
            with contextlib.ExitStack() as locks:
                if writer:
                    locks.enter_context(RunLock(config.output_dir))
                    locks.enter_context(RunLock(pre.checkpoint_dir, "checkpoint.dir"))
                return _train(config, pre, args, writer)
        except Exception as err:   # a refused write (no space, read-only, permission): one line
            line = None if isinstance(err, CheckpointWriteError) else write_error(   # already one
                err, {"output_dir": config.output_dir, "checkpoint.dir": pre.checkpoint_dir})
            if line is None:
                raise
            raise line from err


def _train(config, pre, args, writer: bool) -> int:
    def log_config_changes(step: int) -> None:
        """After the restore: a checkpoint refused as another model's leaves the run as it was."""
        if pre.config_changes and writer:
            path = record_config_changes(config.output_dir, pre.config_changes, resumed_step=step)
            print(f"resume: config changed ({', '.join(c.field for c in pre.config_changes)}); "
                  f"logged to {path}", file=sys.stderr, flush=True)

    trainer = trainer_module.Trainer(config, preflight=pre)
    # a signal in the loop finishes the step, checkpoints it and stops (run_guard.Stopped: cli.run
    # prints its line, as it does the divergence guard's TrainingDiverged); one after it lets the
    # export and the plots finish (nothing half-written), then the run exits
    with SignalGuard() as stop:
        result = trainer.train(resume=args.resume, stop=stop, on_resumed=log_config_changes)
        if writer:
            plot_after_training(result.run_dir)   # <run_dir>/plots/*.png; warns, never fails
    if stop.requested:
        print(f"{PROG}: {SIGNAL_NAMES[stop.signum]} received after the last step; the run is "
              f"complete and saved in {result.run_dir}", file=sys.stderr)
        return stop.exit_code
    if writer:
        print(json.dumps({"final_step": result.final_step, "run_dir": str(result.run_dir),
                          "checkpoints": str(result.checkpoint_dir),
                          "hf_student": str(result.hf_dir) if result.hf_dir else None,
                          "last_metrics": result.last_metrics}, indent=2))
    return 0


def main(argv=None) -> int:
    return run(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
