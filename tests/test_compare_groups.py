"""The groups protocol (issue 51, item 6): fixed before its seeds run, on new seeds, with options the command takes;
its table's paired tests at the prompt and the seed level, counted by hand."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import committed_table, protocol_digest
from conftest import load_benchmark as load

from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "benchmarks" / "protocols" / "groups-2026-12-05.json"
RESULTS = ROOT / "benchmarks" / "results" / "groups-2026-12-05"


def seed_figures(seed: int, outcomes: dict, pairs=(3, 9), steps=(3, 9)) -> dict:
    """A seed file of the groups protocol as compare_groups writes it: its name, digest and arguments."""
    compare, seed_files = load("compare_groups"), load("seed_files")
    protocol = json.loads(PROTOCOL.read_text())
    argv = {arm: seed_files.recorded_argv(argv) for arm, argv in compare.seed_argv(protocol, seed).items()}
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": seed_files.protocol_digest(protocol),
            "argv": argv, "held_rows": list(range(len(outcomes["pi_0"]))), "outcomes": outcomes,
            "arms": {arm: {"pairs": p, "steps": s} for arm, p, s in zip(("best_vs_worst", "every_pair_groups"),
                                                                        pairs, steps)}}


def run_table(*paths) -> subprocess.CompletedProcess:
    """The command's --table (these refusals come before anything imports transformers: a fraction of a second)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_groups.py"), "--table", *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT)


def table_refusal(capsys, *paths) -> str:
    """print_table's one-line refusal of `paths`, checked to come before any line of the table."""
    with pytest.raises(SystemExit) as refused:
        load("compare_groups").print_table([str(path) for path in paths])
    assert capsys.readouterr().out == ""
    return str(refused.value)



def test_the_protocol_takes_seeds_no_earlier_run_used_and_arms_the_command_accepts(tmp_path):
    protocol = json.loads(PROTOCOL.read_text())
    earlier = {42, 7, 1, 3, 11} | set(json.loads((PROTOCOL.parent / "rounds-2026-12-05.json").read_text())["seeds"])
    assert len(set(protocol["seeds"])) == len(protocol["seeds"]) == 8 and not set(protocol["seeds"]) & earlier
    compare = load("compare_groups")
    configs = {}
    for arm, options in protocol["arm_options"].items():
        argv = ["--rounds", "1", "--seed", str(protocol["seeds"][0]), *compare.demo_options(), *compare.POOL_OPTIONS,
                *protocol["options"], *options, "--output_dir", str(tmp_path / arm)]
        configs[arm] = rounds_config(resolve(argv), None)
    best, groups = configs["best_vs_worst"], configs["every_pair_groups"]
    assert (best.pair_rule, best.pairs_per_prompt, best.training.get("group_by_prompt", False)) == ("best", 1, False)
    assert (groups.pair_rule, groups.pairs_per_prompt, groups.training["group_by_prompt"]) == ("every", 16, True)
    # Everything but the pair rule and the layout is the same: the same draw and samples, the same training.
    assert best.prompts_per_round == groups.prompts_per_round == 32 and best.num_generations == 8
    same = {key for key in best.training if key not in ("group_by_prompt", "padding_free", "output_dir")}
    assert {key: best.training[key] for key in same} == {key: groups.training[key] for key in same}
    assert best.training["lr_scheduler_type"] == "constant" and best.training["loss_type"] == ["sigmoid", "sft"]


def test_a_seed_the_protocol_does_not_list_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not one of the protocol's"):
        load("compare_groups").run_seed(json.loads(PROTOCOL.read_text()), 42, tmp_path)


def one_round(argv, ids):
    """An arm's one round as arm_figures reads it, its sample `ids` written where the arm's folder is."""
    folder = Path(argv[argv.index("--output_dir") + 1])
    (folder / "round-1").mkdir(parents=True)
    (folder / "round-1" / "generated.jsonl").write_text(json.dumps({"prompt_index": 0, "completion_ids": ids}))
    held = [{"round": r, "per_prompt": [[0, 1.0], [1, 0.0]]} for r in (0, 1)]
    rounds = [{"pairs": 1, "dpo": {"steps": 1}, "saturated": 0}]
    return {"plan": None, "config": None, "result": SimpleNamespace(held_out=held, rounds=rounds), "seconds": 1.0}


def test_arms_that_did_not_sample_the_same_completions_are_refused(tmp_path, monkeypatch):
    compare = load("compare_groups")
    # the second arm sampled other ids
    monkeypatch.setattr(compare, "rounds_arm", lambda argv: one_round(argv, [5] if "every" in argv else [6]))
    protocol = json.loads(PROTOCOL.read_text())
    with pytest.raises(SystemExit, match="every_pair_groups's samples differ from the first arm's"):
        compare.run_seed(protocol, protocol["seeds"][0], tmp_path)


def test_a_seed_file_records_the_digest_and_a_relative_dataset_and_the_table_reads_it(tmp_path, monkeypatch, capsys):
    """What run_seed writes (the arms faked) is what --table checks: the protocol's digest, arguments whose
    --dataset is relative to the repository (it was this machine's absolute path) and whose --output_dir is where
    the seed ran."""
    compare = load("compare_groups")
    monkeypatch.setattr(compare, "rounds_arm", lambda argv: one_round(argv, [5]))
    protocol = json.loads(PROTOCOL.read_text())
    figures = compare.run_seed(protocol, 47, tmp_path / "out")
    assert figures["protocol_digest"] == protocol_digest(protocol)
    for arm, argv in figures["argv"].items():
        assert argv[argv.index("--dataset") + 1] == "data/arithmetic-pool.jsonl"
        assert argv[argv.index("--output_dir") + 1] == str(tmp_path / "out" / arm)
    (tmp_path / "47.json").write_text(json.dumps(figures))
    compare.print_table([str(tmp_path / "47.json")])
    assert "| 47 | 1 | 1 | 1 | 1, 1 | 1, 1 |" in capsys.readouterr().out


def test_the_table_gives_the_pooled_counts_and_the_paired_tests_at_both_levels(tmp_path, capsys):
    compare = load("compare_groups")
    files = []
    for seed, best, groups in ((47, [1, 0, 0, 0], [1, 1, 0, 0]), (53, [0, 0, 1, 0], [1, 1, 1, 0]),
                               (59, [1, 1, 0, 0], [1, 0, 0, 0])):
        figures = seed_figures(seed, {"pi_0": [0, 0, 0, 0], "best_vs_worst": best, "every_pair_groups": groups})
        files.append(str(tmp_path / f"{seed}.json"))
        Path(files[-1]).write_text(json.dumps(figures))
    compare.print_table(files)
    printed = capsys.readouterr().out
    assert "| 47 | 0 | 1 | 2 | 3, 9 | 3, 9 |" in printed
    assert "| every_pair_groups | 6/12 = 0.500" in printed
    # Right only in groups: seed 47 prompt 1, seed 53 prompts 0 and 1 (3); only in best: seed 59 prompt 1 (1).
    # Seed differences +1, +2, -1: sign choices reaching |2|: (+1 +2 -1)=2, (-1 -2 +1)=-2, (+1 +2 +1)=4, (-1 -2 -1)=-4,
    # (-1 +2 +1)=2, (+1 -2 -1)=-2, and not (+1 -2 +1)=0, (-1 +2 -1)=0: 6 of 8.
    assert "| every_pair_groups vs best_vs_worst | 3 | 1 | 0.625 | 2 / 1 / 0 | 1 | 0.75 |" in printed
    with pytest.raises(SystemExit, match="seed 47 is given twice"):
        compare.print_table([files[0], files[0]])


def test_the_committed_seed_files_carry_the_protocols_digest_and_print_the_table_docs_groups_quotes(capsys):
    """Migrated once (issue 54 item 6): the digest of the protocol they ran under, --dataset relative to the
    repository; the table over them is the one docs/groups.md quotes, line for line."""
    printed = committed_table("compare_groups", PROTOCOL, RESULTS, capsys)
    doc = (ROOT / "docs" / "groups.md").read_text().splitlines()
    start = doc.index("protocol groups-2026-12-05, 8 seed(s)")
    assert doc[start:start + len(printed)] == printed and len(printed) == 24  # every line, the tests included


def test_a_seed_file_not_run_under_the_protocol_is_refused_in_one_line_and_no_table_printed(tmp_path, capsys):
    """A file run under an edited protocol (3 epochs made 1, --group_by_prompt dropped), a seed the protocol does not
    list, a digest of another protocol: the table over them was printed, their outcomes pooled with the rest."""
    committed = json.loads((RESULTS / "seed-47.json").read_text())
    edited = json.loads(json.dumps(committed))
    groups = edited["argv"]["every_pair_groups"]
    groups.remove("--group_by_prompt")
    groups[len(groups) - 1 - groups[::-1].index("--num_train_epochs") + 1] = "1"
    unlisted = {**committed, "seed": 42,
                "argv": {arm: [*argv[:3], "42", *argv[4:]] for arm, argv in committed["argv"].items()}}
    other_digest = {**committed, "protocol_digest": "0" * 64}
    expected = {
        "edited": "its arguments (arm every_pair_groups) differ from the protocol's: '--num_train_epochs 3' is "
                  "'--num_train_epochs 1' here; '--group_by_prompt' is missing",
        "unlisted": "seed 42 is not one of the protocol's [47, 53, 59, 61, 67, 71, 73, 79]: a protocol's seeds are "
                    "fixed",
        "other_digest": f"its protocol digest 000000000000 is not benchmarks/protocols/groups-2026-12-05.json's "
                        f"({protocol_digest(json.loads(PROTOCOL.read_text()))[:12]}): it ran under another version "
                        "of the "
                        "protocol"}
    for name, figures in (("edited", edited), ("unlisted", unlisted), ("other_digest", other_digest)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(figures))
        assert table_refusal(capsys, RESULTS / "seed-53.json", path) == f"--table: {path}: {expected[name]}"


def test_a_missing_truncated_or_armless_seed_file_is_one_line_not_a_traceback(tmp_path):
    committed = (RESULTS / "seed-47.json").read_text()
    armless = json.loads(committed)
    del armless["outcomes"]["every_pair_groups"]
    (tmp_path / "armless.json").write_text(json.dumps(armless))
    (tmp_path / "truncated.json").write_text(committed[:1500])
    expected = {"missing": "the seed file cannot be read (No such file or directory)",
                "truncated": "the seed file is not whole JSON (cut short?): Expecting value: line 74 column 4 "
                             "(char 1500)",
                "armless": "field 'outcomes.every_pair_groups' is missing"}
    for name, line in expected.items():
        run = run_table(tmp_path / f"{name}.json", RESULTS / "seed-53.json")
        assert (run.returncode, run.stdout, run.stderr) == (1, "", f"--table: {tmp_path / name}.json: {line}\n")
