"""`python -m ctopd_jax.train --config configs/X.yaml [--mesh data=2,...] [--set a.b=c] [--resume]`.

Multi-process (one process per host): set CTOPD_COORDINATOR=host:port, CTOPD_NUM_PROCESSES and
CTOPD_PROCESS_ID (see launch/multi_host.sh); `jax.distributed.initialize` runs before anything
else touches JAX, and the mesh spans the devices of all processes.
"""
from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ctopd_jax.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                   help="override one config value (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ctopd_jax.mesh import initialize_distributed

    initialize_distributed()
    import jax

    from ctopd_jax.config import ConfigError, load_config, validate
    from ctopd_jax.trainer import Trainer, TrainingDiverged

    try:
        config = load_config(args.config, args.overrides, args.mesh)
        validate(config, device_count=jax.device_count())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    trainer = Trainer(config)
    try:
        result = trainer.train(resume=args.resume)
    except TrainingDiverged as err:
        print(f"training stopped: {err}", file=sys.stderr)
        return 3
    if jax.process_index() == 0:
        print(json.dumps({"final_step": result.final_step, "run_dir": str(result.run_dir),
                          "checkpoints": str(result.checkpoint_dir),
                          "hf_student": str(result.hf_dir) if result.hf_dir else None,
                          "last_metrics": result.last_metrics}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
