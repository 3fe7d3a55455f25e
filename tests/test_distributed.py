"""Two processes (accelerate launch, gloo on CPU) train exactly as one process with the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, reference_cache_entries, write_hh_rows

from dpo_min.train import main

STEP_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected")
# eval_loss too: Trainer's own moved by 0.4% between one and two processes once the last evaluation batch is uneven
# (each batch's mean repeated, a process's last batch padded with another's pairs); dpo_min's is the mean over pairs.
EVAL_KEYS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/chosen", "eval_rewards/rejected",
             "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen",
             "eval_logits/rejected")


def command(model_dir, data_file, output_dir, batch_size):
    # 20 pairs: 5 held out, 12 of the other 15 trained on in 3 steps of 4 (no epoch ends, so no training batch is
    # padded). The 5 held-out pairs make an uneven last evaluation batch: with two processes of 2, one process pads
    # it and gather_for_metrics must drop the padding. The default precompute_ref_log_probs=True and the step-0
    # evaluation run under both process counts too.
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
            "--eval_fraction", "0.25", "--max_steps", "3", "--per_device_train_batch_size", str(batch_size),
            "--per_device_eval_batch_size", str(batch_size), "--learning_rate", "5e-3", "--warmup_steps", "0",
            "--num_samples", "1", "--max_new_tokens", "2", "--precompute_ref_log_probs", "true", "--logging_steps", "1",
            "--save_strategy", "no", "--disable_tqdm", "true", "--use_peft",
            "--eval_on_start", "true"]  # the step-0 pass too (stated as ties by default), compared across processes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir, isolated_cache):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 20)
    assert main(command(tiny_model_dir, data_file, tmp_path / "one", batch_size=4)) == 0
    # On a CPU-only machine accelerate spawns processes with its torchrun launcher (--multi_gpu); the command
    # then joins them over gloo.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "DPO_MIN_CACHE": str(tmp_path / "cache")}  # its own empty cache: it must score the reference itself
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()),
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
    # Relative 1e-5 leaves room for another all-reduce order (the steps agree to the bit here). Rewards are beta times
    # a difference of two log-probs, which differently padded evaluation batches round differently: they are held to
    # 1e-6 of those log-probs.
    for mine, reference in zip(two_steps + two_evals, one_steps + one_evals):
        prefix = "" if "loss" in reference else "eval_"
        reward_tolerance = 1e-6 * 0.1 * max(abs(reference[f"{prefix}logps/chosen"]),
                                            abs(reference[f"{prefix}logps/rejected"]))
        for key in STEP_KEYS if "loss" in reference else EVAL_KEYS:
            tolerance = {"abs": reward_tolerance} if "rewards/" in key else {}
            assert mine[key] == pytest.approx(reference[key], rel=1e-5, **tolerance), (mine["step"], key)
    assert one_evals[-1]["eval_rewards/margins"] != 0.0  # the policy moved, so the comparison means something
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert one_evals[0]["eval_loss"] == two_evals[0]["eval_loss"] == pytest.approx(0.6931471805599453, rel=1e-7)
    assert two["train_pairs"] == one["train_pairs"] == 12  # the pairs 3 steps reach
    assert two["held_out_pairs"] == one["held_out_pairs"] == 5
    # Both runs scored the reference (train and held-out pairs) themselves, from the same weights.
    keys = [path.name for path in reference_cache_entries(isolated_cache)]
    assert len(keys) == 2 and [path.name for path in reference_cache_entries(tmp_path / "cache")] == keys
