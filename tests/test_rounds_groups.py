"""DPO in rounds with --pair_rule every --group_by_prompt: each prompt's sampled answers train as one group, on the
token ids the policy sampled, each distinct answer computed once."""

import json

from test_rounds import PROMPTS, letters, settings, tiny_policy

from dpo_min.collator_groups import GroupedDPODataCollator
from dpo_min.rounds import run_rounds


def test_every_pair_of_a_prompts_samples_trains_as_one_group_on_the_sampled_ids(tmp_path, tokenizer, monkeypatch):
    batches, collate = [], GroupedDPODataCollator.__call__

    def spy(self, examples):
        batch = collate(self, examples)
        batches.append((examples, batch))
        return batch

    monkeypatch.setattr(GroupedDPODataCollator, "__call__", spy)
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=4, pair_rule="every",
                      pairs_per_prompt=6, training={"group_by_prompt": True, "save_strategy": "no",
                                                    "per_device_train_batch_size": 32})
    line = run_rounds(tiny_policy(), tokenizer, PROMPTS[:3], letters, config).rounds[0]
    assert line["status"] == "trained" and line["dpo"]["steps"] == 1
    folder = tmp_path / "run" / "round-1"
    sampled = {}
    for row in map(json.loads, (folder / "samples.jsonl").read_text().splitlines()):
        sampled.setdefault(row["prompt_index"], set()).add(tuple(row["completion_ids"]))
    pairs = [json.loads(row) for row in (folder / "pairs.jsonl").read_text().splitlines()]
    (examples, batch), = batches  # the one step's batch: every pair of the round
    assert len(examples) == len(pairs) > len(PROMPTS[:3])  # several pairs a prompt
    prompts = {tuple(pair["prompt_ids"]) for pair in pairs}
    assert batch["input_ids"].shape[0] == len(prompts)  # one segment (a row) per prompt
    answers = {(tuple(p["prompt_ids"]), tuple(p[side])) for p in pairs for side in ("chosen_ids", "rejected_ids")}
    assert int(batch["completion_index"].max()) + 1 == len(answers)  # each distinct answer once
    trained = {tuple(ex[side]) for ex in examples for side in ("chosen_ids", "rejected_ids")}
    assert trained <= set().union(*sampled.values())  # the ids the policy sampled, not the text tokenized again
