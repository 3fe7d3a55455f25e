"""notebooks/quickstart.ipynb runs top to bottom (on a tiny model, so it is quick)."""

import os

import nbformat
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs_and_plots(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DPO_MIN_NOTEBOOK_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    committed = [cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"]
    assert all(committed), "the committed notebook must carry the outputs of a real run"
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "held-out before: reward accuracy 0.000, mean margin +0.0000, loss 0.6931" in text
    assert "held-out after:" in text
    assert any("image/png" in output.get("data", {}) for output in outputs)
    assert not any(output.output_type == "error" for output in outputs)
