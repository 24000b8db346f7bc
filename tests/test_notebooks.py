"""The tour notebooks run top to bottom (nbclient, a fresh kernel each) without an error, and their
committed copies carry outputs, pictures included, so GitHub readers see them without running anything.

Together they took 2-3.5 minutes on a 2-core machine shared at load average 8-12, most of it
notebook 2's full-size UNet plan and XLA's H100 compile of it (which alone takes ~9 s idle and
~100 s at that load). `python notebooks/build.py` rewrites and re-executes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PICTURES = ("image/svg+xml", "image/png")


def test_the_three_tours_exist():
    assert [path.name for path in NOTEBOOKS] == [
        "01_egraph_tour.ipynb", "02_extraction.ipynb", "03_writing_a_fusion_rule.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_committed_notebook_has_outputs_and_pictures(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), f"{path.name} is not fully executed"
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} was committed with an error"
    assert any(kind in output.get("data", {}) for output in outputs for kind in PICTURES), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
