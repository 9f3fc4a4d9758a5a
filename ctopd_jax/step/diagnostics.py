"""Gradient diagnostics of SPEC §6 (paper §5), for any objective that names two terms to compare
(`Objective.gradient_comparison`: its trained term, the term to compare it with, and the weights
whose positions the control splits; below for the strict objectives and span).

On a fixed replay set — `algorithm.diagnostics_prompts` prompts drawn once with a seed from the
run's seed, and their responses sampled once by the student the first time the diagnostics run
— at step 0 and every `algorithm.diagnostics_every` steps, per replay unit (a micro-batch of
`optimizer.micro_batch_size` responses):

    g_strict = ∇ L_strict,  g_mis = ∇ L_span   (the whole parameter vector)
    grad_cos_mismatch = cos(g_strict, g_mis),  grad_norm_ratio = ‖g_mis‖ / ‖g_strict‖
    grad_cos_control  = cos(∇ L_strict on half A of the strict pairs, ∇ on half B)

with the halves a seeded random split of the unit's strict pairs. Reported: medians over units.
For the strict objectives and span: L_strict is the trained objective's strict part (full or
top-k, same divergence and kernel); L_span is SPEC §6's span term, whatever the trained
objective (so `strict` runs can be diagnosed too). Decision: after a resume the replay
responses are sampled again by the resumed student (they are not stored in checkpoints).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import objectives_that
from ctopd_jax.common.metrics import StepTimer
from ctopd_jax.config import ConfigError
from ctopd_jax.mesh.arrays import replicated, to_global
from ctopd_jax.step.grad import objective_sums, scalar
from ctopd_jax.step.teacher import teacher_hidden_rows


def tree_dot(a, b):
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def cosine_and_ratio(g, h):
    """(cos(g, h), ‖h‖ / ‖g‖) of two gradient trees (0 where a norm is 0)."""
    gg, hh, gh = tree_dot(g, g), tree_dot(h, h), tree_dot(g, h)
    denom = jnp.sqrt(gg * hh)
    cos = jnp.where(denom > 0, gh / jnp.where(denom > 0, denom, 1.0), 0.0)
    ratio = jnp.where(gg > 0, jnp.sqrt(hh / jnp.where(gg > 0, gg, 1.0)), 0.0)
    return cos, ratio


@functools.partial(jax.jit, static_argnames=("graphdef", "comparison"))
def unit_statistics(params, rest, batch, t_hidden, t_lm_head, overlap, half_a, *, graphdef, comparison):
    """(cos mismatch, norm ratio, cos control) of one replay unit (`comparison`:
    base.GradientComparison)."""
    c = comparison

    def grad_of(name, weight):
        def f(p):
            b = dataclasses.replace(batch, terms=dataclasses.replace(batch.terms, **{c.weight: weight}))
            return objective_sums(p, rest, b, t_hidden, t_lm_head, overlap, graphdef=graphdef,
                                  objective=c.objective)[0][name]
        return jax.grad(f)(params)

    w = getattr(batch.terms, c.weight)
    g_trained, g_compared = grad_of(c.trained, w), grad_of(c.compared, w)
    cos_mis, ratio = cosine_and_ratio(g_trained, g_compared)
    cos_control, _ = cosine_and_ratio(grad_of(c.trained, w * half_a), grad_of(c.trained, w * (1 - half_a)))
    return cos_mis, ratio, cos_control


class Diagnostics:
    """The replay set of one run (`prompts`: the run's prompt pool) and its statistics."""

    def __init__(self, config, objective, prompts):
        c = config
        self.comparison = objective.gradient_comparison()
        if self.comparison is None:
            can = objectives_that(lambda o: o.gradient_comparison() is not None)
            raise ConfigError(f"algorithm.diagnostics_every: objective {c.algorithm.name!r} has no "
                              f"terms to compare; use {', '.join(can)}, or set it to 0")
        self.config, self.every = c, c.algorithm.diagnostics_every
        rng = np.random.default_rng([c.seed, 6])
        pool = prompts
        pick = rng.choice(len(pool), size=min(c.algorithm.diagnostics_prompts, len(pool)), replace=False)
        self.prompts = [pool[i] for i in sorted(pick)]
        self.seed = int(rng.integers(2 ** 31 - 1))
        self.host = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, collector, mesh, student, teacher, overlap) -> dict[str, float]:
        """Medians over the replay units. `student`: (graphdef, params, rest); `teacher`:
        (graphdef, state, lm_head); `overlap`: the V∩ id arrays on the mesh."""
        graphdef, params, rest = student
        t_graphdef, t_state, t_lm_head = teacher
        if self.host is None:
            self.host = collector.collect(self.prompts, self.seed, StepTimer())
        host, micro = self.host, self.config.optimizer.micro_batch_size
        rows = []
        for unit, start in enumerate(range(0, host.size, micro)):
            stop = min(start + micro, host.size)
            unit_batch = self.comparison.objective.prepare(host, start, stop)
            weight = getattr(unit_batch.terms, self.comparison.weight)
            split = np.random.default_rng([self.config.seed, 7, unit]).permutation(int(weight.sum()))
            half_a = np.zeros_like(weight)
            half_a[split[: len(split) // 2]] = 1.0
            batch = to_global(unit_batch, mesh)
            t_hidden = teacher_hidden_rows(t_graphdef, t_state, batch.teacher_ids, batch.teacher_mask,
                                           batch.teacher_rows)
            stats = unit_statistics(params, rest, batch, t_hidden, t_lm_head, overlap,
                                    replicated(half_a, mesh), graphdef=graphdef,
                                    comparison=self.comparison)
            rows.append([scalar(v) for v in stats])
        med = np.median(np.asarray(rows), axis=0)
        return {"grad_cos_mismatch": float(med[0]), "grad_norm_ratio": float(med[1]),
                "grad_cos_control": float(med[2])}
