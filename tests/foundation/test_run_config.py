import dataclasses

import pytest

from ctopd_jax.config import ConfigError, TrainConfig, load_config, validate


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
