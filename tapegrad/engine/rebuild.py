"""Values backward rebuilds instead of keeping: cheap exact ops whose operands it keeps
anyway (a layer norm's normalised value, a softmax's quotient, a residual stream's sum),
random bits from their kept key (a dropout's mask), and records that keep an operand
or their output instead of a mask derived from it when that value is rebuilt or kept
anyway (relu's mask off the output the next matmul keeps). A tape pass:
`_checkpoint._decide` marks what `rebuilt_records` returns "recompute", and the
executor re-runs it in backward like any recompute segment."""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from types import MappingProxyType

import numpy as np

from tapegrad.core.residual_policy import ResidualInfo
from tapegrad.core.tape import Record, Saved, Tape, Var
from tapegrad.rules._bits import mask_aval
from tapegrad.rules._registry import keeping_operands
from tapegrad.rules.cheap import EXACT_CHEAP

__all__ = ["RANDOM", "rebuilt_records", "shared_in_body", "switched"]


# Counter-based random bits: a pure function of the key (jax.random's contract, and what
# jax.checkpoint relies on when it recomputes dropout). Not XLA's stateful rng_uniform,
# which `engine.trace._NO_CSE` never merges either. Tens of integer ops per element, not one:
# rebuilt only where what they free has as many elements (`_worth_rebuilding`).
RANDOM = frozenset({"random_bits", "threefry2x32"})
# Keys (and their raw data) are a few bytes each: kept, never rebuilt, however they were
# made. A key split in two for two dropouts then starts two segments, each rebuilding its
# own mask at its own backward step, rather than one rebuilding both at the first.
_KEYS = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split"})


def rebuilt_records(
    tape: Tape,
    decisions: Sequence[str],
    open_: Sequence[bool],
    draws: bool = True,
    kept_exact: Callable[[ResidualInfo], bool] | None = None,
) -> tuple[set[int], dict[int, Record]]:
    """Records whose outputs backward rebuilds instead of keeping, because it holds
    everything needed to rebuild them anyway; and records that keep their operands or
    outputs instead of masks derived from them, because those are rebuilt or kept anyway.

    A cheap op (`EXACT_CHEAP`) whose operands are all kept anyway -- the function's
    inputs and constants, values some record saves for its own backward, or outputs of
    records rebuilt the same way -- is recomputed in backward at no memory cost: a layer
    norm's ``(x - mu) * rsqrt(var + eps) * g + b`` keeps ``x - mu`` and the rsqrt for its
    own backward, so the normalised value and the output need not be kept as well; a
    softmax's quotient ``e / s`` is rebuilt from ``e`` and ``s``. jax.vjp keeps all of
    them. The cost is the op run again in backward (under jit, without a barrier: XLA
    may merge it with the forward value, which is no worse than saving it).

    Random bits (`RANDOM`) are rebuilt the same way from a kept key, and a record that
    keeps a bit-packed mask of an operand (``select_n``'s predicate) keeps the operand
    instead when that operand is rebuilt (`keeping_operands`): a dropout
    ``where(bernoulli(key, p, x.shape), x / p, 0)`` keeps no mask, only the key. A
    record whose mask is a function of its own output (``jax.nn.relu``'s ``x > 0`` is
    ``relu(x) > 0``, NaN included) keeps that output instead when another record keeps
    it (the next matmul, for its weight gradient): 1 bit an element fewer.

    Only records whose decision is open (`save` by default or PREFER_SAVE, outside a
    checkpoint region) and which have no names (a `tg.name`d value is the user's
    to decide) are rebuilt; a tape's outputs are left alone; random draws only with
    ``draws``.

    ``kept_exact`` (None: every kept value is exact, as under `save()`) says whether a
    lossy policy stores an operand unchanged, asked with the info the operand is packed
    with (the rebuilt record reading it: backward's recompute takes it from there). A
    value rebuilt only from unchanged operands is the forward value, bit for bit; one
    rebuilt from a rounded operand would carry that rounding into a value the policy
    might have kept exact (a divisor, under low-bit compression), so it is kept instead.
    Under `compress(bits=2)` a batch reshaped or broadcast before its first layer, or
    labels turned into gather indices, then cost nothing instead of a rounded copy. The
    same holds for a record switching from a mask to its operand or output: only to an
    unchanged one (under `compress(bits=2)` relu keeps its mask: small positives rounded
    to 0 or below would read as masked).

    Returns the indices of the rebuilt records and the records that switch to keeping
    operands, by index."""
    banned: set[int] = set() if draws else {r.index for r in tape.records if r.primitive in RANDOM}
    while True:
        rebuilt, plain, saved = _rebuilt_once(tape, decisions, open_, banned, kept_exact)
        readers: dict[int, list[Record]] = {}
        for r in tape.records:
            if r.index in rebuilt:
                for u in r.inputs:
                    if isinstance(u, Var):
                        readers.setdefault(u.id, []).append(r)
        costly = {
            i
            for i in rebuilt
            if tape.records[i].primitive in RANDOM
            and not _worth_rebuilding(tape.records[i], readers, saved)
        }
        if not costly:
            return rebuilt, plain
        banned |= costly


def _rebuilt_once(
    tape: Tape,
    decisions: Sequence[str],
    open_: Sequence[bool],
    banned: set[int],
    kept_exact: Callable[[ResidualInfo], bool] | None = None,
) -> tuple[set[int], dict[int, Record], set[int]]:
    producer: dict[int, Record] = {}
    for rec in tape.records:
        for o in rec.outputs:
            producer[o.id] = rec
    saved: set[int] = {
        rec.residual_key(s)
        for rec in tape.records
        if rec.rule != "none"
        for s in rec.saves
        if s.kind != "aux"
    }
    kept_by_rules = frozenset(saved)  # not counting operands kept because they are rebuilt
    outputs = {o.id for o in tape.outputs if isinstance(o, Var)}
    rebuilt: set[int] = set()

    def kept(u: object, reader: Record, i: int, saved: Saved | None = None) -> bool:
        """Whether backward holds input ``i`` of ``reader`` (or the value ``saved``
        names) as forward made it, as far as ``reader`` reads it (`Saved.reads_positive`)."""
        if not isinstance(u, Var):
            return True  # a literal
        p = producer.get(u.id)  # None: an input or a constant, held by the caller
        if p is not None and p.index in rebuilt:
            return True
        if p is not None and not (
            decisions[p.index] == "save" and (u.id in kept_by_rules or p.primitive in _KEYS)
        ):
            return False
        if kept_exact is None:
            return True
        saved = saved or Saved("in", i, u.shape, u.dtype)
        info = ResidualInfo(reader, saved, u.shape, u.dtype, p is None)
        return kept_exact(info)

    users: dict[int, list[Record]] = {}
    for rec in tape.records:
        for u in rec.inputs:
            if isinstance(u, Var):
                users.setdefault(u.id, []).append(rec)

    plain: dict[int, Record] = {}
    for rec in tape.records:
        if rec.index in plain:  # a max-pool switched with the relu before it
            rec = plain[rec.index]
        elif rec.rule in ("rule", "linearized") and decisions[rec.index] == "save":
            # The values its masks are read off are rebuilt (or kept) anyway: keep those
            # instead, for free. An output counts only when kept by a record (relu's, by
            # the next matmul) and unchanged: a mask read off a rounded output is wrong
            # where small values round across the threshold.
            alt = keeping_operands(rec)
            if alt is not None and all(
                kept((rec.inputs if s.kind == "in" else rec.outputs)[s.index], alt, s.index, s)
                for s in alt.saves
            ):
                plain[rec.index] = rec = alt
                saved.update(rec.residual_key(s) for s in rec.saves)
            elif alt is not None and not rec.names:
                pair = _relu_into_pool(rec, alt, users, outputs, decisions)
                if pair is not None:
                    rec, pool = pair
                    plain[rec.index], plain[pool.index] = rec, pool
        if not (
            (rec.primitive in EXACT_CHEAP or rec.primitive in RANDOM)
            and rec.index not in banned
            and open_[rec.index]
            and decisions[rec.index] == "save"
            and not rec.names
            and not rec.bodies
            and rec.rule != "fallback"
            # re-running a record that derives values for its own backward (a mask) would
            # change what it keeps, not just free its output
            and not any(s.kind == "aux" for s in rec.saves)
            and not any(o.id in outputs for o in rec.outputs)
        ):
            continue
        if all(kept(u, rec, i) for i, u in enumerate(rec.inputs)):
            rebuilt.add(rec.index)
    # Only what backward needs: a rebuilt output some record saves, and what it is built from.
    needed: set[int] = set()
    stack = [i for i in rebuilt if any(o.id in saved for o in tape.records[i].outputs)]
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            for u in tape.records[i].inputs:
                if isinstance(u, Var) and u.id in producer and producer[u.id].index in rebuilt:
                    stack.append(producer[u.id].index)
    return needed, plain, saved


def _relu_into_pool(
    relu: Record, alt: Record, users: dict[int, list[Record]], outputs: set[int], decisions
) -> tuple[Record, Record] | None:
    """A relu whose output only a max-pool reads keeps no mask: the pool keeps, beside
    which element each window picked, whether that element is positive (1 bit per
    output), and masks its cotangent by it before scattering.

    Exact: the pool's cotangent reaches only the picked elements, and there relu's mask
    ``z > 0`` is ``relu(z) > 0``, the picked value's sign (NaN included: a window with a
    NaN still picks what XLA's select-and-scatter picks). Elsewhere the cotangent is 0
    whatever the mask. The same selects as jax's relu, so the gradient is jax.grad's, bit
    for bit, under every policy (the mask is exact bits). A 2x2 pool: 1 bit per output
    instead of 1 per input, 4. Only where the pool has fewer outputs than inputs.

    Returns the two records switched (``params``: ``mask_in_pool`` on the relu,
    ``relu_mask`` on the pool), or None."""
    if [(s.kind, s.index, s.reads_positive) for s in alt.saves] != [("out", 0, True)]:
        return None
    (y,) = relu.outputs
    readers = users.get(y.id, [])
    if y.id in outputs or len(readers) != 1 or relu.inputs[-1].shape != y.shape:
        return None
    (pool,) = readers
    if not (
        pool.primitive == "reduce_window_max"
        and pool.rule == "rule"
        and decisions[pool.index] == "save"
        and isinstance(pool.inputs[0], Var)
        and pool.inputs[0].id == y.id
        and [s.kind for s in pool.saves] == ["aux"]
        and math.prod(pool.outputs[0].shape) < math.prod(y.shape)
    ):
        return None
    (out,) = pool.outputs
    sharding = getattr(out, "sharding", None)
    m = mask_aval(out.shape, sharding)
    mine = Saved("aux", 1, tuple(m.shape), np.dtype(m.dtype), sharding)
    params = MappingProxyType({**pool.params, "relu_mask": True})
    pool = dataclasses.replace(pool, saves=pool.saves + (mine,), params=params)
    params = MappingProxyType({**relu.params, "mask_in_pool": True})
    return dataclasses.replace(relu, saves=(), params=params), pool


def shared_in_body(body: Tape, kept_exact: Callable[[ResidualInfo], bool] | None) -> Tape:
    """A loop body whose records keep the values their masks are read off instead of
    the masks (`keeping_operands`: max's operands, relu's output) where another record of
    the body saves those values anyway and the policy hands them back unchanged
    (``kept_exact``; None: every kept value is, as under `save()`). A body is not
    planned whole (`_checkpoint._plan_bodies`), so this is its part of
    `rebuilt_records`' switch; its values are per-step, kept only by its records."""
    holders: dict[int, set[int]] = {}
    for r in body.records:
        for s in r.saves:
            if s.kind != "aux":
                holders.setdefault(r.residual_key(s), set()).add(r.index)

    def kept(alt: Record, s: Saved) -> bool:
        v = (alt.inputs if s.kind == "in" else alt.outputs)[s.index]
        if not isinstance(v, Var) or not holders.get(v.id, set()) - {alt.index}:
            return False  # nobody else keeps it: the masks cost less
        info = ResidualInfo(alt, s, v.shape, v.dtype, False)
        return kept_exact is None or kept_exact(info)

    alts: dict[int, Record] = {}
    for r in body.records:
        if r.rule in ("rule", "linearized") and r.saves:
            alt = keeping_operands(r)
            if alt is not None and all(kept(alt, s) for s in alt.saves):
                alts[r.index] = alt
    return switched(body, alts) if alts else body


# Tapes with records switched to their plain forms, by source tape and switch: each
# eager call of a function traces the same (cached) tape and switches the same records,
# and gets the very same records back, their fused keys memoised with them.
_SWITCHED: weakref.WeakKeyDictionary[Tape, dict[tuple, Tape]] = weakref.WeakKeyDictionary()


def switched(tape: Tape, plain: dict[int, Record]) -> Tape:
    """``tape`` with the records in ``plain`` (by index) in their place, memoised."""
    memo = _SWITCHED.setdefault(tape, {})
    key = tuple(sorted((i, r.saves) for i, r in plain.items()))
    got = memo.get(key)
    if got is None:
        records = tuple(plain.get(r.index, r) for r in tape.records)
        got = memo[key] = dataclasses.replace(tape, records=records)
    return got


def _worth_rebuilding(draw: Record, readers: dict[int, list[Record]], saved: set[int]) -> bool:
    """Random bits are rebuilt only for kept values of as many elements as they have
    (reached through the rebuilt records that read them): a dropout mask is, a slice of
    a larger draw is not (the draw would cost more than the few bytes it frees)."""
    freed, seen, stack = 0, {draw.index}, [draw]
    while stack:
        r = stack.pop()
        for o in r.outputs:
            if o.id in saved:
                freed += math.prod(o.shape)
            for c in readers.get(o.id, ()):
                if c.index not in seen:
                    seen.add(c.index)
                    stack.append(c)
    return freed >= max(math.prod(o.shape) for o in draw.outputs)
