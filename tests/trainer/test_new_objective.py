"""A new objective needs nothing but its own module: one defined here, registered here, trains
through the real loop (config -> preflight-free Trainer -> metrics) with no edit anywhere else.

The toy: at every strict pair, the student's cross-entropy on the teacher's most likely token
of the shared vocabulary (a hard-label distillation). Its value is checked against a numpy
recomputation from the same hidden states, so the loop really ran it."""
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax import losses
from ctopd_jax.algorithms.base import Objective, register
from ctopd_jax.algorithms.strict import strict_inputs
from ctopd_jax.config import AlgorithmSection, load_config
from ctopd_jax.metrics import read_metrics
from ctopd_jax.trainer import Trainer


@dataclass(frozen=True)
class HardLabelSettings(AlgorithmSection):
    hard_label_weight: float = 1.0      # the objective's own config key (algorithm.hard_label_weight)


def hard_label_terms(s_rows, s_head, t_rows, t_head, s_ids, t_ids):
    """Per pair: -log softmax_{V∩}(student)[argmax_{V∩} teacher]."""
    s_logits = jnp.einsum("rh,hv->rv", s_rows, s_head[:, s_ids].astype(s_rows.dtype),
                          preferred_element_type=jnp.float32)
    t_logits = jnp.einsum("rh,hv->rv", t_rows, t_head[:, t_ids].astype(t_rows.dtype),
                          preferred_element_type=jnp.float32)
    target = jnp.argmax(t_logits, axis=-1)
    picked = jnp.take_along_axis(s_logits, target[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(s_logits, axis=-1) - picked


class HardLabel(Objective):
    settings_class = HardLabelSettings      # needs: the default (student rollouts, teacher scores)

    def prepare(self, host, start, stop):
        return strict_inputs(host, start, stop)   # tokens, response rows and strict pairs

    def kd_weights(self):
        return {"hard_label": self.settings.hard_label_weight}

    def kd_sums(self, x):
        rows = jnp.take(x.hidden, x.batch["strict_student_rows"], axis=0)
        terms = hard_label_terms(rows, x.lm_head, x.teacher_hidden, x.teacher_lm_head,
                                 x.overlap["s_ids"], x.overlap["t_ids"])
        return {"hard_label": losses.masked_sum(terms, x.batch["strict_weight"])}, {}


@pytest.fixture(autouse=True)
def registered():
    """Registered for this module's tests only: other tests enumerate the registry."""
    from ctopd_jax.algorithms import base
    from ctopd_jax.config import algorithm_settings

    register("hard_label")(HardLabel)
    yield
    del base._REGISTRY["hard_label"], algorithm_settings._ALGORITHM_SETTINGS["hard_label"]


def test_a_toy_objective_trains_through_the_real_loop(write_config):
    cfg, run_dir = write_config("toy", steps=3, algorithm={"name": "hard_label",
                                                           "hard_label_weight": 1.0,
                                                           "chunked_loss_size": 64},
                                checkpoint__save=False)
    trainer = Trainer(load_config(cfg))
    assert type(trainer.objective).__name__ == "HardLabel"
    before = jax.tree.map(np.asarray, trainer.params)
    trainer.train()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["hard_label_loss"]) and r["hard_label_loss"] > 0 for r in rows)
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)))   # it trained


def test_the_toy_terms_match_numpy():
    rng = np.random.default_rng(0)
    s_rows, t_rows = rng.normal(size=(5, 8)), rng.normal(size=(5, 6))
    s_head, t_head = rng.normal(size=(8, 20)), rng.normal(size=(6, 30))
    s_ids, t_ids = np.array([3, 7, 11, 2]), np.array([0, 29, 5, 17])
    got = hard_label_terms(*(jnp.asarray(a, jnp.float32) for a in (s_rows, s_head, t_rows, t_head)),
                           jnp.asarray(s_ids), jnp.asarray(t_ids))
    s_logits, t_logits = s_rows @ s_head[:, s_ids], t_rows @ t_head[:, t_ids]
    target = t_logits.argmax(axis=1)
    log_z = np.log(np.exp(s_logits).sum(axis=1))
    want = log_z - s_logits[np.arange(5), target]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_an_unknown_key_of_the_toy_is_refused_naming_it(write_config):
    cfg, _ = write_config("toy_bad", algorithm={"name": "hard_label", "hard_label_wieght": 2.0})
    with pytest.raises(ValueError, match="hard_label_wieght"):
        load_config(cfg)
