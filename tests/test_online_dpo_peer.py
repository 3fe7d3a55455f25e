"""benchmarks/online_dpo_peer.py, the maintained peer of DPO in rounds: its held-out rows are the rounds' split of
the pool, apart from its training prompts, and TRL's experimental OnlineDPOTrainer runs it end to end on a tiny
model with the arithmetic reward (a test that fails when TRL moves or changes that trainer)."""

import importlib.util
import json
from pathlib import Path

from dpo_min.rounds.prompts import split_held_out

ROOT = Path(__file__).resolve().parent.parent


def load_peer():
    spec = importlib.util.spec_from_file_location("online_dpo_peer", ROOT / "benchmarks" / "online_dpo_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peers_held_out_rows_are_the_rounds_split_and_apart_from_its_training_prompts():
    peer = load_peer()
    rows, train_rows, held_rows = peer.pool_split(peer.POOL, 64, 42)
    assert len(rows) == 3000 and len(held_rows) == 64
    assert held_rows == split_held_out(3000, 64 / 3000, 42)[1]
    assert sorted(train_rows) == split_held_out(3000, 64 / 3000, 42)[0] and not set(train_rows) & set(held_rows)
    assert peer.pool_split(peer.POOL, 64, 42)[1:] == (train_rows, held_rows)  # seeded
    assert peer.pool_split(peer.POOL, 64, 7)[2] != held_rows


def test_online_dpo_trains_on_the_pool_with_the_arithmetic_reward_and_scores_the_held_out_prompts(
        tiny_model_dir, tmp_path):
    peer = load_peer()
    result = peer.run_online_dpo(seed=0, train_prompts=4, max_completion_length=4, held_out=2,
                                 per_device_train_batch_size=2, output_dir=str(tmp_path / "run"),
                                 model=str(tiny_model_dir), score_pi0=True)
    assert (result["train_prompts"], result["sampled_completions"], result["steps"]) == (4, 8, 2)
    assert result["held_out"] == 2 and 0 <= result["held_out_right"] <= 2 and 0 <= result["pi0_right"] <= 2
    assert len(result["train_reward_mean"]) == len(result["train_scores_margin"]) == 2  # OnlineDPO's logs, per step
    json.dumps(result)
