"""The command line as DPO users write it: demo defaults only for the demo, TRL's option names and recipes, QLoRA's
error where bitsandbytes cannot run, the closest option for a typo."""

import json
from dataclasses import fields

import pytest
import trl  # the independent reference for which names are TRL's
import yaml
from conftest import write_hh_rows

from dpo_min import models
from dpo_min.cli_args import DEMO_DEFAULTS, TRL_NAMES, UsageError, parse_args
from dpo_min.config import DPOMinConfig
from dpo_min.train import load_pairs, main

TRL_KEYS = {f.name for cls in (trl.ScriptArguments, trl.ModelConfig, trl.DPOConfig) for f in fields(cls)}


def test_demo_defaults_apply_to_the_demo_only(tmp_path):
    _, demo_data, demo = parse_args([])
    assert (demo.learning_rate, demo.max_steps, demo.padding_free, demo.share_prompt) == (
        DEMO_DEFAULTS["learning_rate"], DEMO_DEFAULTS["max_steps"], True, True)
    assert demo_data.max_eval_samples >= 100
    library = DPOMinConfig(output_dir="unused")
    for given in (["--dataset", "my.jsonl"], ["--model", "some/model"], ["--model_name_or_path", "some/model"]):
        _, data_args, args = parse_args([*given, "--num_train_epochs", "1"])
        for name in ("learning_rate", "max_steps", "max_length", "max_prompt_length", "per_device_train_batch_size",
                     "padding_free", "logging_steps", "save_strategy"):
            assert getattr(args, name) == getattr(library, name), (given, name)
        assert data_args.max_eval_samples is None


def test_a_run_with_a_dataset_is_not_capped(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 40)
    _, data_args, args = parse_args(["--dataset", str(data_file), "--num_train_epochs", "1"])
    train, held_out = load_pairs(data_args, args)
    assert len(train) + len(held_out) == 40 and len(held_out) == 2  # 5% held out, nothing dropped


def test_a_trl_recipe_runs_unchanged(tmp_path, tiny_model_dir, capsys):
    recipe = {  # ScriptArguments, ModelConfig and DPOConfig keys only, as `trl dpo --config` takes them
        "model_name_or_path": str(tiny_model_dir), "model_revision": "main", "dtype": "float32",
        "attn_implementation": "sdpa", "trust_remote_code": False,
        "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
        "lora_target_modules": ["q_proj", "v_proj"], "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM",
        "use_rslora": True, "use_dora": False, "load_in_4bit": False, "load_in_8bit": False,
        "dataset_name": str(write_hh_rows(tmp_path / "pairs.jsonl", 40)), "dataset_config": None,
        "dataset_train_split": "train", "dataset_num_proc": 2,
        "learning_rate": 5.0e-3, "beta": 0.1, "loss_type": ["sigmoid"], "max_length": 256, "max_steps": 3,
        "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False, "bf16": False, "logging_steps": 1, "report_to": "none",
        "output_dir": str(tmp_path / "run"), "seed": 0, "precompute_ref_batch_size": 4,
    }
    assert set(recipe) <= TRL_KEYS, set(recipe) - TRL_KEYS
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["--config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "training: 3 steps" in out and "learning rate 0.005" in out
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["use_rslora"], adapter["task_type"]) == (8, True, "CAUSAL_LM")
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_pairs"] == 6 and metrics["held_out_pairs"] == 2  # 3 steps of 2 pairs; 5% of 40 held out


def test_trl_names_on_the_command_line_and_the_older_torch_dtype():
    assert set(TRL_NAMES) <= TRL_KEYS | {"torch_dtype"}  # torch_dtype: TRL before 0.20, alignment-handbook recipes
    model_args, data_args, _ = parse_args([
        "--model-name-or-path", "org/model", "--torch_dtype=bfloat16", "--dataset_name", "org/pairs",
        "--dataset_config", "default", "--dataset_train_split", "train_prefs", "--dataset_test_split", "test_prefs",
        "--use_dora", "--lora_modules_to_save", "lm_head", "--dataset_num_proc", "8"])
    assert (model_args.model, model_args.dtype, model_args.use_dora, model_args.lora_modules_to_save) == (
        "org/model", "bfloat16", True, ["lm_head"])
    assert (data_args.dataset, data_args.dataset_config, data_args.split, data_args.eval_split) == (
        "org/pairs", "default", "train_prefs", "test_prefs")


@pytest.mark.parametrize("argv, message", [
    (["--lora_rr", "4"], "unknown argument(s): --lora_rr 4 (did you mean --lora_r?)"),
    (["--learning_rat=1e-5"], "(did you mean --learning_rate?)"),
    (["--lora_target_parameters", "mlp.experts"], "TRL's lora_target_parameters='mlp.experts' is not supported"),
    (["--load_in_4bit", "--no_use_peft"], "keep --use_peft"),
], ids=["typo", "typo-inline-value", "trl-option-without-counterpart", "qlora-without-adapter"])
def test_command_line_mistakes_name_the_fix(argv, message):
    with pytest.raises(UsageError) as error:
        parse_args(argv)
    assert message in str(error.value)


def test_an_unknown_recipe_key_names_the_closest_option(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model_name_or_pth: org/model\n")
    with pytest.raises(UsageError, match=r"unknown option 'model_name_or_pth' \(did you mean --model_name_or_path"):
        parse_args(["--config", str(path)])


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
    code = main(["--model", str(tiny_model_dir), "--load_in_4bit", "--output_dir", str(tmp_path / "out")])
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error_lines) == 1 and message in error_lines[0], error_lines
    assert not (tmp_path / "out").exists()


def test_a_dataset_flag_overrides_the_recipes_mixture_and_both_in_one_place_train_the_mixture(tmp_path, capsys):
    mixture = [{"dataset": "a.jsonl"}, {"dataset": "b.jsonl"}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"datasets": mixture}))
    _, data_args, _ = parse_args([str(path), "--dataset", "x.jsonl"])  # flags override the recipe
    assert (data_args.dataset, data_args.datasets) == ("x.jsonl", None)
    path.write_text(yaml.safe_dump({"dataset_name": "x.jsonl"}))
    _, data_args, _ = parse_args([str(path), "--datasets", json.dumps(mixture)])
    assert (data_args.dataset, data_args.datasets) == (None, json.dumps(mixture))
    assert capsys.readouterr().err == ""
    path.write_text(yaml.safe_dump({"dataset_name": "x.jsonl", "datasets": mixture}))  # TRL's rule: the mixture
    _, data_args, _ = parse_args([str(path)])
    assert (data_args.dataset, data_args.datasets) == (None, mixture)
    assert "the mixture is trained, dataset ignored" in capsys.readouterr().err
