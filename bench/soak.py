"""Soak: many eager ``tg.grad`` calls whose closed-over constants change every call (issue 14).

    python bench/soak.py                 # 10,000 calls
    python bench/soak.py --calls 3000    # fewer
    python bench/soak.py --scan          # add a scanned RNN (tapegrad only: jax's eager
                                         # scan compiles its body again on every call)

Each call builds a new closure ``lambda p, x: loss(p, x * c) * t`` with ``c`` a decaying
learning-rate-like scale and ``t`` a temperature, over a cycle of models (tanh MLP, ReLU
MLP, pre-LN transformer block), two shapes each and three residual policies
(``save()``, ``offload()``, ``compress(jnp.bfloat16)``). The same sequence runs through
``jax.grad`` eagerly, call by call interleaved with tapegrad's (the same machine load).

Printed: resident memory (RSS, from /proc/self/statm) every 1,000 calls; live jax arrays
after every call against the count after warm-up (max over the baseline); tapegrad's
cache sizes; time per call, tapegrad / jax.grad (total and per model and policy).
Targets: RSS flat after warm-up (< 50 MB growth per 10,000 calls), live arrays back to
the baseline after every backward, time <= 1.0x jax.grad eager.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
from _models import (
    mlp_loss,
    mlp_params,
    relu_mlp_loss,
    rnn_loss,
    rnn_params,
    split_static,
    transformer_loss,
    transformer_params,
)

import tapegrad as tg
from tapegrad.core import caches as _caches

POLICIES = {
    "save": tg.policies.save,
    "offload": tg.policies.offload,
    "bf16": lambda: tg.policies.compress(jnp.bfloat16),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def models(scan: bool) -> list[tuple[str, object, object, object]]:
    """(name, loss, params, input) for each model and shape."""
    key = jax.random.PRNGKey(0)
    out = []
    for width in (64, 128):
        x = jax.random.normal(key, (32, width))
        out.append((f"tanh_mlp{width}", mlp_loss, mlp_params(key, 4, width), x))
        out.append((f"relu_mlp{width}", relu_mlp_loss, mlp_params(key, 4, width), x))
    for d in (32, 64):
        p, heads = split_static(transformer_params(key, d=d, heads=4, ff=2 * d))

        def tf_loss(p, x, heads=heads):
            return transformer_loss({**p, "heads": heads}, x)

        out.append((f"transformer{d}", tf_loss, p, jax.random.normal(key, (2, 16, d))))
    if scan:
        p = rnn_params(key, width=32, d_in=32)
        out.append(("rnn32", rnn_loss, p, jax.random.normal(key, (16, 8, 32))))
    return out


def schedule(i: int) -> tuple[float, float]:
    """A decaying scale and a cycling temperature: new Python floats on every call."""
    return 1.0 / (1.0 + 1e-3 * i), 0.5 + 0.25 * ((i * 7) % 11) / 11


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--scan", action="store_true", help="add a scanned RNN (tapegrad only)")
    args = ap.parse_args()

    cases = models(args.scan)
    combos = [(m, pol) for m in range(len(cases)) for pol in POLICIES]
    print(
        f"jax {jax.__version__}, {platform.machine()} {os.cpu_count()} cores, "
        f"python {sys.version.split()[0]}; {args.calls} calls over {len(cases)} models "
        f"x {len(POLICIES)} policies"
    )

    def tg_call(i: int):
        m, pol = combos[i % len(combos)]
        name, loss, p, x = cases[m]
        c, t = schedule(i)
        return tg.grad(lambda p, x: loss(p, x * c) * t, policy=POLICIES[pol]())(p, x)

    def jax_call(i: int):
        m, _ = combos[i % len(combos)]
        name, loss, p, x = cases[m]
        if name.startswith("rnn"):
            return None
        c, t = schedule(i)
        return jax.grad(lambda p, x: loss(p, x * c) * t)(p, x)

    warm = 4 * len(combos)  # every structure seen 4 times (tapegrad compiles at the 3rd)
    for i in range(warm):
        jax.block_until_ready(tg_call(i))
        jax.block_until_ready(jax_call(i))
    gc.collect()
    base_live = len(jax.live_arrays())
    base_rss = rss_mb()
    base_caches = _caches.cache_info()
    print(f"after warm-up ({warm} calls): RSS {base_rss:.1f} MB, {base_live} live arrays")
    print(f"caches: {base_caches}")

    t_tg: dict[tuple[str, str], float] = defaultdict(float)
    t_jax: dict[tuple[str, str], float] = defaultdict(float)
    n_calls: dict[tuple[str, str], int] = defaultdict(int)
    ratios: list[float] = []
    live_over: list[int] = []
    rss = [base_rss]
    for k in range(args.calls):
        i = warm + k
        m, pol = combos[i % len(combos)]
        name = cases[m][0]
        t0 = time.perf_counter()
        g = tg_call(i)
        jax.block_until_ready(g)
        t1 = time.perf_counter()
        del g
        live_over.append(len(jax.live_arrays()) - base_live)
        t2 = time.perf_counter()
        g = jax_call(i)
        jax.block_until_ready(g)
        t3 = time.perf_counter()
        del g
        t_tg[name, pol] += t1 - t0
        n_calls[name, pol] += 1
        if not name.startswith("rnn"):
            t_jax[name, pol] += t3 - t2
            ratios.append((t1 - t0) / (t3 - t2))
        if (k + 1) % 1000 == 0 or k + 1 == args.calls:
            gc.collect()
            rss.append(rss_mb())
            print(
                f"call {k + 1:6d}: RSS {rss[-1]:8.1f} MB ({rss[-1] - base_rss:+.1f}), "
                f"live arrays over baseline (max so far) {max(live_over)}, "
                f"cache entries {sum(_caches.cache_info().values())}",
                flush=True,
            )

    gc.collect()
    print()
    print(f"RSS growth after warm-up: {rss[-1] - base_rss:+.1f} MB over {args.calls} calls")
    print(
        f"live arrays after each call, over the baseline: max {max(live_over)}, "
        f"final {len(jax.live_arrays()) - base_live}"
    )
    print(f"caches after warm-up {base_caches}")
    print(f"caches at the end    {_caches.cache_info()}")
    print(f"cache bytes {_caches.cache_bytes()}")
    timed = [k for k in t_jax]
    tg_total = sum(t_tg[k] for k in timed)
    jax_total = sum(t_jax[k] for k in timed)
    n_timed = sum(n_calls[k] for k in timed)
    print(
        f"time per call: tapegrad {tg_total / n_timed * 1e3:.2f} ms, jax.grad eager "
        f"{jax_total / n_timed * 1e3:.2f} ms; ratio of totals {tg_total / jax_total:.2f}x, "
        f"median per-call ratio {statistics.median(ratios):.2f}x"
    )
    print(f"{'model':<14} {'policy':<8} {'tg/jax':>7}")
    for name, pol in sorted(t_tg):
        if (name, pol) in t_jax:
            print(f"{name:<14} {pol:<8} {t_tg[name, pol] / t_jax[name, pol]:7.2f}")
        else:
            ms = t_tg[name, pol] / n_calls[name, pol] * 1e3
            print(f"{name:<14} {pol:<8} {'-':>7}  (tapegrad only: {ms:.2f} ms per call)")


if __name__ == "__main__":
    main()
