"""The bytes of a run's kept residuals, read off the packed arrays the policy produced:
per residual key, device and host bytes, the compressed part of each (bytes stored in a
dtype other than the residual's own), the bytes unpacked, and the bytes that are the
caller's own arrays; loop and branch records' per-step residuals measured off what the
run stacked or kept per step (`_Body`); bit widths under ``compress(bits="auto")``; and
the devices sharded values span (bytes count one device's shard)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import tree_util

from tapegrad.core.residual_policy import wrapped
from tapegrad.core.sizes import array_nbytes, as_dtype
from tapegrad.core.tape import Lit, Record, Tape
from tapegrad.engine.loops.common import _Stored
from tapegrad.engine.loops.saves import forwarded_ids
from tapegrad.engine.loops.schedule import _Segmented
from tapegrad.policies._lowbit import LowBit, residual_name
from tapegrad.policies.compress import Compress

__all__ = ["Accounts", "account"]


# Bytes of residuals, as a list: device, host, compressed on device, compressed on host
# (both already in the first two), and what they would take unpacked.
_Acc = list


def _measure(packed, info, runs: int = 1, seen: set[int] | None = None) -> _Acc:
    """The bytes of one packed residual; ``runs`` is how many body runs it stacks
    (``info`` describes one run's value). Arrays already in ``seen`` (a loop step's carry
    shared with the step before) count nothing; the ones counted are added to it."""
    d = h = 0
    dts = []
    new = 0
    for leaf in tree_util.tree_leaves(packed):
        if not hasattr(leaf, "nbytes") or not hasattr(leaf, "dtype"):
            continue
        dts.append(as_dtype(leaf.dtype))
        if seen is not None:
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
        new += 1
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device"
        if "host" in kind:
            h += array_nbytes(leaf)
        else:
            d += array_nbytes(leaf)
    if dts and not new:
        return [0] * 5  # all shared with a value counted already
    comp = info is not None and any(dt != info.dtype for dt in dts)
    orig = info.nbytes * runs if info is not None else d + h
    return [d, h, d if comp else 0, h if comp else 0, orig]


def _note_bits(packed, info, key, by_key: dict, named: dict) -> None:
    """Note the bits a floating residual was packed at: a `LowBit`'s, or the dtype's own
    width for one kept as it is (an input kept as it is: none)."""
    if info is None:
        return
    if isinstance(packed, LowBit):
        bits = packed.bits
    elif info.is_input or not jax.numpy.issubdtype(info.dtype, jax.numpy.floating):
        return
    else:
        dts = {as_dtype(leaf.dtype) for leaf in tree_util.tree_leaves(packed)}
        if dts != {info.dtype}:
            return  # packed some other way (a cast, int8)
        bits = info.dtype.itemsize * 8
    # A set: eagerly, a scan step's carry input shares the step before's packed output
    # (packed at that residual's width), all but the first step's.
    by_key.setdefault(key, set()).add(bits)
    values = int(math.prod(info.shape)) * info.trip_count
    named.setdefault(residual_name(info), (bits, values))


def _add(acc: _Acc, more: _Acc) -> _Acc:
    for i, v in enumerate(more):
        acc[i] += v
    return acc


def _is_body_key(key) -> bool:
    return type(key) is tuple and len(key) == 2 and key[0] == "body"


def _is_loop_store(x) -> bool:
    return isinstance(x, (_Stored, _Segmented))


class _Body:
    """The per-step residuals one loop/branch record held in a real run, measured off
    its `_Stored` (or a checkpointed scan's `_Segmented`), summed over every body run
    (each branch of a cond apart). ``seen``: ids of the arrays counted so far."""

    def __init__(self, rec: Record, seen: set[int], named: dict | None = None):
        n = len(rec.bodies)
        self.rec = rec
        self.seen = seen
        # Under compress(bits="auto") (``named`` given, shared with the whole report): bit
        # widths read off the packed values, per branch by key, and by residual name with
        # the values each packs.
        self.bits: list[dict[Any, set[int]]] = [{} for _ in range(n)]
        self.named = named
        self.keys: list[dict[Any, _Acc]] = [{} for _ in range(n)]
        self.nested: list[dict[int, _Body]] = [{} for _ in range(n)]
        self.runs = [0] * n  # body runs whose residuals are held, per branch
        self.checkpoints = [0] * 5  # a checkpointed scan's carries (no record's residual)

    def add(self, stored: Any, mult: int = 1, length: int | None = None) -> None:
        """Measure one `_Stored`; ``mult`` is how many runs each of its leaves already
        stacks (a body inside a stacked scan holds one row per outer step); ``length``
        the steps a scan's `_Stored` holds (its trip count unless told)."""
        rec = self.rec
        if isinstance(stored, _Segmented):  # the carry every k steps, then the remainder
            _add(self.checkpoints, _measure(stored.checkpoints, None, mult, self.seen))
            self.add(stored.rem, mult, stored.rem_length)
            return
        if stored.steps is not None:  # one Residuals per step (Python loop, concrete cond)
            b = stored.branch or 0
            for r in stored.steps:
                if r is not None:
                    self.runs[b] += mult
                    self._add_store(b, r.store, r.infos, mult)
        elif stored.values is not None:  # stacked (scan) or a union over branches (switch)
            if rec.primitive == "cond":
                for b in range(len(rec.bodies)):
                    self.runs[b] += mult
                    vals = dict(zip(stored.keys[b], stored.values[b]))
                    self._add_store(b, vals, stored.skel[b].infos, mult)
            else:
                runs = mult * (rec.trip_count if length is None else length)
                self.runs[0] += runs
                vals = dict(zip(stored.keys, stored.values))
                self._add_store(0, vals, stored.skel.infos, runs)
                # A carry saved as a step's input is the step before's saved output, but
                # for the first step's: the initial carry, kept beside the stack.
                firsts = {k_in: init for k_in, _, init in getattr(stored, "shifted", ())}
                self._add_store(0, firsts, stored.skel.infos, mult)

    def _add_store(self, b: int, store: dict, infos: dict, mult: int) -> None:
        body = self.rec.bodies[b]
        fwd = forwarded_ids(self.rec)
        consts = {v.id: c for v, c in body.consts}
        for key, packed in store.items():
            if key in fwd:
                continue  # kept once by the record itself (its own saves)
            if _is_body_key(key) and _is_loop_store(packed):
                j = key[1]
                nb = self.nested[b].setdefault(j, _Body(body.records[j], self.seen, self.named))
                nb.add(packed, mult)
                continue
            if key in consts and packed is consts[key]:
                continue  # the body's constant itself, owned by the tape
            acc = _measure(packed, infos.get(key), mult, self.seen)
            _add(self.keys[b].setdefault(key, [0] * 5), acc)
            if self.named is not None:
                _note_bits(packed, infos.get(key), key, self.bits[b], self.named)

    def sizes(self, b: int) -> dict[Any, _Acc]:
        """Branch ``b``'s residual key -> bytes over all runs (nested bodies as one key)."""
        out = dict(self.keys[b])
        for j, nb in self.nested[b].items():
            out[("body", j)] = nb.total()
        return out

    def total(self) -> _Acc:
        acc = list(self.checkpoints)
        for b in range(len(self.keys)):
            for a in self.sizes(b).values():
                _add(acc, a)
        return acc


def _arrays(x) -> list:
    """The arrays inside packed residuals, loop bodies' per-step residuals included."""
    out: list = []
    if isinstance(x, _Segmented):
        return _arrays(x.checkpoints) + _arrays(x.rem)
    if isinstance(x, _Stored):
        if x.steps is not None:
            for r in x.steps:
                if r is not None:
                    out.extend(_arrays(list(r.store.values())))
        if x.values is not None:
            out.extend(_arrays(x.values))
        out.extend(_arrays([init for _, _, init in getattr(x, "shifted", ())]))
        return out
    for leaf in tree_util.tree_leaves(x, is_leaf=_is_loop_store):
        if _is_loop_store(leaf):
            out.extend(_arrays(leaf))
        elif isinstance(leaf, jax.Array):
            out.append(leaf)
    return out


def _tape_owned(tape: Tape) -> set[int]:
    """Ids of the arrays ``tape`` owns: its constants and its records' literal values,
    its bodies' included."""
    out = {id(c) for _, c in tape.consts}
    for rec in tape.records:
        out.update(id(i.value) for i in rec.inputs if type(i) is Lit)
        for body in rec.bodies:
            out |= _tape_owned(body)
    return out


def _auto_of(policy: Any) -> Any:
    """The `compress(bits="auto")` policy packing the residuals (it or one it wraps)."""
    for p in wrapped(policy):
        if isinstance(p, Compress):
            return p if p.bits == "auto" else None
    return None


def _devices(values: Any) -> int:
    n = 1
    for leaf in tree_util.tree_leaves(values):
        n = max(n, len(getattr(getattr(leaf, "sharding", None), "device_set", ())))
    return n


def _processes(values: Any) -> int:
    """How many processes' devices the arrays among ``values`` span (a multi-process
    run's global arrays: all of them; this process sees only its own shards)."""
    n = 1
    for leaf in tree_util.tree_leaves(values):
        devs = getattr(getattr(leaf, "sharding", None), "device_set", ())
        n = max(n, len({getattr(d, "process_index", 0) for d in devs}))
    return n


@dataclass(frozen=True)
class Accounts:
    """What one run keeps, per residual key (a loop record's per-step residuals are one
    key, ``("body", index)``)."""

    # key -> [device, host, compressed on device, compressed on host, unpacked] bytes
    bytes_of: dict[Any, _Acc]
    bodies: dict[int, _Body]  # loop/branch record index -> its bodies' residuals
    sizes: dict[Any, int]  # key -> device + host bytes
    # key -> (device, host, compressed) bytes: compressed residuals count as compressed
    # wherever they live
    kind_of: dict[Any, tuple[int, int, int]]
    caller: dict[Any, int]  # key -> bytes that are the caller's own arrays
    auto: Any  # the compress(bits="auto") policy packing the residuals, or None
    bits: dict[Any, set[int]]  # under auto: key -> the bit widths read off its values
    named: dict[str, tuple[int, int]] | None  # under auto: name -> (bits, values packed)


def account(tape: Tape, res: Any, policy: Any, args: Sequence[Any] = ()) -> Accounts:
    """Measure the residuals ``res`` (a forward run of ``tape`` on ``args``) keeps."""
    const_ids = {v.id for v, _ in tape.consts}

    # Bytes per kept key, read off the packed values; a loop record's per-step residuals
    # are one key, measured (with its bodies' rows) off its _Stored.
    sizes_acc: dict[Any, _Acc] = {}
    bodies: dict[int, _Body] = {}
    # A literal or constant handed back as it is (`stop_gradient(1.0)` into a custom_vjp
    # that keeps it) is the tape's own, like ``const_ids``: no residual's bytes.
    seen: set[int] = _tape_owned(tape)
    # Under compress(bits="auto"): the bit widths read off the packed values.
    auto = _auto_of(policy)
    bits: dict[Any, set[int]] = {}
    named: dict[str, tuple[int, int]] | None = {} if auto is not None else None
    for key, packed in res.store.items():
        if key in const_ids:
            continue  # constants belong to the tape, not to the residuals
        if not (_is_body_key(key) and _is_loop_store(packed)):
            sizes_acc[key] = _measure(packed, res.infos.get(key), 1, seen)
            if named is not None:
                _note_bits(packed, res.infos.get(key), key, bits, named)
    for key, packed in res.store.items():  # loops last: what they share is counted once
        if _is_body_key(key) and _is_loop_store(packed):
            bm = bodies[key[1]] = _Body(tape.records[key[1]], seen, named)
            bm.add(packed)
            sizes_acc[key] = bm.total()
    sizes = {k: a[0] + a[1] for k, a in sizes_acc.items()}
    # by kind (device, host, compressed): compressed residuals count as compressed
    # wherever they live
    kind_of = {k: (a[0] - a[2], a[1] - a[3], a[2] + a[3]) for k, a in sizes_acc.items()}

    # Bytes of each kept value that are the caller's own arrays (an input kept as it is,
    # a loop's initial carry): alive before the call and after it, whatever is saved.
    arg_ids = {id(a) for a in args}
    caller: dict[Any, int] = {}
    for k in sizes:
        v = res.store[k]
        if _is_loop_store(v):
            n = sum(array_nbytes(a) for a in _arrays(v) if id(a) in arg_ids)
        else:
            n = sizes[k] if any(id(x) in arg_ids for x in tree_util.tree_leaves(v)) else 0
        if n:
            caller[k] = n
    return Accounts(sizes_acc, bodies, sizes, kind_of, caller, auto, bits, named)
