"""Two processes (accelerate launch, gloo on CPU) train exactly as one process with the same global batch."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, write_hh_rows

from dpo_min.train import main

STEP_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected")
EVAL_KEYS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen",
             "eval_logps/rejected")


def command(model_dir, data_file, output_dir, batch_size):
    # 16 pairs: 4 held out, 12 trained on in 3 steps of 4 (one epoch, so no process ever sees a padded batch).
    # precompute_ref_log_probs and the step-0 evaluation run under both process counts too.
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
            "--eval_fraction", "0.25", "--max_steps", "3", "--per_device_train_batch_size", str(batch_size),
            "--per_device_eval_batch_size", str(batch_size), "--learning_rate", "5e-3", "--warmup_steps", "0",
            "--num_samples", "1", "--max_new_tokens", "2", "--precompute_ref_log_probs", "true", "--logging_steps", "1",
            "--save_strategy", "no", "--disable_tqdm", "true"]


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 16)
    assert main(command(tiny_model_dir, data_file, tmp_path / "one", batch_size=4)) == 0
    # On a CPU-only machine accelerate spawns processes with its torchrun launcher (--multi_gpu); the command
    # then joins them over gloo.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
         "-m", "dpo_min.train", *command(tiny_model_dir, data_file, tmp_path / "two", batch_size=2)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("held-out before training") == 1  # only the main process reports

    def history(name):
        state = json.loads((tmp_path / name / "trainer_state.json").read_text())
        steps = [entry for entry in state["log_history"] if "loss" in entry]
        evals = [entry for entry in state["log_history"] if "eval_loss" in entry]
        return steps, evals

    (one_steps, one_evals), (two_steps, two_evals) = history("one"), history("two")
    assert len(one_steps) == len(two_steps) == 3 and len(one_evals) == len(two_evals) == 2
    for mine, reference in zip(two_steps + two_evals, one_steps + one_evals):
        for key in STEP_KEYS if "loss" in reference else EVAL_KEYS:
            assert mine[key] == pytest.approx(reference[key], abs=1e-4), (mine["step"], key)
    assert one_evals[-1]["eval_rewards/margins"] != 0.0  # the policy moved, so the comparison means something
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert two["train_pairs"] == one["train_pairs"] == 12
