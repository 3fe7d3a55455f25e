"""run_rounds under `accelerate launch` (2 CPU processes, gloo): each process samples and scores only its share, the
gathered samples and pairs are one process's to the bit, and the round's files are written once."""

import json
import os
import subprocess
import sys

import pytest
import rounds_worker
import torch
from conftest import ROOT
from test_distributed import free_port

from dpo_min.rounds.prompts import split_held_out
from dpo_min.rounds.store import read_jsonl

WORKER = ROOT / "tests" / "rounds_worker.py"


def launch_two(model_dir, output_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()), str(WORKER), str(model_dir), str(output_dir), "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def run_alone(model_dir, output_dir):
    """The same round in this process, one torch thread as each launched process has (the same float sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return rounds_worker.run(str(model_dir), str(output_dir), 2)  # batch 2: the global batch of 2 x 1
    finally:
        torch.set_num_threads(threads)


def files(folder):
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def test_two_processes_sample_and_score_their_share_and_gather_what_one_process_gets(tmp_path, tiny_model_dir):
    two = launch_two(tiny_model_dir, tmp_path / "two")
    assert two.returncode == 0, two.stderr[two.stderr.find("Traceback"):][:3000]
    run_alone(tiny_model_dir, tmp_path / "one")
    train, held = split_held_out(len(rounds_worker.PROMPTS), 0.2, seed=11)
    assert len(train) == 8 and len(held) == 2
    batches = [train[start:start + 2] for start in range(0, 8, 2)]  # round 1's batch b is seeded 11 + 1000 + b
    calls = [json.loads((tmp_path / "two" / f"calls-{rank}.json").read_text()) for rank in (0, 1)]
    greedy = {"rows": held, "seed": 0, "do_sample": False}  # the held-out batch, before round 1 and after it
    assert calls[0]["sampled"] == [greedy, *({"rows": batches[b], "seed": 1011 + b, "do_sample": True}
                                             for b in (0, 2)), greedy]
    assert calls[1]["sampled"] == [{"rows": batches[b], "seed": 1011 + b, "do_sample": True} for b in (1, 3)]
    # Scoring: every second prompt, all its 3 samples in one call; the held-out prompts split the same way.
    for rank in (0, 1):
        assert calls[rank]["scored"] == [[held[rank]], [i for i in train[rank::2] for _ in range(3)], [held[rank]]]

    # The gathered samples, their scores and the pairs are those one process makes with the same seed.
    for name in ("round-1/generated.jsonl", "round-1/samples.jsonl", "round-1/pairs.jsonl"):
        assert read_jsonl(tmp_path / "two" / name) == read_jsonl(tmp_path / "one" / name), name
    pairs = read_jsonl(tmp_path / "two" / "round-1/pairs.jsonl")
    assert [pair["prompt_index"] for pair in pairs] == train  # no tie: each prompt gave its pair
    # The DPO pass on them: 2 processes of batch 1 step as one of batch 2 (tests/test_distributed.py's tolerance).
    (mine,), (theirs,) = (read_jsonl(tmp_path / name / "rounds.jsonl") for name in ("two", "one"))
    assert mine["dpo"]["steps"] == theirs["dpo"]["steps"] == 4
    assert {k: v for k, v in mine.items() if k not in ("seconds", "dpo")} == \
        {k: v for k, v in theirs.items() if k not in ("seconds", "dpo")}
    # Rewards and drifts are beta times a difference of two log-probs near -90: held to 1e-6 of those log-probs.
    near_zero = 1e-6 * 0.1 * max(abs(theirs["dpo"]["logps/chosen"]), abs(theirs["dpo"]["logps/rejected"]))
    for key, value in theirs["dpo"].items():
        tolerance = {"abs": near_zero} if key.startswith(("rewards/", "drift/")) else {}
        assert mine["dpo"][key] == pytest.approx(value, rel=1e-5, **tolerance), key
    held_two, held_one = (read_jsonl(tmp_path / name / "held_out.jsonl") for name in ("two", "one"))
    assert len(held_two) == len(held_one) == 2
    def figures(line):
        return {key: value for key, value in line.items() if key != "per_prompt"}
    assert all(figures(line) == pytest.approx(figures(other), rel=1e-5) for line, other in zip(held_two, held_one))
    # Each held-out prompt's total, gathered from the two processes, is the one process's, prompt by prompt.
    for line, other in zip(held_two, held_one):
        assert [i for i, _ in line["per_prompt"]] == [i for i, _ in other["per_prompt"]]
        assert [t for _, t in line["per_prompt"]] == pytest.approx([t for _, t in other["per_prompt"]], rel=1e-5)

    # Written once: the same files as one process leaves (no second copy, no staging left), each line once.
    assert files(tmp_path / "two") == sorted([*files(tmp_path / "one"), "calls-1.json"])
    assert [line["round"] for line in held_two] == [0, 1]
    assert two.stdout.count("round 1: 24 samples, 8 pairs") == 1
    assert two.stdout.count("held-out before round 1") == 1
