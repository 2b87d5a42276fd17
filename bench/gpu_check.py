"""What only an accelerator shows: run on a GPU machine, prints one block per check.

1. offload(inputs=True), then offload() (activations only), under jax.jit: device vs host
   bytes of the compiled step (memory_analysis) and step time vs save(), on the 32-layer MLP
   and a 6-block transformer stack.
2. Recompute survives XLA's CSE: sine ops in the *compiled* (optimized) HLO with and without
   per-layer tg.checkpoint (on CPU XLA drops the barrier; the GPU pipeline is what matters).
3. jit step time of tg.grad vs jax.grad.

    python bench/gpu_check.py
"""

from __future__ import annotations

import re
import sys
import time

import jax
import jax.numpy as jnp

_here = __file__.rsplit("/", 1)[0]
sys.path[:0] = [_here, _here + "/.."]  # bench/_models.py, and tapegrad from a checkout
from _models import (  # noqa: E402
    mlp_loss,
    mlp_params,
    split_static,
    transformer_block,
    transformer_params,  # noqa: E402
)

import tapegrad as tg  # noqa: E402


def timeit(f, *args, reps=50):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        best.append((time.perf_counter() - t) / reps)
    return min(best)


def mem(f, *args):
    m = jax.jit(f).lower(*args).compile().memory_analysis()
    return (m.temp_size_in_bytes, getattr(m, "host_temp_size_in_bytes", 0))


def stack_loss(blocks, heads, x):
    for p in blocks:
        x = transformer_block({**p, "heads": heads}, x)
    return jnp.mean(x**2)


def main():
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})")
    print("memory kinds:", [m.kind for m in dev.addressable_memories()])

    key = jax.random.PRNGKey(0)
    ws = mlp_params(key, 32, int(__import__("os").environ.get("W", 1024)))
    x = jax.random.normal(key, (512, 1024))
    arrays, heads = split_static(transformer_params(key, d=512, heads=8, ff=2048))
    blocks = [arrays] * 6
    xt = jax.random.normal(key, (8, 256, 512))
    stack = lambda b, x: stack_loss(b, heads, x)
    cases = [("mlp32x1024", mlp_loss, (ws, x)), ("transformer6", stack, (blocks, xt))]

    print("\n# 1. offload under jit: compiled temp bytes (device, host) and step time vs save()")
    # jax's own offloading (a remat policy over named activations) as the reference.
    from jax.ad_checkpoint import checkpoint_name

    jax_off = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["act"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def mlp_named(ws, x):
        h = x
        for w in ws:
            h = checkpoint_name(jnp.tanh(h @ w), "act")
        return jnp.mean(h**2)

    g_ref = jax.jit(jax.grad(jax.checkpoint(mlp_named, policy=jax_off)))
    mr = mem(jax.grad(jax.checkpoint(mlp_named, policy=jax_off)), ws, x)
    print(
        f"{'mlp32x1024':14s} jax's own offload (remat policy on tanh outputs): temp device/host "
        f"MiB {mr[0] / 2**20:.1f}/{mr[1] / 2**20:.1f}, jit step ms {timeit(g_ref, ws, x) * 1e3:.3f}"
    )
    for name, f, args in cases:
        g_save = jax.jit(tg.grad(f, policy=tg.policies.save()))
        g_off = jax.jit(tg.grad(f, policy=tg.policies.offload(inputs=True)))
        g_jax = jax.jit(jax.grad(f))
        ref = g_save(*args)
        got = g_off(*args)
        err = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got))
        )
        ms, mo, mj = (
            mem(tg.grad(f, policy=tg.policies.save()), *args),
            mem(tg.grad(f, policy=tg.policies.offload(inputs=True)), *args),
            mem(jax.grad(f), *args),
        )
        ts, to, tj = timeit(g_save, *args), timeit(g_off, *args), timeit(g_jax, *args)
        print(
            f"{name:14s} temp device/host MiB: jax {mj[0] / 2**20:8.1f}/{mj[1] / 2**20:6.1f}  "
            f"save {ms[0] / 2**20:8.1f}/{ms[1] / 2**20:6.1f}  offload {mo[0] / 2**20:8.1f}/"
            f"{mo[1] / 2**20:6.1f}"
        )
        print(
            f"{name:14s} jit step ms: jax {tj * 1e3:.3f}  "
            f"save {ts * 1e3:.3f} ({ts / tj:.2f}x jax)  "
            f"offload {to * 1e3:.3f} ({to / ts:.2f}x save)  max|offload-save| {err:.1e}"
        )
        # Only activations move: the function's inputs are held by the caller anyway.
        act_only = tg.policies.offload()  # the default: activations only
        ma = mem(tg.grad(f, policy=act_only), *args)
        ta = timeit(jax.jit(tg.grad(f, policy=act_only)), *args)
        print(
            f"{name:14s} offload(): temp device/host MiB {ma[0] / 2**20:.1f}/"
            f"{ma[1] / 2**20:.1f}, jit step ms {ta * 1e3:.3f} ({ta / ts:.2f}x save)"
        )

    print("\n# 2. recompute in compiled HLO (sine count; 8 layers)")
    w8 = [jax.random.normal(k, (256, 256)) / 16 for k in jax.random.split(key, 8)]
    x8 = jax.random.normal(key, (64, 256))

    def layer(h, w):
        return jnp.sin(h @ w)

    def plain(ws, x):
        for w in ws:
            x = layer(x, w)
        return jnp.sum(x)

    def per_layer(ws, x):
        for w in ws:
            x = tg.checkpoint(layer)(x, w)
        return jnp.sum(x)

    for name, f, gfn in [
        ("jax.grad plain", plain, jax.grad),
        ("tg.grad plain", plain, tg.grad),
        ("jax.grad checkpoint", per_layer, jax.grad),
        ("tg.grad checkpoint", per_layer, tg.grad),
    ]:
        hlo = jax.jit(gfn(f)).lower(w8, x8).compile().as_text()
        n = {op: len(re.findall(rf"=\s*\S+\s+{op}\(", hlo)) for op in ("sine", "cosine")}
        print(f"{name:22s} instructions in optimized HLO: sine {n['sine']}, cosine {n['cosine']}")

    print("\n# 3. eager step time vs jax.grad eager (GPU dispatch)")
    for name, f, args in cases:
        te = timeit(tg.grad(f), *args, reps=3)
        tje = timeit(jax.grad(f), *args, reps=3)
        print(
            f"{name:14s} eager ms: tapegrad {te * 1e3:.1f}  jax {tje * 1e3:.1f}  "
            f"ratio {te / tje:.2f}"
        )


if __name__ == "__main__":
    main()
