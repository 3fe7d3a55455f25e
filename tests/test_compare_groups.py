"""The groups protocol (issue 51, item 6): fixed before its seeds run, on new seeds, with options the command takes;
its table's paired tests at the prompt and the seed level, counted by hand."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_benchmark as load

from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "benchmarks" / "protocols" / "groups-2026-12-05.json"



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


def test_arms_that_did_not_sample_the_same_completions_are_refused(tmp_path, monkeypatch):
    compare = load("compare_groups")

    def fake_arm(argv):  # each arm's one round, as arm_figures reads it; the second arm sampled other ids
        folder = Path(argv[argv.index("--output_dir") + 1])
        (folder / "round-1").mkdir(parents=True)
        ids = [5] if "every" in argv else [6]
        (folder / "round-1" / "generated.jsonl").write_text(json.dumps({"prompt_index": 0, "completion_ids": ids}))
        held = [{"round": r, "per_prompt": [[0, 1.0], [1, 0.0]]} for r in (0, 1)]
        rounds = [{"pairs": 1, "dpo": {"steps": 1}, "saturated": 0}]
        return {"plan": None, "config": None, "result": SimpleNamespace(held_out=held, rounds=rounds),
                "seconds": 1.0}

    monkeypatch.setattr(compare, "rounds_arm", fake_arm)
    protocol = json.loads(PROTOCOL.read_text())
    with pytest.raises(SystemExit, match="every_pair_groups's samples differ from the first arm's"):
        compare.run_seed(protocol, protocol["seeds"][0], tmp_path)


def test_the_table_gives_the_pooled_counts_and_the_paired_tests_at_both_levels(tmp_path, capsys):
    compare = load("compare_groups")
    files = []
    for seed, best, groups in ((47, [1, 0, 0, 0], [1, 1, 0, 0]), (53, [0, 0, 1, 0], [1, 1, 1, 0]),
                               (59, [1, 1, 0, 0], [1, 0, 0, 0])):
        figures = {"seed": seed, "protocol": "p", "outcomes": {"pi_0": [0, 0, 0, 0], "best_vs_worst": best,
                                                               "every_pair_groups": groups},
                   "arms": {"best_vs_worst": {"pairs": 3, "steps": 3}, "every_pair_groups": {"pairs": 9, "steps": 9}}}
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
