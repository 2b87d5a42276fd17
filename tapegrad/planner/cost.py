"""The planner's cost model: what keeping, recomputing, offloading or compressing one
residual costs in device bytes and in step time.

* bytes: what the residual occupies on *one device* (`device_nbytes`: a sharded
  value's shard, since that is what must fit);
* recompute: `record_flops` at ``flops_per_s``;
* offload: device -> host in forward and host -> device in backward, at the measured
  bandwidths (no overlap assumed: an upper bound on the step time it adds);
* compress: one pack and one unpack, at ``compress_bytes_per_s`` of the original
  bytes (bf16, int8) or ``lowbit_bytes_per_s`` (4-bit, 2-bit: stochastic rounding and
  bit packing); the stored bytes are the packed format's (`compressed_nbytes`), and the
  mechanism carries an *error class* (`ERROR_CLASSES`, lossless first) that
  ``budget(max_error=...)`` bounds.

Figures are per backend: `DEFAULTS` until `calibrate` has measured them (a few timed
probes, cached per backend; in a multi-process run measured on process 0 and shared, so
every process plans alike); a `CostModel` can also be written by hand and passed to
``budget(costs=...)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.processes import text_from_process_zero
from tapegrad.core.residual_policy import register_auto_prefetch
from tapegrad.core.sizes import device_nbytes as _nbytes
from tapegrad.core.sizes import sharding_of
from tapegrad.core.tape import Record, Tape, Var, itemsize
from tapegrad.policies._groups import layout_for, type_shards
from tapegrad.policies._lowbit import (
    key_words,
    lowbit_layout,
    pack_lowbit,
    packed_nbytes,
    unpack_lowbit,
)
from tapegrad.policies.compress import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP

__all__ = [
    "CostModel",
    "DEFAULTS",
    "ERROR_CLASSES",
    "MECHANISMS",
    "calibrate",
    "compressed_nbytes",
    "default_costs",
    "device_nbytes",
    "prefetch_depth",
    "record_flops",
    "segment_flops",
]

# Lossless first; ``max_error=c`` allows every class up to c.
ERROR_CLASSES = ("lossless", "bf16", "int8", "4-bit", "2-bit")
# Per-residual mechanisms beside recompute (a record decision), with their error class.
MECHANISMS = {
    "save": "lossless",
    "offload": "lossless",
    "bf16": "bf16",
    "int8": "int8",
    "4-bit": "4-bit",
    "2-bit": "2-bit",
}
# Low-bit mechanisms: `compress(bits=n)`, per-group min/scale with stochastic rounding.
LOWBIT = {"4-bit": 4, "2-bit": 2}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Throughputs the planner turns bytes and flops into seconds with.

    ``flops_per_s``: recomputation (`record_flops` per second);
    ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``: offload's two copies;
    ``compress_bytes_per_s``: a compress round trip (pack + unpack) per original byte;
    ``lowbit_bytes_per_s``: the same for 4-bit and 2-bit (None: ``compress_bytes_per_s``
    / 5, the ratio `calibrate` measured on a CPU: pack ~3.5 GB/s, unpack ~9 GB/s, a
    bfloat16 round trip ~14 GB/s);
    ``segment_s``: what each recomputed segment adds beyond its flops. Under jit a
    recomputation starts behind a barrier (so XLA cannot merge it back into forward),
    which makes it at least one kernel of its own: on an H100, a plan recomputing 0.27
    GFLOP in 36 segments cost 5% of a 3.9 ms step (+36 kernels), ~5.4 us a segment.
    The planner counts it as ``segment_s * flops_per_s`` flops per segment. The GPU
    default, 5 us, was the best of 0 / 1.9 / 5 / 20 us for the 6-block transformer's
    plans at 90%, 75% and 50% budgets on an H100 (`bench/RESULTS.md`); CPU: 0.
    """

    flops_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    compress_bytes_per_s: float
    backend: str = "cpu"
    measured: bool = False
    lowbit_bytes_per_s: float | None = None
    segment_s: float = 0.0

    def segment_flops(self) -> float:
        """A recomputed segment's fixed cost (`segment_s`) in flops."""
        return self.segment_s * self.flops_per_s

    def recompute_s(self, flops: float) -> float:
        return flops / self.flops_per_s

    def offload_s(self, nbytes: int) -> float:
        return nbytes / self.d2h_bytes_per_s + nbytes / self.h2d_bytes_per_s

    def compress_s(self, nbytes: int) -> float:
        return nbytes / self.compress_bytes_per_s

    def lowbit_s(self, nbytes: int) -> float:
        rate = self.lowbit_bytes_per_s or self.compress_bytes_per_s / 5
        return nbytes / rate

    def mechanism_s(self, mech: str, nbytes: int) -> float:
        """Seconds ``mech`` adds to a step for a residual of ``nbytes`` (on one device)."""
        if mech == "save":
            return 0.0
        if mech == "offload":
            return self.offload_s(nbytes)
        if mech in LOWBIT:
            return self.lowbit_s(nbytes)
        return self.compress_s(nbytes)


# Rough figures, used until `calibrate` measures the machine. CPU: a few cores' f32
# matmul, memcpy-speed "transfers" (host and device share DRAM). GPU: what `calibrate`
# measured on an H100 (jax's default f32 matmul precision, pinned host copies, bf16 and
# 2-bit round trips; `bench/RESULTS.md`, session 15) and the per-segment cost.
DEFAULTS: dict[str, CostModel] = {
    "cpu": CostModel(5e10, 5e9, 5e9, 2e9, "cpu"),
    "gpu": CostModel(4e14, 3.2e10, 3.4e10, 1.9e11, "gpu", False, 7e10, 5e-6),
    "tpu": CostModel(1e14, 1e10, 1e10, 1e12, "tpu"),
}

_CALIBRATED: dict[str, CostModel] = {}


def _backend() -> str:
    return jax.default_backend()


def default_costs(backend: str | None = None) -> CostModel:
    """The calibrated figures for ``backend`` if `calibrate` ran, else `DEFAULTS`."""
    backend = backend or _backend()
    if backend in _CALIBRATED:
        return _CALIBRATED[backend]
    return DEFAULTS.get(backend, DEFAULTS["gpu" if backend not in ("cpu",) else "cpu"])


def _best_of(fn, repeats: int) -> float:
    fn()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def calibrate(force: bool = False, *, size: int | None = None, mbytes: int = 16, repeats: int = 5):
    """Measure this backend's figures with a few timed probes and cache them.

    ```python
    costs = tg.policies.calibrate()          # ~0.5 s once per process and backend
    tg.policies.budget(bytes=..., allow=("save", "recompute", "offload"), costs=costs)
    ```
    Probes: ``size``-square float32 matmuls, 8 back to back (flops/s; None: from 512
    up, doubling until one product takes a millisecond, since small ones measure launch
    latency on an accelerator: on an H100 a 512-square product gave 3.5e12 flop/s), an
    ``mbytes`` MiB array to pinned host memory and back (bytes/s each way), a bfloat16
    compress round trip of the same array, and a 2-bit pack and unpack of it (bytes/s;
    timed apart, as forward and backward run them), all on this process's first device
    (`jax.local_devices`). ``force=True`` measures again.
    Returns a `CostModel` (``measured=True``); `budget` uses it by default from then on.

    In a multi-process run (``jax.process_count() > 1``) every process must call it (a
    collective, like the jitted steps): process 0 measures and hands its figures to the
    others through `jax.distributed`'s key-value store, so that every process plans
    with the same cost model and builds the same program (timings differ from process
    to process, and so would their plans).
    """
    backend = _backend()
    if not force and backend in _CALIBRATED:
        return _CALIBRATED[backend]
    args = (backend, size, mbytes, repeats)
    if jax.process_count() > 1:
        text = text_from_process_zero(
            "tg.policies.calibrate", lambda: json.dumps(dataclasses.asdict(_measure(*args)))
        )
        model = CostModel(**json.loads(text))  # floats round-trip JSON exactly
    else:
        model = _measure(*args)
    _CALIBRATED[backend] = model
    return model


def _measure(backend: str, size: int | None, mbytes: int, repeats: int) -> CostModel:
    """`calibrate`'s probes, timed on this process's first device."""
    dev = jax.local_devices()[0]
    key = jax.device_put(jax.random.key(0), dev)
    mm = jax.jit(lambda a: a @ a)

    def products(a, k=8):  # k back to back, one wait: launch latency amortized
        for _ in range(k):
            out = mm(a)
        out.block_until_ready()

    n_mm = size or 512
    while True:
        a = jax.random.normal(key, (n_mm, n_mm), jnp.float32)
        t_mm = _best_of(lambda a=a: products(a), repeats) / 8
        if size is not None or t_mm >= 1e-3 or n_mm >= 8192:
            break
        n_mm *= 2
    flops = 2.0 * n_mm**3 / t_mm

    n = (mbytes << 20) // 4
    x = jax.random.normal(key, (n,), jnp.float32)
    kinds = {m.kind for m in dev.addressable_memories()}
    host_kind = "pinned_host" if "pinned_host" in kinds else None
    nbytes = x.nbytes
    if host_kind is not None:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
        devs = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        on_host = jax.device_put(x, host).block_until_ready()
        d2h = nbytes / _best_of(lambda: jax.device_put(x, host).block_until_ready(), repeats)
        h2d = nbytes / _best_of(lambda: jax.device_put(on_host, devs).block_until_ready(), repeats)
    else:
        base = default_costs(backend)
        d2h, h2d = base.d2h_bytes_per_s, base.h2d_bytes_per_s
    trip = jax.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32))
    comp = nbytes / _best_of(lambda: trip(x).block_until_ready(), repeats)
    lowbit = nbytes / _lowbit_round_trip(x.reshape(-1, 1024), repeats)
    # Not probed: a small barrier-split chain read 1.9 us a segment on an H100, where
    # plans on the transformer were fastest at the default's 5 us (`segment_s`).
    seg = DEFAULTS.get(backend, DEFAULTS["gpu"]).segment_s
    return CostModel(flops, d2h, h2d, comp, backend, True, lowbit, seg)


def _lowbit_round_trip(x: Any, repeats: int) -> float:
    """Seconds of a 2-bit pack plus an unpack of ``x``, each its own compiled call."""
    lay = lowbit_layout(x, 2, DEFAULT_GROUP)
    words, rid = key_words(0), jnp.uint32(0)
    pack = jax.jit(lambda x: pack_lowbit(x, words, rid, bits=2, lay=lay))
    unpack = jax.jit(lambda p: unpack_lowbit(p, x.dtype))
    packed = pack(x)
    t_pack = _best_of(lambda: jax.block_until_ready(pack(x)), repeats)
    return t_pack + _best_of(lambda: unpack(packed).block_until_ready(), repeats)


def record_flops(rec: Record) -> float:
    """A rough cost of re-running ``rec``: 2·M·N·K for dots, output size otherwise."""
    out = sum(math.prod(o.shape) for o in rec.outputs)
    if rec.primitive == "dot_general":
        (lc, _), _ = rec.params["dimension_numbers"]
        k = math.prod(rec.inputs[0].shape[d] for d in lc) if lc else 1
        return 2.0 * out * k
    if rec.primitive == "conv_general_dilated":
        rhs = rec.inputs[1].shape
        return 2.0 * out * math.prod(rhs) / max(rhs[0], 1)
    return float(max(out, 1))


def segment_flops(tape: Tape, seg: Any) -> float:
    """What backward spends recomputing one segment: each of its records once."""
    return sum(record_flops(tape.records[i]) for i in seg.records)


def device_nbytes(var: Any) -> int:
    """Bytes ``var`` (a `Var` or `Saved`: shape, dtype, optional traced sharding) takes on
    one device: the shard's size when its sharding names a mesh, else the whole value
    (`tapegrad.core.sizes.device_nbytes`)."""
    return _nbytes(tuple(var.shape), var.dtype, sharding_of(var))


def _lowbit_nbytes(bits: int, shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    """`compress(bits=...)`'s packed bytes on one device, laid out as `compress` lays
    out a value of this type (`_groups.type_shards`). Its groups never cross a shard,
    so every device holds an equal part of them."""
    shards = type_shards(shape, sharding)
    if shards is None and isinstance(getattr(sharding, "mesh", None), jax.sharding.Mesh):
        try:  # a placed value (Auto axes, eagerly): compress groups the concrete shard
            local = sharding.shard_shape(shape)
            shards = tuple(n // s if s else 1 for n, s in zip(shape, local))
        except Exception:  # noqa: BLE001 -- the whole value, as XLA may place it
            shards = None
    total = packed_nbytes(layout_for(shape, shards, DEFAULT_GROUP, 8 // bits), bits, dtype)
    return total // math.prod(shards or ())


# The deepest lookahead `prefetch_depth` picks: each record ahead holds its residuals'
# device copies that much earlier.
MAX_PREFETCH = 8


def prefetch_depth(tape: Any, costs: CostModel | None = None) -> int:
    """How many records ahead backward brings offloaded residuals back, so that each
    host -> device copy overlaps compute instead of waiting for it.

    A record's copy is hidden when the backward compute of the records that run
    before it (in backward order, ~2x their forward `record_flops`) lasts as
    long as the copy of its operands and outputs (what it may keep; the tape's own
    inputs stay on device). The depth is the least k that hides every record's copy
    behind its k predecessors, at least 1 and at most `MAX_PREFETCH`; a record that
    no lookahead can hide (the first records of backward, with nothing before them)
    does not count. Depends on the records alone (shapes, primitives), so the
    planner's timeline and the interpreter agree on a planned or unplanned tape.
    """
    costs = costs or default_costs()
    memo = _DEPTHS.setdefault(tape, {})
    if costs in memo:
        return memo[costs]
    free = tape.caller_ids()
    order = [r for r in reversed(tape.records) if r.rule != "none"]
    compute = [2.0 * record_flops(r) / costs.flops_per_s for r in order]
    depth = 1
    for m, rec in enumerate(order):
        vals = {v.id: v for v in (*rec.inputs, *rec.outputs) if isinstance(v, Var)}
        nbytes = sum(device_nbytes(v) for i, v in vals.items() if i not in free)
        need = nbytes / costs.h2d_bytes_per_s
        covered = 0.0
        for k in range(1, min(m, MAX_PREFETCH) + 1):
            covered += compute[m - k]
            if covered >= need:
                depth = max(depth, k)
                break
    memo[costs] = depth
    return depth


# Depths by tape (immutable) and cost model: eager backward asks once per call.
_DEPTHS: weakref.WeakKeyDictionary[Any, dict[CostModel, int]] = weakref.WeakKeyDictionary()


register_auto_prefetch(prefetch_depth)


def compressed_nbytes(
    mech: str, shape: tuple[int, ...], dtype: Any, nbytes: int, sharding: Any = None
) -> int | None:
    """Bytes `compress` stores on one device for a residual under ``mech`` ("bf16",
    "int8", "4-bit", "2-bit") whose device bytes are ``nbytes``, or None when it does
    not apply (not floating, or not wider than the target)."""
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        return None
    width = itemsize(dt)
    if mech in LOWBIT:
        return _lowbit_nbytes(LOWBIT[mech], tuple(shape), dt, sharding)
    n = nbytes // max(width, 1)
    if mech == "bf16":
        return 2 * n if width > 2 else None
    if mech == "int8":
        if width <= 1:
            return None
        if n > DEFAULT_BLOCK_SIZE:  # q, one code per block, one float32 top scale
            return n + -(-n // DEFAULT_BLOCK_SIZE) + 4
        return n + 2  # q and one bfloat16 scale
    return None
