"""notebooks/quickstart.ipynb runs top to bottom (on a tiny model, so it is quick), and the held-out figures it
prints are those of the trained model, recomputed pair by pair outside the trainer."""

import json
import os
import re

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
# What the notebook prints, as the command does (dpo_min.train.report.describe_ties / describe_held_out).
TIES = re.compile(r"held-out before training: all (\d+) pairs are ties by definition .*: reward accuracy 0/(\d+), "
                  r"mean margin 0, loss ln 2 = 0\.6931")
AFTER = re.compile(r"reward accuracy (\d+)/(\d+) = [\d.]+, 95% interval .*\n  mean margin ([+-][\d.]+), 95% interval "
                   r"\[([+-][\d.]+), ([+-][\d.]+)\].*\n  loss ([\d.]+)")
# Cut short on the tiny model: 4 steps of the demo's batch, 16 held-out pairs (one batch).
CUT = "--max_steps 4 --max_eval_samples 16"
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
    monkeypatch.setenv("DPO_MIN_NOTEBOOK_ARGS", CUT)
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
    # Before training the policy is the reference: stated, not measured (ties, loss ln 2).
    assert TIES.search(text).groups() == ("16", "16"), text
    wins, pairs, margin, low, high, loss = AFTER.search(text).groups()
    recomputed = json.loads(text.split("RECOMPUTED ", 1)[1].splitlines()[0])
    assert recomputed["pairs"] == int(pairs) == 16 and recomputed["margin"] != 0.0  # the run moved the policy
    assert int(wins) == round(recomputed["accuracy"] * 16)
    # The printed digits (4), up to rounding.
    assert float(margin) == pytest.approx(recomputed["margin"], abs=5e-5 + 1e-5)
    assert float(low) < float(margin) < float(high)
    assert float(loss) == pytest.approx(recomputed["loss"], abs=5e-5 + 1e-5)
    assert "log p(chosen) - log p(rejected): reference " in text
