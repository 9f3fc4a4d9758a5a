"""The demo's named sources (see ctopd_jax.sources): `demo:teacher` / `demo:student` models,
`demo:train` / `demo:held_out` prompt files and the `demo:held_out` evaluation set."""
from __future__ import annotations

from ctopd_jax import sources
from ctopd_jax.demo import data

sources.register("model", "demo", data.checkpoint_dir)
sources.register("prompts", "demo", data.prompt_file)
