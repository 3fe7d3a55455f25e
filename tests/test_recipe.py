"""`train.recipe`: the recipes and option names DPO users write (TRL's recipes and names, every alignment-handbook
recipe key), flags over a recipe, a flag's value as written, a recipe's values read as the flags give them (a key
given twice refused, TRL's env: block applied)."""

import json
import math
import os
from dataclasses import fields

import pytest
import trl  # the independent reference for which names are TRL's
import yaml
from conftest import _recipe, write_hh_rows

from dpo_min.compat import TRL_NAMES
from dpo_min.train import main, resolve
from dpo_min.train.args import UsageError
from dpo_min.train.command_line import parse_args

TRL_KEYS = {f.name for cls in (trl.ScriptArguments, trl.ModelConfig, trl.DPOConfig) for f in fields(cls)}


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


def test_an_unknown_recipe_key_names_the_closest_option(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model_name_or_pth: org/model\n")
    with pytest.raises(UsageError, match=r"unknown option 'model_name_or_pth' \(did you mean --model_name_or_path"):
        parse_args(["--config", str(path)])


# ---- the alignment-handbook's recipe keys ---------------------------------------------------------------------------
# Every key of the handbook's ten DPO recipes (recipes/*/dpo/*.yaml: zephyr-7b-beta full and qlora, zephyr-7b-gemma,
# smollm2 and smollm2 smol, smollm3 apo, starchat2-15b, pref_align_scan zephyr and openhermes, constitutional-ai) but
# the data mixture (dataset_mixture, dataset_mixer, dataset_splits) and the model's location, with a value one of them
# gives, and what it must mean here. The expectations are read off the handbook's scripts/dpo.py and the libraries
# it was written for (transformers 4: warmup_ratio, torch_dtype=None -> float32, overwrite_output_dir).
HANDBOOK_KEYS = [
    ("torch_dtype", None, lambda m, d, a: m.dtype == "float32"),
    ("torch_dtype", "bfloat16", lambda m, d, a: m.dtype == "bfloat16"),
    ("model_revision", "it-SFT", lambda m, d, a: m.model_revision == "it-SFT"),
    ("attn_implementation", "flash_attention_2", lambda m, d, a: m.attn_implementation == "flash_attention_2"),
    ("trust_remote_code", True, lambda m, d, a: a.trust_remote_code),
    ("use_peft", True, lambda m, d, a: m.use_peft),
    ("lora_r", 128, lambda m, d, a: m.lora_r == 128),
    ("lora_alpha", 128, lambda m, d, a: m.lora_alpha == 128),
    ("lora_dropout", 0.05, lambda m, d, a: m.lora_dropout == 0.05),
    ("lora_target_modules", ["q_proj", "k_proj"], lambda m, d, a: m.lora_target_modules == ["q_proj", "k_proj"]),
    ("dataset_num_proc", 12, lambda m, d, a: a.dataset_num_proc == 12),
    ("bf16", True, lambda m, d, a: a.bf16),
    ("beta", 0.01, lambda m, d, a: a.beta == 0.01),
    ("loss_type", "apo_zero", lambda m, d, a: a.loss_type == ["apo_zero"]),
    ("do_eval", True, lambda m, d, a: d.eval_fraction is None),  # 0.05 of one dataset, a mixture its own
    ("do_train", True, lambda m, d, a: True),
    ("eval_strategy", "steps", lambda m, d, a: a.eval_strategy == "steps"),
    ("eval_steps", 100, lambda m, d, a: a.eval_steps == 100),
    ("gradient_accumulation_steps", 8, lambda m, d, a: a.gradient_accumulation_steps == 8),
    ("gradient_checkpointing", True, lambda m, d, a: a.gradient_checkpointing),
    ("gradient_checkpointing_kwargs", {"use_reentrant": True},
     lambda m, d, a: a.gradient_checkpointing_kwargs == {"use_reentrant": True}),
    ("hub_model_id", "zephyr-7b-dpo-full", lambda m, d, a: a.hub_model_id == "zephyr-7b-dpo-full"),
    ("hub_model_revision", "dpo-beta-0.01", lambda m, d, a: a.hub_revision == "dpo-beta-0.01"),
    ("hub_private_repo", True, lambda m, d, a: a.hub_private_repo),
    ("hub_strategy", "every_save", lambda m, d, a: a.hub_strategy == "every_save"),
    ("learning_rate", 5.0e-7, lambda m, d, a: a.learning_rate == 5e-7),
    ("log_level", "info", lambda m, d, a: a.log_level == "info"),
    ("logging_steps", 10, lambda m, d, a: a.logging_steps == 10),
    ("logging_strategy", "steps", lambda m, d, a: a.logging_strategy == "steps"),
    ("lr_scheduler_type", "cosine_with_min_lr", lambda m, d, a: a.lr_scheduler_type == "cosine_with_min_lr"),
    ("lr_scheduler_kwargs", {"min_lr_rate": 0.1}, lambda m, d, a: a.lr_scheduler_kwargs == {"min_lr_rate": 0.1}),
    ("max_grad_norm", 0.2, lambda m, d, a: a.max_grad_norm == 0.2),
    ("max_length", 1024, lambda m, d, a: a.max_length == 1024),
    ("max_prompt_length", 512, lambda m, d, a: a.max_prompt_length == 512),
    ("num_train_epochs", 3, lambda m, d, a: a.num_train_epochs == 3),
    ("optim", "rmsprop", lambda m, d, a: a.optim == "rmsprop"),
    ("output_dir", "data/zephyr-7b-dpo-full", lambda m, d, a: a.output_dir == "data/zephyr-7b-dpo-full"),
    ("overwrite_output_dir", True, lambda m, d, a: True),
    ("padding_free", True, lambda m, d, a: a.padding_free),
    ("per_device_train_batch_size", 8, lambda m, d, a: a.per_device_train_batch_size == 8),
    ("per_device_eval_batch_size", 4, lambda m, d, a: a.per_device_eval_batch_size == 4),
    ("push_to_hub", True, lambda m, d, a: a.push_to_hub),
    ("report_to", ["tensorboard"], lambda m, d, a: a.report_to == ["tensorboard"]),
    ("run_name", "SmolLM3-DPO", lambda m, d, a: a.run_name == "SmolLM3-DPO"),
    ("save_strategy", "steps", lambda m, d, a: a.save_strategy == "steps"),
    ("save_steps", 0.5, lambda m, d, a: a.save_steps == 0.5),  # a ratio of the steps, as in transformers
    ("save_total_limit", 1, lambda m, d, a: a.save_total_limit == 1),
    ("seed", 42, lambda m, d, a: a.seed == 42),
    # transformers 5 reads a float warmup_steps below 1 as warmup_ratio's ratio, rounded up as transformers 4 did.
    ("warmup_ratio", 0.1, lambda m, d, a: a.warmup_steps == 0.1 and a.get_warmup_steps(25) == math.ceil(25 * 0.1)),
    ("use_liger_kernel", True, lambda m, d, a: a.use_liger_kernel is False),  # accepted; see the liger test
    ("chat_template", "{{ messages }}", lambda m, d, a: m.chat_template == "{{ messages }}"),  # handbook DPOConfig
]


@pytest.mark.parametrize(("key", "value", "means"), HANDBOOK_KEYS,
                         ids=[f"{key}={value}" for key, value, _ in HANDBOOK_KEYS])
def test_every_handbook_recipe_key_is_accepted_with_its_meaning(tmp_path, key, value, means):
    recipe = tmp_path / "recipe.yaml"
    # lr_scheduler_kwargs are checked against the schedule they reach: the handbook gives min_lr_rate beside
    # cosine_with_min_lr (linear, the default, takes no min_lr_rate; cosine_with_min_lr needs it or min_lr).
    beside = {"lr_scheduler_type": "cosine_with_min_lr"} if key == "lr_scheduler_kwargs" else {
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}} if key == "lr_scheduler_type" else {}
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "org/model", key: value, **beside}))
    # push_to_hub needs a hub_model_id or an output_dir name.
    model_args, data_args, args = parse_args(["--config", str(recipe)])  # bf16: use_cpu is set on a CPU
    assert means(model_args, data_args, args), (key, value)


@pytest.mark.parametrize(("recipe", "argv", "message"), [
    ({"warmup_ratio": 1.0}, [], "warmup_ratio must be in [0, 1), got 1.0"),
    ({"warmup_ratio": 0.1, "warmup_steps": 5}, [], "warmup_ratio and warmup_steps both set warmup_steps: give one"),
    ({}, ["--warmup_ratio", "0.1", "--warmup_steps=3"], "--warmup_ratio and --warmup_steps both set warmup_steps"),
    ({"model_name_or_path": "a", "model": "b"}, [], "model and model_name_or_path both set model"),
    ({"overwrite_output_dir": False}, [], "overwrite_output_dir=False is not supported: dpo_min replaces"),
    ({"do_train": False}, [], "do_train=False is not supported: the command always trains"),
    ({"do_eval": False, "eval_fraction": 0.1}, [], "do_eval: false evaluates nothing, but eval_fraction asks"),
    ({"merge_adapter": True}, [], "--merge_adapter merges a LoRA adapter, and this run trains none: add --use_peft"),
    ({"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}, [],
     "fused_linear_cross_entropy"),
], ids=["warmup-ratio-1", "warmup-twice", "warmup-twice-flags", "model-twice", "overwrite-false", "do-train-false",
        "do-eval-false-with-eval", "merge-without-lora", "liger-fused-ce"])
def test_handbook_keys_dpo_min_cannot_honour_are_refused_in_one_line(tmp_path, recipe, argv, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "org/model", **recipe}))
    with pytest.raises(UsageError) as error:
        parse_args(["--config", str(path), *argv])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_dataset_flag_overrides_the_recipes_mixture_and_both_in_one_place_train_the_mixture(tmp_path, capsys):
    mixture = [{"path": "a.jsonl"}, {"path": "b.jsonl"}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"datasets": mixture}))
    _, data_args, _ = parse_args([str(path), "--dataset", "x.jsonl"])  # flags override the recipe
    assert (data_args.dataset, data_args.datasets) == ("x.jsonl", None)
    path.write_text(yaml.safe_dump({"dataset_name": "x.jsonl"}))
    _, data_args, _ = parse_args([str(path), "--datasets", json.dumps(mixture)])
    assert (data_args.dataset, data_args.datasets) == (None, mixture)  # the flag's JSON, parsed as it is read
    assert capsys.readouterr().err == ""
    path.write_text(yaml.safe_dump({"dataset_name": "x.jsonl", "datasets": mixture}))  # TRL's rule: the mixture
    plan = resolve([str(path), "--output_dir", str(tmp_path / "out")])
    assert (plan.data.dataset, plan.data.datasets, plan.mixture) == (None, mixture, "datasets")
    assert "the mixture is trained, dataset ignored" in capsys.readouterr().err


# ---- a flag's value is text; mappings and mixtures are parsed, in one line when they cannot be -------------------
JINJA = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_flag_value_reaches_its_option_as_written():
    model_args, _, args = parse_args(["--chat_template", JINJA, "--run_name", "@x", "--hub_model_id", "me/a: b",
                                      "--dataset", "x.jsonl"])
    assert (model_args.chat_template, args.run_name, args.hub_model_id) == (JINJA, "@x", "me/a: b")
    # The translations that read a value still read it as a recipe would; argparse still converts the others.
    model_args, _, args = parse_args(["--warmup_ratio", "0.1", "--torch_dtype", "bfloat16", "--use_peft", "false",
                                      "--max_steps", "7", "--lr_scheduler_kwargs", '{"num_cycles": 0.25}',
                                      "--lr_scheduler_type", "cosine"])
    assert (args.warmup_steps, model_args.dtype, model_args.use_peft, args.max_steps) == (0.1, "bfloat16", False, 7)
    assert args.lr_scheduler_kwargs == {"num_cycles": 0.25}


@pytest.mark.parametrize(("argv", "message"), [
    (["--datasets", "[{path: x}"], "--datasets must be JSON (or write it in the YAML recipe): Expecting property"),
    (["--dataset_mixer", "pairs.jsonl"], "--dataset_mixer must be JSON"),
    (["--lr_scheduler_kwargs", "{nonsense"], "--lr_scheduler_kwargs must be JSON"),
    (["--warmup_ratio", "[0.1"], "--warmup_ratio: cannot read '[0.1'"),
], ids=["trl-mixture", "legacy-mixer", "mapping", "translated-key"])
def test_a_flag_whose_value_cannot_be_parsed_is_one_line_naming_it(argv, message):
    with pytest.raises(UsageError) as error:
        parse_args(argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value


@pytest.mark.parametrize("content", [b"\x90\x01\x00\x00\x00\x00\x00\x00{\"__metadata__\"", "lr: 1e-5 # é".encode(
    "latin-1")], ids=["safetensors", "latin-1"])
def test_a_recipe_that_is_not_utf8_text_is_one_line(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(UsageError) as error:
        parse_args(["--config", str(path)])
    assert str(error.value).startswith(f"{path} is not a YAML recipe: not UTF-8 text (byte ")
    assert error.value.exit_code == 2


# ---- TRL's env: block ---------------------------------------------------------------------------------------------
def test_a_trl_recipes_env_block_is_applied_as_trl_applies_it(tmp_path, monkeypatch):
    for name in ("DPO_MIN_TEST_A", "DPO_MIN_TEST_B"):
        monkeypatch.delenv(name, raising=False)  # restored (removed) after the test
    path = tmp_path / "recipe.yaml"
    path.write_text("dataset_name: x.jsonl\nenv:\n  DPO_MIN_TEST_A: 1\n  DPO_MIN_TEST_B: true\n")
    parse_args(["--config", str(path)])
    ours = {name: os.environ.pop(name) for name in ("DPO_MIN_TEST_A", "DPO_MIN_TEST_B")}
    trl.TrlParser((trl.ScriptArguments,)).parse_args_and_config(["--config", str(path)])
    assert ours == {name: os.environ[name] for name in ours} == {"DPO_MIN_TEST_A": "1", "DPO_MIN_TEST_B": "True"}
    path.write_text("env: [A=1]\n")
    with pytest.raises(UsageError, match="env must be a mapping of variable: value"):
        parse_args(["--config", str(path)])


# ---- issue 30: no option silently outvoted, no secret printed, one line where a traceback was -------------------
def test_a_recipes_null_model_is_no_model_the_demo_model_with_lora(tmp_path):
    without = parse_args(_recipe(tmp_path, "dataset_name: x.jsonl\n"))
    model_args, data_args, args = parse_args(_recipe(tmp_path, "model_name_or_path: null\ndataset_name: x.jsonl\n"))
    assert (model_args.model, model_args.use_peft) == (None, True)  # was full fine-tuning of the demo's model
    assert (model_args, data_args, args.learning_rate) == (without[0], without[1], without[2].learning_rate)


@pytest.mark.parametrize(("text", "message"), [
    ("beta: 0.1\nlearning_rate: 1.0e-5\nbeta: 0.2\n", "key 'beta' is given twice, on lines 1 and 3: give it once"),
    ("dataset_name: x.jsonl\nmodel_init_kwargs:\n  use_cache: false\n  use_cache: true\n",
     "key 'use_cache' is given twice, on lines 3 and 4"),
    ("dataset_name: x.jsonl\nlr_scheduler_kwargs: {min_lr: 1, min_lr: 2}\n", "key 'min_lr' is given twice, on lines 2 "
     "and 2"),
], ids=["top-level", "nested", "flow"])
def test_a_key_given_twice_in_a_recipe_is_refused_naming_it_and_both_lines(tmp_path, text, message):
    assert yaml.safe_load(text)  # PyYAML (and so TRL's parser) keeps the last, silently
    with pytest.raises(UsageError) as error:
        parse_args(_recipe(tmp_path, text))
    assert str(error.value).startswith(f"{tmp_path / 'r.yaml'} is not valid YAML: {message}"), error.value
    # a merge key's values may be overridden: YAML's meaning, not a key given twice
    _, _, args = parse_args(_recipe(tmp_path, "dataset_name: x.jsonl\nmodel_init_kwargs:\n  <<: {use_cache: true}\n"
                                              "  use_cache: false\n"))
    assert args.model_init_kwargs == {"use_cache": False}


def test_a_recipe_scalar_for_a_list_option_is_a_one_item_list_as_the_flag_gives(tmp_path):
    recipe = parse_args(_recipe(tmp_path, "dataset_mixer: {x.jsonl: 1.0}\nlora_target_modules: q_proj\n"
                                          "dataset_splits: train\nlora_modules_to_save: lm_head\n"))
    flags = parse_args(["--dataset_mixer", '{"x.jsonl": 1.0}', "--lora_target_modules", "q_proj",
                        "--dataset_splits", "train", "--lora_modules_to_save", "lm_head"])
    assert recipe[0] == flags[0] and recipe[0].lora_target_modules == ["q_proj"]  # was ['q', '_', 'p', ...]
    assert recipe[1].dataset_splits == flags[1].dataset_splits == ["train"]


def test_a_recipes_number_for_a_text_option_is_its_text_as_the_flags(tmp_path):
    recipe = parse_args(_recipe(tmp_path, "dataset_name: x.jsonl\ndataset_train_split: 2024\n"))[1]
    assert recipe.split == parse_args(["--dataset", "x.jsonl", "--dataset_train_split", "2024"])[1].split == "2024"
