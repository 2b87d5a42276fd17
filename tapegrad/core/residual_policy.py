"""The residual-policy protocol and the active-policy context.

Every residual a record saves goes through ``policy.pack(value, info)`` in
forward and ``policy.unpack(packed, info)`` in backward. The default,
`save()`, keeps the array as it is, and the interpreter skips the calls
entirely for it, so the default costs nothing.

The active policy lives in a `contextvars.ContextVar`: scopes are per thread
and per async task, and leaving a scope restores the previous policy even
when the body raises.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.tape import device_nbytes

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
        sharding = getattr(saved, "sharding", None) if saved is not None else None
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
    while policy is not SAVE and hasattr(policy, "base"):
        if getattr(policy, "packs", False):  # a wrapper that moves or shrinks some itself
            return False
        policy = policy.base
    return policy is SAVE


def is_exact(policy: Any) -> bool:
    """True when ``unpack`` gives back exactly the values ``pack`` was given: `save()`,
    `offload()`, and wrappers of them. A policy says so with ``exact = True``; one that
    does not (`compress`, hooks, `route`) is taken to change values. Under such a
    policy backward rebuilds a value only from operands it keeps unchanged
    (`keeps_exact`, `_rebuild.rebuilt_records`): rebuilt from rounded operands, a
    value the policy itself would keep exact (a divisor, under low-bit compression)
    would come back rounded."""
    if policy is None:
        return True
    while True:
        exact = getattr(policy, "exact", None)
        if exact is not None:
            return bool(exact)
        if hasattr(policy, "base") and not getattr(policy, "packs", False):
            policy = policy.base
            continue
        return False


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
        own = getattr(policy, "keeps_exact", None)
        if own is not None:
            return bool(own(info))
        if not hasattr(policy, "base") or getattr(policy, "packs", False):
            return False
        policy = policy.base
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
    for _ in range(8):  # wrappers keep the policy they wrap in ``base``
        flag = getattr(policy, "inputs", None)
        if flag is not None:
            return bool(flag)
        policy = getattr(policy, "base", None)
        if policy is None:
            break
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


def resolve_policy(explicit: Any) -> Any:
    """An explicit ``policy=`` wins over the enclosing context."""
    return explicit if explicit is not None else current_policy()


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
    p = getattr(policy, "prefetch", 0)
    if p == "auto":
        if not _AUTO_PREFETCH:
            raise RuntimeError("prefetch='auto' needs tapegrad's cost model; import tapegrad")
        return _AUTO_PREFETCH[0](tape, getattr(policy, "costs", None))
    return int(p or 0)
