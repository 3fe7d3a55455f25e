"""A CLI run killed with SIGKILL and resumed (`--resume_from_checkpoint latest`) ends where an uninterrupted run
ends: the same weights and the same logged losses."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
from conftest import ROOT, write_hh_rows
from safetensors.torch import load_file

STEPS, SAVE_EVERY = 8, 2


def command(model_dir, data_file, output_dir, *extra):
    return [sys.executable, "-m", "dpo_min.train", "--model", str(model_dir), "--dataset", str(data_file),
            "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--save_strategy", "steps",
            "--save_steps", str(SAVE_EVERY), "--per_device_train_batch_size", "2", "--learning_rate", "5e-3",
            "--eval_fraction", "0.2", "--num_samples", "0", "--max_length", "128", "--precompute_ref_log_probs", "true",
            "--logging_steps", "1", "--disable_tqdm", "true", *extra]


def environment():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_until_killed(argv, staging, checkpoint_step):
    """Start the command, SIGKILL it once checkpoint-`checkpoint_step` exists (renamed into place, so whole)."""
    process = subprocess.Popen(argv, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (staging / f"checkpoint-{checkpoint_step}").is_dir():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before checkpoint {checkpoint_step}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return process.returncode


def training_losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_killed_and_resumed_run_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 24)
    whole = tmp_path / "whole"
    subprocess.run(command(tiny_model_dir, data_file, whole), cwd=ROOT, env=environment(), check=True,
                   capture_output=True)

    resumed = tmp_path / "resumed"
    staging = tmp_path / "resumed.partial"
    kills = 0
    argv = command(tiny_model_dir, data_file, resumed)
    for checkpoint_step in (2, 6):  # kill, resume from the newest checkpoint, kill again, resume to the end
        assert run_until_killed(argv, staging, checkpoint_step) == -signal.SIGKILL
        kills += 1
        assert not resumed.exists()  # a killed run publishes nothing
        argv = command(tiny_model_dir, data_file, resumed, "--resume_from_checkpoint", "latest")
    finished = subprocess.run(argv, cwd=ROOT, env=environment(), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert kills == 2 and not staging.exists()

    expected, actual = training_losses(whole), training_losses(resumed)
    assert sorted(actual) == list(range(1, STEPS + 1)) == sorted(expected)
    for step in expected:
        assert abs(actual[step] - expected[step]) <= 1e-5, step
    whole_weights = load_file(whole / "adapter_model.safetensors")
    resumed_weights = load_file(resumed / "adapter_model.safetensors")
    assert whole_weights.keys() == resumed_weights.keys()
    largest = max((whole_weights[name] - resumed_weights[name]).abs().max().item() for name in whole_weights)
    print(f"\nresume: {kills} kills survived, largest weight difference {largest:.2e}")
    assert largest <= 1e-5
    # The run moved the weights, so equal weights say something.
    assert max(tensor.abs().max().item() for name, tensor in whole_weights.items() if "lora_B" in name) > 1e-3
    assert torch.isfinite(torch.tensor(list(actual.values()))).all()
