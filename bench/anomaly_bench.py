"""Overhead of anomaly detection on the 8-layer MLP, eager and under jax.jit.

    python bench/anomaly_bench.py            # full run
    python bench/anomaly_bench.py --quick    # fewer repetitions

Compares ``tg.grad(mlp_loss)`` with ``tg.grad(mlp_loss, anomaly=True)`` (NaN
checks), with ``check_inf=True`` as well, and with the
``tg.passes.check_finite`` pass (one host check per record). Target
(issue 5): at most 1.5x under jit.

The variants run round-robin (one call of each per round) and each ratio is
the median over rounds of (variant time / baseline time in the same round), so
load from other processes on a shared machine hits both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import warnings

import _results
import jax
from _models import mlp_loss, mlp_params
from _timing import interleaved

import tapegrad as tg


def rounds(fns: dict, n: int) -> dict[str, list[float]]:
    """Seconds per call of each function, ``n`` rounds of one call each (after warm-up)."""
    return interleaved(fns, n, warmup=3)


def report(title: str, times: dict[str, list[float]], base: str) -> None:
    print(f"\n{title}")
    print(f"  {'variant':28} {'median ms':>10} {'min ms':>8} {'ratio (median of per-round)':>28}")
    for k, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, times[base]))
        print(f"  {k:28} {statistics.median(ts) * 1e3:10.3f} {min(ts) * 1e3:8.3f} {ratio:28.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    _results.add_arguments(ap)
    a = ap.parse_args()
    _results.start(a)
    n_eager, n_jit = (15, 60) if a.quick else (60, 400)
    warnings.simplefilter("ignore", UserWarning)  # the "anomaly mode is on" warning
    k1, k2 = jax.random.split(jax.random.key(0))
    params, x = mlp_params(k1, 8, 256), jax.random.normal(k2, (64, 256))
    variants = {
        "off (tg.grad)": {},
        "anomaly=True (NaN)": dict(anomaly=True),
        "anomaly, check_inf=True": dict(anomaly=tg.AnomalyMode(check_inf=True)),
        "passes=[check_finite]": dict(passes=[tg.passes.check_finite]),
    }
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{platform.processor() or platform.machine()}; 8-layer tanh MLP (256 wide, batch 64)"
    )
    grads = {k: tg.grad(mlp_loss, **kw) for k, kw in variants.items()}
    eager = {k: (lambda g=g: g(params, x)) for k, g in grads.items()}
    jitted = {k: (lambda g=jax.jit(g): g(params, x)) for k, g in grads.items()}  # noqa: B008
    report("eager", rounds(eager, n_eager), "off (tg.grad)")
    report("jax.jit", rounds(jitted, n_jit), "off (tg.grad)")
    _results.finish(a, "anomaly_bench")


if __name__ == "__main__":
    main()
