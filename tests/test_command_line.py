"""`train.command_line`: which run is the demo (demo defaults only for the demo, LoRA only where asked for or in the
demo), command-line mistakes that name the fix, the options that cannot go together (each refused in one line naming
what was written), use_cpu on a machine without an accelerator."""

import json
import math

import pytest
import torch
import trl  # the independent reference for which names are TRL's
import yaml
from conftest import _one_line_error, _recipe, write_hh_rows
from transformers import HfArgumentParser

from dpo_min.config import DPOMinConfig
from dpo_min.train import load_pairs, main, resolve
from dpo_min.train.args import DEMO_DEFAULTS, SMOLLM2_TEMPLATE_WITHOUT_SYSTEM, UsageError
from dpo_min.train.command_line import parse_args


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
        # No step-0 pass either: the policy starts as its reference, every held-out pair a tie (stated, not measured).
        assert data_args.max_eval_samples is None and not args.eval_on_start
        assert parse_args(given)[0].chat_template is None  # the model's own template


@pytest.mark.parametrize(("extra", "measured_at_start"), [
    ([], False),  # sigmoid reads the reference: the figures before training are ties, stated
    (["--loss_type", "simpo"], True),  # no reference: the step-0 figures are the model's own, measured
    (["--eval_on_start", "true"], True),  # asked for
    (["--loss_type", "simpo", "--eval_on_start", "false"], False),
])
def test_the_held_out_pass_before_training_is_spent_only_where_its_figures_are_not_known(extra, measured_at_start):
    plan = resolve(["--dataset", "p.jsonl", *extra])
    assert plan.args.eval_on_start is measured_at_start
    assert plan.ties_at_start is (not measured_at_start and plan.args.loss_settings.reads_reference)


def test_a_run_with_a_dataset_is_not_capped(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 40)
    train, held_out = load_pairs(resolve(["--dataset", str(data_file), "--num_train_epochs", "1",
                                          "--output_dir", str(tmp_path / "out")]))
    assert len(train) + len(held_out) == 40 and len(held_out) == 2  # 5% held out, nothing dropped


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


def test_do_eval_false_holds_nothing_out_as_the_handbook(tmp_path):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 20)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"dataset_name": str(data_file), "do_eval": False, "eval_strategy": "no",
                                    "num_train_epochs": 1}))
    train, held_out = load_pairs(resolve(["--config", str(path), "--output_dir", str(tmp_path / "out")]))
    assert (len(train), held_out) == (20, None)  # the handbook trains on every row when it evaluates nothing


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


# ---- do_eval: false with a mixture --------------------------------------------------------------------------------
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


# ---- issue 30: no option silently outvoted, no secret printed, one line where a traceback was -------------------
def test_a_dtype_flag_beats_the_recipes_model_init_kwargs_and_two_in_one_place_are_refused(tmp_path, tiny_model_dir):
    from dpo_min.train.model_setup import load_model

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


@pytest.mark.parametrize("count", [0, -1])
def test_max_eval_samples_below_one_is_one_line(tmp_path, capsys, monkeypatch, count):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 10)
    line = _one_line_error(["--dataset", str(data_file), "--max_eval_samples", str(count)], tmp_path, capsys,
                           monkeypatch)
    assert line.endswith(f"--max_eval_samples must be >= 1, got {count} (to hold out nothing: --eval_fraction 0)")


@pytest.mark.parametrize(("argv", "recipe", "message"), [
    ([], "dataset_name: x.jsonl\nsave_strategy: no\n", 'r.yaml: save_strategy is not true/false, got False (YAML '
     'reads no, off and false as false; quote the word: save_strategy: "no")'),
    (["--dataset", "x.jsonl", "--split", " train"], None,
     "--split ' train': a split's name has no spaces around it ('train')"),
    (["--config", "second.yaml"], "dataset_name: x.jsonl\n", "one recipe per run: "),
    (["--dataset", "x.jsonl", "--learning_rate", "inf"], None, "--learning_rate must be a finite number, got inf"),
    # TrainingArguments' message is several lines: it was cut at "but found", its strategies shown as enums
    (["--dataset", "x.jsonl", "--load_best_model_at_end", "true"], None, '--load_best_model_at_end requires the save '
     'and eval strategy to match, except when --save_strategy="best", but found Evaluation strategy: no, Save '
     'strategy: steps'),
], ids=["yaml-no", "split-spaces", "second-config", "learning-rate-inf", "load-best-model"])
def test_messages_name_what_was_written(tmp_path, capsys, monkeypatch, argv, recipe, message):
    argv = [*(_recipe(tmp_path, recipe) if recipe else []), *argv]
    line = _one_line_error(argv, tmp_path, capsys, monkeypatch)
    assert message in line and "fsdp_config" not in line, line


def test_bf16_on_a_machine_without_an_accelerator_gets_use_cpu(monkeypatch):
    from dpo_min.train import command_line

    monkeypatch.setattr(command_line, "_has_accelerator", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # was transformers' "Your setup doesn't support bf16/gpu. You need to assign use_cpu"
    _, _, args = parse_args(["--dataset", "x.jsonl", "--bf16", "true"])
    assert args.bf16 and args.use_cpu and args.device.type == "cpu"
