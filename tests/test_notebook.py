"""notebooks/quickstart.ipynb runs top to bottom (on a tiny model, so it is quick), and the held-out figures it
prints are those of the trained model, recomputed pair by pair outside the trainer."""

import json
import math
import os
import re

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
PRINTED = re.compile(r"held-out (before|after): reward accuracy ([\d.]+), mean margin ([+-][\d.]+), loss ([\d.]+)")
# Appended to the executed notebook: each held-out pair scored alone, policy (adapter on) against reference
# (adapter off), with a log-softmax of its own, in float64.
RECOMPUTE = '''
import json as _json
import torch as _torch

def _logp(ids, prompt_length):
    ids = _torch.tensor([ids])
    logps = _torch.log_softmax(trainer.model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    return logps.gather(-1, ids[0, 1:, None]).squeeze(-1)[prompt_length - 1:].sum()

_margins = []
with _torch.no_grad():
    for _pair in trainer.eval_dataset:
        _rewards = []
        for _name in ("chosen_ids", "rejected_ids"):
            _ids, _n = _pair["prompt_ids"] + _pair[_name], len(_pair["prompt_ids"])
            _policy = _logp(_ids, _n)
            with trainer.model.disable_adapter():
                _reference = _logp(_ids, _n)
            _rewards.append(args.beta * (_policy - _reference))
        _margins.append(_rewards[0] - _rewards[1])
_margins = _torch.stack(_margins)
print("RECOMPUTED " + _json.dumps({"pairs": len(_margins), "accuracy": (_margins > 0).double().mean().item(),
                                   "margin": _margins.mean().item(),
                                   "loss": -_torch.nn.functional.logsigmoid(_margins).mean().item()}))
'''


def test_quickstart_notebook_runs_and_prints_the_right_figures(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DPO_MIN_NOTEBOOK_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    committed = [cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"]
    assert all(committed), "the committed notebook must carry the outputs of a real run"
    notebook.cells.append(new_code_cell(RECOMPUTE))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not any(output.output_type == "error" for output in outputs)
    assert any("image/png" in output.get("data", {}) for output in outputs)
    text = "".join(output.get("text", "") for output in outputs)
    printed = {when: tuple(map(float, figures)) for when, *figures in PRINTED.findall(text)}
    assert printed.keys() == {"before", "after"}, text
    # Before training the policy is the reference: rewards 0, loss ln 2, by hand.
    assert printed["before"] == (0.0, 0.0, round(math.log(2), 4))
    recomputed = json.loads(text.split("RECOMPUTED ", 1)[1].splitlines()[0])
    assert recomputed["pairs"] == 16 and recomputed["margin"] != 0.0  # the run moved the policy
    accuracy, margin, loss = printed["after"]
    # The printed digits (3 for the accuracy, 4 for the others), up to rounding.
    assert accuracy == pytest.approx(recomputed["accuracy"], abs=5e-4 + 1e-9)
    assert margin == pytest.approx(recomputed["margin"], abs=5e-5 + 1e-5)
    assert loss == pytest.approx(recomputed["loss"], abs=5e-5 + 1e-5)
