"""The command line as DPO users write it: demo defaults only for the demo, TRL's option names and recipes, QLoRA's
error where bitsandbytes cannot run, the closest option for a typo."""

import json
import logging
import math
import os
from dataclasses import fields

import pytest
import torch
import trl  # the independent reference for which names are TRL's
import yaml
from conftest import write_hh_rows
from transformers import HfArgumentParser

from dpo_min import models
from dpo_min.compat import TRL_NAMES
from dpo_min.config import DPOMinConfig
from dpo_min.train import load_pairs, main, resolve
from dpo_min.train.args import DEMO_DEFAULTS, SMOLLM2_TEMPLATE_WITHOUT_SYSTEM, UsageError
from dpo_min.train.command_line import parse_args

TRL_KEYS = {f.name for cls in (trl.ScriptArguments, trl.ModelConfig, trl.DPOConfig) for f in fields(cls)}


def test_demo_defaults_apply_to_the_demo_only(tmp_path):
    demo_model, demo_data, demo = parse_args([])
    assert demo_model.chat_template == SMOLLM2_TEMPLATE_WITHOUT_SYSTEM
    assert (demo.learning_rate, demo.max_steps, demo.padding_free, demo.share_prompt) == (
        DEMO_DEFAULTS["learning_rate"], DEMO_DEFAULTS["max_steps"], True, True)
    # Whole evaluation batches (the accuracy is then an exact count); no step-0 pass, whose figures are known.
    assert demo_data.max_eval_samples % demo.per_device_eval_batch_size == 0 and not demo.eval_on_start
    library = DPOMinConfig(output_dir="unused")
    for given in (["--dataset", "my.jsonl"], ["--model", "some/model"], ["--model_name_or_path", "some/model"]):
        _, data_args, args = parse_args([*given, "--num_train_epochs", "1"])
        for name in ("learning_rate", "max_steps", "max_length", "max_prompt_length", "per_device_train_batch_size",
                     "padding_free", "logging_steps", "save_strategy"):
            assert getattr(args, name) == getattr(library, name), (given, name)
        assert data_args.max_eval_samples is None and args.eval_on_start
        assert parse_args(given)[0].chat_template is None  # the model's own template


def test_the_demo_template_is_smollm2s_own_less_its_default_system_message(tokenizer):
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    own = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    demo = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert own == system + demo
    with_system = [{"role": "system", "content": "Be brief."}, *conversation]  # a system turn of its own: as before
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == tokenizer.apply_chat_template(
        with_system, tokenize=False, chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)
    prompt = conversation[:1]
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == system + \
        tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                      chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)


def test_a_run_with_a_dataset_is_not_capped(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 40)
    train, held_out = load_pairs(resolve(["--dataset", str(data_file), "--num_train_epochs", "1",
                                          "--output_dir", str(tmp_path / "out")]))
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
    (["--load_in_4bit", "--no_use_peft"], "add --use_peft"),
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
    code = main(["--model", str(tiny_model_dir), "--load_in_4bit", "--use_peft", "--output_dir", str(tmp_path / "out")])
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error_lines) == 1 and message in error_lines[0], error_lines
    assert not (tmp_path / "out").exists()


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


def test_do_eval_false_holds_nothing_out_as_the_handbook(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 20)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"dataset_name": str(data_file), "do_eval": False, "eval_strategy": "no",
                                    "num_train_epochs": 1}))
    train, held_out = load_pairs(resolve(["--config", str(path), "--output_dir", str(tmp_path / "out")]))
    assert (len(train), held_out) == (20, None)  # the handbook trains on every row when it evaluates nothing


def test_use_liger_kernel_is_accepted_with_one_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dpo_min.config"):
        args = DPOMinConfig(output_dir=str(tmp_path), use_liger_kernel=True)
    [record] = caplog.records
    assert "already hold no [2B, T, V] logits" in record.getMessage()
    assert args.use_liger_kernel is False  # so that Trainer does not patch Liger's kernels into the model


# ---- LoRA only when asked for ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "recipe", "lora"), [
    ([], None, True),  # the demo keeps its LoRA adapter
    (["--dataset", "my.jsonl"], None, True),  # the demo's model on other data: still the demo's setup
    (["--model", "org/model"], None, False),  # TRL's ModelConfig: use_peft=False
    (["--model_name_or_path", "org/model", "--use_peft"], None, True),
    ([], {"dataset_name": "my.jsonl"}, True),  # a recipe without a model: the demo's model, with its adapter
    ([], {"model_name_or_path": "org/model"}, False),  # a recipe with a model: TRL's default
    ([], {"model_name_or_path": "org/model", "use_peft": True}, True),
    (["--no_use_peft"], None, False),
], ids=["demo", "demo-model-other-data", "model", "model-use-peft", "recipe-without-model", "recipe", "recipe-use-peft",
        "demo-no-peft"])
def test_lora_only_where_asked_for_or_in_the_demo(tmp_path, argv, recipe, lora):
    if recipe is not None:
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
        argv = ["--config", str(tmp_path / "r.yaml"), *argv]
    model_args, _, _ = parse_args(argv)
    assert model_args.use_peft is lora
    if "model_name_or_path" in (recipe or {}) or "--model" in argv or "--model_name_or_path" in argv:  # as TRL
        keys = {**(recipe or {}), **({"use_peft": True} if "--use_peft" in argv else {})}
        (trl_model_args,) = HfArgumentParser(trl.ModelConfig).parse_dict(keys, allow_extra_keys=True)
        assert (trl.get_peft_config(trl_model_args) is not None) is lora


def test_a_handbook_recipe_without_use_peft_fine_tunes_every_weight(tmp_path, tiny_model_dir, capsys):
    """zephyr-7b-beta's full recipe (its keys as the handbook writes them, the mixture replaced by a local file): no
    LoRA, the warmup of warmup_ratio, the checkpoint of a save_steps ratio."""
    recipe = yaml.safe_load(ZEPHYR_FULL_WITHOUT_DATA) | {
        "model_name_or_path": str(tiny_model_dir), "dataset_name": str(write_hh_rows(tmp_path / "p.jsonl", 10))}
    (tmp_path / "zephyr.yaml").write_text(yaml.safe_dump(recipe))
    output_dir = tmp_path / "run"
    # Sizes for a CPU, and what cannot run here (bf16 on a CPU, the hub), changed on the command line.
    code = main(["--config", str(tmp_path / "zephyr.yaml"), "--output_dir", str(output_dir), "--bf16", "false",
                 "--push_to_hub", "false", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                 "--eval_fraction", "0.2", "--max_length", "128", "--max_prompt_length", "64", "--num_samples", "0",
                 "--logging_steps", "1", "--learning_rate", "1e-3", "--save_steps", "0.5", "--save_total_limit", "2",
                 "--dataset_num_proc", "1", "--disable_tqdm", "true", "--log_level", "warning"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| full fine-tuning |" in out and "LoRA" not in out
    # 8 train pairs in steps of 2: 4 steps; warmup_ratio 0.1 -> ceil(0.4) = 1 step, as transformers 4 counted it.
    assert "training: 4 steps" in out and "warmup 1 step (0.1 of 4)" in out
    files = {path.name for path in output_dir.iterdir()}
    assert "model.safetensors" in files and not {"adapter_model.safetensors", "adapter_config.json"} & files
    state = json.loads((output_dir / "trainer_state.json").read_text())
    rates = [entry["learning_rate"] for entry in state["log_history"] if "loss" in entry]
    # Each step's rate, by hand: 0 in the one warmup step, then cosine over the other 3 (no warmup would start at 1e-3).
    assert rates == pytest.approx([0.0] + [1e-3 * (1 + math.cos(math.pi * k / 3)) / 2 for k in range(3)], rel=1e-6)
    assert state["save_steps"] == 2  # save_steps 0.5 of 4 steps


ZEPHYR_FULL_WITHOUT_DATA = """
torch_dtype: null
dataset_num_proc: 12
bf16: true
beta: 0.01
do_eval: true
eval_strategy: steps
eval_steps: 100
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: False
hub_model_id: zephyr-7b-dpo-full
learning_rate: 5.0e-7
log_level: info
logging_steps: 10
lr_scheduler_type: cosine
max_length: 1024
max_prompt_length: 512
num_train_epochs: 1
optim: adamw_torch
output_dir: data/zephyr-7b-dpo-full
per_device_train_batch_size: 8
per_device_eval_batch_size: 8
push_to_hub: true
save_strategy: "steps"
save_steps: 100
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
"""


def test_hub_model_revision_pushes_to_that_branch(tmp_path, fake_hub):
    from dpo_min.train.card import push_to_hub

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: org/model\nhub_model_revision: dpo-beta-0.01\n")
    _, _, args = parse_args(["--config", str(recipe)])
    push_to_hub(tmp_path, "me/zephyr", revision=args.hub_revision)
    assert fake_hub.calls == [("create_repo", "me/zephyr", None), ("create_branch", "me/zephyr", "dpo-beta-0.01"),
                              ("upload_folder", "me/zephyr", "dpo-beta-0.01")]
    fake_hub.calls.clear()
    push_to_hub(tmp_path, "me/zephyr")  # no revision: the main branch, as before
    assert fake_hub.calls == [("create_repo", "me/zephyr", None), ("upload_folder", "me/zephyr", None)]


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


# ---- nested options, checked before the model loads ---------------------------------------------------------------
def test_an_unknown_model_init_kwarg_of_the_default_model_is_refused_before_it_loads(smollm_path, monkeypatch):
    # The default model's config is its cached conversion's: read before any weights load.
    monkeypatch.setattr("dpo_min.train.model_setup.load_model_and_tokenizer",
                        lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UsageError, match=r"model_init_kwargs: unknown key 'bogus'"):
        parse_args(["--dataset", "pairs.jsonl", "--model_init_kwargs", '{"bogus": 1}'])


@pytest.mark.parametrize(("recipe", "message"), [
    ({"lr_scheduler_kwargs": {"nonsense": 1}},
     "lr_scheduler_kwargs (lr_scheduler_type linear): unknown key 'nonsense' (it takes last_epoch)"),
    ({"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {"last_epoch": 3}},  # transformers would drop it
     "lr_scheduler_kwargs (lr_scheduler_type constant): unknown key 'last_epoch' (it takes no keyword)"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": "half"}},
     "lr_scheduler_kwargs (lr_scheduler_type cosine): num_cycles must be float, got 'half'"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "lr_scheduler_kwargs": {"patience": 2.5}},
     "lr_scheduler_kwargs (lr_scheduler_type reduce_lr_on_plateau): patience must be int, got 2.5"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": "False"}},
     "gradient_checkpointing_kwargs: use_reentrant must be bool or null, got 'False'"),
    ({"gradient_checkpointing_kwargs": {"use_reentrnt": False}},
     "gradient_checkpointing_kwargs: unknown key 'use_reentrnt' (did you mean 'use_reentrant'?)"),
    ({"model_init_kwargs": {"bogus": 1}}, "model_init_kwargs: unknown key 'bogus' (not a keyword of from_pretrained"),
    ({"model_init_kwargs": {"local_files_only": "yes"}}, "model_init_kwargs: local_files_only must be bool, got 'yes'"),
    # what the schedule function itself checks, and the keywords its signature requires
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "lr_scheduler_kwargs (lr_scheduler_type cosine_with_min_lr): One "
     "of min_lr or min_lr_rate should be set"),
    ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6, "min_lr_rate": 0.1}},
     "lr_scheduler_kwargs (lr_scheduler_type cosine_with_min_lr): Only one of min_lr or min_lr_rate should be set"),
    ({"lr_scheduler_type": "warmup_stable_decay"},
     "lr_scheduler_kwargs (lr_scheduler_type warmup_stable_decay): needs num_decay_steps"),
    ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 2, "decay_type": "x"}},
     "lr_scheduler_kwargs (lr_scheduler_type warmup_stable_decay): Unknown decay type: x"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"context_fn": None}},
     "gradient_checkpointing_kwargs: context_fn must be Callable, got None"),
], ids=["scheduler-key", "constant-takes-none", "scheduler-type", "plateau-int", "reentrant-string",
        "checkpoint-typo", "init-key", "init-type", "min-lr-neither", "min-lr-both", "wsd-required", "wsd-checks",
        "context-fn-null"])
def test_bad_nested_options_are_one_line_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys,
                                                                recipe, message):
    import dpo_min.train

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset_name": "x.jsonl", **recipe}))
    monkeypatch.setattr(dpo_min.train, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main(["--config", str(path), "--output_dir", str(tmp_path / "run")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "run").exists()


def test_nested_options_the_signatures_take_pass(tiny_model_dir):
    _, _, args = parse_args([
        "--model", str(tiny_model_dir), "--lr_scheduler_type", "warmup_stable_decay",
        "--lr_scheduler_kwargs", '{"num_decay_steps": 2, "min_lr_ratio": 0}',
        "--gradient_checkpointing_kwargs", '{"use_reentrant": false, "preserve_rng_state": true}',
        # from_pretrained's own keyword, and an attribute of this model's config (use_cache)
        "--model_init_kwargs", '{"attn_implementation": "sdpa", "use_cache": false, "dtype": "float32"}'])
    assert args.model_init_kwargs["use_cache"] is False and args.lr_scheduler_kwargs["num_decay_steps"] == 2
    # A hub id whose config is not on disk: only the keys and values known are checked, from_pretrained decides the
    # rest (it refuses an unknown one when it builds the model).
    parse_args(["--model", "org/not-cached", "--model_init_kwargs", '{"rope_scaling": null}'])


# ---- the demo is the run given no data at all -------------------------------------------------------------------
MIXTURES = {
    "trl-flag": ([], ["--datasets", '[{"path": "json", "data_files": "pairs.jsonl"}]']),
    "handbook-recipe": ({"dataset_mixture": {"datasets": [{"id": "pairs.jsonl"}], "test_split_size": 3}}, []),
    "legacy-flag": ([], ["--dataset_mixer", '{"pairs.jsonl": 0.5}']),
    "recipe-without-model": ({"dataset_name": "pairs.jsonl", "beta": 0.2}, []),
}


@pytest.mark.parametrize("name", MIXTURES)
def test_a_run_with_data_and_no_model_gets_the_library_defaults_and_lora(tmp_path, name):
    recipe, flags = MIXTURES[name]
    if recipe:
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
        flags = ["--config", str(tmp_path / "r.yaml"), *flags]
    model_args, data_args, args = parse_args(flags)
    library = DPOMinConfig(output_dir="unused")
    for option in ("learning_rate", "max_steps", "max_length", "max_prompt_length", "padding_free", "share_prompt",
                   "precompute_ref_log_probs", "logging_steps", "per_device_train_batch_size"):
        assert getattr(args, option) == getattr(library, option), option
    assert (data_args.eval_fraction, data_args.max_eval_samples, model_args.chat_template) == (None, None, None)
    assert model_args.use_peft and model_args.model is None  # the demo's model, with its adapter, on this data


def test_a_recipe_with_neither_data_nor_model_is_the_demo_with_its_adapter(tmp_path):
    (tmp_path / "r.yaml").write_text("beta: 0.2\n")
    model_args, data_args, args = parse_args(["--config", str(tmp_path / "r.yaml")])
    assert (args.learning_rate, args.max_steps, data_args.eval_fraction, args.beta) == (
        DEMO_DEFAULTS["learning_rate"], DEMO_DEFAULTS["max_steps"], DEMO_DEFAULTS["eval_fraction"], 0.2)
    assert model_args.use_peft  # was full fine-tuning at the demo's LoRA learning rate


# ---- do_eval: false with a mixture; TRL's env: block --------------------------------------------------------------
def test_do_eval_false_trains_every_pair_of_a_mixture_and_refuses_a_test_split_size_beside_it(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"dataset_mixture": {"datasets": [{"id": str(data_file)}], "test_split_size": 3},
                                    "do_eval": False, "max_steps": 1, "per_device_train_batch_size": 12}))
    train, held_out = load_pairs(resolve(["--config", str(path), "--output_dir", str(tmp_path / "out")]))
    assert (len(train), held_out) == (12, None)  # the mixture's own test_split_size is its default: nothing held out
    with pytest.raises(UsageError, match=r"^do_eval: false evaluates nothing, but --test_split_size asks for"):
        parse_args(["--config", str(path), "--test_split_size", "2"])
    with pytest.raises(UsageError, match=r"^--do_eval false evaluates nothing, but test_split_size asks for"):
        path.write_text(yaml.safe_dump({"datasets": [{"path": str(data_file)}], "test_split_size": 2}))
        parse_args(["--config", str(path), "--do_eval", "false"])
    _, data_args, _ = parse_args(["--dataset_mixer", json.dumps({str(data_file): 1.0}), "--do_eval", "false",
                                  "--dataset_splits", "train", "test"])
    assert data_args.dataset_splits == ["train"]  # the legacy test splits are not read to be held out


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
def _recipe(tmp_path, text: str) -> list[str]:
    (tmp_path / "r.yaml").write_text(text)
    return ["--config", str(tmp_path / "r.yaml")]


def _one_line_error(argv: list[str], tmp_path, capsys, monkeypatch) -> str:
    """The command's only stderr line for argv, refused with exit code 2 before the model loads or any folder is
    written."""
    import dpo_min.train

    monkeypatch.setattr(dpo_min.train, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert not (tmp_path / "run").exists()
    return line


def test_a_dtype_flag_beats_the_recipes_model_init_kwargs_and_two_in_one_place_are_refused(tmp_path, tiny_model_dir):
    from dpo_min.train import load_model

    recipe = _recipe(tmp_path, f"model_name_or_path: {tiny_model_dir}\ndataset_name: x.jsonl\n"
                               "model_init_kwargs: {torch_dtype: bfloat16}\n")
    out = ["--output_dir", str(tmp_path / "run")]
    for flags, dtype in ([], torch.bfloat16), (["--dtype", "float32"], torch.float32), (
            ["--torch_dtype", "float32"], torch.float32):
        plan = resolve([*recipe, *flags, *out])
        model = load_model(plan)[0]  # the weights as loaded, against the option the card reports
        assert (model.dtype, plan.model.dtype) == (dtype, str(dtype).removeprefix("torch.")), flags
    with pytest.raises(UsageError, match=r"^model_init_kwargs's torch_dtype bfloat16 and dtype float32 both set"):
        parse_args(_recipe(tmp_path, "dataset_name: x.jsonl\ndtype: float32\nmodel_init_kwargs: {torch_dtype: "
                                     "bfloat16}\n"))
    with pytest.raises(UsageError, match=r"^--model_init_kwargs's dtype bfloat16 and --dtype float32 both set"):
        parse_args(["--dataset", "x.jsonl", "--dtype", "float32", "--model_init_kwargs", '{"dtype": "bfloat16"}'])


@pytest.mark.parametrize(("argv", "recipe", "message"), [
    (["--dataset", ""], None, "--dataset '' names no data"),
    (["--datasets", "null"], None, "--datasets null names no data"),
    (["--dataset_mixer", "null"], None, "--dataset_mixer null names no data"),
    ([], "dataset_name: null\nbeta: 0.2\n", "dataset null names no data"),
], ids=["empty-dataset", "null-datasets", "null-mixer", "recipe-null-dataset"])
def test_empty_or_null_data_is_a_usage_error_not_the_demo_pairs(tmp_path, capsys, monkeypatch, argv, recipe, message):
    argv = [*(_recipe(tmp_path, recipe) if recipe else []), *argv]
    assert _one_line_error(argv, tmp_path, capsys, monkeypatch).endswith(
        f"{message}: give a data file, folder or datasets name (or leave the option out for the demo's pairs)")
    # null beside data of another form is the key's default written out, as in a dumped TRL config
    _, data_args, _ = parse_args(_recipe(tmp_path, "dataset_name: null\ndatasets: [{path: a.jsonl}]\n"))
    assert data_args.datasets == [{"path": "a.jsonl"}]


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


SECRET = "hf_SeCrEt0123456789abcdef"


@pytest.mark.parametrize(("argv", "recipe", "message"), [
    (["--hub_tokn", SECRET], None, "unknown argument(s): --hub_tokn <hidden> (did you mean --hub_token?)"),
    ([f"--hub-tokn={SECRET}"], None, "unknown argument(s): --hub-tokn=<hidden>"),
    ([], f"hub_token: [{SECRET}]\n", "hub_token takes a single value, got a list (not shown)"),
    (["--dataset", "x.jsonl", "--model_init_kwargs", json.dumps({"token": [SECRET]})], None,
     "model_init_kwargs: token must be str or bool or null, got a list (not shown)"),
], ids=["typo-flag", "typo-flag-inline", "recipe-list", "model-init-kwargs"])
def test_no_message_shows_a_token(tmp_path, capsys, monkeypatch, argv, recipe, message):
    argv = [*(_recipe(tmp_path, recipe) if recipe else []), *argv]
    line = _one_line_error(argv, tmp_path, capsys, monkeypatch)
    assert message in line and SECRET not in line and SECRET[3:] not in line, line


@pytest.mark.parametrize("count", [0, -1])
def test_max_eval_samples_below_one_is_one_line(tmp_path, capsys, monkeypatch, count):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 10)
    line = _one_line_error(["--dataset", str(data_file), "--max_eval_samples", str(count)], tmp_path, capsys,
                           monkeypatch)
    assert line.endswith(f"--max_eval_samples must be >= 1, got {count} (to hold out nothing: --eval_fraction 0)")


def test_from_pretrained_keywords_it_drops_are_accepted_and_the_list_holds_every_one_it_pops(tmp_path, tiny_model_dir):
    import inspect
    import re

    from transformers import PreTrainedModel

    from dpo_min.train import load_model
    from dpo_min.train.kwargs_checks import FROM_PRETRAINED_KWARGS

    # Every keyword from_pretrained takes from **kwargs, read off transformers' own source; a recipe cannot give
    # objects (a state_dict of tensors, a tqdm class).
    source = inspect.getsource(PreTrainedModel.from_pretrained)
    popped = set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    for names in re.findall(r"for name in \[([^\]]*)\]:\s*_ = kwargs\.pop\(name", source):
        popped |= set(re.findall(r'"(\w+)"', names))
    assert {name for name in popped if not name.startswith("_")} - {"state_dict", "tqdm_class"} <= set(
        FROM_PRETRAINED_KWARGS)
    plan = resolve(["--model", str(tiny_model_dir), "--dataset", "x.jsonl", "--output_dir", str(tmp_path / "run"),
                    "--model_init_kwargs", '{"low_cpu_mem_usage": true, "allow_all_kernels": false}'])
    assert load_model(plan)[0].config.model_type == "llama"  # from_pretrained took and dropped them


@pytest.mark.parametrize(("argv", "recipe", "message"), [
    ([], "dataset_name: x.jsonl\nsave_strategy: no\n", 'r.yaml: save_strategy is not true/false, got False (YAML '
     'reads no, off and false as false; quote the word: save_strategy: "no")'),
    (["--dataset", "x.jsonl", "--split", " train"], None,
     "--split ' train': a split's name has no spaces around it ('train')"),
    (["--config", "second.yaml"], "dataset_name: x.jsonl\n", "one recipe per run: "),
    (["--dataset", "x.jsonl", "--learning_rate", "inf"], None, "--learning_rate must be a finite number, got inf"),
], ids=["yaml-no", "split-spaces", "second-config", "learning-rate-inf"])
def test_messages_name_what_was_written(tmp_path, capsys, monkeypatch, argv, recipe, message):
    argv = [*(_recipe(tmp_path, recipe) if recipe else []), *argv]
    line = _one_line_error(argv, tmp_path, capsys, monkeypatch)
    assert message in line and "fsdp_config" not in line, line


def test_a_recipes_number_for_a_text_option_is_its_text_as_the_flags(tmp_path):
    recipe = parse_args(_recipe(tmp_path, "dataset_name: x.jsonl\ndataset_train_split: 2024\n"))[1]
    assert recipe.split == parse_args(["--dataset", "x.jsonl", "--dataset_train_split", "2024"])[1].split == "2024"


def test_offline_with_a_hub_token_does_not_ask_for_one(monkeypatch):
    from huggingface_hub import constants

    from dpo_min.train.card import check_hub_access

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as error:
        check_hub_access("me/model", token=SECRET)
    assert "offline mode is enabled" in str(error.value) and "pass --hub_token" not in str(error.value)
    assert "check --hub_token and that the Hub can be reached" in str(error.value) and SECRET not in str(error.value)
    with pytest.raises(OSError, match="log in with `hf auth login` or pass --hub_token"):
        check_hub_access("me/model")


def test_bf16_on_a_machine_without_an_accelerator_gets_use_cpu(monkeypatch):
    from dpo_min.train import command_line

    monkeypatch.setattr(command_line, "_has_accelerator", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # was transformers' "Your setup doesn't support bf16/gpu. You need to assign use_cpu"
    _, _, args = parse_args(["--dataset", "x.jsonl", "--bf16", "true"])
    assert args.bf16 and args.use_cpu and args.device.type == "cpu"
