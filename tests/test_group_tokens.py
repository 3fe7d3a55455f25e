"""The groups line the command prints before a `group_by_prompt` run (dpo_min/train/group_tokens.py): the tokens a
batch computes per pair in groups, with share_prompt and as two sequences, counted by hand and by the collators."""

import json
import re

from test_collator_groups import ranked_pairs

from dpo_min.collator_groups import GroupedDPODataCollator
from dpo_min.collator_packed import PackedDPODataCollator
from dpo_min.grouping import GroupBatchSampler, GroupedSampler, prompt_groups
from dpo_min.train import main
from dpo_min.train.group_tokens import describe_groups, epoch_batches, layout_tokens


def _columns(pairs):
    return {key: [pair[key] for pair in pairs] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}


def test_layout_tokens_by_hand():
    # Two pairs of one prompt sharing an answer, and one pair of an empty prompt (no token repeated at its head).
    pairs = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
             {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [7]},
             {"prompt_ids": [], "chosen_ids": [8], "rejected_ids": [9, 9]}]
    # groups: [1, 2] | 3 4 5 | 3 6 | 3 7 = 9 (test_grouped_row_layout's row), and 8 | 9 9 = 3
    # share_prompt: [1, 2] | 3 4 5 | 3 6 = 7 a pair of the first prompt, 3 for the empty one
    # two sequences: 1 2 3 4 5 | 1 2 3 6 = 9, 1 2 3 4 5 | 1 2 3 7 = 9, 8 | 9 9 = 3
    assert layout_tokens(_columns(pairs), [[0, 1, 2]]) == {"groups": 12, "share_prompt": 17, "two sequences": 21}
    # a batch that cuts the group computes its prompt and the shared answer once in each batch
    assert layout_tokens(_columns(pairs), [[0], [1, 2]])["groups"] == 7 + 7 + 3


def test_layout_tokens_are_the_collators_rows():
    """Against what each layout's collator lays out, batch by batch (padding-free: one row, no padding)."""
    pairs = ranked_pairs()
    groups = prompt_groups([pair["prompt_ids"] for pair in pairs])
    batches = epoch_batches([groups[i] for i in (2, 0, 1)], batch_size=4, listwise=False)
    collators = {"groups": GroupedDPODataCollator(0, padding_free=True),
                 "share_prompt": PackedDPODataCollator(0, share_prompt=True),
                 "two sequences": PackedDPODataCollator(0, padding_free=True)}
    laid_out = {layout: sum(collate([pairs[p] for p in batch])["input_ids"].shape[1] for batch in batches)
                for layout, collate in collators.items()}
    assert layout_tokens(_columns(pairs), batches) == laid_out
    assert laid_out["groups"] < laid_out["share_prompt"] < laid_out["two sequences"]


def test_epoch_batches_are_the_samplers():
    groups = prompt_groups([pair["prompt_ids"] for pair in ranked_pairs()])  # 6, 3 and 1 pairs
    ordered = GroupedSampler(groups, seed=3).ordered_groups()
    pairwise = epoch_batches(ordered, batch_size=4, listwise=False)
    order = list(GroupedSampler(groups, seed=3))
    assert pairwise == [order[0:4], order[4:8], order[8:10]]
    assert epoch_batches(ordered, batch_size=2, listwise=True) == list(GroupBatchSampler(groups, 2, seed=3))


def test_describe_groups():
    line = describe_groups(51, 625, 8, {"groups": 18500, "share_prompt": 35812, "two sequences": 57937})
    assert line == ("groups: 51 prompts, 625 pairs (12.3 a prompt); the first epoch's batches of 8 pairs compute "
                    "18500 tokens in groups (29.6 a pair), 35812 with share_prompt (57.3) and 57937 as two sequences "
                    "a pair (92.7): groups compute 0.52x share_prompt's tokens")
    assert "batches of 1 group compute" in describe_groups(2, 3, 1, {"groups": 9, "share_prompt": 10,
                                                                      "two sequences": 12}, listwise=True)


RANKED = [{"prompt": "Name a colour.", "completions": ["Blue.", "Loud.", "Red."], "scores": [3, 1, 2]},
          {"prompt": "Name a fruit.", "completions": ["Apple.", "Chair.", "Pear.", "Stone."], "scores": [4, 1, 3, 0]}]


def test_the_command_prints_the_tokens_its_batch_computes(tmp_path, tiny_model_dir, capsys):
    """docs/groups.md's ranked rows, all 9 pairs in one batch: the line's count in groups is the tokens the trained
    step computed (Trainer's num_tokens, from the collated batch), and a run without groups prints no such line."""
    data_file = tmp_path / "ranked.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in RANKED))
    args = ["--model", str(tiny_model_dir), "--dataset", str(data_file), "--eval_fraction", "0", "--max_steps", "1",
            "--per_device_train_batch_size", "9", "--logging_steps", "1", "--num_samples", "0", "--save_strategy",
            "no", "--disable_tqdm", "true", "--use_peft"]
    assert main([*args, "--group_by_prompt", "--output_dir", str(tmp_path / "groups")]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("groups:")]
    state = json.loads((tmp_path / "groups" / "trainer_state.json").read_text())
    [computed] = [entry["num_tokens"] for entry in state["log_history"] if "loss" in entry]
    found = re.fullmatch(r"groups: 2 prompts, 9 pairs \(4\.5 a prompt\); the first epoch's batches of 9 pairs "
                         r"compute (\d+) tokens in groups .* and (\d+) as two sequences a pair .*", line)
    assert found and int(found[1]) == computed
    assert main([*args, "--output_dir", str(tmp_path / "pairs")]) == 0
    assert "groups:" not in capsys.readouterr().out
    state = json.loads((tmp_path / "pairs" / "trainer_state.json").read_text())
    assert [entry["num_tokens"] for entry in state["log_history"] if "loss" in entry] == [int(found[2])]
