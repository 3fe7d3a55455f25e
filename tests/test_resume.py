"""A CLI run killed with SIGKILL and resumed (`--resume_from_checkpoint latest`) ends where an uninterrupted run
ends: the same weights, logged losses and token counts, and each resumed process trains only the steps still to do."""

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, reference_cache_entries, write_hh_rows
from safetensors.torch import load_file

STEPS, SAVE_EVERY = 8, 2
KILL_AT = (2, 6)  # kill once checkpoint-2 exists, resume, kill once checkpoint-6 exists, resume to the end
VARIANTS = {"lora": (["--use_peft"], "adapter_model.safetensors"), "full": (["--no_use_peft"], "model.safetensors"),
            # 12 train pairs: 6 steps an epoch, so the last process draws the second epoch's group order afresh
            "grouped": (["--use_peft", "--group_by_prompt", "--data_seed", "3", "--eval_fraction", "0.5"],
                        "adapter_model.safetensors")}


def command(model_dir, data_file, output_dir, *extra):
    return [sys.executable, "-m", "dpo_min.train", "--model", str(model_dir), "--dataset", str(data_file),
            "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--save_strategy", "steps",
            "--save_steps", str(SAVE_EVERY), "--per_device_train_batch_size", "2", "--learning_rate", "5e-3",
            "--eval_fraction", "0.2", "--num_samples", "0", "--max_length", "128", "--precompute_ref_log_probs", "true",
            "--logging_steps", "1", "--disable_tqdm", "true", *extra]


def environment(cache):
    # Each process gets its own empty reference cache, so each must compute the reference itself; unbuffered, so
    # that a killed process's printed logs reach its log file.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "DPO_MIN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def run_until_killed(argv, staging, checkpoint_step, cache, log):
    """Start the command, SIGKILL it once checkpoint-`checkpoint_step` exists (renamed into place, so whole)."""
    with log.open("w") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env=environment(cache), stdout=out, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not (staging / f"checkpoint-{checkpoint_step}").is_dir():
            assert process.poll() is None, f"the run ended (exit {process.returncode}) before {checkpoint_step}"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
    return process.returncode


def training_losses(output_dir, figure="loss"):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry[figure] for entry in state["log_history"] if figure in entry and "loss" in entry}


def printed_losses(stdout):
    """The training losses one process printed itself (Trainer's PrinterCallback, 4 significant digits)."""
    logs = [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{")]
    return [entry["loss"] for entry in logs if "loss" in entry]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS)
def test_killed_and_resumed_run_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, variant):
    flags, weights_file = VARIANTS[variant]
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 24)
    whole = tmp_path / "whole"
    subprocess.run(command(tiny_model_dir, data_file, whole, *flags), cwd=ROOT, env=environment(tmp_path / "cache0"),
                   check=True, capture_output=True)
    expected = training_losses(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    if variant == "grouped":  # the last process trains in the second epoch, in its own group order
        assert json.loads((whole / "trainer_state.json").read_text())["epoch"] > 1
    expected_printed = [f"{expected[step]:.4g}" for step in range(1, STEPS + 1)]
    reference_keys = [path.name for path in reference_cache_entries(tmp_path / "cache0")]
    assert len(reference_keys) == 2  # the train and the held-out pairs, scored once each

    resumed = tmp_path / "resumed"
    staging = tmp_path / "resumed.partial"
    argv = command(tiny_model_dir, data_file, resumed, *flags)
    start = 0
    for number, checkpoint_step in enumerate(KILL_AT, start=1):
        log = tmp_path / f"run{number}.log"
        assert run_until_killed(argv, staging, checkpoint_step, tmp_path / f"cache{number}", log) == -signal.SIGKILL
        assert not resumed.exists()  # a killed run publishes nothing
        # The process began at the step after the checkpoint it resumed from, not at step 1.
        printed = printed_losses(log.read_text())
        assert printed and printed == expected_printed[start:start + len(printed)], (start, printed)
        assert start + len(printed) >= checkpoint_step
        start = checkpoint_step
        argv = command(tiny_model_dir, data_file, resumed, *flags, "--resume_from_checkpoint", "latest")
    final_cache = tmp_path / f"cache{len(KILL_AT) + 1}"
    finished = subprocess.run(argv, cwd=ROOT, env=environment(final_cache), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert not staging.exists()
    # The last process trained steps 7 and 8 only.
    assert printed_losses(finished.stdout) == expected_printed[KILL_AT[-1]:]
    # Every process scored the reference itself, from the untrained weights: the same cache keys as the whole run.
    for number in range(1, len(KILL_AT) + 2):
        assert [path.name for path in reference_cache_entries(tmp_path / f"cache{number}")] == reference_keys, number

    actual = training_losses(resumed)
    assert sorted(actual) == sorted(expected)
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=1e-6), step
    # The running token count goes on from the checkpoint, as it runs on in the uninterrupted run.
    assert training_losses(resumed, "num_tokens") == training_losses(whole, "num_tokens")
    whole_weights, resumed_weights = load_file(whole / weights_file), load_file(resumed / weights_file)
    assert whole_weights.keys() == resumed_weights.keys()
    largest = max((whole_weights[name] - resumed_weights[name]).abs().max().item() for name in whole_weights)
    print(f"\nresume ({variant}): {len(KILL_AT)} kills survived, largest weight difference {largest:.2e}")
    assert largest <= 1e-6
    # The run moved the weights, so equal weights say something.
    if variant != "full":
        moved = max(tensor.abs().max().item() for name, tensor in whole_weights.items() if "lora_B" in name)
    else:
        initial = load_file(tiny_model_dir / "model.safetensors")
        moved = max((whole_weights[name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-3
    assert torch.isfinite(torch.tensor(list(actual.values()))).all()


# ---- a resume that is not the same run is refused; the same run, however it is spelled, resumes ----------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    """A real 1-step LoRA run with its checkpoint kept in the published folder: the record a resume is compared
    with. Its held-out share is left to the plan (0.05 of one dataset), its data seed too (the seed's)."""
    from dpo_min.train import main

    folder = tmp_path_factory.mktemp("finished")
    data_file, other_file = write_hh_rows(folder / "pairs.jsonl", 20), folder / "other.jsonl"
    other_file.write_text("".join(reversed(data_file.read_text().splitlines(keepends=True))))
    shutil.copytree(tiny_model_dir, folder / "other-model")  # another base model for the adapter
    argv = ["--model", str(tiny_model_dir), "--use_peft", "--dataset", str(data_file), "--max_steps", "1",
            "--save_strategy", "steps", "--save_steps", "1", "--per_device_train_batch_size", "2", "--max_length",
            "64", "--num_samples", "0", "--precompute_ref_log_probs", "false", "--disable_tqdm", "true"]
    assert main([*argv, "--output_dir", str(folder / "run")]) == 0
    return folder, argv


def replace_in_place(folder):
    data_file = folder / "pairs.jsonl"
    rows = data_file.read_text().splitlines(keepends=True)
    data_file.write_text("".join(rows[1:] + rows[:1]))  # the same rows, another order: other pairs reached
    return []


@pytest.mark.parametrize("change, expected", [
    (lambda folder: ["--dataset", str(folder / "other.jsonl")],
     ["dataset {folder}/pairs.jsonl -> {folder}/other.jsonl"]),
    (replace_in_place, ["pairs (sha256) "]),
    (lambda folder: ["--max_length", "32"], ["max_length 64 -> 32"]),
    (lambda folder: ["--loss_type", "ipo"], ['loss_type ["sigmoid"] -> ["ipo"]']),
    (lambda folder: ["--eval_fraction", "0.5"], ["eval_fraction 0.05 -> 0.5"]),
    (lambda folder: ["--beta", "0.5"], ["beta 0.1 -> 0.5"]),
    # the model, and the adapter on it (another rank or no adapter: before, a traceback from the checkpoint's load)
    (lambda folder: ["--model", str(folder / "other-model")], ["model {model} -> {folder}/other-model"]),
    (lambda folder: ["--model_revision", "v2"], ["model_revision main -> v2"]),
    (lambda folder: ["--lora_r", "8"], ["lora_r 16 -> 8"]),
    (lambda folder: ["--lora_alpha", "8", "--lora_dropout", "0.1"], ["lora_alpha 32 -> 8, lora_dropout 0.0 -> 0.1"]),
    (lambda folder: ["--lora_target_modules", "q_proj"], ['lora_target_modules ["all-linear"] -> ["q_proj"]']),
    (lambda folder: ["--no_use_peft"], ["use_peft True -> False"]),
    # the tokenization
    (lambda folder: ["--chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"],
     ["chat_template None -> "]),
    # the optimizer and the schedule (before, the restored optimizer kept the old ones and the card showed the new)
    (lambda folder: ["--learning_rate", "1e-3"], ["learning_rate 1e-06 -> 0.001"]),
    (lambda folder: ["--weight_decay", "0.1"], ["weight_decay 0.0 -> 0.1"]),
    (lambda folder: ["--lr_scheduler_type", "cosine"], ["lr_scheduler_type linear -> cosine"]),
    (lambda folder: ["--warmup_steps", "2", "--adam_beta2", "0.99"],
     ["adam_beta2 0.999 -> 0.99, warmup_steps 0 -> 2.0"]),
    (lambda folder: ["--optim", "sgd"], ["optim adamw_torch_fused -> sgd"]),
    (lambda folder: ["--group_by_prompt"], ["group_by_prompt False -> True"]),  # another order of the pairs
], ids=["other-file", "file-replaced-in-place", "max-length", "loss-type", "eval-fraction", "beta", "model",
        "model-revision", "lora-r", "lora-alpha-dropout", "lora-targets", "no-peft", "chat-template",
        "learning-rate", "weight-decay", "scheduler", "warmup-betas", "optim", "group-by-prompt"])
def test_a_resume_that_is_not_the_same_run_is_refused_naming_old_and_new(finished_run, tiny_model_dir, tmp_path,
                                                                        capsys, change, expected):
    from dpo_min.train import main

    folder, argv = finished_run
    original = (folder / "pairs.jsonl").read_text()
    checkpoint = folder / "run" / "checkpoint-1"
    try:
        code = main([*argv, *change(folder), "--output_dir", str(tmp_path / "again"), "--resume_from_checkpoint",
                     str(checkpoint)])
    finally:
        (folder / "pairs.jsonl").write_text(original)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"cannot resume {checkpoint} with other settings (" in lines[0]
    for part in expected:
        assert part.format(folder=folder, model=tiny_model_dir) in lines[0], lines[0]
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.partial").exists()


def test_a_resume_is_checked_once_after_the_data_naming_the_settings_and_the_pairs_together(finished_run, tmp_path,
                                                                                           capsys):
    # issue 57: one same-run check, after the data is read, its digest included (it was two: the settings before the
    # data, which named the dataset alone, then the pairs).
    from dpo_min.train import main

    folder, argv = finished_run
    checkpoint = folder / "run" / "checkpoint-1"
    code = main([*argv, "--dataset", str(folder / "other.jsonl"), "--beta", "0.5", "--output_dir",
                 str(tmp_path / "again"), "--resume_from_checkpoint", str(checkpoint)])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"cannot resume {checkpoint} with other settings (" in line
    for part in ("beta 0.1 -> 0.5", f"dataset {folder}/pairs.jsonl -> {folder}/other.jsonl", "pairs (sha256) "):
        assert part in line, line
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.partial").exists()


@pytest.mark.parametrize("spelled", [
    [],
    ["--eval_fraction", "0.05"],  # the share the plan holds out of one dataset when none is given
    ["--data_seed", "42"],  # the data seed the plan takes when none is given: the seed
    ["--dataset_config", "default"],  # a data file's one config
    ["--num_train_epochs", "7"],  # not read when max_steps is given
    ["--logging_steps", "3", "--eval_strategy", "no"],  # what is logged and evaluated, not what trains
], ids=["same", "eval-fraction-spelled", "data-seed-spelled", "config-default", "epochs-with-max-steps", "logging"])
def test_the_same_run_however_it_is_spelled_resumes(finished_run, tmp_path, capsys, spelled):
    from dpo_min.train import main

    folder, argv = finished_run
    again = tmp_path / "again"
    code = main([*argv, *spelled, "--output_dir", str(again), "--resume_from_checkpoint",
                 str(folder / "run" / "checkpoint-1")])
    assert code == 0, capsys.readouterr().err
    state = json.loads((again / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and (again / "adapter_model.safetensors").is_file()
    # What the resumed run was given is what its folder says it ran with.
    if "--logging_steps" in spelled:
        assert torch.load(again / "training_args.bin", weights_only=False).logging_steps == 3


def test_a_record_from_before_the_plan_decided_the_data_seed_and_share_is_the_same_run(tmp_path):
    """A record that left data_seed and eval_fraction to the plan (None) compares them no more; the seed stays."""
    from dpo_min.train.plan import resolve
    from dpo_min.train.run_dir import MANIFEST, OutputDirError
    from dpo_min.train.same_run import check_same_run

    argv = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "a.jsonl"), "--output_dir",
            str(tmp_path / "out")]
    settings = resolve(argv).resume_settings
    assert (settings["data_seed"], settings["eval_fraction"]) == (42, 0.05)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MANIFEST).write_text(json.dumps({"data_settings": {
        "seed": 42, "data_seed": None, "eval_fraction": None, "max_length": 1024}}))
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    check_same_run(checkpoint, settings)
    with pytest.raises(OutputDirError, match=r"other settings \(seed 42 -> 7\)"):
        check_same_run(checkpoint, resolve([*argv, "--seed", "7"]).resume_settings)


def test_a_resume_compares_parsed_mixtures_and_names_the_entries_that_differ(tmp_path):
    """The same mixture as YAML in a recipe and as JSON on the command line is the same run; another entry is named."""
    from dpo_min.train.command_line import parse_args
    from dpo_min.train.run_dir import MANIFEST, OutputDirError
    from dpo_min.train.same_run import check_same_run, resume_settings

    mixture = [{"path": "a.jsonl"}, {"path": "b.jsonl", "split": "train"}]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("datasets:\n  - path: a.jsonl\n  - {path: b.jsonl, split: train}\n")
    recorded = resume_settings(*parse_args(["--config", str(recipe)])[1:])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MANIFEST).write_text(json.dumps({"data_settings": recorded}))
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    check_same_run(checkpoint, resume_settings(*parse_args(["--datasets", json.dumps(mixture)])[1:]))
    other = [mixture[0], {"path": "c.jsonl", "split": "train"}]
    with pytest.raises(OutputDirError) as error:
        check_same_run(checkpoint, resume_settings(*parse_args(["--datasets", json.dumps(other)])[1:]))
    assert 'settings (datasets[1] {"path": "b.jsonl", "split": "train"} -> {"path": "c.jsonl", "split": "train"})' \
        in str(error.value)
    # A record from before flags were parsed holds the flag's text: still the same mixture.
    as_text = {**recorded, "datasets": json.dumps(mixture)}
    (tmp_path / "run" / MANIFEST).write_text(json.dumps({"data_settings": as_text}))
    check_same_run(checkpoint, recorded)


def test_a_test_split_size_given_as_text_or_as_a_number_is_the_same_run(tmp_path):
    from dpo_min.train.command_line import parse_args
    from dpo_min.train.run_dir import MANIFEST, OutputDirError
    from dpo_min.train.same_run import check_same_run, resume_settings

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("datasets:\n  - path: a.jsonl\ntest_split_size: 3\n")
    recorded = resume_settings(*parse_args(["--config", str(recipe)])[1:])
    assert recorded["test_split_size"] == 3
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MANIFEST).write_text(json.dumps({"data_settings": recorded}))
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    flags = ["--datasets", json.dumps([{"path": "a.jsonl"}]), "--test_split_size"]
    check_same_run(checkpoint, resume_settings(*parse_args([*flags, "3"])[1:]))  # the flag's text "3"
    with pytest.raises(OutputDirError, match=r"test_split_size 3 -> 0.25"):
        check_same_run(checkpoint, resume_settings(*parse_args([*flags, "0.25"])[1:]))
