"""The runner of the protocol rounds-pay-2026-12-06 (issue 56 item 5): every arm of one seed end to end on a tiny
random model and a tiny protocol of the same shape (the offline arm on the rounds' own calls, the controls at their
steps, a rerun that reuses what finished), and its table's refusals and paired tests, counted by hand."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import committed_table, protocol_digest
from conftest import load_benchmark as load

from dpo_min.rounds import arithmetic
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "benchmarks" / "protocols" / "rounds-pay-2026-12-06.json"
RESULTS = ROOT / "benchmarks" / "results" / "rounds-pay-2026-12-06"
SEED = 11  # the tiny protocol's: rounds_pay refills, every rounds arm trains in both rounds, at other steps


def parity(completions, solution, **_):
    """A reward a random model earns: right where the text's checksum is odd, on prompts with an odd solution; every
    sample of the others wrong (all wrong: no pair, so dynamic sampling draws further prompts)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(int(s) % 2 == 1 and zlib.crc32(t.encode()) % 2 == 1) for t, s in zip(texts, solution)]


def tiny_protocol(model_dir: Path) -> dict:
    """rounds-pay's shape at a tiny model's scale: 2 rounds; rounds_pay draws 2 prompts and refills up to 3 calls of 2
    prompts, rounds_plain draws that cap (6); every pair in groups, one constant learning rate; 9 held-out prompts."""
    return {"name": "tiny-pay", "rounds": 2, "seeds": [SEED],
            "options": ["--model", str(model_dir), "--use_peft", "--lora_r", "4", "--num_generations", "3",
                        "--max_completion_length", "4", "--temperature", "1.0", "--pair_rule", "every",
                        "--pairs_per_prompt", "4", "--group_by_prompt", "--padding_free", "--num_train_epochs", "1",
                        "--lr_scheduler_type", "constant", "--on_no_pairs", "skip", "--eval_fraction", "0.003",
                        "--generation_batch_size", "6", "--per_device_train_batch_size", "2", "--learning_rate",
                        "0.005", "--disable_tqdm", "true"],
            "arm_options": {"rounds_pay": ["--prompts_per_round", "2", "--dynamic_sampling", "--max_num_gen_batches",
                                           "3", "--skip_saturated", "1"],
                            "rounds_plain": ["--prompts_per_round", "6"]}}


@pytest.fixture(scope="module")
def pay_run(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("pay")
    protocol = tiny_protocol(tiny_model_dir)
    (folder / "tiny-pay.json").write_text(json.dumps(protocol))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPO_MIN_CACHE", str(folder / "cache"))
        patch.setattr(arithmetic, "last_integer_reward", parity)
        figures = load("compare_rounds_pay").run_seed(protocol, SEED, folder / "out")
    return figures, folder / "out", folder / "tiny-pay.json"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_offline_pay_samples_pi_0_on_exactly_rounds_pays_calls_round_by_round(pay_run):
    figures, out, _ = pay_run
    pay, offline = figures["arms"]["rounds_pay"], figures["arms"]["offline_pay"]
    assert sum(r["refills"] for r in pay["rounds"]) > 0  # dynamic sampling drew further prompts: set-aside ones too
    for k, line in enumerate(jsonl(out / "rounds_pay" / "rounds.jsonl"), start=1):
        ours = jsonl(out / "offline_pay" / f"round-{k}" / "samples.jsonl")
        theirs = jsonl(out / "rounds_pay" / f"round-{k}" / "samples.jsonl")
        assert [row["prompt_index"] for row in ours] == [row["prompt_index"] for row in theirs]
        assert len(ours) == len(theirs) == line["samples"] == offline["rounds"][k - 1]["completions"]
        assert offline["rounds"][k - 1]["gen_batches"] == line["draw"]["gen_batches"]
    # Round 1's policy is pi_0 in both: the recorded calls made again give its samples token for token.
    assert [row["completion_ids"] for row in jsonl(out / "offline_pay" / "round-1" / "samples.jsonl")] == \
        [row["completion_ids"] for row in jsonl(out / "rounds_pay" / "round-1" / "samples.jsonl")]
    assert offline["round_1_as_rounds_pay"] is True
    pairs = jsonl(out / "offline_pay" / "pairs.jsonl")
    assert len(pairs) == offline["pairs"] == sum(r["pairs"] for r in offline["rounds"]) > 0


def test_the_controls_take_exactly_rounds_pays_steps_round_by_round_and_in_all(pay_run):
    figures, out, _ = pay_run
    steps = figures["arms"]["rounds_pay"]["steps"]
    assert all(count > 0 for count in steps)
    matched = jsonl(out / "plain_matched" / "rounds.jsonl")
    assert [line["dpo"]["steps"] for line in matched] == steps == figures["arms"]["plain_matched"]["steps"]
    assert json.loads((out / "plain_matched" / "settings.json").read_text())["round_max_steps"] == steps
    assert figures["arms"]["offline_pay_matched"]["steps"] == sum(steps)
    # rounds_plain's own passes ran their epochs: another count, or the control would control nothing here.
    assert figures["arms"]["rounds_plain"]["steps"] != steps
    # The same pi_0 and held-out prompts in every arm, 9 of them.
    assert len(figures["held_rows"]) == 9 and all(len(o) == 9 for o in figures["outcomes"].values())


def test_the_seed_file_records_the_spend_per_round_and_the_table_reads_it(pay_run, tmp_path, capsys):
    figures, _, protocol_file = pay_run
    assert figures["protocol_digest"] == protocol_digest(json.loads(protocol_file.read_text()))
    for arm in ("rounds_pay", "rounds_plain", "plain_matched"):
        assert [set(r) for r in figures["arms"][arm]["rounds"]] == [set(load("compare_rounds_pay").SPEND)] * 2
    assert figures["arms"]["rounds_plain"]["rounds"][0]["prompts"] == 6  # its blind draw: the cap
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(figures))
    load("compare_rounds_pay").print_table([str(path)], str(protocol_file))
    printed = capsys.readouterr().out
    pay = figures["arms"]["rounds_pay"]["rounds"][0]
    assert f"| rounds_pay | 1 | {' | '.join(str(pay[key]) for key in load('compare_rounds_pay').SPEND)} |" in printed
    assert "primary verdict: " in printed and "| rounds_pay vs offline_pay |" in printed


def test_a_rerun_reuses_every_finished_arm(pay_run, monkeypatch):
    figures, out, protocol_file = pay_run
    compare = load("compare_rounds_pay")
    for name in ("rounds_arm", "one_pass", "task"):
        monkeypatch.setattr(compare, name, lambda *a, name=name: pytest.fail(f"{name} ran again"))
    assert compare.run_seed(json.loads(protocol_file.read_text()), SEED, out) == figures


# ---- the table, on hand-made seed files of the committed protocol --------------------------------------------------
def seed_figures(seed: int, outcomes: dict, steps=(2, 3, 4)) -> dict:
    """A seed file of rounds-pay-2026-12-06 as compare_rounds_pay writes it: its name, digest and arguments."""
    compare, seed_files = load("compare_rounds_pay"), load("seed_files")
    protocol = json.loads(PROTOCOL.read_text())
    rounds = [{"prompts": 16, "all_right": 1, "all_wrong": 5, "mixed": 10, "skipped": 0, "refills": 2,
               "gen_batches": 3, "pairs": 20, "steps": s, "completions": 144} for s in steps]
    arm = {"right": [], "changed": [], "steps": list(steps), "rounds": rounds, "seconds": 10}
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": seed_files.protocol_digest(protocol),
            "argv": {name: seed_files.recorded_argv(argv) for name, argv in compare.seed_argv(protocol, seed).items()},
            "held_rows": list(range(len(outcomes["pi_0"]))), "outcomes": outcomes,
            "arms": {"rounds_pay": arm, "rounds_plain": arm, "plain_matched": {**arm, "round_max_steps": list(steps)},
                     "offline_pay": {"rounds": [{**r, "skipped": None, "refills": None, "steps": None} for r in rounds],
                                     "pairs": 60, "steps": 45, "seconds": 5, "round_1_as_rounds_pay": True},
                     "offline_pay_matched": {"max_steps": sum(steps), "steps": sum(steps), "seconds": 4}}}


def seed_files(folder: Path, table: list[tuple]) -> list[str]:
    """One file per (seed, rounds_pay's outcomes, offline_pay's), the other arms as offline_pay, pi_0 all wrong."""
    folder.mkdir(exist_ok=True)
    paths = []
    for seed, pay, offline in table:
        outcomes = {"pi_0": [0] * len(pay), "rounds_pay": pay, "rounds_plain": offline, "offline_pay": offline,
                    "offline_pay_matched": offline, "plain_matched": offline}
        paths.append(str(folder / f"seed-{seed}.json"))
        Path(paths[-1]).write_text(json.dumps(seed_figures(seed, outcomes)))
    return paths


def test_the_tables_tests_are_the_hand_counted_ones_and_paired_pys(tmp_path, capsys):
    paired = load("paired")
    paths = seed_files(tmp_path, [(509, [1, 1, 0, 0], [1, 0, 0, 0]), (521, [1, 1, 1, 0], [0, 0, 1, 0]),
                                  (523, [1, 1, 0, 0], [1, 0, 0, 1])])
    load("compare_rounds_pay").print_table(paths)
    printed = capsys.readouterr().out
    # Right only in rounds_pay: 509's prompt 1, 521's 0 and 1, 523's 1 (4); only offline: 523's prompt 3 (1). Two-sided
    # exact: 2 (C(5,0) + C(5,1)) / 32 = 0.375. Seeds +1, +2, 0: of the 8 sign choices, |sum| >= 3 in 4: 0.5.
    assert paired.exact_mcnemar(4, 1) == 0.375 and paired.seed_permutation_test([1, 2, 0]) == 0.5
    assert "| rounds_pay vs offline_pay | 4 | 1 | 0.375 | 2 / 0 / 1 | 0.5 | 0.5 |" in printed
    assert "primary verdict: no gain claimed (McNemar p 0.375, sign-flip p 0.5, discordant prompts 4 for " \
           "rounds_pay, 1 for offline_pay); 3 of the protocol's 8 seeds run: the 5 left decide it\n" in printed
    assert printed.index("primary:") < printed.index("secondary:") < printed.index("| rounds_pay vs rounds_plain |")
    assert "| rounds_pay | 1 | 48 | 3 | 15 | 30 | 0 | 6 | 9 | 60 | 6 | 432 |" in printed  # 3 seeds' round 1
    assert "| offline_pay | 3 | 48 | 3 | 15 | 30 | - | - | 9 | 60 | - | 432 |" in printed
    # 3 rounds x 144 completions x 3 seeds against 7 prompts gained over pi_0: 1296 / 7.
    assert "| rounds_pay | 1296 | 7 | 185.1 | 10 |" in printed
    assert "one pass: offline_pay 135 steps, offline_pay_matched 27 steps (on offline_pay's pairs); offline_pay's " \
           "round 1 is rounds_pay's, token for token (both pi_0's), in 3 of 3 seed(s)" in printed


def test_the_verdict_claims_a_gain_only_when_both_tests_are_under_005_and_says_what_the_seeds_left_can(
        tmp_path, capsys):
    # 6 seeds, each one prompt right only in rounds_pay: McNemar 2 / 2**6 = 0.03125, sign-flip 2 / 64 alike.
    seeds = json.loads(PROTOCOL.read_text())["seeds"][:6]
    load("compare_rounds_pay").print_table(seed_files(tmp_path, [(s, [1, 0], [0, 0]) for s in seeds]))
    assert "primary verdict: a gain of rounds_pay (McNemar p 0.0312, sign-flip p 0.0312, discordant prompts 6 " \
           "for rounds_pay, 0 for offline_pay); 6 of the protocol's 8 seeds run: the 2 left decide it\n" \
           in capsys.readouterr().out
    paired = load("paired")
    # Three seeds behind: flipping any of them only raises the sum, so 8 sign choices and their 8 negations reach it
    # whatever the 5 left show; 5 large distinct positive differences reach the floor, bounded ones stay above it.
    assert paired.sign_flip_floor([-3, -9, -4], 8) == 16 / 256
    assert paired.seed_permutation_test([-3, -9, -4, 10**3, 2 * 10**3, 4 * 10**3, 8 * 10**3, 16 * 10**3]) == 16 / 256
    assert paired.seed_permutation_test([-3, -9, -4, 64, 64, 64, 64, 64]) >= 16 / 256
    assert paired.sign_flip_floor([1, 2, 0], 8) == 4 / 256  # a level seed counts as not ahead: both signs tie
    seeds = json.loads(PROTOCOL.read_text())["seeds"]
    load("compare_rounds_pay").print_table(seed_files(tmp_path / "behind", [(s, [0, 0], [1, 0]) for s in seeds[:3]]))
    assert "primary verdict: no gain claimed (McNemar p 0.25, sign-flip p 0.25, discordant prompts 0 for " \
           "rounds_pay, 3 for offline_pay); 3 of the protocol's 8 seeds run, and no outcome of the 5 left gives a " \
           "gain: with 3 seed(s) not ahead, the sign-flip p over 8 seeds is at least 16/256 = 0.0625\n" \
           in capsys.readouterr().out
    load("compare_rounds_pay").print_table(seed_files(tmp_path / "all", [(s, [0, 0], [1, 0]) for s in seeds]))
    assert "for offline_pay)\n" in capsys.readouterr().out  # all 8 run: the verdict alone


def test_the_table_refuses_a_file_of_another_protocol_or_an_unmatched_control_in_one_line(tmp_path, capsys):
    (path,) = seed_files(tmp_path, [(509, [1, 0], [0, 0])])
    other = {**json.loads(Path(path).read_text()), "protocol": "rounds-2026-12-05"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_rounds_pay.py"), "--table",
                          str(tmp_path / "other.json"), "--protocol", str(PROTOCOL)],
                         capture_output=True, text=True, cwd=ROOT)
    assert (run.returncode, run.stdout, run.stderr) == (1, "", f"--table: {tmp_path / 'other.json'}: it ran under "
                                                        f"protocol rounds-2026-12-05, not {PROTOCOL}'s "
                                                        "rounds-pay-2026-12-06\n")
    figures = json.loads(Path(path).read_text())
    figures["arms"]["plain_matched"]["round_max_steps"] = [2, 3, 5]
    Path(path).write_text(json.dumps(figures))
    with pytest.raises(SystemExit) as refused:
        load("compare_rounds_pay").print_table([path])
    assert str(refused.value) == ("--table: seed 509: plain_matched ran at [2, 3, 5] steps a round, rounds_pay took "
                                  "[2, 3, 4]: not the protocol's control") and capsys.readouterr().out == ""


def test_the_protocols_arms_are_options_the_command_takes_and_an_unlisted_seed_is_refused(tmp_path):
    compare = load("compare_rounds_pay")
    protocol = json.loads(PROTOCOL.read_text())
    argvs = compare.seed_argv(protocol, protocol["seeds"][0], tmp_path)
    pay, plain = (rounds_config(resolve(argvs[arm]), None) for arm in ("rounds_pay", "rounds_plain"))
    assert (pay.dynamic_sampling, pay.max_num_gen_batches, pay.skip_saturated) == (True, 4, 1)
    assert pay.prompts_per_round == 16
    assert (plain.dynamic_sampling, plain.skip_saturated, plain.prompts_per_round) == (False, 0, 32)
    assert pay.training == plain.training and pay.training["group_by_prompt"] and pay.pair_rule == "every"
    matched = rounds_config(resolve(compare.matched_argv(argvs["rounds_plain"], [12, 9, 24], tmp_path)), None)
    assert matched.round_max_steps == [12, 9, 24] and {**vars(matched), "round_max_steps": None,
                                                        "output_dir": None} == {**vars(plain), "output_dir": None}
    with pytest.raises(SystemExit, match="not one of the protocol's"):
        compare.run_seed(protocol, 42, tmp_path)


def test_the_committed_seed_files_pass_the_tables_checks_and_print_the_table_docs_rounds_quotes(capsys):
    """The seeds run so far, each run under the committed protocol (its digest, the command's arguments, the controls
    at rounds_pay's steps): the table over them is the one docs/rounds.md quotes, line for line, whatever it shows."""
    printed = committed_table("compare_rounds_pay", PROTOCOL, RESULTS, capsys, every_seed=False)
    doc = (ROOT / "docs" / "rounds.md").read_text().splitlines()
    start = doc.index(printed[0])
    assert doc[start:start + len(printed)] == printed and printed[0].startswith("protocol rounds-pay-2026-12-06, ")
