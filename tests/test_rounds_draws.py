"""Where a round's samples go (issue 56): dynamic sampling draws further prompts until prompts_per_round of them gave
a pair, the history skips prompts whose recent draws gave none, and each round says where its samples went (its
line, rounds.jsonl's `draw`, rounds.png). A resume after a kill at any phase is the same run."""

import json
import random
import zlib

import pytest
from test_rounds import Killed, kill_in, same_rounds, tiny_policy

from dpo_min.rounds import RoundsConfig, RoundsError, history, run_rounds
from dpo_min.rounds import draws as rounds_draws
from dpo_min.rounds import loop as rounds_loop
from dpo_min.rounds.prompts import prompt_rows, rendered_prompts, split_held_out
from dpo_min.rounds.sampling import Completion, GenerationSettings, sample
from dpo_min.rounds.schedule import round_prompts
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

# 10 prompts, 2 held out: 8 training prompts. The reward ties every sample of an even `i` (no pair, ever) and scores
# those of an odd one by their text (distinct texts, distinct scores), so half the pool is saturated from the start.
PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i), "i": i}
           for i in range(10)]


SEED = 22  # one whose round 2 both skips a prompt and draws two to refill (with a reward as this one)


def half_saturated(completions, i, **_):
    return [0.0 if k % 2 == 0 else zlib.crc32(c[0]["content"].encode()) / 2**32 for c, k in zip(completions, i)]


def settings(folder, name="run", **overrides):
    training = {"per_device_train_batch_size": 2, "learning_rate": 5e-3, "disable_tqdm": True,
                "save_strategy": "steps", "save_steps": 1, **overrides.pop("training", {})}
    return RoundsConfig(**{"output_dir": str(folder / name), "rounds": 2, "num_generations": 3,
                           "max_completion_length": 4, "held_out_share": 0.2, "seed": SEED, "prompts_per_round": 2,
                           "generation_batch_size": 3, "dynamic_sampling": True, "skip_saturated": 1,
                           "training": training, **overrides})


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- the draw, on its own -----------------------------------------------------------------------------------------
def fake_round(config, past, saturated, pool=tuple(range(8)), round_index=1):
    """sample_round with a sampler that records its calls and a score that ties the samples of `saturated` prompts."""
    calls = []

    def sample(indices, first):
        calls.append((list(indices), first))
        return [[Completion(f"{i}-{s}", [i, s], False) for s in range(config.num_generations)] for i in indices]

    def score(rows):
        return [{**row, "rewards": {}, "total": 0.0 if row["prompt_index"] in saturated else float(row["sample"])}
                for row in rows]
    rows, record = rounds_draws.sample_round(config, list(pool), past, round_index, sample, score)
    return rows, record, calls


def test_dynamic_sampling_draws_more_prompts_until_enough_gave_a_pair_each_once_never_held_out(tmp_path):
    config = RoundsConfig(output_dir=str(tmp_path), num_generations=2, prompts_per_round=4, generation_batch_size=4,
                          dynamic_sampling=True)
    pool = [0, 2, 3, 5, 8, 9, 11, 12, 14, 15]  # the training prompts; 1, 4, 6, 7, 10, 13 are held out
    order = rounds_draws.candidates(pool, 4, config.seed, 1)
    assert order[:4] == round_prompts(pool, 4, config.seed, 1) and sorted(order) == pool
    saturated = set(order[:3]) | {order[5]}  # 3 of the draw tie, and the second refill does too
    rows, record, calls = fake_round(config, {}, saturated, pool)
    sampled = list(dict.fromkeys(row["prompt_index"] for row in rows))
    # The draw (2 batches of 2 prompts), then 3 refills for the 3 tied (2 batches), then 1 for the refill that tied.
    assert calls == [(order[:4], 0), (order[4:7], 2), (order[7:8], 4)]
    assert sampled == order[:8] and len(set(sampled)) == 8 and set(sampled) <= set(pool)
    assert len([p for p in sampled if p not in saturated]) == 4  # prompts_per_round gave a pair
    # Each generate() call's prompts and seed (seed 42 + 1000 x round 1 + the call's number over the waves).
    assert record == {"skipped": [], "refills": 4, "gen_batches": 5, "temperature": 1.0, "batches": [
        {"seed": 1042, "prompts": order[0:2]}, {"seed": 1043, "prompts": order[2:4]},
        {"seed": 1044, "prompts": order[4:6]}, {"seed": 1045, "prompts": order[6:7]},
        {"seed": 1046, "prompts": order[7:8]}]}
    assert len(rows) == 8 * 2  # every sample counted, the tied prompts' too


def test_max_num_gen_batches_caps_the_generate_calls_and_0_is_no_cap_but_the_pool(tmp_path):
    every = set(range(8))  # nothing ever gives a pair: the round draws until its cap, or the pool, is spent
    capped = RoundsConfig(output_dir=str(tmp_path), num_generations=2, prompts_per_round=2, generation_batch_size=2,
                          dynamic_sampling=True, max_num_gen_batches=3)
    _, record, calls = fake_round(capped, {}, every)
    assert calls == [(calls[0][0], 0), (calls[1][0], 2)] and len(calls[1][0]) == 1 and record["gen_batches"] == 3
    _, record, calls = fake_round(RoundsConfig(**{**capped.__dict__, "max_num_gen_batches": 0}), {}, every)
    assert sum(len(indices) for indices, _ in calls) == 8 and record["refills"] == 6


def test_without_dynamic_sampling_the_round_samples_its_draw_in_one_pass(tmp_path):
    config = RoundsConfig(output_dir=str(tmp_path), num_generations=2, prompts_per_round=3, generation_batch_size=4)
    rows, record, calls = fake_round(config, {}, set(range(8)))
    assert calls == [(round_prompts(list(range(8)), 3, config.seed, 1), 0)] and "total" not in rows[0]
    drawn = round_prompts(list(range(8)), 3, config.seed, 1)
    assert record == {"skipped": [], "refills": 0, "gen_batches": 2, "temperature": 1.0,
                      "batches": [{"seed": 1042, "prompts": drawn[:2]}, {"seed": 1043, "prompts": drawn[2:]}]}
    assert rounds_draws.recorded(config, tmp_path, drawn, 1) == record  # what a plain round's line records


def test_a_prompt_is_skipped_with_the_probability_its_streak_of_draws_without_a_pair_gives():
    assert history.streak([True, False, False]) == 2 and history.streak([False, True]) == 0
    assert [history.skip_probability(s, 2) for s in range(5)] == [0, 0, 0.5, 0.75, 0.875]
    assert history.skip_probability(9, 0) == 0  # off
    # Over many prompts, a streak of 3 at threshold 2 skips about 3/4 of them, seeded by (seed, prompt, round).
    skips = [history.skipped(p, [True, False, False, False], 2, seed=5, round_index=4) for p in range(4000)]
    assert abs(sum(skips) / 4000 - 0.75) < 0.03
    assert skips == [history.skipped(p, [True, False, False, False], 2, seed=5, round_index=4) for p in range(4000)]


def test_skipped_prompts_are_passed_over_and_the_round_still_samples_prompts_per_round(tmp_path):
    config = RoundsConfig(output_dir=str(tmp_path), num_generations=2, prompts_per_round=3, skip_saturated=1)
    past = {p: [True, False, False] for p in range(4)}  # 2 draws without a pair: skipped with p = 3/4
    past |= {p: [False, True] for p in range(4, 8)}  # a pair last time: never skipped
    order = rounds_draws.candidates(list(range(8)), 3, config.seed, 2)
    rows, record, _ = fake_round(config, past, set(), round_index=2)
    sampled = list(dict.fromkeys(row["prompt_index"] for row in rows))
    expected_skips = [p for p in order if history.skipped(p, past[p], 1, config.seed, 2)]
    assert expected_skips and set(expected_skips) <= {0, 1, 2, 3}
    assert sampled == [p for p in order if p not in expected_skips][:3]
    assert record["skipped"] == [p for p in order[:order.index(sampled[-1])] if p in expected_skips]


def test_the_history_is_read_from_the_rounds_samples(tmp_path):
    rows = [{"prompt_index": 3, "completion": c, "total": t} for c, t in (("a", 1.0), ("b", 1.0))]
    rows += [{"prompt_index": 4, "completion": c, "total": t} for c, t in (("a", 1.0), ("b", 0.0))]
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    assert history.draws([tmp_path / "one.jsonl", tmp_path / "two.jsonl"], 0.0, "best") == \
        {3: [False, False], 4: [True]}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"dynamic_sampling": True, "prompts_per_round": None}, "dynamic_sampling draws more prompts until "
     "prompts_per_round of them gave a pair: set prompts_per_round"),
    ({"max_num_gen_batches": 3}, "max_num_gen_batches caps the generate() calls of dynamic sampling: add "
     "dynamic_sampling, or drop it"),
    ({"dynamic_sampling": True, "max_num_gen_batches": 1}, "max_num_gen_batches 1 is less than the 2 generate() "
     "call(s) of prompts_per_round 16 (8 prompts a call): raise it, or leave it 0 for no cap"),
    ({"skip_saturated": -1}, "skip_saturated must be >= 0, got -1"),
], ids=["no-draw", "cap-alone", "cap-under-draw", "negative"])
def test_draw_settings_that_cannot_work_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(RoundsError) as error:
        RoundsConfig(**{"output_dir": str(tmp_path), "prompts_per_round": 16, **overrides})
    assert str(error.value).startswith(message)


def test_the_command_passes_the_draw_options_and_settings_json_leaves_them_out_at_their_defaults(tmp_path):
    plan = resolve(["--rounds", "2", "--prompts_per_round", "4", "--dynamic_sampling", "--max_num_gen_batches", "3",
                    "--skip_saturated", "2", "--output_dir", str(tmp_path / "out")])
    config = rounds_config(plan, None)
    assert (config.dynamic_sampling, config.max_num_gen_batches, config.skip_saturated) == (True, 3, 2)
    assert {"dynamic_sampling": True, "max_num_gen_batches": 3, "skip_saturated": 2}.items() <= \
        config.settings().items()
    plain = rounds_config(resolve(["--rounds", "2", "--output_dir", str(tmp_path / "out")]), None).settings()
    assert not {"dynamic_sampling", "max_num_gen_batches", "skip_saturated"} & set(plain)


# ---- whole rounds on the tiny policy ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drawn_run(tmp_path_factory, smollm_path):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("draws")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPO_MIN_CACHE", str(folder / "cache"))
        return run_rounds(tiny_policy(), tokenizer, PROMPTS, half_saturated, settings(folder, rounds=3)), folder


def test_a_round_with_dynamic_sampling_samples_until_prompts_per_round_gave_a_pair_and_counts_every_sample(
        drawn_run):
    result, folder = drawn_run
    train_rows = split_held_out(len(PROMPTS), 0.2, SEED)[0]
    for line in result.rounds:
        samples = read_jsonl(folder / f"run/round-{line['round']}/samples.jsonl")
        sampled = list(dict.fromkeys(row["prompt_index"] for row in samples))
        odd = [p for p in sampled if p % 2]
        assert len(odd) == min(2, len([p for p in train_rows if p % 2]))  # prompts_per_round gave a pair
        assert set(sampled) <= set(train_rows) and len(sampled) == len(set(sampled))
        assert line["samples"] == len(samples) == 3 * len(sampled)  # set-aside prompts' samples count too
        draw = line["draw"]
        assert draw["mixed"] == len(odd) and draw["all_alike"] == len(sampled) - len(odd)  # not a 0/1 reward
        assert draw["refills"] == len(sampled) - 2 and draw["gen_batches"] == len(sampled)  # one prompt a call
        assert {json.loads(row)["prompt_index"] for row in
                (folder / f"run/round-{line['round']}/pairs.jsonl").read_text().splitlines()} <= set(odd)
    assert sum(line["draw"]["refills"] for line in result.rounds) > 0
    assert read_jsonl(folder / "run/rounds.jsonl") == result.rounds


def test_each_rounds_draw_records_every_generate_call_so_pi_0_sampled_on_it_gives_round_1_again(drawn_run, tokenizer):
    """Issue 56 item 5: an offline arm samples pi_0 on exactly a rounds run's prompts, call by call, with the same
    seeds and temperature. Round 1's policy is pi_0: sampled so, it gives round 1's completions token for token."""
    result, folder = drawn_run
    for line in result.rounds:
        batches = line["draw"]["batches"]
        draw = json.loads((folder / f"run/round-{line['round']}/draw.json").read_text())
        sampled = list(dict.fromkeys(row["prompt_index"] for row in
                                     read_jsonl(folder / f"run/round-{line['round']}/samples.jsonl")))
        assert [p for batch in batches for p in batch["prompts"]] == sampled  # every prompt, set-aside ones too
        assert [batch["seed"] for batch in batches] == [SEED + 1000 * line["round"] + b for b in range(len(batches))]
        assert draw["batches"] == batches and draw["temperature"] == line["draw"]["temperature"] == 1.0
    ids = rendered_prompts(tokenizer, prompt_rows(PROMPTS), None)
    again = [c.ids for batch in result.rounds[0]["draw"]["batches"]
             for group in sample(tiny_policy(), tokenizer, [ids[p] for p in batch["prompts"]],
                                 GenerationSettings(3, 4, True, 1.0, seed=batch["seed"]), len(batch["prompts"]))
             for c in group]
    assert again == [row["completion_ids"] for row in read_jsonl(folder / "run/round-1/generated.jsonl")]


def test_the_history_skips_prompts_that_gave_no_pair_as_its_rule_says(drawn_run):
    result, folder = drawn_run
    past = {}
    for line in result.rounds:
        order = rounds_draws.candidates(split_held_out(len(PROMPTS), 0.2, SEED)[0], 2, SEED,
                                           line["round"])
        skips = [p for p in order if history.skipped(p, past.get(p, []), 1, SEED, line["round"])]
        sampled = list(dict.fromkeys(row["prompt_index"] for row in
                                     read_jsonl(folder / f"run/round-{line['round']}/samples.jsonl")))
        assert not set(skips) & set(sampled) and all(p % 2 == 0 for p in skips)
        assert line["draw"]["skipped"] == len([p for p in skips if order.index(p) < order.index(sampled[-1])])
        for p in sampled:
            past.setdefault(p, []).append(p % 2 == 1)
    assert sum(line["draw"]["skipped"] for line in result.rounds) > 0  # rounds 2 and 3 skipped saturated prompts


def test_a_rounds_line_says_where_its_samples_went_and_rounds_png_draws_it(drawn_run, capsys):
    result, folder = drawn_run
    line = result.rounds[1]
    text = rounds_loop.summary(line)
    draw = line["draw"]
    assert text.startswith(f"round 2: {line['samples']} samples, {line['pairs']} pairs (dropped: ")
    assert f"); {line['prompts']} prompts: {draw['all_alike']} all alike, {draw['mixed']} mixed" in text
    assert f"; DPO: {line['dpo']['steps']} step" in text
    assert (f"{draw['skipped']} skipped as saturated" in text) == bool(draw["skipped"])
    assert (f"{draw['refills']} drawn to refill" in text) == bool(draw["refills"])
    png = (folder / "run/rounds.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.parametrize("phase", ["sample", "_score", "_train", "_evaluate"])
def test_a_run_with_draws_killed_at_any_phase_of_round_2_resumes_to_the_same_run(tmp_path, tokenizer, monkeypatch,
                                                                                 drawn_run, phase):
    whole, folder = drawn_run
    with monkeypatch.context() as patch:
        if phase == "sample":  # inside round 2's sampling, in its refill: the draw's 2 batches and one more finished
            original, calls = rounds_loop.sample, []

            def killed(model, tokenizer, prompt_ids, settings, *args, **kwargs):
                if SEED + 2000 <= settings.seed < SEED + 3000:  # round 2's batches: seed + 1000 * round + batch
                    calls.append(settings.seed)
                    if len(calls) == 4:
                        raise Killed("round 2, fourth generate() call")
                return original(model, tokenizer, prompt_ids, settings, *args, **kwargs)
            patch.setattr(rounds_loop, "sample", killed)
        else:
            kill_in(patch, rounds_loop, phase)
        with pytest.raises(Killed):
            run_rounds(tiny_policy(), tokenizer, PROMPTS, half_saturated, settings(tmp_path))
    if phase == "sample":
        kept = read_jsonl(tmp_path / "run/round-2/generated.partial.jsonl")
        assert [line["batch"] for line in kept] == [0, 1, 2]  # the draw's batches kept over the refill's calls
    resumed = run_rounds(tiny_policy(), tokenizer, PROMPTS, half_saturated, settings(tmp_path))
    same_rounds(resumed.rounds, whole.rounds[:2])
    assert resumed.held_out == whole.held_out[:3]
    for name in ("generated.jsonl", "samples.jsonl", "pairs.jsonl", "draw.json"):
        assert (tmp_path / "run/round-2" / name).read_text() == (folder / "run/round-2" / name).read_text()


def test_the_seeded_further_prompts_do_not_change_later_rounds_draws():
    pool = list(range(12))
    assert [rounds_draws.candidates(pool, 4, 3, k)[:4] for k in (1, 2, 3)] == \
        [round_prompts(pool, 4, 3, k) for k in (1, 2, 3)]
    rest = rounds_draws.candidates(pool, 4, 3, 1)[4:]
    expected = [p for p in pool if p not in round_prompts(pool, 4, 3, 1)]
    random.Random("3 further prompts of round 1").shuffle(expected)
    assert rest == expected
