import dataclasses
from pathlib import Path

import pytest

from ctopd_jax.config import ConfigError, TrainConfig, from_dict, load_config, validate


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_overrides_and_mesh(tmp_path):
    path = write(tmp_path, "steps: 3\noptimizer:\n  lr: 1.0e-5\nrollout:\n  engine: jax\n")
    cfg = load_config(path, ["optimizer.betas=[0.9, 0.95]", "algorithm.ctkd_topk=16",
                             "rollout.top_p=0.95"], mesh="fsdp=4,tensor=2")
    assert cfg.steps == 3 and cfg.optimizer.lr == 1e-5
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.algorithm.ctkd_topk == 16 and cfg.rollout.top_p == 0.95
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign"):
        cfg.steps = 4  # frozen


def test_defaults_follow_spec():
    o = TrainConfig().optimizer
    assert o.betas == (0.9, 0.98) and o.weight_decay == 0.0 and o.max_grad_norm == 1.0
    assert o.warmup_ratio == 0.05 and o.min_lr == 1e-8


@pytest.mark.parametrize("overrides, field", [
    (["optimizer.lrr=1"], "optimizer.lrr"),
    (["nosection.x=1"], "nosection"),
    (["optimizer.lr=abc"], "optimizer.lr"),
    (["optimizer.lr=-1"], "optimizer.lr"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["algorithm.kd_loss_fn=mse"], "algorithm.kd_loss_fn"),
    (["algorithm.jsd_beta=1.0"], "algorithm.jsd_beta"),
    (["algorithm.ctkd_topk=0"], "algorithm.ctkd_topk"),
    (["steps=true"], "steps"),
    (["optimizer.betas=[0.9]"], "optimizer.betas"),
    (["optimizer.micro_batch_size=3"], "optimizer.train_batch_size"),
    (["mesh.data=0"], "mesh.data"),
    (["badformat"], "section.key=value"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_mesh_must_match_device_count():
    cfg = load_config(None, [], mesh="data=3,tensor=2")
    with pytest.raises(ConfigError, match="8 devices"):
        validate(cfg, device_count=8)
    validate(load_config(None, [], mesh="data=2,fsdp=2,tensor=2"), device_count=8)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--config"):
        load_config(tmp_path / "nope.yaml")


# -- keys of another objective (algorithm.name picks the settings class) ---------------------------

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"

@pytest.mark.parametrize("name, cls", [("simct", "SimCTSettings"), ("mp_opd", "MpOpdSettings")])
def test_switching_the_objective_drops_the_files_keys_of_another(name, cls):
    """tiny_cpu.yaml sets ctkd_topk for its topk_strict; `--set algorithm.name=X` takes the
    file's other settings and drops the keys only other objectives define."""
    cfg = load_config(TINY_CPU, [f"algorithm.name={name}"])
    assert type(cfg.algorithm).__name__ == cls and cfg.algorithm.name == name
    assert not hasattr(cfg.algorithm, "ctkd_topk")
    assert cfg.algorithm.kd_loss_fn == "rkl" and cfg.algorithm.chunked_loss_size == 2048
    assert "ctkd_topk" not in cfg.to_dict()["algorithm"]


def test_the_files_own_objective_keeps_its_keys():
    assert load_config(TINY_CPU).algorithm.ctkd_topk == 16
    assert load_config(TINY_CPU, ["algorithm.name=strict"]).algorithm.ctkd_topk == 16
    assert load_config(TINY_CPU,
                       ["algorithm.name=span"]).algorithm.ctkd_topk == 16


@pytest.mark.parametrize("overrides", [
    ["algorithm.name=simct", "algorithm.ctkd_topk=16"],   # given explicitly: it would do nothing
    ["algorithm.ctkd_topk=16", "algorithm.name=simct"],
])
def test_another_objectives_key_on_the_command_line_is_refused(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CPU, overrides)
    assert str(err.value) == ("algorithm.ctkd_topk belongs to span, strict, topk_strict; "
                              "remove it when algorithm.name=simct")


def test_another_objectives_key_in_a_file_naming_the_objective_is_refused(tmp_path):
    path = write(tmp_path, "algorithm:\n  name: mp_opd\n  ctkd_topk: 16\n")
    with pytest.raises(ConfigError, match=r"^algorithm\.ctkd_topk belongs to span, strict, "
                                          r"topk_strict; remove it when algorithm\.name=mp_opd$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"algorithm\.span_lambda belongs to span;"):
        from_dict({"algorithm": {"name": "simct", "span_lambda": 1.0}})


def test_a_key_no_objective_defines_is_still_unknown():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) algorithm\.ctkd_topkk"):
        load_config(TINY_CPU, ["algorithm.name=simct", "algorithm.ctkd_topkk=3"])


def test_rollout_async_is_the_issue_spelling_of_async_rollouts():
    """`rollout.async` (a Python keyword, so the field is async_rollouts) reads as the field."""
    served = {"engine": "vllm_server", "url": "http://127.0.0.1:9"}
    assert from_dict({"rollout": {**served, "async": True}}).rollout.async_rollouts is True
    assert from_dict({"rollout": served}).rollout.async_rollouts is False
    with pytest.raises(ConfigError, match="rollout.async: is rollout.async_rollouts under another name"):
        from_dict({"rollout": {**served, "async": True, "async_rollouts": False}})
