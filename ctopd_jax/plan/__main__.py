"""`python -m ctopd_jax.plan`: the planner's command line (planner.py)."""
import sys

from ctopd_jax.common.cli import run
from ctopd_jax.plan.planner import main

sys.exit(run(main, None, "python -m ctopd_jax.plan"))
