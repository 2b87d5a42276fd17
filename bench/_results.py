"""Writes a benchmark's printed table into its section of ``bench/RESULTS.md``.

``RESULTS.md`` holds one section per benchmark between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``. A script run with ``--write`` replaces the text between its
markers with what it printed, stamped with the date, the machine and its command line:

    python bench/grad_bench.py --write                    # bench/RESULTS.md
    python bench/grad_bench.py --write --results /tmp/R.md
    TAPEGRAD_RESULTS=/tmp/R.md python bench/grad_bench.py --write

In a script: ``add_arguments(ap)`` before ``ap.parse_args()``, ``start(args)`` after it
(keeps a copy of what is printed), ``finish(args, NAME)`` after the last print.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import jax

DEFAULT = Path(__file__).resolve().parent / "RESULTS.md"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--write`` and ``--results PATH`` on a benchmark's parser."""
    ap.add_argument("--write", action="store_true", help="write the printed table into RESULTS.md")
    ap.add_argument(
        "--results",
        metavar="PATH",
        help="the results page (default: $TAPEGRAD_RESULTS, else bench/RESULTS.md)",
    )


def results_path(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$TAPEGRAD_RESULTS``, else ``bench/RESULTS.md``."""
    return Path(path or os.environ.get("TAPEGRAD_RESULTS") or DEFAULT)


def machine() -> str:
    """The CPU model, its core count and jax's version and device, in one line."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    kind = "" if dev.device_kind.lower() == dev.platform else f" ({dev.device_kind})"
    return f"{model}, {os.cpu_count()} cores; jax {jax.__version__}, {dev.platform}{kind}"


def command() -> str:
    """The command line this process was started with."""
    return shlex.join(["python", *sys.argv])


def write_section(name: str, text: str, path: str | os.PathLike | None = None) -> Path:
    """Replace the text between ``<!-- results:name -->`` and ``<!-- /results:name -->``
    with a stamp (date, machine, command line) and ``text``; a section the page lacks is
    added at its end. Returns the page's path."""
    page = results_path(path)
    stamp = (
        f"_Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
        f"`{command()}` on {machine()}._"
    )
    begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    body = f"{begin}\n{stamp}\n\n{text.strip()}\n{end}"
    old = page.read_text() if page.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(old):
        new = pattern.sub(lambda _: body, old, count=1)
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + body + "\n"
    page.write_text(new)
    return page


class _Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def start(args: argparse.Namespace) -> None:
    """With ``--write``: keep a copy of everything printed from now on."""
    if args.write and not isinstance(sys.stdout, _Tee):
        sys.stdout = _Tee(sys.stdout)


def finish(args: argparse.Namespace, name: str) -> None:
    """With ``--write``: what was printed since ``start`` becomes section ``name``."""
    if not args.write or not isinstance(sys.stdout, _Tee):
        return
    tee, sys.stdout = sys.stdout, sys.stdout.stream
    page = write_section(
        name, "```text\n" + tee.copy.getvalue().strip("\n") + "\n```", args.results
    )
    print(f"(written to section {name} of {page})")
