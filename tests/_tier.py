"""Choose the quick tier: which tests `pytest -m "not slow"` leaves out.

    python -m pytest -n 2 tests --junitxml=run.xml   # the whole suite, timed
    python tests/_tier.py run.xml                     # rewrites tests/slow_tests.txt

Every test file keeps its fastest test; then the fastest tests of all are kept until their
summed time reaches ``--budget`` seconds. junit times leave out collection, imports and
each worker's first compiles: 240 s summed ran in 4.5 min of wall time on 2 cores (2026-11),
420 s in 6.7 min. The rest are listed in ``tests/slow_tests.txt``, which conftest
marks ``slow``. A test added later is quick until the list is made again; a test renamed
or removed drops out of the list harmlessly.
"""

from __future__ import annotations

import argparse
import os
import xml.etree.ElementTree as ET
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIST = os.path.join(HERE, "slow_tests.txt")


def node_id(classname: str, name: str) -> str:
    """pytest's node id from junit's ``classname`` (``tests.rules.test_x.TestY``) and name."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        path = os.path.join(*parts[:k]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return "::".join([path, *parts[k:], name])
    raise ValueError(f"no test file for {classname}")


def timings(xml_path: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        nid = node_id(case.get("classname", ""), case.get("name", ""))
        out[nid] = out.get(nid, 0.0) + float(case.get("time", 0.0))
    return out


def slow_tests(times: dict[str, float], budget: float) -> list[str]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for nid in times:
        by_file[nid.split("::")[0]].append(nid)
    keep = {min(ids, key=times.__getitem__) for ids in by_file.values()}
    spent = sum(times[n] for n in keep)
    for nid in sorted(times, key=times.__getitem__):
        if nid not in keep and spent + times[nid] <= budget:
            keep.add(nid)
            spent += times[nid]
    return sorted(n for n in times if n not in keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", help="a junit XML file of a whole-suite run")
    ap.add_argument("--budget", type=float, default=240.0, help="summed seconds kept")
    a = ap.parse_args()
    times = timings(a.junit)
    slow = slow_tests(times, a.budget)
    with open(LIST, "w") as f:
        f.write("".join(n + "\n" for n in slow))
    kept = sum(t for n, t in times.items() if n not in set(slow))
    print(f"{len(times) - len(slow)} quick tests ({kept:.0f} s summed), {len(slow)} slow")


if __name__ == "__main__":
    main()
