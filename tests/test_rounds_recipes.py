"""Rounds as the published recipes run them (docs/rounds.md, "The recipes' options"): a fresh draw of prompts each
round, more than one pair per prompt, a temperature per round, the NLL term and the reference moved each round, and
each round's count of saturated prompts."""

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_rounds import PROMPTS, constant, letters, settings, tiny_policy

from dpo_min.rounds import RoundsConfig, RoundsError, make_pairs, run_rounds
from dpo_min.rounds.config import MAX_TEMPERATURE
from dpo_min.rounds.pairs import saturated
from dpo_min.rounds.prompts import split_held_out
from dpo_min.rounds.sampling import hf_generate
from dpo_min.rounds.schedule import round_prompts, round_temperature
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

ONE_STEP = {"save_strategy": "no"}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompts_per_round_draws_each_training_prompt_once_a_pass_seeded_and_never_a_held_out_one():
    pool = [0, 2, 3, 5, 8, 9, 11]  # the training prompts: 1, 4, 6, 7, 10 held out
    draws = [round_prompts(pool, 3, seed=7, round_index=k) for k in range(1, 6)]
    assert all(len(draw) == len(set(draw)) == 3 and set(draw) <= set(pool) for draw in draws)
    # Pass one: rounds 1 and 2 draw 6 of the 7 without replacement; round 3 takes the one left, then 2 of a new pass.
    assert set(draws[0]).isdisjoint(draws[1])
    (last,) = set(pool) - set(draws[0]) - set(draws[1])
    assert last in draws[2]
    # Pass two began in round 3 with its 2 fresh ones; rounds 3 (those 2), 4 and 5 draw 2 + 3 + 2 more of it (pass
    # two's last prompt would come in round 5 with the first of pass three).
    second = [p for p in draws[2] if p != last] + draws[3]
    assert len(set(second)) == 5
    assert draws == [round_prompts(pool, 3, seed=7, round_index=k) for k in range(1, 6)]  # a resume draws the same
    assert draws != [round_prompts(pool, 3, seed=8, round_index=k) for k in range(1, 6)]
    assert round_prompts(pool, None, seed=7, round_index=4) == pool  # unset: every prompt, every round


def test_a_run_with_prompts_per_round_samples_its_draw_and_says_how_many_prompts(tmp_path, tokenizer):
    config = settings(tmp_path, prompts_per_round=2, training=ONE_STEP)  # 3 training prompts, 2 held out
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config)
    train_rows, held_rows = split_held_out(len(PROMPTS), config.held_out_share, config.seed)
    for line in result.rounds:
        sampled = [row["prompt_index"] for row in read_jsonl(tmp_path / f"run/round-{line['round']}/samples.jsonl")]
        assert sorted(set(sampled)) == round_prompts(train_rows, 2, config.seed, line["round"])
        assert set(sampled).isdisjoint(held_rows) and line["prompts"] == 2 and line["samples"] == 2 * 3
    # Round 2 drew the training prompt round 1 left, and one of a new pass.
    first, second = (round_prompts(train_rows, 2, config.seed, k) for k in (1, 2))
    assert set(train_rows) - set(first) <= set(second)


def test_a_draw_larger_than_the_training_prompts_is_refused_before_the_folder_is_claimed(tmp_path, tokenizer):
    with pytest.raises(RoundsError, match=r"^prompts_per_round 4 is more than the 3 training prompt\(s\) \(held-out "
                                          r"ones are never drawn\): lower it, or leave it unset"):
        run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path, prompts_per_round=4))
    assert not (tmp_path / "run").exists()


def group(texts_and_totals, index=0):
    return {"prompt_index": index, "prompt": "p", "prompt_ids": [1],
            "samples": [{"completion": text, "completion_ids": [ord(text[0])], "total": total}
                        for text, total in texts_and_totals]}


def test_pairs_per_prompt_pairs_the_best_against_each_of_the_k_worst_of_other_texts():
    samples = group([("right", 1.0), ("wrong a", 0.0), ("right", 1.0), ("wrong a", 0.0), ("wrong b", 0.0),
                     ("half", 0.5), ("also right", 1.0)])
    made, dropped = make_pairs([samples], 0.0, pairs_per_prompt=3)
    # The 3 worst (lowest total, first of equals first): wrong a, wrong a (its text twice: one pair), wrong b.
    assert [(p["chosen"], p["rejected"], p["rejected_reward"]) for p in made] == \
        [("right", "wrong a", 0.0), ("right", "wrong b", 0.0)]
    assert [p["chosen"] for p in make_pairs([samples], 0.0, pairs_per_prompt=5)[0]] == ["right"] * 3  # + half
    assert make_pairs([samples], 0.0, pairs_per_prompt=1)[0] == made[:1]  # 1: best against worst, as before
    assert make_pairs([samples], 0.6, pairs_per_prompt=5)[0] == made  # half's margin 0.5 is under 0.6
    assert sum(dropped.values()) == 0
    tied = group([("same", 1.0), ("same", 0.0), ("same", 0.5)])  # a cut sample's penalty: one text, scored apart
    assert make_pairs([tied], 0.0, pairs_per_prompt=2) == ([], {"unscorable": 0, "all_tied": 1,
                                                                "below_min_margin": 0})


def test_a_run_with_pairs_per_prompt_trains_on_more_pairs_than_prompts(tmp_path, tokenizer):
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=4, pairs_per_prompt=3,
                      training=ONE_STEP)
    line = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config).rounds[0]
    pairs = read_jsonl(tmp_path / "run/round-1/pairs.jsonl")
    assert line["status"] == "trained" and line["pairs"] == len(pairs) > line["prompts"] - sum(line["dropped"].values())
    assert all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)


def test_a_temperature_per_round_samples_each_round_at_its_own(tmp_path, tokenizer):
    seen = []

    def generate(model, prompt_ids, settings_):
        seen.append(settings_.temperature)
        return hf_generate(model, prompt_ids, settings_, tokenizer.eos_token_id)
    config = settings(tmp_path, held_out_share=0.0, temperature=[0.5, 2.0], training=ONE_STEP)
    run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config, generate_fn=generate)
    assert sorted(set(seen)) == [0.5, 2.0] and seen == sorted(seen)  # round 1's batches at 0.5, round 2's at 2.0
    assert round_temperature(0.7, 3) == 0.7 and round_temperature([0.7, 1.0, 1.2], 3) == 1.2


def test_a_temperature_list_is_one_value_or_one_per_round_and_a_longer_resume_is_refused(tmp_path):
    assert RoundsConfig("out", rounds=3, temperature=[0.7]).temperature == 0.7  # the command's --temperature 0.7
    assert RoundsConfig("out", rounds=3, temperature=[0.7, 1, 1.2]).settings()["temperature"] == [0.7, 1.0, 1.2]
    with pytest.raises(RoundsError, match=r"^temperature has 3 values for 4 rounds: give one value, or one per round "
                                          r"\(a resume that adds rounds needs a temperature for each\)$"):
        RoundsConfig("out", rounds=4, temperature=[0.7, 1.0, 1.2])
    with pytest.raises(RoundsError, match=r"^temperature must be > 0, got \[0.7, 0.0\]$"):
        RoundsConfig("out", rounds=2, temperature=[0.7, 0])


def test_a_run_with_a_temperature_per_round_resumes_with_more_rounds_and_a_list_that_starts_with_its_own(tmp_path,
                                                                                                   tokenizer):
    seen = []

    def generate(model, prompt_ids, settings_):
        seen.append(settings_.temperature)
        return hf_generate(model, prompt_ids, settings_, tokenizer.eos_token_id)
    three = settings(tmp_path, rounds=3, held_out_share=0.0, temperature=[0.5, 1.0, 1.5], training=ONE_STEP)
    run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, three, generate_fn=generate)
    seen.clear()
    longer = [*three.temperature, 2.0]  # "needs a temperature for each": given one for each, it is the same run
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, replace(three, rounds=4, temperature=longer),
                        generate_fn=generate)
    assert [(line["round"], line["status"]) for line in result.rounds] == [(k, "trained") for k in range(1, 5)]
    assert set(seen) == {2.0}  # the finished rounds are not sampled again; round 4 at its own
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["temperature"] == longer
    assert run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, three).rounds == result.rounds  # the list's start
    with pytest.raises(RoundsError, match=r"holds a run with other settings \(temperature \[0.5, 1.0, 1.5, 2.0\] -> "
                                          r"\[0.5, 0.7, 1.5, 2.0, 2.5\]\)"):  # a finished round's changed: refused
        run_rounds(tiny_policy(), tokenizer, PROMPTS, letters,
                   replace(three, rounds=5, temperature=[0.5, 0.7, 1.5, 2.0, 2.5]))


@pytest.mark.parametrize("temperature", [math.inf, math.nan, 1e30, MAX_TEMPERATURE * 1.01, [0.7, math.inf]])
def test_a_temperature_that_is_not_finite_or_past_the_bound_is_refused(temperature):
    # inf (or 1e30) samples uniformly over the vocabulary: noise, paired and trained on.
    with pytest.raises(RoundsError, match=rf"^temperature must be a finite number <= {MAX_TEMPERATURE:g}, got "):
        RoundsConfig("out", rounds=2, temperature=temperature)
    assert RoundsConfig("out", temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_an_evaluation_in_a_rounds_dpo_pass_is_refused_by_the_config(strategy):
    # The pass has no held-out pairs: Trainer refused it after the round had sampled and scored.
    with pytest.raises(RoundsError, match=rf"^training: drop eval_strategy '{strategy}', a round's DPO pass has no "):
        RoundsConfig("out", training={"eval_strategy": strategy})
    assert RoundsConfig("out", training={"eval_strategy": "no"}).training == {"eval_strategy": "no"}


@pytest.mark.parametrize(("name", "value"), [("prompts_per_round", 0), ("pairs_per_prompt", 0)])
def test_a_recipe_option_below_one_is_one_line_naming_it(name, value):
    with pytest.raises(RoundsError, match=rf"^{name} must be >= 1, got 0$"):
        RoundsConfig("out", **{name: value})


def test_the_recipes_options_left_at_their_defaults_leave_settings_as_before():
    # A run recorded before these options resumes: at their defaults, settings.json does not name them.
    assert not {"prompts_per_round", "pairs_per_prompt"} & set(RoundsConfig("out").settings())
    assert RoundsConfig("out", pairs_per_prompt=2).settings()["pairs_per_prompt"] == 2


def test_the_command_passes_the_recipes_options_to_the_rounds(tmp_path):
    plan = resolve(["--rounds", "3", "--output_dir", str(tmp_path / "out"), "--temperature", "0.7", "1.0", "1.2",
                    "--prompts_per_round", "16", "--pairs_per_prompt", "2", "--reference", "previous",
                    "--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0.2"])
    config = rounds_config(plan, None)
    assert (config.temperature, config.prompts_per_round, config.pairs_per_prompt) == ([0.7, 1.0, 1.2], 16, 2)
    assert config.reference == "previous"
    assert (config.training["loss_type"], config.training["loss_weights"]) == (["sigmoid", "sft"], [1.0, 0.2])
    assert rounds_config(resolve(["--rounds", "3", "--output_dir", str(tmp_path / "o"), "--temperature", "0.9"]),
                         None).temperature == 0.9


def test_the_nll_term_trains_through_a_round_and_adds_the_chosen_answers_token_mean_nll(tmp_path, tokenizer):
    # One prompt, one pair, one step: the step's loss is DPO's on the logged margin plus the weight times the chosen
    # answer's NLL per token (Iterative RPO's term, `sft` in the core's LOSSES).
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=4,
                      training={"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], **ONE_STEP})
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS[1:2], letters, config)
    (pair,) = read_jsonl(tmp_path / "run/round-1/pairs.jsonl")
    (step,) = [entry for entry in result.trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
    nll = -step["logps/chosen"] / len(pair["chosen_ids"])
    dpo = -F.logsigmoid(torch.tensor(step["rewards/margins"])).item()
    assert result.rounds[0]["status"] == "trained" and nll > 0.1
    assert step["loss"] == pytest.approx(dpo + 0.5 * nll, abs=1e-3)
    assert result.rounds[0]["dpo"]["loss"] == step["loss"]


def test_saturated_counts_the_prompts_whose_samples_all_scored_the_same():
    groups = [group([("a", 1.0), ("b", 1.0)]), group([("a", 1.0), ("b", None), ("c", 1.0)]),
              group([("a", 1.0), ("b", 0.0)]), group([("a", 1.0), ("b", None)]), group([("a", 0.0), ("a", 1.0)])]
    assert saturated(groups) == 2  # the last is all_tied (one text) but not saturated; one scorable is unscorable


def test_a_rounds_line_and_rounds_jsonl_say_how_many_prompts_were_saturated(tmp_path, tokenizer, capsys):
    config = settings(tmp_path, on_no_pairs="skip", rounds=1, training=ONE_STEP)
    line = run_rounds(tiny_policy(), tokenizer, PROMPTS, constant, config).rounds[0]
    assert line["saturated"] == line["dropped"]["all_tied"] == line["prompts"] == 3
    assert read_jsonl(tmp_path / "run/rounds.jsonl")[0]["saturated"] == 3
    # Where the samples went (issue 56 item 3), a plain draw too: every prompt all right, one generate() call, its
    # prompts (every training prompt, in the pool's order) and its seed, seed 7 + 1000 x round 1 (issue 56 item 5).
    assert line["draw"] == {"all_right": 3, "all_wrong": 0, "all_alike": 0, "mixed": 0, "unscorable": 0, "skipped": 0,
                            "refills": 0, "gen_batches": 1, "temperature": 1.0,
                            "batches": [{"seed": 1007, "prompts": split_held_out(5, 0.4, 7)[0]}]}
    assert (tmp_path / "run/rounds.png").is_file()
    assert "round 1: 9 samples, 0 pairs (dropped: 3 all_tied); 3 prompts: 3 all right, 0 mixed, reward mean 1.000 " \
        "(best 1.000, worst 1.000); no pair, round skipped" in capsys.readouterr().out
