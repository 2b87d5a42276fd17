"""dm-haiku: an MLP of `hk.remat` blocks under `hk.layer_stack`, and a residual conv block
with `hk.BatchNorm` under `hk.transform_with_state`, differentiated through tapegrad."""

from __future__ import annotations

import functools

import pytest

hk = pytest.importorskip("haiku")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

LAYERS, WIDTH, BATCH = 4, 8, 3


def layer_stack_remat() -> Case:
    def forward(x):
        def block(h):
            return jnp.tanh(hk.Linear(WIDTH)(hk.LayerNorm(-1, True, True)(h))) + h

        h = hk.layer_stack(LAYERS)(hk.remat(block))(x)
        return hk.Linear(1)(h)

    model = hk.without_apply_rng(hk.transform(forward))
    x = jax.random.normal(jax.random.key(0), (BATCH, WIDTH))
    params = model.init(jax.random.key(1), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    return Case(loss, (params, x), argnums=(0, 1))


def batchnorm_resblock() -> Case:
    def forward(x, is_training):
        bn = lambda: hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)
        h = jax.nn.relu(bn()(hk.Conv2D(4, 3)(x), is_training))
        h = bn()(hk.Conv2D(2, 3)(h), is_training) + x
        return hk.Linear(2)(jax.nn.relu(h).reshape(h.shape[0], -1))

    model = hk.without_apply_rng(hk.transform_with_state(forward))
    x = jax.random.normal(jax.random.key(2), (BATCH, 6, 6, 2))
    params, state = model.init(jax.random.key(3), x, True)
    # One training step's state: the moving averages are no longer their zero init.
    _, state = model.apply(params, state, x, True)

    def loss(params, state, x):
        # Training mode normalises by the batch's statistics; the updated state is the
        # step's other output, which a loss drops (its gradient w.r.t. state is zero).
        out, _ = model.apply(params, state, x, True)
        return jnp.mean(out**2)

    # Recompute alone cannot bring this peak below ~95% of it (~64% with offload): the
    # budget is 70%, and may offload.
    allow = ("save", "recompute", "offload")
    return Case(loss, (params, state, x), argnums=(0, 2), budget_fraction=0.7, allow=allow)


CASES = {
    "layer_stack-remat-mlp": layer_stack_remat,
    "transform_with_state-batchnorm-resblock": batchnorm_resblock,
}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}


SLOW: set = set()


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW, at_save="slow"))
def test_haiku(name, mode):
    check(case(name), mode)
