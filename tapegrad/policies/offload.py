"""Offload residuals to host memory, like PyTorch's ``save_on_cpu(pin_memory=True)``.

Uses jax memory kinds, so it works eagerly (the array really moves: its
``sharding.memory_kind`` says so) and under `jax.jit` (the program carries
``device_put`` to the host space; its effect on memory shows on accelerators:
`bench/gpu_check.py` reads it from the compiled program's memory analysis).
"""

from __future__ import annotations

import jax

__all__ = ["Offload", "offload"]

_SPACES = {"pinned_host": "Host", "unpinned_host": "Host", "device": "Device"}


def _move(x, memory_kind: str):
    if not isinstance(x, jax.Array):
        x = jax.device_put(x)  # numpy arrays and Python scalars: a device array first
    if isinstance(x, jax.core.Tracer):
        # Under a trace there is no concrete sharding to re-target; jax's memory
        # spaces say "host" / "device" and keep the value's sharding.
        return jax.device_put(x, getattr(jax.memory.Space, _SPACES[memory_kind]))
    return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))


class Offload:
    """Move residuals to ``memory_kind`` in forward and back to the device in backward."""

    prefetch = 1  # the interpreter starts bringing the next record's residuals back early
    exact = True  # values come back bit for bit

    def __init__(self, memory_kind: str = "pinned_host", min_bytes: int = 0, inputs: bool = False):
        if memory_kind not in ("pinned_host", "unpinned_host"):
            raise ValueError(
                f"offload: memory_kind must be 'pinned_host' or 'unpinned_host', "
                f"got {memory_kind!r}."
            )
        self.memory_kind, self.min_bytes, self.inputs = memory_kind, min_bytes, inputs

    def _keeps(self, info) -> bool:
        return info.nbytes < self.min_bytes or (info.is_input and not self.inputs)

    def pack(self, value, info):
        if self._keeps(info):
            return value
        return _move(value, self.memory_kind)

    def unpack(self, packed, info):
        if self._keeps(info):
            return packed
        if isinstance(packed, jax.core.Tracer):
            # Under jit, XLA folds device_put(device_put(x, host), device) back into x and
            # keeps the device copy alive: measured on an H100, no byte reached host memory
            # and device temp grew 60 -> 160 MiB. A barrier on the host value (what
            # jax.checkpoint's offload policies emit too) keeps the pair apart, so the
            # residual really lives in host memory between forward and backward.
            packed = jax.lax.optimization_barrier(packed)
        return _move(packed, "device")

    def __repr__(self) -> str:
        extra = ", inputs=True" if self.inputs else ""
        return f"offload({self.memory_kind!r}{extra})"


def offload(memory_kind: str = "pinned_host", min_bytes: int = 0, inputs: bool = False) -> Offload:
    """Keep residuals in host memory between forward and backward.

    Residuals smaller than ``min_bytes`` stay on device (copying tiny arrays
    costs more than it saves). Residuals that are the function's own inputs
    (weights, the batch) stay where they are: the caller holds them anyway, so
    sending them to host and back frees nothing and costs two transfers; only
    activations move (on an H100 under jit this halved the bytes moved for a
    32-layer MLP, see bench/RESULTS.md). ``inputs=True`` moves them too (worth it
    only when the caller drops its own reference before backward).
    """
    return Offload(memory_kind, min_bytes, inputs)
