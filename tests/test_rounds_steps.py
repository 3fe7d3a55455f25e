"""Each round's DPO pass for a given number of optimizer steps (`round_max_steps`, `--round_max_steps`; issue 56 item
5): the control at equal steps of the protocol rounds-pay-2026-12-06 runs one rounds arm for as many steps a round
as another took, its pairs cycled over more epochs or cut within the first."""

import json

import pytest
from conftest import _one_line_error
from test_rounds import PROMPTS, letters, settings, tiny_policy

from dpo_min.rounds import RoundsConfig, RoundsError, run_rounds
from dpo_min.rounds.store import RoundFiles
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import rounds_config


def test_each_round_trains_exactly_its_count_of_steps_its_pairs_cycled_or_cut(tmp_path, tokenizer):
    # 3 training prompts give at most 3 pairs a round: 2 batches of 2 an epoch. 5 steps cycle them over 3 epochs;
    # 1 step cuts the first epoch short.
    config = settings(tmp_path, round_max_steps=[5, 1], training={"num_train_epochs": 1})
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config)
    assert [line["dpo"]["steps"] for line in result.rounds] == [5, 1]
    assert [json.loads(line)["dpo"]["steps"] for line in
            (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()] == [5, 1]
    for line, steps in zip(result.rounds, (5, 1)):
        train = tmp_path / "run" / f"round-{line['round']}" / "train"
        state = json.loads((train / f"checkpoint-{steps}" / "trainer_state.json").read_text())
        batches = -(-line["pairs"] // 2)
        assert state["global_step"] == state["max_steps"] == steps
        assert state["epoch"] == pytest.approx(steps / batches)  # 5 steps of 2 batches an epoch: 2.5 epochs
        assert not (train / f"checkpoint-{steps + 1}").exists()
    assert result.rounds[0]["pairs"] <= 3 < 5 * 2  # round 1 saw its pairs more than once: cycled
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["round_max_steps"] == [5, 1]


def test_a_round_given_no_step_writes_its_pairs_and_trains_none(tmp_path, tokenizer, capsys):
    """The control at equal steps of a round that had no pair: round_max_steps 0 for it. The count was refused
    (>= 1), so a protocol seed with such a round had no control and could not be reported."""
    config = settings(tmp_path, round_max_steps=[2, 0], training={"num_train_epochs": 1})
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config)
    first, second = result.rounds
    assert first["dpo"]["steps"] == 2 and second["status"] == "no step: round_max_steps 0" and "dpo" not in second
    assert second["pairs"] > 0 and (tmp_path / "run" / "round-2" / "pairs.jsonl").read_text().count("\n") == \
        second["pairs"]
    assert not (tmp_path / "run" / "round-2" / "train").exists()
    assert "no step (round_max_steps 0), round skipped" in capsys.readouterr().out
    again = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config)  # finished: read back, not rerun
    assert [line["status"] for line in again.rounds] == ["trained", "no step: round_max_steps 0"]


@pytest.mark.parametrize(("steps", "message"), [
    ([4], "round_max_steps has 1 values for 2 rounds: give one per round"),
    ([4, -1], "round_max_steps must be whole numbers >= 0 (a round's optimizer steps), got [4, -1]"),
], ids=["count", "negative"])
def test_a_step_count_per_round_that_cannot_work_is_refused_in_one_line(tmp_path, capsys, monkeypatch, steps,
                                                                       message):
    with pytest.raises(RoundsError) as error:
        RoundsConfig(str(tmp_path), rounds=2, round_max_steps=steps)
    assert str(error.value) == message
    argv = ["--rounds", "2", "--round_max_steps", *map(str, steps)]
    assert _one_line_error(argv, tmp_path, capsys, monkeypatch) == f"python -m dpo_min.train: error: --{message}"


def test_the_command_passes_round_max_steps_and_a_resume_may_only_extend_it(tmp_path):
    plan = resolve(["--rounds", "3", "--round_max_steps", "12", "9", "24", "--output_dir", str(tmp_path / "out")])
    config = rounds_config(plan, None)
    assert config.round_max_steps == [12, 9, 24] and config.settings()["round_max_steps"] == [12, 9, 24]
    assert config.round_training(2) == {**config.training, "max_steps": 9}
    assert "round_max_steps" not in RoundsConfig("out").settings()  # a run from before the option resumes
    with pytest.raises(RoundsError, match="round_max_steps sets each round's max_steps: drop max_steps"):
        RoundsConfig("out", rounds=1, round_max_steps=[3], training={"max_steps": 3})
    files = RoundFiles(tmp_path / "run")
    assert files.claim({"round_max_steps": [12, 9]}) is False
    assert files.claim({"round_max_steps": [12, 9, 24]}) is True  # a resume that adds a round
    with pytest.raises(RoundsError, match=r"round_max_steps"):
        files.claim({"round_max_steps": [12, 8, 24]})  # a finished round's count changed
