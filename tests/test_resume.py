"""A CLI run killed with SIGKILL and resumed (`--resume_from_checkpoint latest`) ends where an uninterrupted run
ends: the same weights and the same logged losses, and each resumed process trains only the steps still to do."""

import ast
import json
import os
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
VARIANTS = {"lora": (["--use_peft"], "adapter_model.safetensors"), "full": (["--no_use_peft"], "model.safetensors")}


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


def training_losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


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
    whole_weights, resumed_weights = load_file(whole / weights_file), load_file(resumed / weights_file)
    assert whole_weights.keys() == resumed_weights.keys()
    largest = max((whole_weights[name] - resumed_weights[name]).abs().max().item() for name in whole_weights)
    print(f"\nresume ({variant}): {len(KILL_AT)} kills survived, largest weight difference {largest:.2e}")
    assert largest <= 1e-6
    # The run moved the weights, so equal weights say something.
    if variant == "lora":
        moved = max(tensor.abs().max().item() for name, tensor in whole_weights.items() if "lora_B" in name)
    else:
        initial = load_file(tiny_model_dir / "model.safetensors")
        moved = max((whole_weights[name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-3
    assert torch.isfinite(torch.tensor(list(actual.values()))).all()
