"""The memory and time planner, `python -m ctopd_jax.plan` (planner.py): its model of a run
(model.py), its table (rows.py) and the rollout's decode floor (decode.py)."""
