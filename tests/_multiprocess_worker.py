"""One process of tests/test_multiprocess.py's run: ``python _multiprocess_worker.py PORT
PROCESS_ID NUM_PROCESSES OUT_DIR``, with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` set by the launcher.

It joins the run (`jax.distributed.initialize` on 127.0.0.1), then runs every case of
`CASES` in order, each under `jax.jit` (eager calls on global arrays can hang in jax
itself), comparing tapegrad against jax: values gathered with `process_allgather`, and
the gradients' shardings. After each case it rewrites ``OUT_DIR/process<i>.json``
(``{"cases": {name: {"ok", "info", "error"}}, "done"}``), so a run killed half-way still
says which case it was in. Comparisons run after a case's last collective, so a case that
fails on one process does not leave the other waiting in one.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils as mu
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# Before jax.distributed.initialize, as a user's script would: importing tapegrad must not
# start jax's backend (initialize refuses to run after that).
import tapegrad as tg
import tapegrad.core.processes

LAYOUTS = ("dp", "tp")  # data-parallel: 4 devices on "data"; tensor-parallel: 2 x 2
AXES = ("auto", "explicit")
POLICIES = ("save", "offload", "checkpoint", "scan", "budget", "train")
# The cases, in the order they run. calibrate runs first, so every budget below plans
# with the figures process 0 measured (they would differ per process otherwise).
CASES = (
    ("calibrate",)
    + tuple(f"{p}/{lay}/{ax}" for ax in AXES for lay in LAYOUTS for p in POLICIES)
    + ("reports/dp/explicit", "reports/tp/auto", "mismatch/bytes", "mismatch/costs")
)

L, B, D, H = 2, 16, 8, 16  # layers, batch, width, hidden
RNG = np.random.RandomState(0)
W1 = np.float32(RNG.standard_normal((L, D, H)) * 0.3)
W2 = np.float32(RNG.standard_normal((L, H, D)) * 0.3)
X = np.float32(RNG.standard_normal((B, D)))
Y = np.float32(RNG.standard_normal((B, D)))


class Setup:
    """One layout on one kind of mesh: its arrays (global, each process holding its
    shards) and its models, built of the same layer."""

    def __init__(self, layout: str, axes: str, pid: int, nproc: int):
        kind = AxisType.Explicit if axes == "explicit" else AxisType.Auto
        ndev = jax.device_count()
        if layout == "dp":
            self.mesh = jax.make_mesh((ndev,), ("data",), axis_types=(kind,))
            w1s, w2s = P(), P()
            out = None
        else:  # "model" within a process, "data" across processes
            self.mesh = jax.make_mesh((nproc, ndev // nproc), ("data", "model"), (kind, kind))
            w1s, w2s = P(None, None, "model"), P(None, "model", None)
            # Explicit axes: contracting a sharded dimension needs the output's sharding.
            out = NamedSharding(self.mesh, P("data", None)) if axes == "explicit" else None
        self.explicit = axes == "explicit"
        self.w1 = self._put(W1, w1s)
        self.w2 = self._put(W2, w2s)
        batch = NamedSharding(self.mesh, P("data", None))
        rows = B // nproc  # this process's part of the batch
        local = slice(pid * rows, (pid + 1) * rows)
        self.x = jax.make_array_from_process_local_data(batch, X[local], X.shape)
        self.y = jax.make_array_from_process_local_data(batch, Y[local], Y.shape)

        def layer(h, w1, w2):
            return jnp.einsum("bh,hd->bd", jnp.tanh(h @ w1), w2, out_sharding=out)

        def loss(w1, w2, x, y):
            h = x
            for i in range(L):
                h = layer(h, w1[i], w2[i])
            return jnp.mean((h - y) ** 2)

        def loss_checkpoint(w1, w2, x, y):
            h = x
            for i in range(L):
                h = tg.checkpoint(layer)(h, w1[i], w2[i])
            return jnp.mean((h - y) ** 2)

        def loss_scan(w1, w2, x, y):
            h, _ = lax.scan(lambda h, w: (layer(h, *w), None), x, (w1, w2))
            return jnp.mean((h - y) ** 2)

        self.loss, self.loss_checkpoint, self.loss_scan = loss, loss_checkpoint, loss_scan

    def _put(self, a: np.ndarray, spec: P) -> jax.Array:
        s = NamedSharding(self.mesh, spec)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    @property
    def args(self) -> tuple:
        return (self.w1, self.w2, self.x, self.y)


def gathered(tree):
    """Every value of ``tree``, whole, on every process."""
    return jax.tree.map(np.asarray, mu.process_allgather(tree, tiled=True))


def assert_match(got, want, what: str) -> None:
    """tapegrad's result against jax's: values (gathered) and every leaf's sharding.
    Gathers first: a check that fails must not leave the other processes in a gather."""
    g_all, w_all = gathered(got), gathered(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (what, g.sharding, w.sharding)
    for g, w in zip(jax.tree.leaves(g_all), jax.tree.leaves(w_all), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6, err_msg=what)


def both(fun, policy=None):
    """tapegrad's value_and_grad and jax's side by side, as one compiled program (one
    compile per case instead of two: compiling is most of this run's time). Where the
    two agree op for op, XLA may share their work; where tapegrad differs, it cannot."""
    tg_vg = tg.value_and_grad(fun, argnums=(0, 1), policy=policy)
    jax_vg = jax.value_and_grad(fun, argnums=(0, 1))
    return jax.jit(lambda *args: (tg_vg(*args), jax_vg(*args)))


def value_and_grad_case(s: Setup, policy_name: str) -> dict:
    fun = {"checkpoint": s.loss_checkpoint, "scan": s.loss_scan}.get(policy_name, s.loss)
    policy = tg.policies.offload() if policy_name == "offload" else None
    with jax.set_mesh(s.mesh):
        got, want = both(fun, policy)(*s.args)
        if policy_name == "checkpoint":
            tape = tg.trace(fun, argnums=(0, 1))(*s.args)
            assert tape.segments, "no recomputed segment under tg.checkpoint"
        assert_match(got, want, policy_name)
    return {"loss": float(gathered(got[0]))}


def budget_case(s: Setup) -> dict:
    with jax.set_mesh(s.mesh):
        rep = tg.memory_report(s.loss, argnums=(0, 1))(*s.args)  # eager: every process
        budget = rep.peak_beyond_inputs_bytes
        pol = tg.policies.budget(bytes=budget)
        got, want = both(s.loss, pol)(*s.args)
        assert_match(got, want, "budget")
    assert pol.last["peak_bytes"] <= budget, (pol.last["peak_bytes"], budget)
    return {"budget": budget, "planned_peak": pol.last["peak_bytes"]}


def train_case(s: Setup) -> dict:
    """Three SGD steps, tapegrad's and jax's, from the same weights (one program steps
    both)."""

    def sgd(value_and_grad, w1, w2, x, y):
        loss, (g1, g2) = value_and_grad(s.loss, argnums=(0, 1))(w1, w2, x, y)
        return loss, w1 - 0.1 * g1, w2 - 0.1 * g2

    @jax.jit
    def step(t, j, x, y):  # a global array is an argument: jit refuses to close over one
        return sgd(tg.value_and_grad, *t[1:], x, y), sgd(jax.value_and_grad, *j[1:], x, y)

    losses = []
    with jax.set_mesh(s.mesh):
        t = j = (None, s.w1, s.w2)
        for _ in range(3):
            t, j = step(t, j, s.x, s.y)
            assert_match(t, j, "train")
            losses.append(float(gathered(t[0])))
    assert losses[2] < losses[0], ("SGD did not lower the loss", losses)
    return {"losses": losses}


def calibrate_case() -> dict:
    """calibrate() on every process: process 0 measures, the others get its figures
    (it used to time on jax.devices()[0], process 0's device, and fail elsewhere)."""
    costs = tg.policies.calibrate(size=256, mbytes=1, repeats=1)
    assert costs.measured, costs
    figures = np.array(
        [costs.flops_per_s, costs.d2h_bytes_per_s, costs.h2d_bytes_per_s,
         costs.compress_bytes_per_s, costs.lowbit_bytes_per_s], np.float64,
    )  # fmt: skip
    every = np.asarray(mu.process_allgather(figures.view(np.uint32)))  # bit for bit
    assert (every == every[0]).all(), every.view(np.float64)
    return {"flops_per_s": costs.flops_per_s}


def reports_case(s: Setup) -> dict:
    """memory_report and jax_residuals on global arrays count the shard one of this
    process's devices holds, and say so."""
    with jax.set_mesh(s.mesh):
        rep = tg.memory_report(s.loss, argnums=(0, 1))(*s.args)
        jr = tg.jax_residuals(s.loss, argnums=(0, 1))(*s.args)
    n, procs = jax.device_count(), jax.process_count()
    for r in (rep, jr):
        assert (r.devices, r.processes) == (n, procs), (r.devices, r.processes)
        assert f"values sharded over {n} devices of {procs} processes" in str(r), str(r)
    info = {"beyond_inputs": rep.beyond_inputs_bytes, "jax_beyond": jr.beyond_inputs_bytes}
    if s.explicit and len(s.mesh.axis_names) == 1:
        # Oracle: the same report of whole arrays on this process's first device alone.
        # Batch-sharded over every device, each activation's shard is 1/n of it.
        whole = tg.memory_report(s.loss, argnums=(0, 1))(W1, W2, X, Y)
        assert whole.devices == 1, whole.devices
        assert rep.beyond_inputs_bytes * n == whole.beyond_inputs_bytes, (
            rep.beyond_inputs_bytes, whole.beyond_inputs_bytes)  # fmt: skip
        info["whole_beyond_inputs"] = whole.beyond_inputs_bytes
    return info


def mismatch_case(s: Setup, field: str, pid: int) -> dict:
    """One process plans with other figures: every process raises before anything runs."""
    if field == "bytes":
        pol = tg.policies.budget(bytes=10**6 + pid)
    else:
        base = tg.policies.CostModel(5e10 * (1 + pid), 5e9, 5e9, 2e9)
        pol = tg.policies.budget(bytes=10**6, costs=base)
    try:
        with jax.set_mesh(s.mesh):
            jax.jit(tg.grad(s.loss, argnums=(0, 1), policy=pol))(*s.args)
    except tg.ProcessMismatchError as err:
        msg = str(err)
    else:
        raise AssertionError("no ProcessMismatchError")
    name = "bytes" if field == "bytes" else "costs.flops_per_s"
    assert f"  {name}: process 0: " in msg and "; process 1: " in msg, msg
    return {"message": msg}


def run_case(name: str, pid: int, nproc: int, setups: dict) -> dict:
    if name == "calibrate":
        return calibrate_case()
    what, *rest = name.split("/")
    if what == "mismatch":
        return mismatch_case(setups["dp", "explicit"], rest[0], pid)
    key = (rest[0], rest[1])
    if key not in setups:
        setups[key] = Setup(rest[0], rest[1], pid, nproc)
    s = setups[key]
    if what == "budget":
        return budget_case(s)
    if what == "train":
        return train_case(s)
    if what == "reports":
        return reports_case(s)
    return value_and_grad_case(s, what)


def main() -> None:
    port, pid, nproc, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # A hang anywhere ends this process with every thread's stack on stderr, before the
    # launcher's own deadline kills it.
    faulthandler.dump_traceback_later(float(os.environ.get("TG_WORKER_TIMEOUT_S", 240)), exit=True)
    t0 = time.perf_counter()
    addr = f"127.0.0.1:{port}"
    jax.distributed.initialize(
        coordinator_address=addr,
        num_processes=nproc,
        process_id=pid,
        coordinator_bind_address=addr,
        initialization_timeout=60,
    )
    tapegrad.core.processes.TIMEOUT_S = 60.0  # a process missing from an exchange: fail fast
    results: dict = {"cases": {}, "done": False, "setup_s": time.perf_counter() - t0}
    path = os.path.join(out_dir, f"process{pid}.json")

    def write() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    setups: dict = {}
    for name in CASES:
        results["running"] = name
        write()
        t = time.perf_counter()
        try:
            info, error = run_case(name, pid, nproc, setups), None
        except Exception:  # noqa: BLE001 -- reported to the test, which fails on it
            info, error = None, traceback.format_exc()
        results["cases"][name] = {
            "ok": error is None,
            "info": info,
            "error": error,
            "s": time.perf_counter() - t,
        }
    results["running"] = None
    results["done"] = True
    results["total_s"] = time.perf_counter() - t0
    write()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
