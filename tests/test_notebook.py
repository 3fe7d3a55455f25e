"""notebooks/quickstart.ipynb: it uses the public API only, its written-out settings and split are the demo's (so a
change to DEMO_DEFAULTS that the notebook does not follow fails here), it runs top to bottom (on a tiny model, so it
is quick), and the held-out figures it prints are those of the trained model, recomputed pair by pair outside the
trainer."""

import ast
import dataclasses
import importlib.util
import json
import os
import re
import sys

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell
from peft import LoraConfig

import dpo_min
from dpo_min import DPOMinConfig
from dpo_min.train import load_pairs, resolve
from dpo_min.train.args import DEMO_DEFAULTS, SMOLLM2_TEMPLATE_WITHOUT_SYSTEM
from dpo_min.train.command_line import parse_args

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
# What the notebook prints: the stated ties before training, the held-out block after.
TIES = re.compile(r"held-out before training: all (\d+) pairs are ties .*: reward accuracy 0/(\d+), mean margin 0, "
                  r"loss ln 2 = 0\.6931")
AFTER = re.compile(r"reward accuracy (\d+)/(\d+) = [\d.]+, 95% interval .*\n  mean margin ([+-][\d.]+), 95% interval "
                   r"\[([+-][\d.]+), ([+-][\d.]+)\].*\n  loss ([\d.]+)")
# Cut short on the tiny model: 4 steps of the demo's batch, 16 held-out pairs (one batch).
CUT = {"DPO_MIN_NOTEBOOK_STEPS": "4", "DPO_MIN_NOTEBOOK_EVAL": "16"}
HOOKS = ("DPO_MIN_NOTEBOOK_MODEL", *CUT)
# The settings cell's names for the demo's options that are not DPOMinConfig's.
OTHER_DEMO_OPTIONS = {"chat_template": "CHAT_TEMPLATE", "eval_fraction": "HELD_OUT_FRACTION",
                      "max_eval_samples": "HELD_OUT_PAIRS"}
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
            _rewards.append(trainer.args.beta * (_policy - _reference))
        _margins.append(_rewards[0] - _rewards[1])
_margins = _torch.stack(_margins)
print("RECOMPUTED " + _json.dumps({"pairs": len(_margins), "accuracy": (_margins > 0).double().mean().item(),
                                   "margin": _margins.mean().item(),
                                   "loss": -_torch.nn.functional.logsigmoid(_margins).mean().item()}))
'''


def _notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


def _cell(tag: str) -> str:
    (source,) = [cell.source for cell in _notebook().cells if tag in cell.get("metadata", {}).get("tags", [])]
    return source


def _value(node: ast.expr):
    """A literal, or the demo's value behind an environment hook: int(os.environ.get("NAME", value))."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "int":
        (hook,) = node.args
        assert ast.unparse(hook.func) == "os.environ.get" and hook.args[0].value.startswith("DPO_MIN_NOTEBOOK_")
        return ast.literal_eval(hook.args[1])
    return ast.literal_eval(node)


def _settings() -> tuple[dict, dict, dict]:
    """The settings cell: (its names assigned, the LoraConfig keywords, the DPOMinConfig keywords), as values."""
    names, calls = {}, {}
    for statement in ast.parse(_cell("settings")).body:
        assert isinstance(statement, ast.Assign)
        targets = statement.targets[0].elts if isinstance(statement.targets[0], ast.Tuple) else statement.targets
        values = statement.value.elts if isinstance(statement.value, ast.Tuple) else [statement.value]
        for target, value in zip(targets, values):
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("LoraConfig", "DPOMinConfig"):
                assert not value.args
                calls[ast.unparse(value.func)] = {keyword.arg: keyword.value for keyword in value.keywords}
            else:
                names[target.id] = _value(value)
    config = {name: _value(node) for name, node in calls["DPOMinConfig"].items() if name != "output_dir"}
    return names, {name: _value(node) for name, node in calls["LoraConfig"].items()}, config


def test_the_committed_notebook_is_the_one_the_script_builds():
    spec = importlib.util.spec_from_file_location("build_quickstart", ROOT / "notebooks" / "build_quickstart.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert [cell.source for cell in _notebook().cells] == [cell.source for cell in script.CELLS]


def _text(notebook) -> str:
    return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.outputs)


def test_the_committed_notebook_carries_the_outputs_of_the_demos_run():
    notebook = _notebook()
    text = _text(notebook)
    assert "658 pairs: 256 to train on, 192 held out" in text
    assert TIES.search(text).groups() == ("192", "192")
    assert AFTER.search(text).group(2) == "192"
    assert text.count("log p(chosen) - log p(rejected): reference ") == 3
    assert any("image/png" in output.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs)
    assert not any(output.output_type == "error" for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.outputs)


def test_no_cell_reaches_below_the_package():
    """The notebook is the library as a user calls it: `from dpo_min import ...` of its exported names only, never
    the command layer (dpo_min.train) or a module below the package."""
    imported = []
    for cell in _notebook().cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Import):
                imported += [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported += [(node.module, alias.name) for alias in node.names]
    assert ("dpo_min", "DPOMinTrainer") in imported  # the walk found the imports
    for module, name in imported:
        assert not module.startswith("dpo_min."), module
        assert module != "dpo_min" or name in dpo_min.__all__, name
    assert not any("dpo_min.train" in cell.source for cell in _notebook().cells if cell.cell_type == "code")


def test_the_settings_are_the_demos():
    names, lora, config = _settings()
    # Every option the demo sets, each where the notebook writes it; nothing else but its output and progress bar.
    config_fields = {field.name for field in dataclasses.fields(DPOMinConfig)}
    assert {key: value for key, value in DEMO_DEFAULTS.items() if key in config_fields} == {
        key: value for key, value in config.items() if key != "disable_tqdm"}
    assert set(DEMO_DEFAULTS) - config_fields == set(OTHER_DEMO_OPTIONS)
    assert {key: names[name] for key, name in OTHER_DEMO_OPTIONS.items()} == {
        key: DEMO_DEFAULTS[key] for key in OTHER_DEMO_OPTIONS}
    assert names["CHAT_TEMPLATE"] == SMOLLM2_TEMPLATE_WITHOUT_SYSTEM
    # The rest of the config as the command parses the demo: the defaults, untouched.
    model_args, data_args, args = parse_args([])
    written = DPOMinConfig(output_dir=args.output_dir, **config).to_dict()
    parsed = args.to_dict()
    # The command also sets use_cpu where there is no accelerator (so that --bf16 works there; TrainingArguments then
    # turns pin_memory off): on such a machine Trainer trains on the CPU either way.
    assert {key for key in written if written[key] != parsed[key]} <= {
        "disable_tqdm", "ddp_find_unused_parameters", "use_cpu", "dataloader_pin_memory"}
    # The adapter that the command's load_model builds from the demo's ModelArguments.
    targets = model_args.lora_target_modules
    assert model_args.use_peft and LoraConfig(**lora) == LoraConfig(
        r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=model_args.lora_modules_to_save, task_type=model_args.lora_task_type,
        use_rslora=model_args.use_rslora, use_dora=model_args.use_dora)
    assert (names["SAMPLES"], names["NEW_TOKENS"]) == (data_args.num_samples, data_args.max_new_tokens)


def test_the_split_is_the_commands(monkeypatch, tmp_path):
    """The settings and pairs cells, run here, give the pairs that the command's load_pairs gives the demo."""
    for name in HOOKS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(NOTEBOOK.parent)
    imports = ast.parse(_cell("imports"))
    imports.body = [node for node in imports.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace = {}
    exec(compile(imports, "imports", "exec"), namespace)
    exec(_cell("settings"), namespace)
    exec(_cell("pairs"), namespace)
    train, held_out = load_pairs(resolve(["--output_dir", str(tmp_path / "demo")]))
    assert (len(namespace["train_pairs"]), len(namespace["held_out"])) == (len(train), len(held_out)) == (256, 192)
    assert namespace["train_pairs"].to_list() == train.to_list()
    assert namespace["held_out"].to_list() == held_out.to_list()


def test_quickstart_notebook_runs_and_prints_the_right_figures(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DPO_MIN_NOTEBOOK_MODEL", str(tiny_model_dir))
    for name, value in CUT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = _notebook()
    notebook.cells.append(new_code_cell(RECOMPUTE))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not any(output.output_type == "error" for output in outputs)
    assert any("image/png" in output.get("data", {}) for output in outputs)
    text = _text(notebook)
    assert "16 to train on, 16 held out" in text
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
    assert text.count("log p(chosen) - log p(rejected): reference ") == 3


def test_the_notebook_extra_installs_what_building_and_opening_the_notebook_need():
    # README's install alone lacks nbformat (`python notebooks/build_quickstart.py` failed with "No module named
    # 'nbformat'"): the Notebook section names the extra, and the extra holds every package the builder imports, the
    # kernel nbclient runs the cells in and JupyterLab, which opens the notebook.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    packages = {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0] for spec in extras["notebook"]}
    tree = ast.parse((ROOT / "notebooks" / "build_quickstart.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and
                 node.module and not node.level}
    assert imported - set(sys.stdlib_module_names) - {"dpo_min"} == {"nbformat", "nbclient"}
    assert packages >= {"nbformat", "nbclient", "ipykernel", "jupyterlab"}
    section = (ROOT / "README.md").read_text().split("\n## Notebook\n", 1)[1].split("\n## ", 1)[0]
    assert 'pip install -e ".[notebook]"' in section and "jupyter lab notebooks/quickstart.ipynb" in section


def test_the_committed_outputs_hold_no_machine_path_and_no_warning_that_says_nothing():
    """The outputs are a reader's first look: no path of the machine that built them, no TqdmWarning (ipywidgets is
    in the notebook extra), no DeepSpeed line about picking the CPU (the notebook names it on a CPU)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    shown = "".join(json.dumps(output) for cell in notebook.cells if cell.cell_type == "code"
                    for output in cell.get("outputs", []))
    assert shown, "the committed notebook has outputs"
    for said in ("TqdmWarning", "Setting accelerator", "site-packages", str(ROOT), os.path.expanduser("~") + "/"):
        assert said not in shown, said
