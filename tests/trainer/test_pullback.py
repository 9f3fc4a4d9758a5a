"""step/pullback.py: a vjp made in one compiled program and applied in another equals the
gradient of the whole function, and the forward's own arguments are not copied out of it."""
import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.step import pullback


def layers(w, x):
    """Three tanh layers under a scan with each layer recomputed, as the student's layers run."""
    body = jax.checkpoint(lambda h, wl: (jnp.tanh(h @ wl), None))
    return jax.lax.scan(body, x, w)[0]


@jax.jit
def forward(w, x):
    return pullback.vjp(lambda w: layers(w, x), w, (w, x))


@jax.jit
def backward(w, x, back, cotangent):
    return back((w, x), cotangent)[0]


def test_the_carried_vjp_is_the_gradient_and_keeps_no_argument():
    w = jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (5, 8))
    cotangent = jax.random.normal(jax.random.key(2), (5, 8))
    out, back = forward(w, x)
    np.testing.assert_array_equal(out, layers(w, x))
    grad = backward(w, x, back, cotangent)
    expected = jax.grad(lambda w: jnp.vdot(layers(w, x), cotangent))(w)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7)
    # the weights (an argument) come back from the caller, not as a copied residual; the scan's
    # saved carries (one per layer) are what is carried
    assert [r.shape for r in back.residuals if r.shape == w.shape] == []
    assert ("argument", 0) in back.layout[1]
    assert any(r.shape == (3, 5, 8) for r in back.residuals)


def test_one_backward_program_per_forward_program():
    w = jnp.ones((2, 6, 6)) / 6   # shapes of this test only
    before = backward._cache_size()
    for scale in (1.0, 2.0):
        out, back = forward(w * scale, jnp.ones((4, 6)))
        backward(w * scale, jnp.ones((4, 6)), back, jnp.ones_like(out))
    assert backward._cache_size() == before + 1
    out, back = forward(w, jnp.ones((7, 6)))   # a new shape: a new forward, and its own backward
    backward(w, jnp.ones((7, 6)), back, jnp.ones_like(out))
    assert backward._cache_size() == before + 2
    out, back = forward(w, jnp.ones((4, 6)))   # back to the first shape: its programs again
    backward(w, jnp.ones((4, 6)), back, jnp.ones_like(out))
    assert backward._cache_size() == before + 2
