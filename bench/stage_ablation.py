"""Do the planner's searches earn their place? Each stage switched off in turn.

Runs ``bench/ilp_bench.py --plans`` once as shipped and once per stage with that stage's
work limit set to 0 (``--set``, patching `tapegrad.planner.candidates`), and compares per
cell the predicted step time of the plan (without highspy and as shipped) and the
planning CPU. A stage whose removal makes no cell's plan ≥1% slower and saves ≥5% of
planning CPU does not earn its place.

    python bench/stage_ablation.py [--quick] [--jobs 2] [--write]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
import _results  # noqa: E402

# stage -> the work limits that switch it off
STAGES = {
    "joint descent": "JOINT_WORK=0",
    "kicks": "JOINT_KICK_WORK=0",
    "edge swaps": "SWAP_WORK=0",
    "annealing": "ANNEAL_WORK=0",
    "exact descent (ILP)": "EXACT_WORK=0",
    "ILP windows": "WINDOW_ROUNDS=0",
    "chain program": "CHAIN_DP_RECORDS=0",
    "flops descent": "FLOPS_WORK=0,FLOPS_KICK_WORK=0",
    "oscillation": "OSCILLATE_WORK=0",
    "relaxed plans": "_RELAXED=0",
    "small exhaustive search": "SMALL_SEARCH=0",
}
_CELL = r" ([^|]+?) \|"
ROW = re.compile(r"^\|" + _CELL * 2 + r" (\d+) \| (\d+)% \|" + (_CELL + r" ([\d.]+) \|") * 2)


def run(setting: str, quick: bool) -> dict:
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "ilp_bench.py"), "--plans"]
    cmd += ["--quick"] * quick + (["--set", setting] if setting else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cells = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            fam, size, _, pct, h, hs, w, ws = m.groups()
            cells[(fam, size, int(pct))] = tuple(
                float(v) if v[0].isdigit() else None for v in (h, hs, w, ws)
            )
    if not cells:
        raise SystemExit(f"no plan rows from {' '.join(cmd)}:\n{out[-2000:]}")
    return cells


def compare(base: dict, off: dict) -> tuple[int, float, float, float]:
    """(cells whose plan is ≥1% slower, the worst slowdown, CPU saved without and with
    highspy, as fractions of the shipped planner's)."""
    worse, worst = 0, 0.0
    for key, (h0, _, w0, _) in base.items():
        h1, _, w1, _ = off[key]
        for a, b in ((h0, h1), (w0, w1)):
            if a and b:
                d = b / a - 1
                worst = max(worst, d)
                worse += d >= 0.01
            elif a and not b:  # the stage was needed to find any plan
                worse, worst = worse + 1, float("inf")
    cpu = [sum(v[i] for v in base.values()) for i in (1, 3)]
    cpu_off = [sum(v[i] for v in off.values()) for i in (1, 3)]
    return worse, worst, 1 - cpu_off[0] / cpu[0], 1 - cpu_off[1] / cpu[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ilp_bench's quick cells")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--stages", nargs="*", help="only these stages (names as in STAGES)")
    _results.add_arguments(ap)
    args = ap.parse_args()
    _results.start(args)
    stages = {k: v for k, v in STAGES.items() if not args.stages or k in args.stages}
    settings = ["", *stages.values()]
    with ThreadPoolExecutor(args.jobs) as pool:
        got = dict(zip(settings, pool.map(lambda s: run(s, args.quick), settings)))
    base = got[""]
    print(f"ilp_bench --plans{' --quick' * args.quick}: {len(base)} cells; shipped planner")
    print("| stage off | cells ≥1% slower | worst | CPU saved (no highspy) | (shipped) | verdict |")
    print("|---|---|---|---|---|---|")
    for stage, setting in stages.items():
        worse, worst, cpu_h, cpu_w = compare(base, got[setting])
        verdict = "keeps its place" if worse else ("goes" if max(cpu_h, cpu_w) >= 0.05 else "free")
        print(
            f"| {stage} (`{setting}`) | {worse} | {worst:+.1%} | {cpu_h:+.0%} | {cpu_w:+.0%} | "
            f"{verdict} |"
        )
    _results.finish(args, "stage_ablation")


if __name__ == "__main__":
    main()
