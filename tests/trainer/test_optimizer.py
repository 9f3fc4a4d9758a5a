"""optimizer.py against transformers' scheduler and torch's AdamW + clip_grad_norm_."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from ctopd_jax.config import ConfigError, OptimizerSection, TrainConfig, validate
from ctopd_jax.step.optimizer import cosine_with_min_lr_schedule, decay_mask, make_optimizer, warmup_steps


@pytest.mark.parametrize("total,ratio,lr,min_lr", [(100, 0.05, 1e-6, 1e-8), (7, 0.3, 1e-3, 1e-5), (10, 0.0, 2e-4, 0.0)])
def test_schedule_matches_transformers(total, ratio, lr, min_lr):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=warmup_steps(total, ratio), num_training_steps=total, min_lr=min_lr)
    ours = cosine_with_min_lr_schedule(lr, total, ratio, min_lr)
    for count in range(total):
        expected = opt.param_groups[0]["lr"]
        np.testing.assert_allclose(float(ours(count)), expected, rtol=1e-5, atol=1e-12)
        opt.step()
        sched.step()


def test_warmup_is_ceil():
    assert warmup_steps(100, 0.05) == 5
    assert warmup_steps(30, 0.05) == 2  # ceil(1.5)
    assert warmup_steps(10, 0.0) == 0


def test_decay_mask_by_hand():
    params = {"embed": {"embedding": jnp.zeros((5, 4))},
              "layers": {"0": {"q_proj": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros((4,))},
                               "input_norm": {"scale": jnp.zeros((4,))}}},
              "final_norm": {"scale": jnp.zeros((4,))}}
    mask = decay_mask(params)
    assert mask["embed"]["embedding"] is True
    assert mask["layers"]["0"]["q_proj"]["kernel"] is True
    assert mask["layers"]["0"]["q_proj"]["bias"] is False
    assert mask["layers"]["0"]["input_norm"]["scale"] is False
    assert mask["final_norm"]["scale"] is False


def test_update_matches_torch_adamw_with_clipping_and_masked_decay():
    rng = np.random.default_rng(0)
    w0, b0 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)
    grads = [(rng.normal(size=(3, 4)).astype(np.float32) * 3, rng.normal(size=(4,)).astype(np.float32) * 3)
             for _ in range(6)]
    section = OptimizerSection(lr=1e-2, weight_decay=0.1, warmup_ratio=0.34, min_lr=1e-4)
    # torch reference: decay on the matrix only, clip 1.0, same schedule
    tw, tb = torch.nn.Parameter(torch.tensor(w0)), torch.nn.Parameter(torch.tensor(b0))
    topt = torch.optim.AdamW([{"params": [tw], "weight_decay": 0.1}, {"params": [tb], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.98), eps=1e-8)
    tsched = get_cosine_with_min_lr_schedule_with_warmup(topt, warmup_steps(6, 0.34), 6, min_lr=1e-4)
    tx, _ = make_optimizer(section, 6)
    params = {"lin": {"kernel": jnp.asarray(w0), "bias": jnp.asarray(b0)}}
    state = tx.init(params)
    for gw, gb in grads:
        tw.grad, tb.grad = torch.tensor(gw), torch.tensor(gb)
        torch.nn.utils.clip_grad_norm_([tw, tb], 1.0)
        topt.step()
        tsched.step()
        updates, state = tx.update({"lin": {"kernel": jnp.asarray(gw), "bias": jnp.asarray(gb)}}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_allclose(np.asarray(params["lin"]["kernel"]), tw.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["lin"]["bias"]), tb.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_bad_settings_rejected():
    with pytest.raises(ConfigError, match="optimizer.min_lr"):
        validate(TrainConfig(optimizer=OptimizerSection(lr=1e-6, min_lr=1e-3)))
