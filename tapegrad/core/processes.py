"""What the processes of a multi-process run (``jax.process_count() > 1``) tell each
other before they build a program: a few lines of text through `jax.distributed`'s
key-value store (its coordinator).

Every process of a multi-controller jax run compiles its own copy of each program, and
their collectives meet only if the copies match. A plan made from per-process figures (a
budget, a cost model timed on each machine) could differ from process to process, so the
planner compares them first (`check_same`) and `calibrate` measures on process 0 and
hands the figures to the others (`text_from_process_zero`).

Why not `jax.experimental.multihost_utils.process_allgather`: the planner runs while
`jax.jit` traces, where process_allgather cannot run (it is a jitted program of its own,
on a global mesh). The store is host-side, works anywhere, and every wait has a timeout
(`TIMEOUT_S`), so a process that never arrives is an error, not a hang.

Exchanges are matched by order: the n-th exchange of a topic on one process meets the
n-th of that topic on every other, so, as in any SPMD program, every process must make
the same tapegrad calls in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax

from tapegrad.core.jax_compat import distributed_client
from tapegrad.errors import ProcessMismatchError

__all__ = ["TIMEOUT_S", "allgather_text", "check_same", "text_from_process_zero"]

# Seconds a process waits for each other process's part of an exchange: the others may be
# busy compiling or calibrating, but a process that is not there by then never will be.
TIMEOUT_S = 300.0
# An exchange whose maker raised on its own process: the others raise too.
_FAILED = "\x00failed: "
# topic -> how many exchanges of it this process has made (the next one's number).
_ROUNDS: dict[str, int] = {}


def _client(topic: str) -> Any:
    client = distributed_client()
    if client is None:
        raise ProcessMismatchError(
            f"{topic}: jax reports {jax.process_count()} processes but jax.distributed is "
            "not initialized in this one, so they cannot compare what they will run. Call "
            "jax.distributed.initialize(...) on every process before tapegrad."
        )
    return client


def _key(topic: str) -> tuple[str, int]:
    n = _ROUNDS.get(topic, 0)
    _ROUNDS[topic] = n + 1
    return f"tapegrad/{topic}/{n}", n


def _get(client: Any, key: str, process: int, topic: str, n: int) -> str:
    try:
        text = client.blocking_key_value_get(key, int(TIMEOUT_S * 1000))
    except Exception as err:  # noqa: BLE001 -- jax's runtime error for a deadline
        raise ProcessMismatchError(
            f"{topic}: process {process} did not take part in exchange #{n} within "
            f"{TIMEOUT_S:g} s (tapegrad.core.processes.TIMEOUT_S). Every process must make "
            "the same tapegrad calls in the same order (each budget planned, each "
            "calibrate()), as in any SPMD program; or that process has died. "
            f"jax said: {err}"
        ) from err
    if text.startswith(_FAILED):
        raise ProcessMismatchError(f"{topic}: process {process} failed: {text[len(_FAILED) :]}")
    return text


def allgather_text(topic: str, text: str) -> list[str]:
    """Every process's ``text`` for this exchange of ``topic``, by process index (this
    process's own included)."""
    client = _client(topic)
    key, n = _key(topic)
    me = jax.process_index()
    client.key_value_set(f"{key}/{me}", text)
    return [
        text if p == me else _get(client, f"{key}/{p}", p, topic, n)
        for p in range(jax.process_count())
    ]


def text_from_process_zero(topic: str, make: Callable[[], str]) -> str:
    """``make()`` run on process 0 only, its text handed to every process. Where it
    raises on process 0, every other process raises a `ProcessMismatchError` saying so."""
    client = _client(topic)
    key, n = _key(topic)
    if jax.process_index() != 0:
        return _get(client, key, 0, topic, n)
    try:
        text = make()
    except BaseException as err:
        client.key_value_set(key, f"{_FAILED}{type(err).__name__}: {err}")
        raise
    client.key_value_set(key, text)
    return text


def _by_value(values: list[Any]) -> str:
    groups: dict[str, list[int]] = {}
    for p, v in enumerate(values):
        groups.setdefault(json.dumps(v), []).append(p)
    parts = []
    for v, procs in groups.items():
        who = "process" if len(procs) == 1 else "processes"
        parts.append(f"{who} {', '.join(map(str, procs))}: {v}")
    return "; ".join(parts)


def check_same(topic: str, fields: dict[str, Any], fix: str) -> None:
    """Raise a `ProcessMismatchError` on every process when any of ``fields`` (a name ->
    a JSON value) differs between processes, naming each field that differs and every
    process's value of it; ``fix`` says what to do. Does nothing in a single process."""
    if jax.process_count() <= 1:
        return
    texts = allgather_text(topic, json.dumps(fields, sort_keys=True))
    every = [json.loads(t) for t in texts]
    names = sorted(set().union(*every))
    differ = [k for k in names if len({json.dumps(f.get(k)) for f in every}) > 1]
    if not differ:
        return
    lines = "\n".join(f"  {k}: {_by_value([f.get(k) for f in every])}" for k in differ)
    raise ProcessMismatchError(
        f"{topic}: the {len(every)} processes of this run would build different programs, "
        "whose collectives would wait on each other forever. What differs:\n"
        f"{lines}\n{fix}"
    )
