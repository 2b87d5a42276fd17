"""The residual-policy protocol and the active-policy context.

Every residual a record saves goes through ``policy.pack(value, info)`` in
forward and ``policy.unpack(packed, info)`` in backward. The default,
`save()`, keeps the array as it is, and the interpreter skips the calls
entirely for it, so the default costs nothing.

Beside pack/unpack a policy may declare the optional members of `MEMBERS`
(docs/howto/custom_policy.md). This module is their one reader: the engine,
the report and the planner ask `capabilities(policy)`, `is_plain`, `is_exact`,
`keeps_exact`, `packs_inputs` and `resolve_prefetch`, never the policy itself,
and `check_policy` rejects a member of the wrong kind (or a near-miss name)
where the policy is given, naming the policy and the member.

The active policy lives in a `contextvars.ContextVar`: scopes are per thread
and per async task, and leaving a scope restores the previous policy even
when the body raises.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.sizes import device_nbytes, sharding_of

__all__ = [
    "ResidualPolicy",
    "ResidualInfo",
    "Save",
    "save",
    "residual_policy",
    "current_policy",
    "disable_saved_tensors_hooks",
    "packs_inputs",
    "keeps_exact",
    "MEMBERS",
    "Capabilities",
    "capabilities",
    "check_policy",
    "declared",
    "wrapped",
]


@dataclass(frozen=True, slots=True)
class ResidualInfo:
    """What a policy knows about one residual: its record, which value, shape, dtype, bytes."""

    record: Any  # tapegrad Record
    saved: Any  # tapegrad Saved: which input/output/derived value
    shape: tuple[int, ...]
    dtype: np.dtype
    # The value is one of the traced function's own inputs (or a closed-over constant):
    # the caller holds it anyway, so moving or compressing it frees no memory. Only
    # policies that opt in (``inputs = True``, see `packs_inputs`) are given such values.
    is_input: bool = False
    # The loop records (scan) this residual's record runs inside, outermost first: the
    # residual is packed once per step, `trip_count` times in all.
    loops: tuple = ()
    # The step index in each of those loops (a Python int eagerly, a traced uint32 inside
    # a traced scan body, valid only during that pack: backward's copy holds ``()``).
    # Steps that see identical data are told apart by it (a stochastic rounding that
    # seeds by the data alone would give them identical noise). Not compared or hashed.
    steps: tuple = field(default=(), compare=False)
    # Every (record, Saved) that keeps this value, in forward order: a value several
    # records keep is packed once, with the first's info, so a policy that depends on
    # how the value is read (kept exact where backward divides by it) asks them all.
    # Empty: only ``(record, saved)``.
    readers: tuple = field(default=(), compare=False, repr=False)
    # The input of a recomputed segment: backward re-runs records from this value, so a
    # rounding of it would reach every recomputed value (`compress(bits=...)` keeps it).
    segment_input: bool = False

    @property
    def savers(self) -> tuple:
        """``readers``, or ``((record, saved),)`` when none were given."""
        return self.readers or ((self.record, self.saved),)

    @property
    def nbytes(self) -> int:
        """Bytes of one packed value (one step's, inside a loop) that one device holds:
        the shard's, when the value's type is sharded over a mesh (Explicit axes)."""
        saved = self.saved
        sharding = sharding_of(saved) if saved is not None else None
        if sharding is not None and tuple(saved.shape) != tuple(self.shape):
            sharding = None
        return device_nbytes(tuple(self.shape), self.dtype, sharding)

    @property
    def trip_count(self) -> int:
        """How many times this residual is packed per forward (product of loop lengths)."""
        n = 1
        for rec in self.loops:
            n *= rec.trip_count
        return n

    @property
    def in_loop(self) -> bool:
        return bool(self.loops)

    @property
    def primitive(self) -> str:
        return self.record.primitive

    @property
    def source(self) -> str:
        return self.record.source

    @property
    def names(self) -> tuple[str, ...]:
        """Names given with `tg.name` / `checkpoint_name` to this value (if any)."""
        return tuple(getattr(self.record, "names", ()))

    def __str__(self) -> str:
        return (
            f"{self.saved} of '{self.record.primitive}' (record #{self.record.index}, "
            f"{self.dtype}{list(self.shape)}) at {self.record.source}"
        )


@runtime_checkable
class ResidualPolicy(Protocol):
    """``pack(value, info) -> anything`` in forward; ``unpack(packed, info) -> array`` after."""

    def pack(self, value: Any, info: ResidualInfo) -> Any: ...

    def unpack(self, packed: Any, info: ResidualInfo) -> Any: ...


# The protocol's optional members: what a policy may say beside pack/unpack, and the
# kind of value each must be. docs/howto/custom_policy.md documents each one.
MEMBERS: dict[str, str] = {
    "exact": "bool",  # unpack(pack(x)) is x bit for bit (save, offload)
    "keeps_exact": "callable",  # (info) -> bool: this residual comes back unchanged
    "inputs": "bool",  # pack the function's own inputs too (default: never given them)
    "packs": "bool",  # a wrapper (with `base`) that moves or shrinks some values itself
    "base": "policy",  # the policy a wrapper hands residuals to
    "prefetch": "prefetch",  # records ahead backward unpacks: an int >= 0, or "auto"
    "costs": "any",  # the cost model prefetch="auto" reads
    "choose": "callable",  # (record) -> CheckpointPolicy: save or recompute, and how firmly
    "decide": "callable",  # (record) -> "save" | "recompute"
    "plan": "callable",  # (tape, fixed[, rebuilt]) -> one "save"/"recompute" per record
    "loop_segment": "callable",  # (scan record) -> segment length, or a LoopPlan
    "loop_schedule": "callable",  # (scan record) -> segment lengths, outermost first
    "loop_snapshots": "callable",  # (scan record) -> snapshots of a binomial schedule
}
_MISSING = object()


def declared(policy: Any, name: str, default: Any = None) -> Any:
    """``policy``'s own value of the protocol member ``name``, or ``default`` when it
    declares none. The one place the package reads a policy's optional members."""
    if name not in MEMBERS:
        raise KeyError(f"{name!r} is not a member of the residual-policy protocol")
    got = getattr(policy, name, _MISSING)
    return default if got is _MISSING or got is None else got


def wrapped(policy: Any) -> Iterator[Any]:
    """``policy``, the policy it wraps (its ``base``), that one's base, ..."""
    for _ in range(16):
        if policy is None:
            return
        yield policy
        policy = declared(policy, "base")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one policy says beside pack/unpack, read once (`capabilities`).

    ``base``: the policy it wraps, or None; the per-record and per-loop members are
    None where the policy declares none (a planner's ``choose`` is its base's).
    ``prefetch`` and ``costs`` are not kept: a budget sets its prefetch as it plans, and
    both are read when backward runs (`resolve_prefetch`)."""

    base: Any
    choose: Callable | None
    decide: Callable | None
    plan: Callable | None
    loop_segment: Callable | None
    loop_schedule: Callable | None
    loop_snapshots: Callable | None

    @property
    def planner_choose(self) -> Callable | None:
        """The per-record hints a planner (``plan``) takes: its base's ``choose``."""
        return declared(self.base, "choose") if self.base is not None else None


def capabilities(policy: Any) -> Capabilities:
    """The optional members ``policy`` declares, in one object."""
    get = functools.partial(declared, policy)
    return Capabilities(
        get("base"),
        get("choose"),
        get("decide"),
        get("plan"),
        get("loop_segment"),
        get("loop_schedule"),
        get("loop_snapshots"),
    )


def _kind_ok(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, (bool, np.bool_))
    if kind == "callable":
        return callable(value)
    if kind == "prefetch":
        return bool(
            value == "auto"
            or (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0)
        )
    return True


def check_policy(policy: Any) -> None:
    """Raise a `TypeError` naming ``policy`` and the member when a policy (or one it
    wraps) lacks a callable ``pack``/``unpack``, declares a member of the wrong kind, or
    a name one letter or two from a member's (``keep_exact`` for ``keeps_exact``), which
    would otherwise be ignored and give a plan or a gradient the user did not ask for."""
    for p in wrapped(policy):
        if p is SAVE:
            return
        for name in ("pack", "unpack"):
            if not callable(getattr(p, name, None)):
                raise TypeError(
                    f"residual policy {p!r} has no callable {name}(): a policy implements "
                    "pack(value, info) and unpack(packed, info) (docs/howto/custom_policy.md)."
                )
        for name, kind in MEMBERS.items():
            value = declared(p, name)
            if value is not None and not _kind_ok(kind, value):
                want = {"prefetch": 'an int >= 0 or "auto"', "policy": "a policy"}.get(kind, kind)
                raise TypeError(
                    f"residual policy {p!r} declares {name}={value!r}; the protocol's {name} "
                    f"is {want} (docs/howto/custom_policy.md)."
                )
        own = set(getattr(p, "__dict__", {})) | {n for c in type(p).__mro__ for n in vars(c)}
        for name in sorted(n for n in own if not n.startswith("_") and n not in MEMBERS):
            near = difflib.get_close_matches(name, MEMBERS, n=1, cutoff=0.9)
            if near:
                raise TypeError(
                    f"residual policy {p!r} declares {name!r}, which is not a member of the "
                    f"residual-policy protocol: did you mean {near[0]!r}? "
                    "(docs/howto/custom_policy.md lists the members)"
                )


def check_plan(policy: Any, tape: Any, got: Any) -> list[str]:
    """A planner's decisions, checked: one "save" or "recompute" per record of ``tape``."""
    out = list(got) if isinstance(got, (list, tuple)) else None
    if (
        out is None
        or len(out) != len(tape.records)
        or any(d not in ("save", "recompute") for d in out)
    ):
        raise TypeError(
            f"residual policy {policy!r}: plan() must return one 'save' or 'recompute' per "
            f"record ({len(tape.records)} here), got {got!r:.200}."
        )
    return out


class Save:
    """Keep residuals on device as they are: no copy, no extra op."""

    exact = True

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        return packed

    def __repr__(self) -> str:
        return "save()"


SAVE = Save()


def is_plain(policy: Any) -> bool:
    """True when residuals end up saved as they are: `save()`, or a wrapper (selective,
    budget) whose ``base`` is `save()`. The interpreter then skips pack/unpack."""
    while policy is not SAVE and declared(policy, "base") is not None:
        if declared(policy, "packs", False):  # a wrapper that moves or shrinks some itself
            return False
        policy = declared(policy, "base")
    return policy is SAVE


def is_exact(policy: Any) -> bool:
    """True when ``unpack`` gives back exactly the values ``pack`` was given: `save()`,
    `offload()`, and wrappers of them. A policy says so with ``exact = True``; one that
    does not (`compress`, hooks, `route`) is taken to change values. Under such a
    policy backward rebuilds a value only from operands it keeps unchanged
    (`keeps_exact`, `_rebuild.rebuilt_records`): rebuilt from rounded operands, a
    value the policy itself would keep exact (a divisor, under low-bit compression)
    would come back rounded."""
    return policy is None or bool(_exact_declaration(policy)[1])


def _exact_declaration(policy: Any) -> tuple[Any, bool | None]:
    """(the policy whose own ``exact`` answers for ``policy``: it, or the base of a wrapper
    that packs nothing itself; that answer), or (None, None) where none declares one."""
    for p in wrapped(policy):
        exact = declared(p, "exact")
        if exact is not None:
            return p, bool(exact)
        if declared(p, "packs", False):
            break
    return None, None


def exact_claim(policy: Any) -> Any:
    """The policy written outside tapegrad whose own ``exact = True`` makes ``policy``
    exact (`is_exact`): it, or one it wraps; None where there is none (tapegrad's own
    exact policies, `save()` and `offload()`, are not taken on trust from users)."""
    who, exact = _exact_declaration(policy)
    if not exact or type(who).__module__.split(".")[0] == "tapegrad":
        return None
    return who


def check_exact(claim: Any, value: Any, back: Any, info: ResidualInfo) -> None:
    """Raise a `TypeError` naming the policy when ``back`` (``unpack(pack(value))``) is
    not ``value`` bit for bit although ``claim`` declares ``exact = True``: backward
    would rebuild values from ones the policy changed, and give a wrong gradient. (A
    ``back`` of another shape or dtype breaks pack/unpack's own contract, which backward
    checks with the record's line: `engine.residuals._unpack`.)"""
    a, b = np.asarray(value), np.asarray(back)
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype == object:
        return
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        raise TypeError(
            f"residual policy {claim!r} declares exact=True, but unpack(pack(x)) is not x "
            f"bit for bit for {info} (its first values came back as {b.ravel()[:3]} for "
            f"{a.ravel()[:3]}). Backward rebuilds values from what an "
            "exact policy keeps, so a policy that rounds, compresses or scales must not "
            "declare exact (docs/howto/custom_policy.md)."
        )


def keeps_exact(policy: Any, info: ResidualInfo) -> bool:
    """Whether ``policy`` hands backward the residual ``info`` describes unchanged, bit for
    bit: always under an exact policy (`is_exact`); an input the policy is not given
    (`packs_inputs`); else what the policy's own ``keeps_exact(info)`` says (`compress`:
    integer and boolean values, values already in a dtype no larger than its target). A
    policy without that method is taken to change everything it packs.

    Backward rebuilds a cheap value under a lossy policy only from operands this holds
    for (`_rebuild.rebuilt_records`): the rebuilt value is then exact too."""
    if is_exact(policy):
        return True
    if info.is_input and not packs_inputs(policy):
        return True
    for _ in range(8):  # wrappers that pack nothing themselves answer with their base
        own = declared(policy, "keeps_exact")
        if own is not None:
            return bool(own(info))
        if declared(policy, "base") is None or declared(policy, "packs", False):
            return False
        policy = declared(policy, "base")
    return False


def packs_inputs(policy: Any) -> bool:
    """Whether ``policy`` wants the residuals that are the function's own inputs packed.

    The caller holds its inputs (weights, the batch) until backward anyway, so moving or
    shrinking one adds a copy and frees nothing: policies never add memory by default.
    The interpreter hands an input to ``pack`` only when the policy says ``inputs =
    True``: `offload(inputs=True)`, `compress(..., inputs=True)`, `hooks` /
    `saved_tensors_hooks` (PyTorch calls pack hooks on every saved tensor) and `route`
    (its function sees every residual; the policy it picks decides). A wrapper
    (`budget`, `tg.selective`, `scan_checkpoint`) answers with its ``base``; a custom
    policy without the attribute is never given an input (``info.is_input`` is False
    for everything it packs).
    """
    for p in wrapped(policy):  # wrappers keep the policy they wrap in ``base``
        flag = declared(p, "inputs")
        if flag is not None:
            return bool(flag)
    return False


def as_array(value: Any, info: ResidualInfo) -> Any:
    """``value`` as a jax array of the residual's dtype: an input given as a Python or
    numpy scalar or a numpy array reaches ``pack`` as the caller passed it."""
    if isinstance(value, jax.Array):
        return value
    return jnp.asarray(value, dtype=info.dtype)


def save() -> Save:
    """The default policy: keep every residual on device, unchanged."""
    return SAVE


_POLICY: contextvars.ContextVar[Any] = contextvars.ContextVar("tapegrad_policy", default=None)
_DISABLED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tapegrad_hooks_disabled", default=None
)


def current_policy() -> Any:
    """The policy of the innermost enclosing `residual_policy` / `saved_tensors_hooks`."""
    p = _POLICY.get()
    return SAVE if p is None else p


# Policies already checked, by id, each with a weak reference that tells a later object
# at the same address apart (a policy that cannot be weakly referenced is checked each
# time: a few attribute reads).
_CHECKED: dict[int, Any] = {}


def resolve_policy(explicit: Any) -> Any:
    """The policy a transform runs with, checked (`check_policy`): an explicit
    ``policy=`` wins over the enclosing context."""
    policy = explicit if explicit is not None else current_policy()
    if policy is SAVE:
        return policy
    ref = _CHECKED.get(id(policy))
    if ref is None or ref() is not policy:
        check_policy(policy)
        try:
            if len(_CHECKED) > 256:
                _CHECKED.clear()
            _CHECKED[id(policy)] = weakref.ref(policy)
        except TypeError:
            pass
    return policy


def _check_not_disabled() -> None:
    msg = _DISABLED.get()
    if msg is not None:
        e = RuntimeError(msg)
        e.add_note(
            "tapegrad: saved-tensor hooks are disabled here (tg.disable_saved_tensors_hooks): "
            "register the hooks outside that scope."
        )
        raise e


@contextlib.contextmanager
def residual_policy(policy: Any) -> Iterator[Any]:
    """Use ``policy`` for every residual saved inside the ``with`` block.

    ```python
    with tg.residual_policy(tg.policies.compress(jnp.bfloat16)):
        out, vjp_fn = tg.vjp(f, x)
    ```
    Nesting: the inner scope wins. `vjp_fn` keeps the policy that packed its
    residuals, so it unpacks correctly after the scope has closed.
    """
    if policy is not SAVE:
        _check_not_disabled()
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


@contextlib.contextmanager
def disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
    """Inside this scope, registering hooks or a residual policy raises
    ``RuntimeError(error_message)``.

    As PyTorch's, it refuses to start while hooks are active: entering it inside a
    `saved_tensors_hooks` / `residual_policy` scope (any policy but `save()`) raises
    ``RuntimeError(error_message)`` too, and changes nothing. Nested, the innermost
    message wins, and leaving a scope restores the one around it.

    ```python
    with tg.disable_saved_tensors_hooks("this library manages its own residuals"):
        ...  # tg.saved_tensors_hooks(pack, unpack) here raises RuntimeError
    ```
    """
    active = _POLICY.get()
    if active is not None and active is not SAVE:
        e = RuntimeError(error_message)
        e.add_note(
            f"tapegrad: saved-tensor hooks ({active!r}) are active where "
            "disable_saved_tensors_hooks was entered. Enter it outside the "
            "saved_tensors_hooks / residual_policy scope, or pass the policy to the "
            "transform that needs it (tg.grad(f, policy=...)) instead of a scope."
        )
        raise e
    token = _DISABLED.set(error_message)
    try:
        yield
    finally:
        _DISABLED.reset(token)


# How deep a policy's ``prefetch="auto"`` looks ahead, from a cost model that sits above
# this layer (the planner's `prefetch_depth` registers itself here on import).
_AUTO_PREFETCH: list[Callable[[Any, Any], int]] = []


def register_auto_prefetch(fn: Callable[[Any, Any], int]) -> None:
    """``fn(tape, costs) -> depth`` answers ``prefetch="auto"`` (the cost model's)."""
    _AUTO_PREFETCH[:] = [fn]


def resolve_prefetch(policy: Any, tape: Any) -> int:
    """A policy's ``prefetch`` on ``tape``: an int as it is, ``"auto"`` from the cost
    model (`prefetch_depth` with the policy's ``costs``, else the backend's)."""
    p = declared(policy, "prefetch", 0)
    if p == "auto":
        if not _AUTO_PREFETCH:
            raise RuntimeError("prefetch='auto' needs tapegrad's cost model; import tapegrad")
        return _AUTO_PREFETCH[0](tape, declared(policy, "costs"))
    return int(p or 0)
