"""`tapegrad.core.processes` without a second process: a fake key-value client stands
in for `jax.distributed`'s, holding what the "other" process published (the real
exchange runs in tests/test_multiprocess.py)."""

from __future__ import annotations

import jax
import pytest

import tapegrad as tg
from tapegrad.core import processes
from tapegrad.planner.cost import default_costs


class FakeClient:
    """`jax.distributed`'s key-value client, in a dict; a missing key is a deadline."""

    def __init__(self, store: dict[str, str]):
        self.store = dict(store)

    def key_value_set(self, key: str, value: str) -> None:
        assert key not in self.store, f"{key} published twice"
        self.store[key] = value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.store[key]


@pytest.fixture
def as_process(monkeypatch):
    """Pretend to be process ``index`` of ``count``, the others' texts in ``store``."""

    def become(index: int, count: int, store: dict[str, str]) -> FakeClient:
        client = FakeClient(store)
        monkeypatch.setattr(processes, "distributed_client", lambda: client)
        monkeypatch.setattr(processes, "_ROUNDS", {})
        monkeypatch.setattr(jax, "process_index", lambda: index)
        monkeypatch.setattr(jax, "process_count", lambda: count)
        return client

    return become


def test_check_same_does_nothing_on_one_process():
    processes.check_same("topic", {"bytes": 1}, "fix")  # no client needed


def test_check_same_passes_when_every_process_agrees(as_process):
    client = as_process(0, 2, {"tapegrad/t/0/1": '{"bytes": 5}'})
    processes.check_same("t", {"bytes": 5}, "fix")
    assert client.store["tapegrad/t/0/0"] == '{"bytes": 5}'  # this process's part


def test_check_same_names_each_field_and_every_processs_value(as_process):
    as_process(1, 3, {"tapegrad/t/0/0": '{"a": 1, "b": 2}', "tapegrad/t/0/2": '{"a": 1, "b": 2}'})
    with pytest.raises(tg.ProcessMismatchError) as err:
        processes.check_same("t", {"a": 1, "b": 3}, "Do the same everywhere.")
    msg = str(err.value)
    assert "  b: processes 0, 2: 2; process 1: 3\n" in msg, msg
    assert "  a:" not in msg and msg.endswith("Do the same everywhere."), msg


def test_a_process_that_never_arrives_is_an_error_not_a_hang(as_process, monkeypatch):
    as_process(0, 2, {})
    monkeypatch.setattr(processes, "TIMEOUT_S", 0.01)
    with pytest.raises(tg.ProcessMismatchError, match="process 1 did not take part in exchange #0"):
        processes.allgather_text("t", "x")


def test_text_from_process_zero(as_process):
    client = as_process(0, 2, {})
    assert processes.text_from_process_zero("c", lambda: "figures") == "figures"
    assert client.store == {"tapegrad/c/0": "figures"}
    as_process(1, 2, client.store)
    assert processes.text_from_process_zero("c", lambda: pytest.fail("measured")) == "figures"


def test_a_failure_on_process_zero_is_raised_on_the_others(as_process):
    client = as_process(0, 2, {})
    with pytest.raises(ZeroDivisionError):
        processes.text_from_process_zero("c", lambda: str(1 / 0))
    as_process(1, 2, client.store)
    with pytest.raises(tg.ProcessMismatchError, match="process 0 failed: ZeroDivisionError"):
        processes.text_from_process_zero("c", lambda: "")


def test_budget_fields_name_what_a_plan_depends_on():
    pol = tg.policies.budget(bytes=1000, allow=("save", "recompute", "offload"))
    fields = pol.plan_fields()
    assert fields["bytes"] == 1000 and fields["allow"] == ["save", "recompute", "offload"]
    assert fields["costs.flops_per_s"] == default_costs().flops_per_s
    assert "candidates.JOINT_WORK" in fields
