"""Build the notebooks in this folder from their sources in ``src/``.

Each source is a Python file in the "percent" format (as jupytext and VS Code
read it): ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell
whose lines are comments. The sources are what reviewers read and edit; the
``.ipynb`` files are generated, with no outputs and ``execution_count`` null,
so git holds no rendered results (``tests/test_notebooks.py`` checks both that
and that the notebooks match their sources).

    python notebooks/_build.py          # rewrite notebooks/*.ipynb from notebooks/src/*.py
    python notebooks/_build.py --check  # exit 1 if a notebook is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source), ...]`` from a percent-format source (module docstring dropped)."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
        # lines before the first marker (the file's docstring) are not part of the notebook
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def build(src: Path) -> nbformat.NotebookNode:
    """The stripped notebook for one source file, with stable cell ids (clean diffs)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source) in enumerate(parse_cells(src.read_text())):
        cell_id = f"{src.stem[:2]}-{i:02d}"
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source, id=cell_id))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(source, id=cell_id))
    nbformat.validate(nb)
    return nb


def render(src: Path) -> str:
    return nbformat.writes(build(src)) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for src in sorted(SRC.glob("[0-9][0-9]_*.py")):
        target = HERE / f"{src.stem}.ipynb"
        text = render(src)
        if "--check" in argv:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python notebooks/_build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
