"""A new objective is one file: a module written here to a temporary folder, named in the config
(`algorithm.modules`), trains through the real command (`python -m ctopd_jax.train`) with no
other file changed and no private name touched (docs/objectives.md walks through it).

The toy: at every strict pair, the student's cross-entropy on the teacher's most likely token
of the shared vocabulary (a hard-label distillation). The training run is a process of its own;
the tests that import the toy here (its loss against numpy, its config key) give the registry
back as it was (`toy_here`), since other tests enumerate it."""
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from conftest import subprocess_env, tiny_tree
from ctopd_jax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

TOY = '''
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import losses
from ctopd_jax.algorithms.base import Objective, register
from ctopd_jax.algorithms.strict import strict_inputs
from ctopd_jax.config import AlgorithmSection


@dataclass(frozen=True)
class HardLabelSettings(AlgorithmSection):
    hard_label_weight: float = 1.0      # the objective's own key (algorithm.hard_label_weight)


@register("hard_label")
class HardLabel(Objective):
    settings_class = HardLabelSettings  # needs: the default (student rollouts, teacher scores)

    def prepare(self, host, start, stop):
        return strict_inputs(host, start, stop)   # tokens, response rows and strict pairs

    def kd_weights(self):
        return {"hard_label": self.settings.hard_label_weight}

    def kd_sums(self, x):
        s_ids, t_ids = x.overlap["s_ids"], x.overlap["t_ids"]
        rows = jnp.take(x.hidden, x.batch.terms.strict_student_rows, axis=0)
        s_logits = rows @ x.lm_head[:, s_ids].astype(rows.dtype)
        t_logits = x.teacher_hidden @ x.teacher_lm_head[:, t_ids].astype(x.teacher_hidden.dtype)
        target = jnp.argmax(t_logits, axis=-1)
        picked = jnp.take_along_axis(s_logits, target[:, None], axis=-1)[:, 0]
        terms = jax.nn.logsumexp(s_logits.astype(jnp.float32), axis=-1) - picked
        return {"hard_label": losses.masked_sum(terms, x.batch.terms.strict_weight)}, {}
'''


@pytest.fixture
def toy_here(tmp_path, monkeypatch):
    """The toy module importable in this process, registered only for the test: the catalog's
    registry and its record of imported modules are copies, dropped (with the module) after."""
    from ctopd_jax.config import catalog

    catalog.registry()   # the package's own objectives first, into the registry that stays
    (tmp_path / "toy_hard_label.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(catalog, "_OBJECTIVES", dict(catalog._OBJECTIVES))
    monkeypatch.setattr(catalog, "_IMPORTED", set(catalog._IMPORTED))
    monkeypatch.delitem(sys.modules, "toy_hard_label", raising=False)
    yield
    sys.modules.pop("toy_hard_label", None)


def test_the_toy_loss_matches_numpy(toy_here):
    """The toy's kd_sums (what the command above trains) against the same loss in numpy:
    Σ_pairs w · (logsumexp(z_S) − z_S[argmax z_T]) over the shared vocabulary, the student's and
    teacher's logits from their hidden rows and lm_head columns s_ids / t_ids."""
    toy = importlib.import_module("toy_hard_label")
    rng = np.random.default_rng(0)
    hidden, s_head = rng.normal(size=(7, 8)), rng.normal(size=(8, 20))     # 7 flat student rows
    t_rows, t_head = rng.normal(size=(5, 6)), rng.normal(size=(6, 30))     # 5 pairs' teacher rows
    s_ids, t_ids = np.array([3, 7, 11, 2]), np.array([0, 29, 5, 17])        # V∩ of 4 columns
    pair_rows, weight = np.array([0, 2, 3, 5, 6]), np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    x = SimpleNamespace(hidden=f32(hidden), lm_head=f32(s_head), teacher_hidden=f32(t_rows),
                        teacher_lm_head=f32(t_head),
                        overlap={"s_ids": jnp.asarray(s_ids), "t_ids": jnp.asarray(t_ids)},
                        batch=SimpleNamespace(terms=SimpleNamespace(
                            strict_student_rows=jnp.asarray(pair_rows), strict_weight=f32(weight))))
    sums, _ = toy.HardLabel(toy.HardLabelSettings(name="hard_label")).kd_sums(x)
    s_logits, t_logits = hidden[pair_rows] @ s_head[:, s_ids], t_rows @ t_head[:, t_ids]
    target = t_logits.argmax(axis=1)
    log_z = np.log(np.exp(s_logits).sum(axis=1))
    want = np.sum(weight * (log_z - s_logits[np.arange(5), target]))
    assert float(sums["hard_label"]) == pytest.approx(want, rel=1e-5)


def test_the_toys_own_key_is_read_and_a_misspelt_one_refused_naming_it(toy_here):
    toy = ["algorithm.name=hard_label", "algorithm.modules=[toy_hard_label]"]
    assert load_config(None, [*toy, "algorithm.hard_label_weight=2.5"]).algorithm.hard_label_weight == 2.5
    # refused, not dropped: the line names the misspelt key and lists the toy's own among the known
    with pytest.raises(ConfigError, match=r"^unknown config key\(s\) algorithm\.hard_label_wieght; "
                                          r"known keys of algorithm: .*hard_label_weight"):
        load_config(None, [*toy, "algorithm.hard_label_wieght=2.0"])


def test_a_toy_objective_module_trains_through_the_real_command(tmp_path, compile_cache):
    (tmp_path / "toy_hard_label.py").write_text(TOY)
    run_dir = tmp_path / "run"
    tree = tiny_tree(run_dir, steps=2, **{"checkpoint.save": False})
    tree["algorithm"] = {"name": "hard_label", "modules": ["toy_hard_label"],
                         "hard_label_weight": 1.0, "chunked_loss_size": 64}
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump(tree))
    env = subprocess_env(compile_cache, PYTHONPATH=f"{ROOT}:{tmp_path}")
    done = subprocess.run([sys.executable, "-m", "ctopd_jax.train", "--config", str(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    loss = np.array([r["hard_label_loss"] for r in rows])
    assert np.isfinite(loss).all() and (loss > 0).all()
    assert loss[0] != loss[1] and all(r["grad_norm"] > 0 for r in rows)   # it trained


def test_a_module_that_cannot_import_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^algorithm\.modules: cannot import 'no_such_objective_mod'"):
        load_config(None, ["algorithm.name=hard_label", "algorithm.modules=[no_such_objective_mod]"])


def test_modules_must_be_a_list_of_names():
    with pytest.raises(ConfigError, match=r"^algorithm\.modules: .* must be a list of module names"):
        load_config(None, ["algorithm.modules=toy"])
