"""Every pair in groups in the rounds with the listwise loss (issue 56 item 4): a graded reward for the arithmetic
pool (the distance of the answer to the solution), and, for plackett_luce, each prompt's pairs as one ranking (one
answer per score), so that ties between answers never reach the loss, which refuses them."""

import json

import pytest
from test_rounds import settings, tiny_policy

from dpo_min.rounds import make_pairs, run_rounds
from dpo_min.rounds.arithmetic import arithmetic_distance
from dpo_min.rounds.pairs import ranked_chain
from dpo_min.train.rounds.runner import _imported

# What the policy answers to "What is 40 + 45?" (85): two right answers (a tie), two one off (a tie), one with no
# number. Every pair of these has ties: plackett_luce would refuse the prompt's group.
ANSWERS = ["85", "84", "It is 85", "86", "I do not know"]
PROMPT = [{"prompt": [{"role": "user", "content": "What is 40 + 45? Answer with the number."}], "solution": 85}]


def test_arithmetic_distance_is_1_when_right_then_falls_with_the_distance_and_0_without_a_number():
    completions = ["85", "I think 84", "86", "83.", "-85", "none", [{"role": "assistant", "content": "= 85"}]]
    assert arithmetic_distance(completions, [85] * 6 + ["85"]) == [1.0, 1 / 3, 1 / 3, 1 / 4, 1 / 172, 0.0, 1.0]
    # By name, as --reward_funcs takes it.
    assert _imported("dpo_min.rounds.arithmetic:arithmetic_distance") is arithmetic_distance


def samples(scored):
    return [{"completion": text, "completion_ids": [i], "total": total} for i, (text, total) in enumerate(scored)]


@pytest.mark.parametrize(("scored", "cap", "min_margin", "expected"), [
    ([("85", 1.0), ("84", 1 / 3), ("It is 85", 1.0), ("86", 1 / 3), ("?", 0.0)], 8, 0.0, [(0, 1), (1, 4)]),
    ([("a", 3.0), ("b", 2.0), ("c", 1.0), ("d", 0.0)], 2, 0.0, [(0, 1), (1, 2)]),  # the best cap + 1 answers
    ([("a", 3.0), ("b", 2.5), ("c", 1.0), ("d", 0.0)], 8, 1.0, [(0, 2), (2, 3)]),  # b is under a by < min_margin
    ([("a", 1.0), ("a", 0.0), ("b", 0.5)], 8, 0.0, [(0, 2)]),  # a text once: its best-scored sample
    ([("a", 1.0), ("b", 1.0)], 8, 0.0, "all_tied"),
    ([("a", 1.0), ("b", None)], 8, 0.0, "unscorable"),
], ids=["ties", "cap", "min-margin", "one-text-twice", "tied", "unscorable"])
def test_ranked_chain_orders_one_answer_per_score_each_against_the_next(scored, cap, min_margin, expected):
    assert ranked_chain(samples(scored), min_margin, cap) == expected


def test_make_pairs_ranks_only_with_rule_every_for_a_listwise_loss():
    group = {"prompt_index": 0, "prompt": "p", "prompt_ids": [1], "samples": samples(
        [("85", 1.0), ("84", 1 / 3), ("It is 85", 1.0), ("86", 1 / 3), ("?", 0.0)])}
    ranked, _ = make_pairs([group], 0.0, 8, "every", ranked=True)
    every, _ = make_pairs([group], 0.0, 8, "every")
    assert [(p["chosen"], p["rejected"]) for p in ranked] == [("85", "84"), ("84", "?")]
    assert len(every) == 8  # 2 right x 3 others + 2 one-off x 1 no-number: ties inside, no single order


def test_a_round_of_every_pair_in_groups_trains_the_listwise_loss_on_the_graded_reward(tmp_path, tokenizer):
    def answers(model, prompt_ids, generation):  # the policy's samples, fixed: a tiny random model writes no numbers
        texts = ANSWERS * (len(prompt_ids) * generation.num_return_sequences // len(ANSWERS))
        return [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]

    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=5, pair_rule="every",
                      pairs_per_prompt=16, training={"loss_type": ["plackett_luce"], "group_by_prompt": True,
                                                     "save_strategy": "no", "per_device_train_batch_size": 4})
    result = run_rounds(tiny_policy(), tokenizer, PROMPT, arithmetic_distance, config, generate_fn=answers)
    line = result.rounds[0]
    assert line["status"] == "trained" and line["dpo"]["steps"] == 1 and line["pairs"] == 2
    pairs = [json.loads(row) for row in (tmp_path / "run/round-1/pairs.jsonl").read_text().splitlines()]
    assert [(p["chosen_reward"], p["rejected_reward"]) for p in pairs] == [(1.0, 1 / 3), (1 / 3, 0.0)]
    assert line["draw"]["mixed"] == 1 and line["samples"] == 5
