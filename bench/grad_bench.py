"""tapegrad vs jax: eager time, jit time, residual bytes — in one run.

    python bench/grad_bench.py            # all three models
    python bench/grad_bench.py --quick    # fewer repetitions
    python bench/grad_bench.py --only mlp8 mlp32

With PyTorch installed (the ``bench`` extra), the MLPs also get a PyTorch eager column:
the same weights, forward and backward with ``torch.autograd.grad``.

Times are medians; each ratio is the median of per-round ratios, tapegrad and jax
timed alternately (robust to the load of a shared machine).

Residual bytes are measured from live arrays (``jax.live_arrays()``): the bytes
that appear when ``vjp`` returns and stay alive while ``vjp_fn`` is held,
minus the output. Inputs already alive are not counted, for either library.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics

import _results
import jax
import jax.numpy as jnp
from _models import mlp_loss, mlp_params, split_static, transformer_loss, transformer_params
from _timing import interleaved

import tapegrad as tg


def paired(fa, fb, reps: int) -> tuple[float, float, float]:
    """Medians (ms) of ``fa`` and ``fb`` and the median of their per-round ratio.

    The two run alternately, so both see the same load on a shared machine; the
    per-round ratio cancels slow drift. 5 warm-up calls each first (tapegrad compiles
    a repeated eager structure at its third call)."""
    t = interleaved({"a": fa, "b": fb}, reps, warmup=5)
    ta, tb = t["a"], t["b"]
    ratio = statistics.median(a / b for a, b in zip(ta, tb))
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3, ratio


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def held_bytes(vjp, f, *args) -> int:
    gc.collect()
    before = live_bytes()
    out, vjp_fn = vjp(f, *args)
    jax.block_until_ready(out)
    gc.collect()
    held = live_bytes() - before - out.nbytes
    del out, vjp_fn
    return held


def torch_grad(params, x):
    """The same tanh MLP in PyTorch eager (float32, CPU): a call that returns the weights'
    gradients, or None where torch is not installed (`pip install -e .[bench]`)."""
    try:
        import numpy as np
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)  # one thread: a shared 2-core machine makes more of them spin
    ws = [torch.tensor(np.asarray(w), requires_grad=True) for w in params]
    xt = torch.tensor(np.asarray(x))

    def call():
        h = xt
        for w in ws:
            h = torch.tanh(h @ w)
        return torch.autograd.grad((h**2).mean(), ws)

    got = call()
    want = jax.grad(mlp_loss)(params, x)
    err = max(float(abs(g.numpy() - np.asarray(v)).max()) for g, v in zip(got, want))
    assert err < 1e-4, f"torch and jax disagree by {err}"
    return call


def models():
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    yield (
        "mlp8 (256 wide, batch 64)",
        mlp_loss,
        mlp_params(k1, 8, 256),
        jax.random.normal(k2, (64, 256)),
    )
    yield (
        "mlp32 (64 wide, batch 64)",
        mlp_loss,
        mlp_params(k3, 32, 64),
        jax.random.normal(k4, (64, 64)),
    )
    arrays, heads = split_static(transformer_params(k1))
    loss = lambda p, x: transformer_loss({**p, "heads": heads}, x)  # noqa: E731
    yield (
        "transformer block (d=128, 4 heads, seq 64, batch 8)",
        loss,
        arrays,
        jax.random.normal(k2, (8, 64, 128)),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="model name prefixes, e.g. mlp8 mlp32")
    _results.add_arguments(ap)
    a = ap.parse_args()
    _results.start(a)
    reps_eager, reps_jit = (5, 20) if a.quick else (30, 200)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"load average {load:.1f}"
    )
    print(
        f"{'model':54} {'eager tg/jax':>22} {'jit tg/jax':>22} {'residual bytes tg/jax':>32}"
        f"  {'eager torch, tg/torch':>20}"
    )
    for name, f, params, x in models():
        if a.only and not any(name.startswith(o) for o in a.only):
            continue
        for g_tg, g_jax in [(tg.grad(f)(params, x), jax.grad(f)(params, x)) for _ in range(4)]:
            err = max(
                float(jnp.max(jnp.abs(u - v)))
                for u, v in zip(jax.tree.leaves(g_tg), jax.tree.leaves(g_jax))
            )
            assert err < 1e-4, f"{name}: eager tapegrad and jax disagree by {err}"
        e_tg, e_jax, e_ratio = paired(
            lambda: tg.grad(f)(params, x), lambda: jax.grad(f)(params, x), reps_eager
        )
        jt, jj = jax.jit(tg.grad(f)), jax.jit(jax.grad(f))
        g_tg, g_jax = jt(params, x), jj(params, x)
        err = max(
            float(jnp.max(jnp.abs(u - v)))
            for u, v in zip(jax.tree.leaves(g_tg), jax.tree.leaves(g_jax))
        )
        assert err < 1e-4, f"{name}: tapegrad and jax disagree by {err}"
        j_tg, j_jax, j_ratio = paired(lambda: jt(params, x), lambda: jj(params, x), reps_jit)
        b_tg = held_bytes(tg.vjp, f, params, x)
        b_jax = held_bytes(jax.vjp, f, params, x)
        torch_call = torch_grad(params, x) if f is mlp_loss else None
        if torch_call is not None:
            _, t_torch, t_ratio = paired(lambda: tg.grad(f)(params, x), torch_call, reps_eager)
            vs_torch = f"{t_torch:7.2f} ms {t_ratio:4.2f}x"
        else:
            vs_torch = "–"
        print(
            f"{name:54} {e_tg:7.2f}/{e_jax:7.2f} ms {e_ratio:4.2f}x "
            f"{j_tg:7.3f}/{j_jax:7.3f} ms {j_ratio:4.2f}x "
            f"{b_tg:>11,}/{b_jax:>11,} B {b_tg / b_jax:4.2f}x  {vs_torch}"
        )
    _results.finish(a, "grad_bench")


if __name__ == "__main__":
    main()
