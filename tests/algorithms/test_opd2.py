"""OPD² (SPEC §9): the check values (0.4277, 0 gated, −0.6709) through the objective, values and
gradients against the PyTorch reference at temperature 0.7 with a top-k smaller than V."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from divergences import log_softmax
from same_helpers import objective_sum, random_logits
import torch_opd

from ctopd_jax.algorithms.opd2 import Opd2, Opd2Settings, opd2_advantages


def test_spec_check_values():
    """π_θ = (.5,.3,.2), π_T = (.6,.3,.1), π_B = (.4,.4,.2), τ = 1, k = V: with the scale s = 1 the
    loss of one sampled token y is −A_y·log π_θ(y), so A_y = loss / (−log π_θ(y))."""
    ps, pt, pb = (np.log([p], dtype=np.float32) for p in ([.5, .3, .2], [.6, .3, .1], [.4, .4, .2]))
    obj = Opd2(Opd2Settings(name="opd2", opd2_temperature=1.0, opd2_reward_scale=1.0, opd2_topk=3,
                            implementation="reference"))
    adv = [objective_sum(obj, ps, pt, [y], "opd2", base_logits=pb)[0] / -float(ps[0, y]) for y in range(3)]
    assert adv == pytest.approx([0.4277, 0.0, -0.6709], abs=1e-4)
    ref = torch_opd.opd2_advantages(*(torch.tensor(np.repeat(p, 3, 0), dtype=torch.float64) for p in (ps, pt, pb)),
                                    [0, 1, 2], k=3)
    assert ref.tolist() == pytest.approx([0.4277, 0.0, -0.6709], abs=1e-4)
    # the scale multiplies A and never flips the gate
    scaled = Opd2(Opd2Settings(name="opd2", opd2_temperature=1.0, opd2_topk=3, implementation="reference"))
    assert objective_sum(scaled, ps, pt, [0], "opd2", base_logits=pb)[0] / -float(ps[0, 0]) == \
        pytest.approx(0.04277, abs=1e-5)


def test_gate_rule():
    args = (np.array([0.0, 0.0, 0.0]), np.array([1.0, 1.0, -1.0]), np.array([0.5, 2.0, 0.0]),
            np.array([0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.0]))
    a, d, o = opd2_advantages(*args)
    assert np.asarray(a).tolist() == [0.5, 0.0, -1.0]  # kept, gated (signs differ), kept
    a, d, o = opd2_advantages(*args, disagree="opd")
    assert np.asarray(a).tolist() == [0.5, 1.0, -1.0]  # where the signs differ: A^OPD


@pytest.mark.parametrize("disagree", ["drop", "opd"])
def test_values_and_gradients_match_torch(disagree):
    rows, vocab, k = 7, 10, 4
    s, t, b = random_logits(40, rows, vocab), random_logits(41, rows, vocab), random_logits(42, rows, vocab)
    y = np.random.default_rng(43).integers(0, vocab, rows)
    obj = Opd2(Opd2Settings(name="opd2", opd2_topk=k, chunked_loss_size=3, opd2_disagree=disagree))
    value, grad = objective_sum(obj, s, t, y, "opd2", base_logits=b)
    zs = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    ref = torch_opd.opd2_loss(zs, torch.tensor(t, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                              y, k, scale=0.1, temperature=0.7, disagree=disagree)
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)
    np.testing.assert_allclose(grad, zs.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_metrics_count_kept_and_unopposed_tokens():
    """opd2_kept_fraction: tokens whose A^Δ and A^OPD agree in sign; opd2_unopposed_fraction:
    A^Δ > 0 while A^OPD < 0 (the student already above the teacher, the gate drops the pull
    back). Numpy reference with k = V at temperature 1; the SPEC-style example row
    π_θ = (.2,.7,.1), π_T = (.6,.3,.1), π_B = (.8,.1,.1) is unopposed at token 1."""
    from same_helpers import step_inputs

    rows, vocab = 9, 6
    s, t, b = random_logits(50, rows, vocab), random_logits(51, rows, vocab), random_logits(52, rows, vocab)
    s[0], t[0], b[0] = np.log([.2, .7, .1, 1e-9, 1e-9, 1e-9]), np.log([.6, .3, .1, 1e-9, 1e-9, 1e-9]), \
        np.log([.8, .1, .1, 1e-9, 1e-9, 1e-9])
    y = np.random.default_rng(53).integers(0, vocab, rows)
    y[0] = 1
    obj = Opd2(Opd2Settings(name="opd2", opd2_topk=vocab, opd2_temperature=1.0))
    _, metrics = obj.kd_sums(step_inputs(s, t, y, base_logits=b))

    def centred(reward, ls):
        return reward[np.arange(rows), y] - (np.exp(ls) * reward).sum(-1)
    ls, lt, lb = (log_softmax(x) for x in (s, t, b))
    a_opd, a_delta = centred(lt - ls, ls), centred(lt - lb, ls)
    assert a_delta[0] > 0 > a_opd[0]
    for name, expected in (("opd2_kept_fraction", np.mean(a_delta * a_opd > 0)),
                           ("opd2_unopposed_fraction", np.mean((a_delta > 0) & (a_opd < 0)))):
        num, den = metrics[name]
        assert float(num) / float(den) == pytest.approx(expected)


def test_at_its_base_opd2_is_vopd_times_the_scale():
    """With the student as its own base (θ = θ_B), temperature 1 and k = V, A^Δ = A^OPD = vOPD's
    advantage g + KL_t, every token passes the gate, and OPD²'s gradient is vOPD's times the
    reward scale (benchmarks/opd_gradient_noise.py measures the same on the demo's rollouts)."""
    from ctopd_jax.algorithms.vopd import Vopd, VopdSettings

    rows, vocab = 8, 12
    s, t = random_logits(60, rows, vocab), random_logits(61, rows, vocab)
    y = np.random.default_rng(62).integers(0, vocab, rows)
    old = log_softmax(s)[np.arange(rows), y]
    opd2 = Opd2(Opd2Settings(name="opd2", opd2_temperature=1.0, opd2_topk=vocab, opd2_reward_scale=0.1))
    _, g_opd2 = objective_sum(opd2, s, t, y, "opd2", base_logits=s)
    _, g_vopd = objective_sum(Vopd(VopdSettings(name="vopd")), s, t, y, "vopd", old=old)
    assert np.abs(g_vopd).max() > 1e-3
    np.testing.assert_allclose(g_opd2, 0.1 * g_vopd, rtol=1e-4, atol=1e-6)
