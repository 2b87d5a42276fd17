"""``python -m tapegrad``: print a tape and compare tapegrad with jax on an MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import tapegrad as tg


def mlp(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def _jax_residual_bytes(f, *args) -> int:
    _, vjp_fn = jax.vjp(f, *args)
    arg_ids = {id(a) for a in jax.tree.leaves(args)}
    leaves = {id(x): x for x in jax.tree.leaves(vjp_fn) if hasattr(x, "nbytes")}
    return sum(x.nbytes for i, x in leaves.items() if i not in arg_ids)


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 9)
    params = [jax.random.normal(k, (256, 256)) / 16 for k in keys[:8]]
    x = jax.random.normal(keys[8], (64, 256))

    small = tg.trace(mlp)(params[:2], x[:4, :8] @ jnp.ones((8, 256)))
    print("The tape of a 2-layer MLP (one line per record; what each record saves):\n")
    print(small)

    g_tg = tg.grad(mlp)(params, x)
    g_jax = jax.grad(mlp)(params, x)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_tg, g_jax))
    print(f"\n8-layer MLP (256 wide, batch 64): max |tg.grad - jax.grad| = {err:.2e}")

    tape = tg.trace(mlp, argnums=0)(params, x)
    arg_ids = {v.id for v in tape.inputs}
    tg_bytes = sum(n for k, n in tape.residual_vars().items() if k not in arg_ids)
    jax_bytes = _jax_residual_bytes(mlp, params, x)
    print(
        f"residual bytes kept for backward (excluding the inputs): tapegrad {tg_bytes:,} "
        f"vs jax.vjp {jax_bytes:,}  ({tg_bytes / jax_bytes:.2f}x)"
    )
    np.testing.assert_allclose(np.asarray(g_tg[0]), np.asarray(g_jax[0]), rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    main()
