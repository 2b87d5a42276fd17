"""Measure a plan's device peak from the arrays jax holds, to check the planner's
prediction: run forward and backward eagerly and sample `jax.live_arrays()` at the
end of forward, after every record re-run in backward (recomputation) and after every
backward record. The peak counts what the planner counts: device memory only (arrays
whose memory kind is not a host kind), on one of this process's devices (a shard's
bytes), *beyond* what was alive before forward (inputs, weights), excluding the
function's outputs, the cotangent fed to backward and the cotangents backward holds
(their bytes mirrored from the tape as backward produces and consumes them).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tapegrad.api.traced import Traced, argnums_tuple, leaf_owners
from tapegrad.core.residual_policy import resolve_policy
from tapegrad.core.tape import Var
from tapegrad.engine import interpret as _interpret

__all__ = ["measured_peak"]


def _device_bytes(a: Any, dev: Any) -> int:
    s = a.sharding
    if "host" in str(getattr(s, "memory_kind", "") or ""):
        return 0
    if dev not in s.device_set:
        return 0
    return math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize


class _Sampler:
    def __init__(self, exclude: set[int], dev: Any):
        self.exclude, self.dev = exclude, dev
        self.pending: dict[int, int] = {}  # var id -> bytes of its pending cotangent
        self.in_flight = 0  # cotangents returned by the rule being observed
        self.peak = 0
        self.samples = 0

    def sample(self) -> None:
        # No gc.collect() here (it costs ~25 ms a call with jax loaded): the interpreter
        # frees by reference counting, and breaks its own cycles.
        live = sum(
            _device_bytes(a, self.dev)
            for a in jax.live_arrays()
            if id(a) not in self.exclude and not a.is_deleted()
        )
        cts = sum(self.pending.values()) + self.in_flight
        self.peak = max(self.peak, live - cts)
        self.samples += 1

    # the interpreter's observer protocol
    def forward_record(self, rec, ins, outs) -> None:
        pass

    def backward_record(self, rec, gs, in_cts) -> None:
        self.in_flight = sum(_device_bytes(c, self.dev) for c in in_cts if isinstance(c, jax.Array))
        self.sample()
        self.in_flight = 0
        for o in rec.outputs:
            self.pending.pop(o.id, None)
        for v, c in zip(rec.inputs, in_cts):
            if c is not None and isinstance(v, Var):
                self.pending[v.id] = _device_bytes(c, self.dev)


def measured_peak(
    fun: Callable, args: Sequence[Any], policy: Any = None, argnums: int | Sequence[int] = 0
) -> int:
    """Peak device bytes of residuals (and what backward recomputes or unpacks) over an
    eager forward and backward of ``fun(*args)`` under ``policy``, on this process's first
    device (`jax.local_devices`; in a multi-process run each process measures its own)."""
    pol = resolve_policy(policy)
    nums = argnums_tuple(argnums, len(args), "measured_peak")
    owners = leaf_owners(tuple(args))
    t = Traced(fun, tuple(args), lambda i: owners[i] in nums, False, "measured_peak", pol)
    dev = jax.local_devices()[0]  # jax.devices()[0] is process 0's: no shard here elsewhere
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    flat_out, res = _interpret.forward(t.tape, t.flat, pol)
    jax.block_until_ready(flat_out)
    cts = [jax.numpy.ones_like(o) for o in flat_out[: t.n_out]]
    sampler = _Sampler(before | {id(o) for o in flat_out} | {id(c) for c in cts}, dev)
    sampler.sample()
    run, run_compiled = _interpret._run, _interpret.run_compiled_segment

    def sampled_run(rec, ins):  # records re-run in backward: the recomputation's peak
        out = run(rec, ins)
        if not any(isinstance(o, jax.core.Tracer) for o in out[0]):  # not inside a compiled segment
            jax.block_until_ready(out[0])
            sampler.sample()
        return out

    def sampled_compiled(tape, seg, vals):  # a segment run as one call: after it
        out = run_compiled(tape, seg, vals)
        jax.block_until_ready(out)
        sampler.sample()
        return out

    _interpret._run, _interpret.run_compiled_segment = sampled_run, sampled_compiled
    try:
        _interpret.backward(
            t.tape, res, cts + [None] * (len(flat_out) - t.n_out), retain=False, observer=sampler
        )
    finally:
        _interpret._run, _interpret.run_compiled_segment = run, run_compiled
    return sampler.peak
