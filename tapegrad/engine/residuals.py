"""The residual store of one forward run (`Residuals`) and the two crossings of the
residual policy: `_pack` (forward: a value a record keeps goes through ``policy.pack``,
once per distinct value) and `_unpack` (backward: ``policy.unpack``, checked against
the shape and dtype that was packed, and a deleted or donated array named).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import numpy as np
from jax import lax

from tapegrad.core import jax_compat as compat
from tapegrad.core.residual_policy import ResidualInfo, check_exact, exact_claim, packs_inputs
from tapegrad.core.tape import Lit, Record, as_dtype
from tapegrad.errors import ResidualError, where

__all__ = ["Residuals"]


class Residuals:
    """The packed residuals of one forward run, keyed by value.

    A value saved by several records (``tanh``'s output is also the next
    ``dot_general``'s input) is packed once; backward releases it after its last use
    (`engine.backward_schedule` counts the uses).
    """

    __slots__ = (
        "store",
        "policy",
        "infos",
        "released",
        "plain",
        "input_ids",
        "raw",
        "loops",
        "steps",
        "readers",
        "sources",
        "origins",
        "probe",
    )

    def __init__(self, policy):
        self.store: dict[Any, Any] = {}
        self.infos: dict[Any, ResidualInfo] = {}
        self.input_ids: frozenset[int] = frozenset()
        self.policy = policy
        self.released = False
        self.plain = False
        # Keys stored as they are, never packed: a loop body's residuals that the loop
        # record keeps once for all steps (its consts, its scanned slices).
        self.raw: frozenset = frozenset()
        self.loops: tuple = ()  # the loop records this tape runs inside, outermost first
        self.steps: tuple = ()  # this run's step index in each of them (see ResidualInfo)
        # residual key -> every (record, Saved) keeping it (ResidualInfo.readers)
        self.readers: dict[Any, tuple] = {}
        # record index -> a device_put's operands' placements, seen in forward (`_placed`)
        self.sources: dict[int, tuple] = {}
        # residual key -> the traced value a policy packed (`_stands_for`)
        self.origins: dict[Any, Any] = {}
        # (key, host copy) of the residual a user's exact claim is checked on (`_probe`)
        self.probe: tuple[Any, Any] | None = None


def _pack(res: Residuals, rec: Record, key, s, value, segment_input: bool = False):
    readers = res.readers.get(key, ())
    info = ResidualInfo(
        rec,
        s,
        s.shape,
        s.dtype,
        key in res.input_ids,
        res.loops,
        res.steps,
        readers,
        segment_input,
    )
    # Backward's copy forgets the steps: inside a traced scan they are the forward
    # body's tracers.
    res.infos[key] = dataclasses.replace(info, steps=()) if res.steps else info
    if info.is_input and not packs_inputs(res.policy):
        return value  # the caller holds it: a packed copy would add memory and free none
    if isinstance(value, compat.SCALARS):
        return value  # a custom_vjp's Python residual (a bool flag): no array to move
    try:
        packed = res.policy.pack(value, info)
    except Exception as e:
        e.add_note(f"tapegrad: raised by {res.policy!r}.pack for residual {info}")
        if isinstance(value, jax.core.Tracer):
            e.add_note(
                "tapegrad: under jax.jit, pack/unpack run once at trace time on tracers; "
                "a pack that needs concrete data (np.asarray, .item()) cannot run there."
            )
        raise
    if res.probe is None and id(res.policy) not in _EXACT_CHECKED:
        _probe(res, key, value)
    if not res.loops and not compat.batches_concrete(value):
        # Traced (under jit, or differentiated again): backward's unpacked value will
        # stand for this one (`_stands_for`). A loop body's backward is another trace,
        # which cannot reach this step's value: there the hooks are differentiated.
        res.origins[key] = value
    return packed


# Policies whose exactness is settled, by id (each with a weak reference telling a later
# object at the same address apart): tapegrad's own, one that declares nothing, or a
# user's `exact = True` checked on a residual of a run (`_probe`, `check_exact`).
_EXACT_CHECKED: dict[int, Any] = {}
_PROBE_BYTES = 1 << 16  # the largest residual copied to host to check a claim with


def _settle(policy: Any) -> None:
    if len(_EXACT_CHECKED) > 256:
        _EXACT_CHECKED.clear()
    try:
        _EXACT_CHECKED[id(policy)] = weakref.ref(policy)
    except TypeError:
        _EXACT_CHECKED[id(policy)] = lambda: policy  # kept alive: its id stays its own


def _probe(res: Residuals, key: Any, value: Any) -> None:
    """Keep a host copy of one small concrete residual a user's `exact = True` policy
    packs, for backward's unpack of it to be compared with (`_check_probe`): the claim is
    checked without calling the policy's hooks once more than backward does."""
    policy = res.policy
    ref = _EXACT_CHECKED.get(id(policy))
    if ref is not None and ref() is policy:
        return
    if exact_claim(policy) is None:
        _settle(policy)
    elif (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended)  # no bits to compare
        and value.nbytes <= _PROBE_BYTES
    ):
        res.probe = (key, np.array(value))


def _check_probe(res: Residuals, original: Any, value: Any, info: ResidualInfo) -> None:
    if not isinstance(value, jax.core.Tracer):
        res.probe = None
        check_exact(exact_claim(res.policy), original, value, info)
        _settle(res.policy)


@jax.custom_jvp
def _stands_for(original, unpacked):
    """``unpacked``, differentiated as ``original``, as PyTorch's unpacked saved tensor
    is (test_default_saved_tensors_hooks_double_backward): an outer derivative of
    backward flows to the residual the value replaced, and not through ``pack``/
    ``unpack`` (a hook that packs ``2 * x``, a rounding, a copy to host). Its value is
    ``unpacked`` exactly; ``original`` is only a tangent's path, so under jit without
    an outer derivative XLA keeps nothing for it."""
    return unpacked


@_stands_for.defjvp
def _stands_for_jvp(primals, tangents):
    return primals[1], tangents[0]


def _on_host(tree) -> bool:
    """Whether a traced value (or any leaf of it) lives in host memory (an offload)."""
    return any(
        isinstance(x, jax.core.Tracer)
        and getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        for x in jax.tree.leaves(tree)
    )


def tie_to(values, after: list):
    """``values`` through one ``optimization_barrier`` with ``after`` (the cotangents of
    the backward step that asks for them), so nothing that reads them can start before
    that step's cotangents exist. ``after`` is replaced, in place, by the barrier's own
    copies, which the step's rule then reads: XLA's algebraic simplifier drops a barrier
    operand whose output nothing reads once that operand has no other user (it had none
    after fusion duplicated the cotangent's producer into the barrier's operand, on a
    transformer block on XLA:CPU), and the tie went with it: a recomputation was
    scheduled in forward and held to backward (tests/test_compiled_plan.py)."""
    values, tied = lax.optimization_barrier((values, tuple(after)))
    after[:] = tied
    return values


def _unpack(res: Residuals, rec: Record, key, s, after: list | None = None):
    packed = res.store[key]
    if after and _on_host(packed):
        # Under a trace the host -> device copy has no input computed in backward, so
        # XLA hoists it (measured on an H100: every copy back ran at the start of
        # backward, one after the other, and the device held them all at once). Tied
        # to ``after`` (cotangents of the backward step that asks for it), the copy
        # starts there and overlaps the records up to its reader.
        packed = tie_to(packed, after)
    if (
        res.plain
        or key in res.raw
        or isinstance(packed, compat.SCALARS)  # kept as it was (`_pack`)
        or (res.infos[key].is_input and not packs_inputs(res.policy))
    ):
        value = packed
    else:
        info = res.infos[key]
        try:
            value = res.policy.unpack(packed, info)
        except Exception as e:
            e.add_note(f"tapegrad: raised by {res.policy!r}.unpack for residual {info}")
            raise
        if (
            tuple(getattr(value, "shape", ())) != s.shape
            or as_dtype(getattr(value, "dtype", None)) != s.dtype
        ):
            raise ResidualError(
                f"the residual policy's unpack returned "
                f"{getattr(value, 'dtype', type(value).__name__)}"
                f"{list(getattr(value, 'shape', []))}"
                f" for {s} of {where(rec)}, which saved {s.dtype}{list(s.shape)}. "
                "unpack must return an array of the shape and dtype that pack received."
            )
        probe = res.probe
        if probe is not None and probe[0] == key:
            _check_probe(res, probe[1], value, info)
        original = res.origins.get(key)
        if original is not None:
            value = _stands_for(original, value)
    if (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and value.is_deleted()
    ):
        raise ResidualError(
            f"residual {s} of {where(rec)} was deleted (or donated to a jitted call) after it "
            "was saved for backward. Keep the array alive until vjp_fn has run, or pass a "
            "copy (e.g. jnp.copy(x)) to the call that donates or deletes it."
        )
    return value


def _saved_values(rec: Record, saves, keys, get) -> tuple[list, list, list]:
    x = [i.value if type(i) is Lit else None for i in rec.inputs]
    y: list = [None] * len(rec.outputs)
    aux: list = []
    for s, key in zip(saves, keys):
        v = get(rec, key, s)
        if s.kind == "in":
            x[s.index] = v
        elif s.kind == "out":
            y[s.index] = v
        else:
            aux.extend([None] * (s.index + 1 - len(aux)))
            aux[s.index] = v
    return x, y, aux
