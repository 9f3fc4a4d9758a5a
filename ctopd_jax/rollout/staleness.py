"""Training on responses generated one update earlier (`rollout.async_rollouts`, staleness 1).

Each objective declares how it takes such responses (`Objective.stale_responses`, SPEC §1 and
docs/served_rollouts.md list them per objective):
- "none": its loss at each visited state is a complete divergence there (full vocabulary, top-k,
  span or served top-k terms): stale responses change which states are weighted, not what each
  term pulls towards; no correction.
- "ratio": its surrogate −(π_θ/π_old)·A reads π_old from the rollout log-probs
  (`gap_logprobs: rollout`), so the ratio IS the importance weight of the stale sample;
  `algorithm.opd_clip` truncates it (ppo) or masks its outliers (icepop), SPEC §9.
- "tis": the truncated importance weight w_t = min(π_θ(y_t) / π_rollout(y_t), C) per response
  token (π_θ the trainer's current policy, detached; C = `rollout.async_tis_cap`), the
  correction NeMo-RL and slime apply to off-policy rollouts, multiplies the response weights
  of every sum (`TruncatedIS`). Rows without a rollout log-prob keep weight 1.
- None: one step of staleness is wrong for it (an on-policy score-function estimator with no
  rollout log-probs to correct it): `rollout.async_rollouts` is refused in one line.
At staleness 0 nothing is stale: no correction, the same numbers as a run without async.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ctopd_jax.kernels.token_rows import token_rows

STALE_RESPONSES = ("none", "ratio", "tis", None)


def truncated_weights(logp_train, logp_rollout, have, cap: float):
    """min(exp(log π_train − log π_rollout), cap) where `have` (a rollout log-prob), else 1."""
    ratio = jnp.exp(jnp.minimum(logp_train - logp_rollout, jnp.log(cap)))
    return jnp.where(have, ratio, 1.0)


class TruncatedIS:
    """The objective as the step sees it (step/grad.py: loss_sums, loss_weights,
    after_micro_batch), its response weights multiplied by the truncated importance weights
    (the "tis" correction). Hashable like an objective: a static argument of the jitted step."""

    def __init__(self, objective, cap: float):
        self.objective, self.cap = objective, float(cap)

    def loss_weights(self):
        return self.objective.loss_weights()

    def after_micro_batch(self, metrics):
        return self.objective.after_micro_batch(metrics)

    def __hash__(self):
        return hash((TruncatedIS, self.objective, self.cap))

    def __eq__(self, other):
        return isinstance(other, TruncatedIS) and (self.objective, self.cap) == (other.objective, other.cap)

    def loss_sums(self, hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap):
        s = self.objective.settings
        rows = jnp.take(jax.lax.stop_gradient(hidden), batch.response_rows, axis=0)
        logp, _ = token_rows(rows, jax.lax.stop_gradient(lm_head), batch.response_targets,
                             chunk_rows=s.chunked_loss_size, implementation=s.implementation)
        weights = truncated_weights(logp, batch.rollout_logprobs, batch.rollout_logprob_weight > 0, self.cap)
        batch = dataclasses.replace(batch, response_weight=batch.response_weight * weights)
        sums, metrics = self.objective.loss_sums(hidden, lm_head, teacher_hidden, teacher_lm_head,
                                                 batch, overlap)
        have = batch.rollout_logprob_weight
        return sums, {**metrics, "tis_weight": (jnp.sum(have * weights), jnp.sum(have))}


def step_objective(objective, rollout):
    """What the step computes with: the objective, corrected when it trains on stale responses."""
    if rollout.async_rollouts and rollout.async_staleness == 1 and objective.stale_responses == "tis":
        return TruncatedIS(objective, rollout.async_tis_cap)
    return objective


def check_async(config, objective) -> None:
    """One ValueError line when `rollout.async_rollouts` cannot hold for this run (preflight)."""
    r = config.rollout
    if not r.async_rollouts:
        return
    name = config.algorithm.name
    if r.async_staleness == 1 and objective.stale_responses not in STALE_RESPONSES[:3]:
        raise ValueError(f"rollout.async_rollouts: algorithm.name={name} trains on-policy only (one "
                         "update of staleness biases its estimator and it has no rollout log-probs "
                         "to correct it); set rollout.async_rollouts=false or rollout.async_staleness=0")
    if config.algorithm.diagnostics_every:
        raise ValueError("algorithm.diagnostics_every: the diagnostics' replay rollouts would run "
                         "beside the background collection of rollout.async_rollouts; set "
                         "algorithm.diagnostics_every=0 or rollout.async_rollouts=false")
    if jax.process_count() > 1:
        raise ValueError(f"rollout.async_rollouts: {jax.process_count()} trainer processes gather "
                         "their samples with collectives, which must not run beside training's; "
                         "run one process or set rollout.async_rollouts=false")
    if config.optimizer.offload_during_rollout:
        raise ValueError("optimizer.offload_during_rollout: the rollout runs beside training with "
                         "rollout.async_rollouts, so the optimizer state stays on the device; set "
                         "optimizer.offload_during_rollout=false")
