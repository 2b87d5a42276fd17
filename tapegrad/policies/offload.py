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

    exact = True  # values come back bit for bit

    def __init__(
        self,
        memory_kind: str = "pinned_host",
        min_bytes: int = 0,
        inputs: bool = False,
        prefetch: int | str = "auto",
    ):
        if memory_kind not in ("pinned_host", "unpinned_host"):
            raise ValueError(
                f"offload: memory_kind must be 'pinned_host' or 'unpinned_host', "
                f"got {memory_kind!r}."
            )
        if prefetch != "auto" and (
            isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0
        ):
            raise ValueError(
                f"offload: prefetch must be 'auto' or a number of records >= 0, got {prefetch!r}."
            )
        self.memory_kind, self.min_bytes, self.inputs = memory_kind, min_bytes, inputs
        # How many records ahead backward starts bringing residuals back, so the copies
        # overlap compute: "auto" asks the cost model (`planner.cost.prefetch_depth`).
        self.prefetch = prefetch

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
        if self.prefetch != "auto":
            extra += f", prefetch={self.prefetch}"
        return f"offload({self.memory_kind!r}{extra})"


def offload(
    memory_kind: str = "pinned_host",
    min_bytes: int = 0,
    inputs: bool = False,
    prefetch: int | str = "auto",
) -> Offload:
    """Keep residuals in host memory between forward and backward.

    Residuals smaller than ``min_bytes`` stay on device (copying tiny arrays
    costs more than it saves). Residuals that are the function's own inputs
    (weights, the batch) stay where they are: the caller holds them anyway, so
    sending them to host and back frees nothing and costs two transfers; only
    activations move (on an H100 under jit this halved the bytes moved for a
    32-layer MLP, see bench/RESULTS.md). ``inputs=True`` moves them too (worth it
    only when the caller drops its own reference before backward).

    In forward each copy to host is dispatched as soon as the residual is packed
    (jax dispatch is asynchronous: the copy runs while forward goes on). In backward
    each residual starts coming back ``prefetch`` records before the record that
    reads it: ``"auto"`` picks the least lookahead whose compute covers the copy
    time in the cost model (`tg.policies.calibrate` measures it; at least 1), an
    int fixes it (0: copy back at first use). Device copies are released after
    their last use.
    """
    return Offload(memory_kind, min_bytes, inputs, prefetch)
