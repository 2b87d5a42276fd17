"""The notebooks in ``notebooks/`` run top to bottom, and git holds them stripped.

Each notebook asserts its own claims (gradients against ``jax.grad``, bytes
against the tape), so executing it is the test: a failing assert in a cell
fails here with that cell's traceback. They run in a fresh ``python3`` kernel
of this interpreter's environment (checked from inside the kernel).

Needs the ``notebooks`` extra; without it these tests fail (not skip) and
say what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
EXPECTED = [
    "01_tour",
    "02_residual_policies",
    "03_checkpointing",
    "04_debugging",
    "05_training",
    "06_language_model",
]
NEEDS = ["nbclient", "nbformat", "ipykernel", "matplotlib", "optax", "equinox"]


def _require_extra() -> None:
    missing = []
    for mod in NEEDS:
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        pytest.fail(
            f'the notebook tests need {", ".join(missing)}: pip install -e ".[notebooks]"',
            pytrace=False,
        )


def _notebooks() -> list[Path]:
    return sorted(NB_DIR.glob("*.ipynb"))


def test_the_expected_notebooks_exist():
    assert [p.stem for p in _notebooks()] == EXPECTED


def test_notebooks_are_stripped():
    """No outputs or execution counts in git: diffs stay reviewable, results stay reproducible."""
    for path in _notebooks():
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            where = f"{path.name} cell {cell.get('id')}"
            assert cell.get("outputs") == [], f"{where} has outputs; run python notebooks/_build.py"
            assert cell.get("execution_count") is None, f"{where} has an execution count"
        assert "widgets" not in nb.get("metadata", {}), f"{path.name} carries widget state"


def test_notebooks_match_their_sources():
    """The .ipynb files are generated from notebooks/src/*.py by notebooks/_build.py."""
    _require_extra()
    spec = importlib.util.spec_from_file_location("notebooks_build", NB_DIR / "_build.py")
    _build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_build)
    for path in _notebooks():
        src = NB_DIR / "src" / f"{path.stem}.py"
        assert src.exists(), f"{path.name} has no source {src.relative_to(ROOT)}"
        # Compared as JSON, so a different nbformat's whitespace is not a difference.
        assert json.loads(path.read_text()) == json.loads(_build.render(src)), (
            f"{path.name} differs from {src.relative_to(ROOT)}: edit the source, then run "
            "python notebooks/_build.py"
        )


@pytest.mark.parametrize("stem", EXPECTED)
def test_notebook_runs(stem, request):
    _require_extra()
    import nbclient
    import nbformat

    nb = nbformat.read(NB_DIR / f"{stem}.ipynb", as_version=4)
    # The kernel must be this interpreter's environment (the one with tapegrad installed),
    # not whatever `python` a kernelspec finds first.
    probe = nbformat.v4.new_code_cell(
        f"import sys\nassert sys.prefix == {sys.prefix!r}, (sys.executable, {sys.executable!r})"
    )
    nb.cells.insert(0, probe)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NB_DIR)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{stem}.ipynb failed:\n{e}", pytrace=False)
    request.node.user_properties.append(
        ("summary", f"{stem}.ipynb ran in {time.perf_counter() - start:.1f} s")
    )
