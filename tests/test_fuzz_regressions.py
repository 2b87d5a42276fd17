"""Counterexamples found by bench/fuzz.py, replayed against jax.grad.

bench/fuzz.py appends each program whose gradient differed from jax.grad's (or that
crashed) to tests/fuzz_regressions.json: the program as data, the policy, anomaly on or
off. Each entry is a case here; one marked ``"xfail": "<reason>"`` is a known bug,
expected to fail (strictly: fixing it turns the case red until the mark is removed).
A few fixed programs, heavy in literal constants, run under every built-in policy with
anomaly off and on, so the file checks something even before fuzzing finds anything.
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import pytest
from _fuzz_programs import ALL_POLICIES, COMPRESSING, POLICY_TOL, build, inputs, max_err, scale

import tapegrad as tg

HERE = os.path.dirname(os.path.abspath(__file__))


def _load() -> list[dict]:
    path = os.path.join(HERE, "fuzz_regressions.json")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return json.load(fh)


# Literals (1.0 in `div` and `hypot1`, 0.5 in `half` and `cat`), matmuls, a reduction.
FIXED = [  # drawn by the generator (random.Random(13) and (4), smooth)
    {
        "shapes": [[3, 2], [2, 1], [2, 4]],
        "steps": [
            ["b", "div", 0, 0],
            ["t", 0],
            ["mm", 0, 3],
            ["b", "hypot1", 3, 2],
            ["u", "tanh", 1],
            ["mm", 6, 7],
            ["b", "hypot1", 6, 4],
        ],
        "loss": "sumsq",
        "seed": 2090727744,
        "smooth": True,
    },
    {
        "shapes": [[3], []],
        "steps": [
            ["u", "cos", 0],
            ["cat", 0],
            ["u", "half", 2],
            ["r", "mean", 4, 0, False],
            ["b", "hypot1", 2, 0],
        ],
        "loss": "mean",
        "seed": 830799655,
        "smooth": True,
    },
]


def _cases():
    cases = []
    for i, prog in enumerate(FIXED):
        for policy in ALL_POLICIES:
            for anomaly in (False, True):
                cases.append(
                    pytest.param(prog, policy, anomaly, id=f"fixed{i}-{policy}-anomaly{anomaly}")
                )
    for i, e in enumerate(_load()):
        marks = [pytest.mark.xfail(strict=True, reason=e["xfail"])] if e.get("xfail") else []
        cases.append(
            pytest.param(
                e["program"],
                e["policy"],
                e["anomaly"],
                marks=marks,
                id=f"found{i}-{e['policy']}-anomaly{e['anomaly']}-seed{e.get('seed')}",
            )
        )
    return cases


@pytest.mark.parametrize("prog,policy,anomaly", _cases())
def test_program_matches_jax_grad(prog, policy, anomaly):
    f, xs = build(prog), inputs(prog)
    argnums = tuple(range(len(xs)))
    want = jax.grad(f, argnums=argnums)(*xs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "tapegrad anomaly detection is enabled")
        got = tg.grad(f, argnums=argnums, policy=ALL_POLICIES[policy], anomaly=anomaly)(*xs)
    tol = max(1e-4, POLICY_TOL[policy]) if policy in COMPRESSING else 1e-4
    assert max_err(got, want) <= tol * scale(want), (got, want)
