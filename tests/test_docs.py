"""Every ```python block in docs/ runs, and the site builds with ``mkdocs build --strict``.

The blocks of one page run in order, in one namespace (a page is a script told in
pieces), one test per page. Blocks that must not run use another fence
(```pycon, ```text, ```bash). Each block is compiled with the page's path and its
line numbers, so a failure points at the markdown line, and records traced from the
docs show ``index.md:12`` as their source.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(info, first code line (1-based), code)`` for every fenced block of a page."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        code = "\n".join(line[indent:] for line in lines[i + 1 : j])
        out.append((info, i + 2, code))
        i = j + 1
    return out


def runnable(path: Path) -> list[tuple[int, str]]:
    return [(line, code) for info, line, code in blocks(path) if info == "python"]


def _id(path: Path) -> str:
    return str(path.relative_to(DOCS))


def test_docs_exist_and_have_examples():
    names = {_id(p) for p in PAGES}
    for page in ("index.md", "concepts.md", "api.md", "from_pytorch.md", "from_jax.md"):
        assert page in names, f"docs/{page} is missing"
    assert sum(len(runnable(p)) for p in PAGES) >= 30, "the docs lost most of their examples"


@pytest.mark.parametrize("path", PAGES, ids=_id)
def test_fences_are_explicit(path: Path):
    # A ```py or ```python3 block would silently not run: only ``python`` runs, and
    # the non-running fences are the ones that say so.
    for info, line, _ in blocks(path):
        lang = info.split()[0] if info else ""
        assert lang in ("python", "pycon", "text", "bash", "yaml", "toml", "console"), (
            f"docs/{_id(path)}:{line - 1}: code fence ```{info}: use ```python for code that "
            "runs in tests/test_docs.py, or ```pycon / ```text / ```bash for code that does not."
        )
        if lang == "python":
            assert info == "python", (
                f"docs/{_id(path)}:{line - 1}: ```{info}: a python block takes no options "
                "(it would not run); use ```pycon for a block that must not run."
            )


@pytest.mark.parametrize("path", [p for p in PAGES if runnable(p)], ids=_id)
def test_page_examples_run(path: Path, monkeypatch):
    monkeypatch.chdir(ROOT)
    ns: dict = {"__name__": f"docs.{path.stem}"}
    for line, code in runnable(path):
        # Pad so line numbers in tracebacks (and tape source lines) are the page's own.
        compiled = compile("\n" * (line - 1) + code, str(path.relative_to(ROOT)), "exec")
        exec(compiled, ns)


def test_mkdocs_build_strict(tmp_path: Path):
    missing = []
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    assert not missing, (
        f"the docs toolchain is not installed (missing: {', '.join(missing)}). "
        'Install it with: pip install -e ".[docs]"'
    )
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    assert "WARNING" not in log, f"mkdocs build printed warnings:\n{log[-4000:]}"
    assert (tmp_path / "site" / "api" / "index.html").exists()
