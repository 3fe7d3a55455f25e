"""The rounds' reward contract (TRL GRPOTrainer's: TRL's own reward functions run unmodified) and the pair rule."""

import hashlib
import importlib
import json
import math
import re
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from datasets import Dataset
from test_rounds import PROMPTS, tiny_policy
from trl.rewards import accuracy_reward, think_format_reward

from dpo_min import DPOMinConfig, tokenize_dataset
from dpo_min.rounds import RoundsConfig, RoundsError, held_out, make_pairs, run_rounds
from dpo_min.rounds.pairs import keep_trainable
from dpo_min.rounds.rewards import Rewards
from dpo_min.rounds.sampling import Completion

PROMPT = [{"role": "user", "content": "What is 1/3 + 0?"}]


def completions(*texts, truncated=False):
    return [Completion(text, [1, 2], truncated) for text in texts]


def test_trl_accuracy_and_think_format_rewards_run_unmodified_on_conversational_samples():
    samples = completions(r"<think>easy</think>The answer is $\boxed{\frac{1}{3}}$",
                          r"The answer is $\boxed{\frac{1}{2}}$")
    rewards = Rewards([accuracy_reward, think_format_reward], weights=[1.0, 0.5])
    scores = rewards.score([PROMPT, PROMPT], samples, {"solution": [r"$\frac{1}{3}$"] * 2}, round_index=1)
    # TRL's own functions on the same one-message completions are the oracle.
    as_trl = [[{"role": "assistant", "content": c.text}] for c in samples]
    accuracy = accuracy_reward(as_trl, [r"$\frac{1}{3}$"] * 2)
    think = think_format_reward(as_trl)
    assert accuracy == [1.0, 0.0] and think == [1.0, 0.0]
    assert scores.per_function == [{"accuracy_reward": a, "think_format_reward": t} for a, t in zip(accuracy, think)]
    assert scores.total == [a + 0.5 * t for a, t in zip(accuracy, think)]


def test_a_none_is_left_out_of_the_sum_and_a_sample_no_function_judges_is_unscorable():
    def sometimes(completions, **_):
        return [None, 2.0, None]

    def other(completions, **_):
        return [1.0, None, None]
    scores = Rewards([sometimes, other], weights=[3.0, 1.0]).score(["p"] * 3, completions("a", "b", "c"), {}, 1)
    assert scores.total == [1.0, 6.0, None]


def test_missing_eos_penalty_is_taken_off_a_cut_completion_only():
    def one(completions, **_):
        return [1.0] * len(completions)
    rewards = Rewards(one, missing_eos_penalty=0.75)
    cut, ended = completions("x", truncated=True), completions("y")
    assert rewards.score(["p", "p"], cut + ended, {}, 1).total == [0.25, 1.0]


def test_columns_text_completions_and_ids_reach_the_function_as_trl_passes_them():
    seen = {}

    def spy(prompts, completions, completion_ids, solution, trainer_state, log_extra, log_metric, **_):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution)
        log_metric("spy", 2.0)
        return [0.0] * len(completions)
    scores = Rewards(spy).score(["p1", "p2"], completions("a", "b"), {"solution": ["1", "2"]}, 1)
    assert seen == {"prompts": ["p1", "p2"], "completions": ["a", "b"], "ids": [[1, 2], [1, 2]],
                    "solution": ["1", "2"]}
    assert scores.metrics == {"spy": 2.0}


def raises(completions, **_):
    raise ZeroDivisionError("division by zero")


def too_few(completions, **_):
    return [1.0]


def gives_nan(completions, **_):
    return [1.0, math.nan]


def only_none(completions, **_):
    return [None, None]


@pytest.mark.parametrize(("func", "message"), [
    (raises, "round 3: reward function 'raises' raised ZeroDivisionError: division by zero"),
    (too_few, "round 3: reward function 'too_few' returned 1 rewards for 2 completions"),
    (gives_nan, "round 3: reward function 'gives_nan' returned nan for completion 1: a reward is a finite number or "
                "None"),
    (only_none, "round 3: reward function 'only_none' returned only None (2 completions): it judged none of them"),
])
def test_a_bad_reward_is_one_line_naming_the_function_and_the_round(func, message):
    with pytest.raises(RoundsError) as error:
        Rewards(func).score(["p", "p"], completions("a", "b"), {}, round_index=3)
    assert str(error.value) == message


def trl_reads(output, count=2):
    """TRL GRPOTrainer._calculate_rewards on one function's output: None as NaN, then a float32 column of the
    rewards-per-function table; or the error it raises."""
    rewards = [r if r is not None else torch.nan for r in output]
    if len(rewards) != count:
        raise ValueError(f"{len(rewards)} rewards for {count} completions")
    column = torch.zeros(count)
    column[:] = torch.tensor(rewards, dtype=torch.float32)
    return column.tolist()


def returning(output):
    def func(completions, **_):
        return output
    return func


@pytest.mark.parametrize("output", [
    [np.float32(0.5), np.float32(2.0)], [np.int64(1), np.int64(3)], [torch.tensor(0.5), torch.tensor(2)],
    [torch.tensor([0.5]), 1], np.array([0.5, 2.0]), np.array([1, 3], dtype=np.int32), torch.tensor([0.5, 2.0]),
    torch.tensor([[0.5], [2.0]]), [np.float64(1.0), None], [True, 2], (1, 2.5),
    # refused by TRL too:
    np.float32(1.0), torch.tensor(1.0), [10 ** 400, 1.0], [10 ** 5000, 1.0], ["1", "2"], [1 + 2j, 1.0],
    [np.array([1.0]), 1.0], [[1.0], [2.0]], np.array([[1.0, 2.0]]),
])
def test_a_reward_output_is_read_as_trl_reads_it_and_what_trl_refuses_is_one_line(output):
    try:
        expected = trl_reads(output)
    except Exception:  # any error of TRL's conversion is a refusal
        expected = None
    if expected is None:
        with pytest.raises(RoundsError) as error:
            Rewards(returning(output)).score(["p", "p"], completions("a", "b"), {}, round_index=3)
        assert str(error.value).startswith("round 3: reward function 'func' returned ")
        assert "\n" not in str(error.value) and len(str(error.value)) < 200
        return
    scores = Rewards(returning(output)).score(["p", "p"], completions("a", "b"), {}, round_index=3)
    read = [math.nan if sample["func"] is None else sample["func"] for sample in scores.per_function]
    assert read == pytest.approx(expected, nan_ok=True)
    assert all(isinstance(value, float) or value is None for value in scores.total)


def test_a_dict_is_refused_though_trl_would_read_its_keys_as_rewards():
    with pytest.raises(RoundsError, match=r"^round 3: reward function 'func' returned dict, not a list of rewards$"):
        Rewards(returning({0: 1.0, 1: 2.0})).score(["p", "p"], completions("a", "b"), {}, round_index=3)


def test_a_weighted_total_that_overflows_is_one_line_naming_the_round():
    rewards = Rewards([returning([1e308, 1.0]), returning([1e308, 1.0])], weights=[2.0, -2.0])
    with pytest.raises(RoundsError) as error:
        rewards.score(["p", "p"], completions("a", "b"), {}, round_index=2)
    assert str(error.value) == ("round 2: the weighted reward of completion 0 is nan (its rewards times "
                                "reward_weights overflow a float): scale the rewards down")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("reward_weights", [1.0, math.nan], "reward_weights must be finite numbers, got [1.0, nan]"),
    ("reward_weights", [math.inf], "reward_weights must be finite numbers, got [inf]"),
    ("missing_eos_penalty", math.nan, "missing_eos_penalty must be a finite number, got nan"),
    ("missing_eos_penalty", -math.inf, "missing_eos_penalty must be a finite number, got -inf"),
])
def test_a_weight_or_penalty_that_is_not_finite_is_refused_by_the_config(tmp_path, field, value, message):
    with pytest.raises(RoundsError) as error:
        RoundsConfig(output_dir=str(tmp_path / "run"), **{field: value})
    assert str(error.value) == message


def test_reward_weights_must_match_the_functions():
    with pytest.raises(RoundsError, match="reward_weights has 2 weights for 1 reward functions"):
        Rewards(too_few, weights=[1.0, 2.0])


LENGTH = """def length(completions, **_):
    return [{sign}float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
"""


@pytest.fixture
def lengths(tmp_path, monkeypatch):
    """Two reward functions named `length`, of opposite signs, in modules rw and rw2 of the working folder."""
    for module, sign in (("rw", ""), ("rw2", "-")):
        (tmp_path / f"{module}.py").write_text(LENGTH.format(sign=sign))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield [importlib.import_module(module).length for module in ("rw", "rw2")]
    for module in ("rw", "rw2"):
        sys.modules.pop(module, None)


def test_reward_functions_of_the_same_name_are_named_by_their_full_reference(lengths, tmp_path, tokenizer):
    # samples.jsonl kept one `length` of the two, while the total summed both.
    rewards = Rewards(lengths)
    samples = completions("ab", "abc")
    assert rewards.names == ["rw:length", "rw2:length"]
    assert rewards.score(["p"] * 2, samples, {}, 1).per_function == [
        {"rw:length": len(c.text), "rw2:length": -len(c.text)} for c in samples]
    assert Rewards([lengths[0], lengths[0]]).names == ["rw:length#0", "rw:length#1"]
    assert Rewards([lengths[0], accuracy_reward]).names == ["length", "accuracy_reward"]  # TRL's, as runs recorded
    config = RoundsConfig(str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=3)
    run_rounds(tiny_policy(), tokenizer, PROMPTS, lengths, config)  # every total 0: a tie, no pair, no training
    for row in map(json.loads, (tmp_path / "run" / "round-1" / "samples.jsonl").read_text().splitlines()):
        size = len(row["completion"])
        assert row["rewards"] == {"rw:length": size, "rw2:length": -size} and row["total"] == 0


def test_a_resume_with_another_reward_function_of_the_same_name_is_refused_naming_old_and_new(lengths, tmp_path,
                                                                                              tokenizer):
    # rw2:length (the opposite sign) went on under the name the run recorded, `length`.
    config = RoundsConfig(str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=3)
    run_rounds(tiny_policy(), tokenizer, PROMPTS, lengths[0], config)
    path = tmp_path / "run" / "settings.json"
    old = hashlib.sha256(LENGTH.format(sign="").encode()).hexdigest()  # rw.py holds the function alone
    code = Rewards(lengths[0]).identity()["length"]["code (sha256)"]  # what decides it (test_rounds_identity.py)
    assert json.loads(path.read_text())["reward_identity"] == {"length": {"reference": "rw:length",
                                                                          "source (sha256)": old,
                                                                          "code (sha256)": code}}
    assert len(run_rounds(tiny_policy(), tokenizer, PROMPTS, lengths[0], config).rounds) == 1  # the same: resumes
    new = hashlib.sha256(LENGTH.format(sign="-").encode()).hexdigest()
    changed = f"reward_identity[length][source (sha256)] {old[:12]} -> {new[:12]}; reward_identity[length][code"
    with pytest.raises(RoundsError, match=re.escape(f"{tmp_path / 'run'} holds a run with other settings ("
                                                    f"reward_identity[length][reference] rw:length -> rw2:length; "
                                                    f"{changed}")):
        run_rounds(tiny_policy(), tokenizer, PROMPTS, lengths[1], replace(config, rounds=2))
    (tmp_path / "rw.py").write_text(LENGTH.format(sign="-"))  # the same function, its source edited
    with pytest.raises(RoundsError, match=re.escape(f"other settings ({changed}")):
        run_rounds(tiny_policy(), tokenizer, PROMPTS, importlib.reload(sys.modules["rw"]).length, config)
    recorded = json.loads(path.read_text())
    del recorded["reward_identity"]  # a run recorded before it: compared once recorded
    path.write_text(json.dumps(recorded))
    assert len(run_rounds(tiny_policy(), tokenizer, PROMPTS, lengths[1], config).rounds) == 1


def group(index, *totals, prompt="p"):
    return {"prompt_index": index, "prompt": prompt, "prompt_ids": [1, 2],
            "samples": [{"completion": f"c{i}", "completion_ids": [10 + i], "total": total}
                        for i, total in enumerate(totals)]}


def test_the_pair_is_the_best_against_the_worst_the_first_of_equals():
    made, dropped = make_pairs([group(0, 0.5, 2.0, -1.0, 2.0, -1.0)], min_margin=0.0)
    assert [(p["chosen"], p["rejected"], p["chosen_reward"], p["rejected_reward"]) for p in made] == [
        ("c1", "c2", 2.0, -1.0)]
    assert dropped == {"unscorable": 0, "all_tied": 0, "below_min_margin": 0}


def test_ties_margins_and_unscorable_prompts_are_dropped_and_counted_by_reason():
    groups = [group(0, 1.0, 1.0, 1.0), group(1, 0.0, 0.4), group(2, 0.0, 0.5), group(3, None, 1.0),
              group(4, None, None), group(5, 1.0, None, 1.0), group(6, -2.0, None, 3.0)]
    made, dropped = make_pairs(groups, min_margin=0.5)
    # 0.5 is kept: the rule drops a margin *under* min_margin.
    assert [p["prompt_index"] for p in made] == [2, 6]
    assert dropped == {"unscorable": 2, "all_tied": 2, "below_min_margin": 1}
    assert sum(dropped.values()) + len(made) == len(groups)


def test_a_best_and_worst_of_the_same_text_are_a_tie_not_a_pair():
    # The same text scored apart: one sample cut at max_completion_length lost missing_eos_penalty.
    same = {"prompt_index": 0, "prompt": "p", "samples": [{"completion": "abc", "total": 1.0},
                                                          {"completion": "abc", "total": 0.5}]}
    made, dropped = make_pairs([same, group(1, 1.0, 0.0)], min_margin=0.0)
    assert [p["prompt_index"] for p in made] == [1]
    assert dropped == {"unscorable": 0, "all_tied": 1, "below_min_margin": 0}


def test_pairs_the_dpo_pass_would_drop_are_counted_by_reason_and_the_rest_are_what_it_trains(tmp_path, tokenizer):
    shared = "x " * 40  # both answers' first 30 tokens: max_length cuts them to the same ids
    pairs = [{"prompt": "Hi", "chosen": "Hello there", "rejected": "Go away"},
             {"prompt": "word " * 200, "chosen": "Hello there", "rejected": "Go away"},
             {"prompt": "Hi", "chosen": "Hello", "rejected": "   "},
             {"prompt": "Hi", "chosen": shared + "a", "rejected": shared + "b"},
             {"prompt": "Bye", "chosen": "See you", "rejected": "No"}]
    args = DPOMinConfig(output_dir=str(tmp_path), report_to="none", max_length=32)
    kept, dropped = keep_trainable([{**pair, "chosen_reward": 1.0} for pair in pairs], tokenizer, args)
    assert [pair["prompt"] for pair in kept] == ["Hi", "Bye"] and kept[0]["chosen_reward"] == 1.0
    assert dropped == {"empty_completion": 1, "prompt_fills_max_length": 1, "same_after_truncation": 1,
                       "special_token_inside": 0}
    # The DPO pass's own tokenizing (the trainer's) keeps as many.
    assert len(tokenize_dataset(Dataset.from_list(pairs), tokenizer, max_length=32)) == len(kept)


def test_a_conversational_pair_holds_its_completions_as_one_assistant_message():
    made, _ = make_pairs([group(0, 1.0, 0.0, prompt=PROMPT)], min_margin=0.0)
    assert made[0]["chosen"] == [{"role": "assistant", "content": "c0"}]
    assert made[0]["rejected"] == [{"role": "assistant", "content": "c1"}]


@pytest.mark.parametrize("values", [[1e308, 1e308, -1e308], [1e308, 1e308], [1.7e308], [-1.7e308, 1.7e308, 1e308],
                                    [1e300, 2e300, 3e300]])
def test_finite_rewards_near_the_float_range_keep_the_held_out_figures_finite_and_draw(tmp_path, values):
    lines = [{"round": 0, **held_out.mean_with_interval(values)},
             {"round": 1, **held_out.mean_with_interval([0.5, 1.0, 0.25])}]
    json.dumps(lines, allow_nan=False)  # held_out.jsonl stays JSON: no NaN, no Infinity
    assert lines[0]["mean"] == pytest.approx(math.fsum(v / 1e300 for v in values) / len(values) * 1e300)
    assert lines[0]["low"] is None or lines[0]["low"] <= lines[0]["mean"] <= lines[0]["high"]
    held_out.plot(lines, tmp_path / "held_out.png")
    assert (tmp_path / "held_out.png").stat().st_size > 0
