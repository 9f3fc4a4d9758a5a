"""The gradient diagnostics of SPEC §6 run inside the loop: at step 0 and every
`algorithm.diagnostics_every` steps their three medians join that step's metrics row."""
import math

from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer

KEYS = ("grad_cos_mismatch", "grad_norm_ratio", "grad_cos_control")


def test_diagnostics_join_the_rows_of_their_steps(write_config):
    cfg, run_dir = write_config("diag", steps=3, checkpoint__save=False,
                                algorithm__diagnostics_every=2, algorithm__diagnostics_prompts=4)
    Trainer(load_config(cfg)).train()
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in (1, 3):          # before the updates of steps 1 and 3: iterations 0 and 2
        assert all(k in rows[step] for k in KEYS), rows[step]
        assert -1.0 <= rows[step]["grad_cos_mismatch"] <= 1.0
        assert -1.0 <= rows[step]["grad_cos_control"] <= 1.0
        assert rows[step]["grad_norm_ratio"] >= 0 and math.isfinite(rows[step]["grad_norm_ratio"])
    assert not any(k in rows[2] for k in KEYS)
