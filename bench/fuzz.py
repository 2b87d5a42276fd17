"""Fuzz: random programs x every built-in residual policy x anomaly mode on/off (issue 14).

    python bench/fuzz.py                          # 10,000 programs, a fresh seed
    python bench/fuzz.py --programs 500 --seed 7  # fewer, reproducible
    python bench/fuzz.py --minutes 60             # as many as an hour allows

Programs come from tests/_fuzz_programs.py (the generator the in-suite fuzz tests use);
half are smooth (no abs/max/where/relu), and only those run under the compressing
policies (a quantised residual may flip a comparison: a different gradient by design).
Each program's gradient from ``tg.grad`` under every policy, with anomaly detection off
and on, is compared with ``jax.grad``'s (save/offload/hooks/selective/budget/route:
float32 rounding, 1e-4 of the gradient's scale; compress: its quantisation error).

Printed: the seed, counts of programs, runs, passes, mismatches and crashes (by
exception type). Each counterexample (up to ``--keep`` per run) is appended to
tests/fuzz_regressions.json, which tests/test_fuzz_regressions.py replays as a
regression test: fix the bug, or mark the entry ``"xfail": "<reason>"``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
import warnings
from collections import Counter

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _fuzz_programs import (  # noqa: E402
    ALL_POLICIES,
    COMPRESSING,
    POLICY_TOL,
    RandomDraw,
    build,
    generate,
    inputs,
    max_err,
    scale,
)

import tapegrad as tg  # noqa: E402

REGRESSIONS = os.path.join(HERE, "..", "tests", "fuzz_regressions.json")


def check(prog: dict, policy: str, anomaly: bool, want) -> tuple[str, str]:
    """("pass" | "mismatch" | "crash:<Type>", detail) for one run."""
    f, xs = build(prog), inputs(prog)
    argnums = tuple(range(len(xs)))
    try:
        got = tg.grad(f, argnums=argnums, policy=ALL_POLICIES[policy], anomaly=anomaly)(*xs)
        got = jax.block_until_ready(got)
    except tg.policies.BudgetError as e:  # the budget cannot be met: refused by design
        return "refused", str(e)[:200]
    except Exception as e:  # noqa: BLE001 -- counting crashes by type is the point
        return f"crash:{type(e).__name__}", "".join(
            traceback.format_exception_only(type(e), e)
        ).strip()[:2000]
    err, sc = max_err(got, want), scale(want)
    if err <= max(1e-4, POLICY_TOL[policy]) * sc:
        return "pass", ""
    return "mismatch", f"max abs error {err:.3g} at gradient scale {sc:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--keep", type=int, default=25, help="counterexamples written per run")
    ap.add_argument("--no-write", action="store_true", help="do not append counterexamples")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", "tapegrad anomaly detection is enabled")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed} (rerun: python bench/fuzz.py --seed {seed} --programs {args.programs})")
    print(f"jax {jax.__version__}; policies: {', '.join(ALL_POLICIES)}; anomaly off/on")

    rng = random.Random(seed)
    counts: Counter = Counter()
    crashes: Counter = Counter()
    by_policy: Counter = Counter()
    found: list[dict] = []
    t0 = time.perf_counter()
    for i in range(args.programs):
        if args.minutes is not None and time.perf_counter() - t0 > 60 * args.minutes:
            print(f"  stopped after {args.minutes:g} minutes (--minutes)")
            break
        smooth = i % 2 == 1
        prog = generate(RandomDraw(rng), smooth=smooth)
        f, xs = build(prog), inputs(prog)
        counts["programs"] += 1
        try:
            want = jax.block_until_ready(jax.grad(f, argnums=tuple(range(len(xs))))(*xs))
        except Exception:  # noqa: BLE001 -- jax itself cannot: nothing to compare with
            counts["jax raised"] += 1
            continue
        for policy in ALL_POLICIES:
            if policy in COMPRESSING and not smooth:
                counts["runs not made (compression of a non-smooth program)"] += 2
                continue
            for anomaly in (False, True):
                outcome, detail = check(prog, policy, anomaly, want)
                counts["runs"] += 1
                if outcome == "pass":
                    counts["passes"] += 1
                    continue
                if outcome == "refused":
                    counts["refused (BudgetError: budget too small)"] += 1
                    continue
                by_policy[policy, anomaly] += 1
                if outcome == "mismatch":
                    counts["mismatches"] += 1
                else:
                    counts["crashes"] += 1
                    crashes[outcome.split(":", 1)[1]] += 1
                if len(found) < args.keep:
                    found.append(
                        {
                            "program": prog,
                            "policy": policy,
                            "anomaly": anomaly,
                            "kind": outcome,
                            "detail": detail,
                            "seed": seed,
                        }
                    )
        if (i + 1) % 100 == 0:
            rate = (time.perf_counter() - t0) / (i + 1)
            print(f"  {i + 1} programs, {rate * 1e3:.0f} ms each, {dict(counts)}", flush=True)

    print()
    for k in ("programs", "jax raised", "runs", "passes", "mismatches", "crashes"):
        print(f"{k:>12}: {counts.get(k, 0)}")
    print(f"{'refused':>12}: {counts.get('refused (BudgetError: budget too small)', 0)} (budget)")
    skipped = counts.get("runs not made (compression of a non-smooth program)", 0)
    print(f"{'not run':>12}: {skipped} (compressing policies on non-smooth programs)")
    for name, n in crashes.most_common():
        print(f"  crash {name}: {n}")
    for (policy, anomaly), n in by_policy.most_common():
        print(f"  failures under {policy} anomaly={anomaly}: {n}")
    print(f"time: {time.perf_counter() - t0:.0f} s")
    if found and not args.no_write:
        old = []
        if os.path.exists(REGRESSIONS):
            with open(REGRESSIONS) as fh:
                old = json.load(fh)
        with open(REGRESSIONS, "w") as fh:
            json.dump(old + found, fh, indent=1)
        print(f"{len(found)} counterexample(s) appended to tests/fuzz_regressions.json")


if __name__ == "__main__":
    main()
