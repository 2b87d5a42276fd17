"""Issue 15's accelerator targets, in one run (meant for a GPU; runs anywhere, small):

    python bench/budget_gpu.py            # the sizes the targets name
    python bench/budget_gpu.py --quick    # tiny sizes: checks the script on a CPU

0. ``tg.policies.calibrate()``'s figures for this backend (what the planner plans with).
1. The 6-block transformer (d=512, 8 heads, ff=2048, seq 256, batch 8) under `jax.jit`:
   ``save()``, ``budget(bytes=f * save's activation bytes)`` for f = 0.75, 0.5, 0.25 with
   save/recompute and with offload too, and every `jax.checkpoint_policies` policy on the
   same function (jax's own offload among them). Per row: jit step time (median of
   interleaved rounds, `_timing.interleaved`) as a ratio of ``save()``'s, the compiled
   step's temp device / host bytes (``memory_analysis``), and for tapegrad the activation
   bytes the plan keeps on device, measured eagerly from ``jax.live_arrays()``
   (`tg.memory_report`). Target: the 50% budget at <= 1.10x ``save()``'s step time.
2. Offload that hides its transfers: an MLP whose per-layer compute exceeds its per-layer
   transfer (width 8192, batch 1024, f32 matmuls at HIGHEST precision), with an
   offload-only plan (``budget(allow=("save", "offload"))``) and `offload()`. Hidden
   fraction = 1 - (t_plan - t_save) / t_copy, t_copy the measured time to copy the plan's
   host bytes to pinned host memory and back, one way after the other. Under jit and
   eagerly. Target: >= 90% hidden.
3. The compiled HLO of the offload plans: every ``copy-start``/``copy-done`` pair and how
   many compute instructions (fusions, GEMM custom calls, dots) the schedule puts between
   the two, i.e. whether the copies overlap compute.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

_here = __file__.rsplit("/", 1)[0]
sys.path[:0] = [_here, _here + "/.."]  # bench/_models.py, and tapegrad from a checkout
from _models import split_static, transformer_block, transformer_params  # noqa: E402
from _timing import interleaved  # noqa: E402

import tapegrad as tg  # noqa: E402

P = tg.policies
MiB = 2**20
HIGHEST = jax.lax.Precision.HIGHEST


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def temp_bytes(c) -> tuple[int, int]:
    m = c.memory_analysis()
    return m.temp_size_in_bytes, getattr(m, "host_temp_size_in_bytes", 0)


def medians(fns: dict, rounds: int) -> dict[str, float]:
    times = interleaved(fns, rounds=rounds, warmup=2)
    return {k: statistics.median(v) for k, v in times.items()}


def max_err(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def device_activation_bytes(f, args, policy) -> tuple[int, int]:
    """(device, host) residual bytes beyond the inputs at the end of forward, measured."""
    rep = tg.memory_report(f, argnums=(0, 1), policy=policy)(*args)
    dev = rep.device_bytes - rep.input_bytes
    return dev, rep.host_bytes


# ---------------------------------------------------------------- HLO copy pairs

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_COMPUTE = ("fusion", "custom-call", "dot", "convolution")


def copy_pairs(hlo: str) -> list[tuple[str, int]]:
    """Each ``copy-start`` of the scheduled entry computation with the number of compute
    instructions between it and its ``copy-done``, and the direction ("to host" when the
    done value is in host memory space S(5), else "to device")."""
    entry = hlo[hlo.index("ENTRY") :]
    entry = entry[: entry.index("\n}") if "\n}" in entry else len(entry)]
    lines = entry.splitlines()[1:]
    start_at, done_at, direction, ops = {}, {}, {}, []
    for i, line in enumerate(lines):
        m = _INSTR.match(line)
        if not m:
            ops.append("")
            continue
        name, shape, op, rest = m.groups()
        ops.append(op)
        if op == "copy-start":
            start_at[name] = i
        elif op == "copy-done":
            src = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
            done_at[src] = i
            direction[src] = "to host" if "S(5)" in shape else "to device"
    out = []
    for name, i in start_at.items():
        j = done_at.get(name)
        if j is None:
            continue
        between = sum(1 for op in ops[i + 1 : j] if op in _COMPUTE)
        out.append((direction[name], between))
    return out


def dump(name: str, text: str) -> None:
    """Write ``text`` under $HLO_DIR (if set), for reading the schedule offline."""
    import os

    if os.environ.get("HLO_DIR"):
        fn = re.sub(r"[^\w.\-]+", "_", name).strip("_") + ".hlo.txt"
        with open(os.path.join(os.environ["HLO_DIR"], fn), "w") as fh:
            fh.write(text)


def kernels(hlo: str) -> int:
    """Instructions of the compiled entry computation that launch work on the device."""
    entry = hlo[hlo.index("ENTRY") :]
    ops = [m.group(3) for m in map(_INSTR.match, entry.splitlines()) if m]
    return sum(op in _COMPUTE or op in ("copy", "copy-start") for op in ops)


def describe_pairs(pairs) -> str:
    if not pairs:
        return "no copy-start/copy-done pairs"
    parts = []
    for d in ("to host", "to device"):
        ns = [n for dd, n in pairs if dd == d]
        if ns:
            over = sum(1 for n in ns if n > 0)
            parts.append(
                f"{d}: {len(ns)} pairs, {over} with compute between "
                f"(median {statistics.median(ns):.0f} compute ops)"
            )
    return "; ".join(parts)


# ---------------------------------------------------------------- models


def stack_loss(blocks, x, heads):
    for p in blocks:
        x = transformer_block({**p, "heads": heads}, x)
    return jnp.mean(x**2)


def wide_mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(jnp.matmul(h, w, precision=HIGHEST))
    return jnp.mean(h**2)


def jax_policies():
    cp = jax.checkpoint_policies
    out = {
        "everything_saveable": cp.everything_saveable,
        "nothing_saveable": cp.nothing_saveable,
        "dots_saveable": cp.dots_saveable,
        "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
    }
    if hasattr(cp, "offload_dot_with_no_batch_dims"):
        out["offload_dot_with_no_batch_dims"] = cp.offload_dot_with_no_batch_dims(
            "device", "pinned_host"
        )
    return out


def section_transformer(quick: bool, rounds: int):
    d, heads, ff, seq, batch, nblk = (64, 4, 128, 32, 2, 2) if quick else (512, 8, 2048, 256, 8, 6)
    keys = jax.random.split(jax.random.key(0), nblk + 1)
    blocks = []
    for k in keys[:nblk]:
        arrays, _ = split_static(transformer_params(k, d=d, heads=heads, ff=ff))
        blocks.append(arrays)
    x = jax.random.normal(keys[-1], (batch, seq, d))
    f = lambda blocks, x: stack_loss(blocks, x, heads)  # noqa: E731
    args = (blocks, x)
    print(f"\n# 1. transformer, {nblk} blocks (d={d}, {heads} heads, ff={ff}, seq {seq}, ", end="")
    print(f"batch {batch})")
    save_dev, _ = device_activation_bytes(f, args, P.save())
    print(f"save(): activation bytes on device (measured, eager) {save_dev / MiB:.1f} MiB")
    grads = {
        "save()": (P.save(), tg.grad(f, argnums=(0, 1), policy=P.save())),
        "jax.grad": (None, jax.grad(f, argnums=(0, 1))),
    }
    rows: dict[str, tuple] = {}
    for frac in (0.75, 0.5, 0.25):
        for label, allow in (
            ("save/recompute", ("save", "recompute")),
            ("+offload", ("save", "recompute", "offload")),
        ):
            pol = P.budget(bytes=int(frac * save_dev), allow=allow)
            name = f"budget {frac:.0%} {label}"
            grads[name] = (pol, tg.grad(f, argnums=(0, 1), policy=pol))
    for name, pol in jax_policies().items():
        grads[f"jax {name}"] = (None, jax.grad(jax.checkpoint(f, policy=pol), argnums=(0, 1)))
    ref = jax.jit(grads["save()"][1])(*args)
    fns, hlos = {}, {}
    for name, (pol, g) in grads.items():
        try:
            c = compiled(g, *args)
            hlos[name] = c.as_text()
            err = max_err(ref, c(*args))
            dev = host = None
            if pol is not None:
                dev, host = device_activation_bytes(f, args, pol)
            rows[name] = (temp_bytes(c), err, dev, host)
            print(f"{name}: {kernels(hlos[name])} kernels in the compiled step")
            if hasattr(pol, "last"):
                flops, segs = pol.last.get("recompute_flops", 0), pol.last.get("recompute_segments")
                print(f"{name}: recompute {flops / 1e9:.2f} GFLOP in {segs} segments")
            fns[name] = lambda c=c: c(*args)
        except Exception as e:  # report and go on: one failure must not hide the rest
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    t = medians(fns, rounds)
    base = t["save()"]
    print(f"jit step, save(): {base * 1e3:.3f} ms (ratios below are to it)")
    cols = ("step", "temp dev", "temp host", "act dev", "act host", "max|err|")
    print(f"{'':44s} " + " ".join(f"{c:>9s}" for c in cols))
    for name, ((tdev, thost), err, dev, host) in rows.items():
        a = "" if dev is None else f"{dev / MiB:8.1f}"
        h = "" if host is None else f"{host / MiB:8.1f}"
        print(
            f"{name:44s} {t[name] / base:6.3f}x {tdev / MiB:8.1f}M {thost / MiB:8.1f}M "
            f"{a:>8s} {h:>8s} {err:8.1e}"
        )
    for name in rows:
        if "offload" in name:
            dump(name, hlos[name])
            print(f"  HLO {name}: {describe_pairs(copy_pairs(hlos[name]))}")
    return rows, t


def copy_time(nbytes: int, repeats: int = 5) -> float:
    """Seconds to copy ``nbytes`` to pinned host memory and back, one after the other."""
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds or nbytes == 0:
        return 0.0
    a = jnp.ones((nbytes // 4,), jnp.float32)
    host = a.sharding.with_memory_kind("pinned_host")
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        h = jax.device_put(a, host).block_until_ready()
        jax.device_put(h, a.sharding).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def section_hiding(quick: bool, rounds: int):
    width, batch, depth = (256, 64, 4) if quick else (8192, 1024, 12)
    keys = jax.random.split(jax.random.key(1), depth + 1)
    ws = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys[:depth]]
    x = jax.random.normal(keys[-1], (batch, width))
    args = (ws, x)
    f = wide_mlp
    print(f"\n# 2. offload hiding: MLP {depth}x{width}, batch {batch}, HIGHEST precision")
    save_dev, _ = device_activation_bytes(f, args, P.save())
    plans = {
        "save()": P.save(),
        "budget 25% save/offload": P.budget(bytes=int(0.25 * save_dev), allow=("save", "offload")),
        "offload()": P.offload(),
    }
    ref = jax.jit(tg.grad(f, argnums=(0, 1), policy=P.save()))(*args)
    jit_fns, eager_fns, info = {}, {}, {}
    for name, pol in plans.items():
        try:
            g = tg.grad(f, argnums=(0, 1), policy=pol)
            c = compiled(g, *args)
            err = max_err(ref, c(*args))
            dev, host = device_activation_bytes(f, args, pol)
            hlo = c.as_text()
            info[name] = (dev, host, err, temp_bytes(c), copy_pairs(hlo))
            dump("mlp " + name, hlo)
            jit_fns[name] = lambda c=c: c(*args)
            eager_fns[name] = lambda g=g: g(*args)
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    tj = medians(jit_fns, rounds)
    te = medians(eager_fns, max(3, rounds // 4))
    print(
        f"save(): activations {save_dev / MiB:.0f} MiB; jit step {tj['save()'] * 1e3:.2f} ms, "
        f"eager {te['save()'] * 1e3:.2f} ms"
    )
    for name, (dev, host, err, (tdev, thost), pairs) in info.items():
        tc = copy_time(host)
        line = f"{name:26s} act dev/host {dev / MiB:7.1f}/{host / MiB:7.1f} MiB"
        line += f", copy {tc * 1e3:6.2f} ms"
        for mode, t in (("jit", tj), ("eager", te)):
            extra = t[name] - t["save()"]
            hid = f", hidden {1 - extra / tc:6.1%}" if tc > 0 else ""
            line += f" | {mode} {t[name] * 1e3:7.2f} ms ({t[name] / t['save()']:.3f}x){hid}"
        print(line + f" | max|err| {err:.1e}")
        if host:
            print(f"  temp dev/host {tdev / MiB:.1f}/{thost / MiB:.1f} MiB", end="")
            print(f"; HLO: {describe_pairs(pairs)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("costs", "transformer", "hiding"))
    a = ap.parse_args()
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
        f"memory kinds {[m.kind for m in dev.addressable_memories()]}"
    )
    rounds = 5 if a.quick else 30
    if a.only in (None, "costs"):
        c = P.calibrate()
        print(
            f"\n# 0. calibrate(): flops/s {c.flops_per_s:.3g}, d2h {c.d2h_bytes_per_s:.3g} B/s, "
            f"h2d {c.h2d_bytes_per_s:.3g} B/s, compress {c.compress_bytes_per_s:.3g} B/s, "
            f"low-bit {c.lowbit_bytes_per_s or 0:.3g} B/s, segment {c.segment_s * 1e6:.2f} us"
        )
    if a.only in (None, "transformer"):
        section_transformer(a.quick, rounds)
    if a.only in (None, "hiding"):
        section_hiding(a.quick, max(10, rounds // 2))


if __name__ == "__main__":
    main()
