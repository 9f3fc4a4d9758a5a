"""--resume against the saved config: harmless fields pass, others are refused by name unless
--allow-config-change, and the accepted changes are logged."""
import json

import pytest

from ctopd_jax.config import load_config
from ctopd_jax.preflight.resume_config import (ConfigChangeError, check_resume_config, config_changes,
                                               read_saved_config, record_config_changes)


def cfg(*overrides):
    return load_config(None, list(overrides)).to_dict()


def test_harmless_changes_pass_silently_listed():
    saved = cfg()
    new = cfg("logging.progress=false", "checkpoint.keep=9", "evaluation.every=5", "mesh.data=2")
    changes = check_resume_config(saved, new)
    assert {c.field for c in changes} == {"logging.progress", "checkpoint.keep", "evaluation.every",
                                          "mesh.data"}
    assert all(c.harmless for c in changes)


def test_changes_that_matter_are_refused_by_name():
    with pytest.raises(ConfigChangeError, match=r"optimizer\.lr: 1e-06 -> 2e-06; seed: 0 -> 1; "
                                                r"restore those values, or pass --allow-config-change"):
        check_resume_config(cfg(), cfg("optimizer.lr=2e-6", "seed=1", "logging.jsonl=false"))
    allowed = check_resume_config(cfg(), cfg("optimizer.lr=2e-6"), allow_change=True)
    assert [(c.field, c.harmless) for c in allowed] == [("optimizer.lr", False)]


def test_steps_may_grow_only_with_a_constant_schedule():
    cosine = config_changes(cfg("steps=10"), cfg("steps=20"))
    assert [(c.field, c.harmless) for c in cosine] == [("steps", False)]
    constant = config_changes(cfg("steps=10", "optimizer.schedule=constant"),
                              cfg("steps=20", "optimizer.schedule=constant"))
    assert [(c.field, c.harmless) for c in constant] == [("steps", True)]
    shrink = config_changes(cfg("steps=20", "optimizer.schedule=constant"),
                            cfg("steps=10", "optimizer.schedule=constant"))
    assert [c.harmless for c in shrink] == [False]


def test_fields_an_older_saved_config_lacks():
    saved = cfg()
    del saved["guard"]
    saved["removed_field"] = 1
    assert all(c.harmless for c in config_changes(saved, cfg()))
    saved_old = cfg()
    del saved_old["optimizer"]["eps"]
    assert [c.harmless for c in config_changes(saved_old, cfg("optimizer.eps=1e-6"))] == [False]


def test_saved_config_sources_and_the_change_log(tmp_path):
    assert read_saved_config(tmp_path, tmp_path / "checkpoints") == (None, "")
    step = tmp_path / "checkpoints" / "3" / "meta"
    step.mkdir(parents=True)
    (step / "metadata").write_text(json.dumps({"config": cfg("seed=5")}))
    saved, where = read_saved_config(tmp_path, tmp_path / "checkpoints")
    assert saved["seed"] == 5 and where.endswith("checkpoints/3")
    (tmp_path / "config.json").write_text(json.dumps(cfg("seed=6")))
    assert read_saved_config(tmp_path, tmp_path / "checkpoints")[0]["seed"] == 6
    changes = check_resume_config(saved, cfg("seed=7"), allow_change=True)
    path = record_config_changes(tmp_path, changes, resumed_step=3)
    record_config_changes(tmp_path, changes, resumed_step=4)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["resumed_from_step"] for r in rows] == [3, 4]
    assert rows[0]["changes"] == [{"field": "seed", "old": 5, "new": 7, "harmless": False}]
