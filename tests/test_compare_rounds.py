"""The evidence of DPO in rounds (issue 45): the pair rule that raises a round's signal, the paired tests the
comparison reports, and the protocol fixed before its seeds ran."""

import json
import math
import random
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import committed_table, protocol_digest
from conftest import load_benchmark as load

from dpo_min.rounds import RoundsConfig, RoundsError, make_pairs
from dpo_min.rounds.pairs import every_better_against_worse
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "benchmarks" / "protocols" / "rounds-2026-12-05.json"
RESULTS = ROOT / "benchmarks" / "results" / "rounds-2026-12-05"
SEEDS_ALREADY_SEEN = {42, 7, 1, 3, 11}  # the seeds of the published arms and of the replication that broke them



def group(*samples):
    return {"prompt_index": 0, "prompt": "p", "prompt_ids": [1],
            "samples": [{"completion": text, "completion_ids": [i], "total": total}
                        for i, (text, total) in enumerate(samples)]}


def pairs_of(made):
    return [(pair["chosen"], pair["rejected"]) for pair in made]


def test_every_right_against_every_wrong_each_text_pair_once_spread_over_the_samples_and_capped():
    samples = group(("42", 1.0), ("41", 0.0), ("42", 1.0), ("43", 0.0), ("40", 0.0), ("so 42", 1.0))
    made, dropped = make_pairs([samples], 0.0, pairs_per_prompt=8, rule="every")
    # 2 right texts x 3 wrong texts: 6 pairs (the second "42" is the first's text: no pair of its own).
    assert sorted(pairs_of(made)) == sorted((r, w) for r in ("42", "so 42") for w in ("41", "43", "40"))
    # Capped at 3: each right text and each wrong text used before any is used twice.
    capped = pairs_of(make_pairs([samples], 0.0, pairs_per_prompt=3, rule="every")[0])
    assert capped == [("42", "41"), ("so 42", "43"), ("42", "40")]
    assert dict(dropped) == {"unscorable": 0, "all_tied": 0, "below_min_margin": 0}
    # The best rule on the same group: the first best against its 2 worst.
    assert pairs_of(make_pairs([samples], 0.0, pairs_per_prompt=2)[0]) == [("42", "41"), ("42", "43")]


def test_every_rule_takes_the_widest_margins_first_and_honours_min_margin_and_ties():
    graded = group(("a", 3.0), ("b", 2.0), ("c", 1.0), ("d", 0.0))
    assert pairs_of(make_pairs([graded], 0.0, 2, "every")[0]) == [("a", "d"), ("a", "c")]
    assert pairs_of(make_pairs([graded], 0.0, 2, "every")[0])[0] == ("a", "d")  # margin 3 first
    # min_margin 2: only a>c, a>d, b>d qualify.
    assert sorted(pairs_of(make_pairs([graded], 2.0, 8, "every")[0])) == [("a", "c"), ("a", "d"), ("b", "d")]
    made, dropped = make_pairs([group(("x", 1.0), ("y", 1.0))], 0.0, 8, "every")
    assert made == [] and dropped["all_tied"] == 1
    made, dropped = make_pairs([group(("x", 1.0), ("x", 0.0))], 0.0, 8, "every")  # one text against itself
    assert made == [] and dropped["all_tied"] == 1


def brute_force_every(samples, min_margin, cap):
    """The every rule as docs/rounds.md states it, by enumeration: for each ordered pair of distinct texts, the lowest
    total of the first over the highest of the second; then, one pair at a time, the widest margin, the least used
    two texts, the lowest indices (a fresh minimum over every candidate left each time)."""
    totals = [sample["total"] for sample in samples]
    scored = [t for t in totals if t is not None]
    if len(scored) < 2:
        return "unscorable"
    if max(scored) == min(scored):
        return "all_tied"
    if max(scored) - min(scored) < min_margin:
        return "below_min_margin"
    texts = list(dict.fromkeys(s["completion"] for s in samples if s["total"] is not None))
    of = {text: [i for i, s in enumerate(samples) if s["completion"] == text and s["total"] is not None]
          for text in texts}
    best = {text: max(of[text], key=lambda i: (totals[i], -i)) for text in texts}
    worst = {text: min(of[text], key=lambda i: (totals[i], i)) for text in texts}
    candidates = [(totals[worst[t]] - totals[best[u]], t, u) for t in texts for u in texts
                  if t != u and totals[worst[t]] - totals[best[u]] > 0
                  and totals[worst[t]] - totals[best[u]] >= min_margin]
    chosen, uses = [], Counter()
    while candidates and len(chosen) < cap:
        pick = min(candidates, key=lambda c: (-c[0], uses[c[1]] + uses[c[2]], best[c[1]], worst[c[2]]))
        candidates.remove(pick)
        chosen.append((best[pick[1]], worst[pick[2]]))
        uses.update(pick[1:])
    return chosen or "all_tied"


def test_every_rule_is_the_brute_force_enumeration_on_small_groups_and_never_pairs_two_texts_both_ways():
    draw = random.Random(48)
    for _ in range(3000):
        samples = [{"completion": draw.choice("abcde"), "completion_ids": [i],
                    "total": draw.choice([None, 0.0, 0.5, 1.0, 2.0])} for i in range(draw.randrange(9))]
        margin, cap = draw.choice([0.0, 0.5, 1.0]), draw.choice([1, 2, 3, 100])
        made = every_better_against_worse(samples, margin, cap)
        assert made == brute_force_every(samples, margin, cap), (samples, margin, cap)
        if not isinstance(made, str):
            texts = {(samples[a]["completion"], samples[b]["completion"]) for a, b in made}
            assert len(texts) == len(made) and not {(u, t) for t, u in texts} & texts
    # A text sampled twice, scored above and below another: paired over it in neither way (it was, in both).
    straddles = group(("a", 1.0), ("b", 0.5), ("a", 0.0))
    assert make_pairs([straddles], 0.0, 8, "every")[1]["all_tied"] == 1
    # Above in each of its samples: paired, its best-scored sample against the other's worst.
    above = group(("a", 0.75), ("b", 0.5), ("a", 1.0), ("b", 0.0))
    assert every_better_against_worse(above["samples"], 0.0, 8) == [(2, 3)]


def test_every_rule_on_128_samples_unbounded_keeps_every_right_text_against_every_wrong_one():
    draw = random.Random(7)
    samples = [{"completion": f"text {i % 100}", "completion_ids": [i], "total": float(i % 100 < 37)}
               for i in draw.sample(range(128), 128)]
    made = every_better_against_worse(samples, 0.0, 10**9)
    right = {s["completion"] for s in samples if s["total"] == 1.0}
    wrong = {s["completion"] for s in samples if s["total"] == 0.0}
    pairs = [(samples[a]["completion"], samples[b]["completion"]) for a, b in made]
    assert len(pairs) == len(set(pairs)) == len(right) * len(wrong) and set(pairs) == {
        (r, w) for r in right for w in wrong}
    # Each text's first sample stands for it, and a cap keeps the first pairs the unbounded rule orders.
    first = {text: min(i for i, s in enumerate(samples) if s["completion"] == text) for text in right | wrong}
    assert all(a == first[samples[a]["completion"]] and b == first[samples[b]["completion"]] for a, b in made)
    assert every_better_against_worse(samples, 0.0, 50) == made[:50]


class Counted(float):
    """A total that counts the margins taken of it."""
    subtractions = 0

    def __sub__(self, other):
        Counted.subtractions += 1
        return float(self) - float(other)


def test_every_rule_takes_each_margin_once_not_once_per_pair_kept():
    # The work's shape, not a time: margins are taken once per pair of texts (n**2), where a fresh minimum over every
    # candidate for each pair kept took them (n/2)**4 / 2 times (9 s a prompt at 128 samples; docs/rounds.md).
    n = 96
    samples = [{"completion": str(i), "completion_ids": [i], "total": Counted(i % 2)} for i in range(n)]
    Counted.subtractions = 0
    made = every_better_against_worse(samples, 0.0, 10**9)
    assert len(made) == (n // 2) ** 2 and Counted.subtractions <= 10 * n ** 2


def test_pair_rule_is_checked_recorded_only_when_set_and_reaches_the_rounds_from_the_command(tmp_path):
    with pytest.raises(RoundsError, match=r"^pair_rule must be one of \('best', 'every'\), got 'all'$"):
        RoundsConfig("out", pair_rule="all")
    assert "pair_rule" not in RoundsConfig("out").settings()  # a run from before the option resumes
    assert RoundsConfig("out", pair_rule="every").settings()["pair_rule"] == "every"
    plan = resolve(["--rounds", "2", "--output_dir", str(tmp_path / "o"), "--pair_rule", "every",
                    "--pairs_per_prompt", "8"])
    assert (rounds_config(plan, None).pair_rule, rounds_config(plan, None).pairs_per_prompt) == ("every", 8)


@pytest.mark.parametrize(("k", "n", "expected"), [(0, 0, 1.0), (5, 11, 1.0), (0, 6, 2 / 64), (2, 10, 2 * 56 / 1024),
                                                  (8, 8, 2 / 256), (3, 4, 2 * 5 / 16)])
def test_the_two_sided_exact_binomial_is_the_hand_computed_tail(k, n, expected):
    paired = load("paired")
    assert paired.binomial_two_sided(k, n) == pytest.approx(expected)
    assert paired.binomial_two_sided(n - k, n) == pytest.approx(expected)  # symmetric


def test_mcnemar_reads_only_the_discordant_prompts_and_the_sign_test_only_the_seeds_not_level():
    paired = load("paired")
    assert paired.exact_mcnemar(5, 6) == 1.0  # the replication of issue 45: 5 right only in the rounds, 6 offline
    assert paired.exact_mcnemar(10, 0) == pytest.approx(2 / 1024)
    assert paired.sign_test(6, 2) == pytest.approx(2 * (1 + 8 + 28) / 256)


@pytest.mark.parametrize(("differences", "expected"), [
    ([1, 1, 1], 2 / 8),  # only all-plus and all-minus reach |3|
    ([3, -1], 4 / 4),  # sums 2, 4, -4, -2: every one reaches |2|
    ([5, 1, 1], 2 / 8),  # sums +-7, +-5 (twice), +-3: only +-7 reach |7|
    ([2, 0], 4 / 4),  # a level seed flips to itself: +-2 twice each
    ([12, 17, 10, 13, 0, 10, 14, 18], 4 / 256),  # the protocol's rounds against pi_0 (docs/rounds.md)
])
def test_the_seed_level_sign_flip_test_is_the_hand_counted_share_of_sign_choices(differences, expected):
    assert load("paired").seed_permutation_test(differences) == pytest.approx(expected)


def test_overdispersion_is_the_seeds_variance_over_what_independent_prompts_give():
    # 2 seeds of 4 prompts; 2 prompts right only in the first arm, none only in the second: per prompt +1 with
    # share 1/4, so a seed's difference has variance 4 * (1/4 - 1/16) = 3/4; the seeds' differences 2 and 0 vary 2.
    assert load("paired").overdispersion([2, 0], 4, 2, 0) == pytest.approx(2 / 0.75)
    assert load("paired").overdispersion([1, 1], 4, 2, 0) == 0.0


def test_the_two_sided_binomial_is_the_exact_fraction_for_moderate_n_and_never_underflows_to_zero():
    paired = load("paired")
    for n in range(0, 61, 3):
        for k in range(n + 1):
            # The probability, under n fair trials, of a count as far from n/2 as k or farther on k's side, doubled:
            # each count's probability built up as a fraction from the last, with no binomial sum shared.
            probability, far = Fraction(1, 2 ** n), Fraction(0)
            for count in range(n + 1):
                far += probability if count <= min(k, n - k) else 0
                probability = probability * (n - count) / (count + 1)
            exact = min(Fraction(1), 2 * far) if n else Fraction(1)
            assert paired.binomial_two_sided(k, n) == pytest.approx(float(exact), rel=1e-12)
            assert paired.log10_binomial_two_sided(k, n) == pytest.approx(
                math.log10(exact.numerator) - math.log10(exact.denominator), abs=1e-12)
    # 5,000 against 0: 2 * 0.5**5000 = 2**-4999, about 1.42e-1505, below a float's range. It was 0.0.
    assert paired.exact_mcnemar(0, 5000) > 0 and paired.exact_mcnemar(5000, 0) > 0
    assert paired.log10_binomial_two_sided(0, 5000) == pytest.approx(math.log10(2) + 5000 * math.log10(0.5))
    assert paired.log10_binomial_two_sided(0, 5000) == pytest.approx(-4999 * math.log10(2))
    assert paired.shown_p(0, 5000) == "1.42e-1505" and paired.shown_p(10, 10) == "0.00195"


def seed_figures(seed, rounds, offline, pi_0=None):
    """A seed file of the rounds protocol as compare_rounds writes it: its name, digest and arguments."""
    compare, seed_files = load("compare_rounds"), load("seed_files")
    protocol = json.loads(PROTOCOL.read_text())
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": seed_files.protocol_digest(protocol),
            "argv": seed_files.recorded_argv(compare.seed_argv(protocol, seed)),
            "held_rows": list(range(len(rounds))), "per_draw": [1, 2, 3],
            "rounds": {"right": [0, 1, 1, sum(rounds)], "changed": [1, 1, 1], "pairs": [2, 3, 3], "steps": [1, 1, 1]},
            "outcomes": {"pi_0": [0] * len(rounds) if pi_0 is None else pi_0, "rounds": rounds,
                         "offline_samples": offline, "offline_matched": offline},
            "offline": {"offline_samples": {"steps": 2}, "offline_matched": {"steps": 2}}}


def seed_file(folder, seed, rounds, offline, pi_0=None):
    figures = seed_figures(seed, rounds, offline, pi_0)
    path = folder / f"{seed}-{len(list(folder.iterdir()))}.json"
    path.write_text(json.dumps(figures))
    return str(path)


def test_the_table_refuses_a_seed_given_twice_and_arms_of_unequal_length_in_one_line(tmp_path):
    compare = load("compare_rounds")
    once = seed_file(tmp_path, 13, [1, 1, 0, 0], [1, 0, 0, 0])
    for twice in (once, seed_file(tmp_path, 13, [1, 1, 0, 0], [1, 0, 0, 0])):  # the same file, or a copy
        with pytest.raises(SystemExit) as error:
            compare.print_table([once, seed_file(tmp_path, 17, [1, 0], [0, 0]), twice])
        assert str(error.value) == (f"--table: seed 13 is given twice ({once}, {twice}): each seed counts once in "
                                    "the pooled counts and the paired tests")
    short = seed_file(tmp_path, 19, [1, 1, 0, 0], [1, 0, 0])
    with pytest.raises(SystemExit) as error:
        compare.print_table([once, short])
    assert str(error.value) == (f"--table: {short}: the arms of seed 19 were scored on unequal numbers of prompts "
                                "(held-out prompts 4, pi_0 4, rounds 4, offline_samples 3, offline_matched 3): they "
                                "are paired prompt by prompt")


def test_the_table_prints_a_p_value_below_a_floats_range_in_log10_terms(tmp_path, capsys):
    compare = load("compare_rounds")
    compare.print_table([seed_file(tmp_path, 13, [1] * 5000, [0] * 5000)])
    assert "| rounds vs offline_samples | 5000 | 0 | 1.42e-1505 | 1 / 0 / 0 | 1 |" in capsys.readouterr().out


def test_the_protocol_fixes_new_seeds_and_options_the_command_accepts(tmp_path):
    protocol = json.loads(PROTOCOL.read_text())
    assert len(protocol["seeds"]) >= 8 and not set(protocol["seeds"]) & SEEDS_ALREADY_SEEN
    assert len(set(protocol["seeds"])) == len(protocol["seeds"])
    compare = load("compare_rounds")
    argv = ["--rounds", str(protocol["rounds"]), "--seed", str(protocol["seeds"][0]), *compare.demo_options(),
            *compare.POOL_OPTIONS, *protocol["options"], "--output_dir", str(tmp_path / "rounds")]
    config = rounds_config(resolve(argv), None)
    assert (config.pair_rule, config.pairs_per_prompt, config.prompts_per_round) == ("every", 8, 16)
    # One schedule for every arm: no decay restarted each round, equal steps equal summed learning rate.
    assert config.training["lr_scheduler_type"] == "constant" and config.training["num_train_epochs"] == 3
    assert (config.training["loss_type"], config.training["learning_rate"]) == (["sigmoid", "sft"], 1e-4)
    assert config.on_no_pairs == "skip" and config.held_out_share == pytest.approx(0.0213)


def test_a_seed_the_protocol_does_not_list_is_refused(tmp_path):
    compare = load("compare_rounds")
    with pytest.raises(SystemExit, match="not one of the protocol's"):
        compare.run_seed(json.loads(PROTOCOL.read_text()), 42, tmp_path)


def test_the_table_gives_each_seed_the_pooled_counts_and_the_paired_tests(tmp_path, capsys):
    compare = load("compare_rounds")
    files = []
    for seed, rounds, offline in ((13, [1, 1, 0, 0], [1, 0, 0, 0]), (17, [1, 1, 1, 0], [0, 0, 1, 0])):
        figures = seed_figures(seed, rounds, offline)
        files.append(tmp_path / f"{seed}.json")
        files[-1].write_text(json.dumps(figures))
    compare.print_table([str(path) for path in files])
    printed = capsys.readouterr().out
    assert "| rounds | 5/8 = 0.625" in printed and "| offline_samples | 2/8 = 0.250" in printed
    # Right only in the rounds: seed 13 prompt 2, seed 17 prompts 1, 2: 3 against 0; both seeds ahead.
    assert "| rounds vs offline_samples | 3 | 0 | 0.25 | 2 / 0 / 0 | 0.5 |" in printed


def test_the_committed_seed_files_carry_the_protocols_digest_and_print_the_table_docs_rounds_quotes(capsys):
    """Migrated once (issue 54 item 6): the digest of the protocol they ran under, --dataset relative to the
    repository; the table over them is the one docs/rounds.md quotes, line for line."""
    printed = committed_table("compare_rounds", PROTOCOL, RESULTS, capsys)
    doc = (ROOT / "docs" / "rounds.md").read_text().splitlines()
    start = doc.index("protocol rounds-2026-12-05, 8 seed(s)")
    assert doc[start:start + len(printed)] == printed and len(printed) == 27  # every line, the tests included


def test_a_seed_file_not_run_under_the_protocol_is_refused_in_one_line_and_no_table_printed(tmp_path, capsys):
    """A file run under an edited protocol (3 epochs made 1), a seed the protocol does not list, a digest of another
    protocol: the table over them was printed, their outcomes pooled with the rest."""
    committed = json.loads((RESULTS / "seed-13.json").read_text())
    edited = json.loads(json.dumps(committed))
    edited["argv"][edited["argv"].index("--num_train_epochs") + 1] = "1"
    unlisted = {**committed, "seed": 42, "argv": [*committed["argv"][:3], "42", *committed["argv"][4:]]}
    expected = {
        "edited": "its arguments differ from the protocol's: '--num_train_epochs 3' is '--num_train_epochs 1' here",
        "unlisted": "seed 42 is not one of the protocol's [13, 17, 19, 23, 29, 31, 37, 43]: a protocol's seeds are "
                    "fixed",
        "other_digest": "its protocol digest 000000000000 is not benchmarks/protocols/rounds-2026-12-05.json's "
                        f"({protocol_digest(json.loads(PROTOCOL.read_text()))[:12]}): it ran under another version "
                        "of the "
                        "protocol"}
    for name, figures in (("edited", edited), ("unlisted", unlisted),
                          ("other_digest", {**committed, "protocol_digest": "0" * 64})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(figures))
        with pytest.raises(SystemExit) as refused:
            load("compare_rounds").print_table([str(RESULTS / "seed-17.json"), str(path)])
        assert str(refused.value) == f"--table: {path}: {expected[name]}" and capsys.readouterr().out == ""


def test_a_missing_truncated_or_armless_seed_file_is_one_line_not_a_traceback(tmp_path):
    committed = (RESULTS / "seed-13.json").read_text()
    armless = json.loads(committed)
    del armless["outcomes"]["offline_matched"]
    (tmp_path / "armless.json").write_text(json.dumps(armless))
    (tmp_path / "truncated.json").write_text(committed[:-1])
    expected = {"missing": "the seed file cannot be read (No such file or directory)",
                "truncated": "the seed file is not whole JSON (cut short?): Expecting ',' delimiter: line 643 column 1 "
                             "(char 5309)",
                "armless": "field 'outcomes.offline_matched' is missing"}
    for name, line in expected.items():  # the bad file first: refused before the good one's arguments are built
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_rounds.py"), "--table",
                              str(tmp_path / f"{name}.json"), str(RESULTS / "seed-17.json")],
                             capture_output=True, text=True, cwd=ROOT)
        assert (run.returncode, run.stdout, run.stderr) == (1, "", f"--table: {tmp_path / name}.json: {line}\n")


def test_a_seed_file_records_the_digest_and_a_relative_dataset_and_the_table_reads_it(tmp_path, monkeypatch, capsys):
    """What run_seed writes (the arms faked) is what --table checks: the protocol's digest, arguments whose
    --dataset is relative to the repository (it was this machine's absolute path)."""
    compare = load("compare_rounds")
    outcomes = [1, 0]
    monkeypatch.setattr(compare, "rounds_arm", lambda argv: {"argv": argv})
    monkeypatch.setattr(compare, "rounds_figures", lambda on: {
        "right": [0, 1, 1, 1], "outcomes": outcomes, "pi0_outcomes": [0, 0], "held_rows": [5, 9],
        "changed": [1, 0, 0], "pairs": [2, 2, 2], "steps": [1, 1, 1], "saturated": [0, 0, 0], "seconds": 1})
    monkeypatch.setattr(compare, "offline_arms", lambda on, out: {
        "per_draw": [2, 2, 2], "pool": 6, "seconds": 1, **{name: {"pairs": 6, "steps": 3, "outcomes": outcomes}
                                                          for name in ("offline_samples", "offline_matched")}})
    protocol = json.loads(PROTOCOL.read_text())
    figures = compare.run_seed(protocol, 13, tmp_path / "out")
    assert figures["protocol_digest"] == protocol_digest(protocol)
    assert figures["argv"][figures["argv"].index("--dataset") + 1] == "data/arithmetic-pool.jsonl"
    (tmp_path / "13.json").write_text(json.dumps(figures))
    compare.print_table([str(tmp_path / "13.json")])
    assert "| 13 | 0 | 1 -> 1 -> 1 | [1, 0, 0] | 1 | 1 | [2, 2, 2] ([2, 2, 2]) | 3, 3, 3 |" in capsys.readouterr().out
