"""Completions during training, as TRL's LogCompletionsCallback: samples.jsonl and a TensorBoard table."""

import json
import math
import re
import statistics

import pytest
import torch
from conftest import write_hh_rows
from peft import PeftModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import held_out_pairs, sequence_logp, tiny_run_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpo_min.config import DPOMinConfig
from dpo_min.intervals import mean_interval
from dpo_min.rounds.held_out import mean_with_interval
from dpo_min.split import held_out_split
from dpo_min.tokenizing import tokenize_dataset
from dpo_min.train import main
from dpo_min.train.report import (
    describe_change,
    describe_held_out,
    describe_plan,
    describe_ties,
    plot_training,
    smoothed,
    tie_figures,
)


def test_each_evaluation_logs_scalars_and_completions_to_tensorboard(tmp_path, tiny_model_dir):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "run"
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
                 "--eval_fraction", "0.25", "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--eval_strategy", "steps", "--eval_steps", "1", "--learning_rate", "5e-3", "--num_samples", "2",
                 "--max_new_tokens", "3", "--logging_steps", "1", "--report_to", "tensorboard",
                 "--disable_tqdm", "true", "--eval_on_start", "true"])
    assert code == 0
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    # Evaluations at steps 0 (eval_on_start), 1 and 2 (eval_strategy); the one at the last step is the "after" figure,
    # not followed by a second evaluation of the same weights.
    assert [s["step"] for s in samples] == [0, 0, 1, 1, 2, 2]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert [s["prompt"] for s in samples[-2:]] == [s["prompt"] for s in samples[:2]] and metrics["after"]

    [logs] = (output_dir / "runs").iterdir()  # transformers' default folder, inside the output folder
    events = EventAccumulator(str(logs), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    accuracy = events.Scalars("eval/rewards/accuracies")
    assert sorted({e.step for e in accuracy}) == [0, 1, 2]
    assert accuracy[-1].value == metrics["after"]["eval_rewards/accuracies"]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/completions/text_summary")}
    assert sorted(tables) == [0, 1, 2]
    for sample in samples[-2:]:  # the last table holds the final completions
        assert f"| {sample['policy']} |" in tables[2] or sample["policy"] == ""


# ---- what the command prints about the held-out pairs (issue 21) ------------------------------------------------
def test_mean_interval_matches_hand_computed_values():
    # [1, 2, 3, 4]: mean 2.5, sample sd sqrt(5/3) = 1.290994, standard error 0.645497, x 1.959964 = 1.265151.
    assert mean_interval([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 1.234849, 3.765151), abs=1e-6)
    assert mean_interval([0.7]) == (0.7, 0.7, 0.7)  # one pair: no spread to estimate


def test_the_rounds_held_out_interval_is_the_commands_interval_checked_against_statistics():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    half = 1.959964 * statistics.stdev(rewards) / math.sqrt(len(rewards))  # the sample sd, computed apart
    line = mean_with_interval(rewards)
    assert (line["mean"], line["low"], line["high"]) == pytest.approx(
        (statistics.mean(rewards), statistics.mean(rewards) - half, statistics.mean(rewards) + half), abs=1e-12)
    assert line["n"] == 6 and (line["low"], line["high"]) == mean_interval(rewards)[1:]
    assert mean_with_interval([1.0]) == {"mean": 1.0, "low": None, "high": None, "n": 1}
    assert mean_with_interval([]) == {"mean": None, "low": None, "high": None, "n": 0}


def test_held_out_summary_gives_the_count_the_wilson_interval_and_the_margin_interval():
    # 3 of 4 pairs won. Wilson by hand: centre (0.75 + 1.9208/4) / (1 + 3.8415/4) = 0.62753, half-width
    # 1.96 * sqrt(0.75 * 0.25 / 4 + 3.8415 / 64) / 1.96037 = 0.32689 -> [0.3006, 0.9544].
    # Margins [0.5, -0.1, 0.2, 0.4]: mean 0.25, sd 0.264575, standard error 0.132288, x 1.959964 -> +-0.259280.
    text = describe_held_out({"eval_loss": 0.61, "eval_drift/chosen": 0.01, "eval_drift/rejected": -0.02},
                             [0.5, -0.1, 0.2, 0.4])
    assert "reward accuracy 3/4 = 0.750, 95% interval [0.301, 0.954] (Wilson): it contains chance (0.5)" in text
    assert "mean margin +0.2500, 95% interval [-0.0093, +0.5093] over the 4 pairs" in text
    assert "loss 0.6100, drift chosen +0.0100, drift rejected -0.0200 nats per token" in text
    # 60 of 64: centre 0.967511 / 1.060023 = 0.912726, half-width 1.959964 * 0.033912 / 1.060023 = 0.062703.
    assert "60/64 = 0.938, 95% interval [0.850, 0.975] (Wilson): chance (0.5) is outside it" in describe_held_out(
        {}, [1.0] * 60 + [-1.0] * 4)


def test_ties_are_stated_not_measured_and_their_loss_only_where_it_is_ln_2():
    assert describe_ties(64, "sigmoid").startswith("held-out before training: all 64 pairs are ties by definition")
    assert "reward accuracy 0/64, mean margin 0, loss ln 2 = 0.6931" in describe_ties(64, ["sigmoid"])
    assert "loss" not in describe_ties(64, "ipo").split("0/64")[1].split(";")[0]  # ipo's tie loss is not ln 2
    assert tie_figures("sigmoid")["eval_loss"] == pytest.approx(math.log(2))
    assert "eval_loss" not in tie_figures("hinge") and tie_figures("hinge")["eval_rewards/accuracies"] == 0.0


def test_demo_printout_on_a_tiny_model(tmp_path, tiny_model_dir, capsys):
    """Without a step-0 pass the run states the ties; after training it prints the per-pair figures and, beside each
    completion, the pair's log-prob margin under reference and policy: all checked against a pair-by-pair recount."""
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "run"
    assert main(tiny_run_args(tiny_model_dir, data_file, output_dir, "--eval_on_start", "false")) == 0
    out = capsys.readouterr().out
    assert f"model {tiny_model_dir} | 6 train pairs, 3 held-out" in out
    assert "held-out before training: all 3 pairs are ties by definition" in out
    # The final figures are said once, in the closing block: no progress line for the last evaluation, and no
    # before -> after line repeating them against the stated ties.
    assert out.count("reward accuracy") == 2 and "held-out at step" not in out and "before -> after" not in out
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "eval_loss" in entry] == [3]  # no pass at step 0
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["before"] == pytest.approx(tie_figures("sigmoid")) and metrics["before"]["eval_loss"] > 0.69

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), output_dir)
    library = DPOMinConfig(output_dir="unused")  # a run given --model keeps the library's truncation
    pairs = tokenize_dataset(held_out_pairs(output_dir, data_file), tokenizer, library.max_length,
                             library.max_prompt_length)
    with torch.no_grad():
        logp_margins = {name: [(sequence_logp(model, p["prompt_ids"], p["chosen_ids"])
                                - sequence_logp(model, p["prompt_ids"], p["rejected_ids"])).item() for p in pairs]
                        for name, model in (("reference", reference), ("policy", policy))}
    margins = [0.1 * (new - old) for old, new in zip(logp_margins["reference"], logp_margins["policy"])]
    assert any(margins)  # the run moved the policy
    assert describe_held_out(metrics["after"], margins).splitlines()[:2] == [
        line for line in out.splitlines() if line.startswith(("held-out after", "  reward accuracy"))]
    mean, low, high = mean_interval(margins)
    printed = re.search(r"mean margin ([+-][\d.]+), 95% interval \[([+-][\d.]+), ([+-][\d.]+)\]", out).groups()
    assert [float(value) for value in printed] == pytest.approx([mean, low, high], abs=5e-5 + 1e-5)
    shown = re.findall(r"log p\(chosen\) - log p\(rejected\): reference ([+-][\d.]+), policy ([+-][\d.]+)", out)
    assert len(shown) == 3
    for (old, new), expected_old, expected_new in zip(shown, logp_margins["reference"], logp_margins["policy"]):
        assert (float(old), float(new)) == pytest.approx((expected_old, expected_new), abs=5e-3 + 1e-4)


@pytest.mark.parametrize("num_samples", [2, 3])
def test_the_samples_shown_are_the_kept_held_out_pairs_each_beside_its_own_margin(tmp_path, tiny_model_dir, capsys,
                                                                                 num_samples):
    """--max_length drops the held-out pairs whose prompt fills it: the samples shown are the kept pairs' prompts,
    each beside its own pair's margins. They were the split's first prompts, a dropped one beside another pair's
    margin, and an IndexError where fewer pairs than --num_samples were kept."""
    _, held = held_out_split(16, 0.25, 42)  # the command's split of 16 pairs: 4 held out, in this order
    long = {held[0], held[2]}
    rows = [{"prompt": "Tell me a long story about the sea. " * 40 if i in long else f"What is {i} plus {i}?",
             "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."} for i in range(16)]
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = tiny_run_args(tiny_model_dir, data_file, tmp_path / "run", "--max_length", "64", "--max_eval_samples",
                         "4", "--seed", "42", "--eval_on_start", "false")
    args[args.index("--num_samples") + 1] = str(num_samples)
    assert main(args) == 0
    out = capsys.readouterr().out
    kept = [rows[held[1]], rows[held[3]]]  # both others' prompts fill max_length
    assert [line.removeprefix("prompt:    ") for line in out.splitlines() if line.startswith("prompt:    ")] == [
        row["prompt"] for row in kept]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "run")
    with torch.no_grad():
        expected = [(sequence_logp(model, p["prompt_ids"], p["chosen_ids"])
                     - sequence_logp(model, p["prompt_ids"], p["rejected_ids"])).item()
                    for p in tokenize_dataset(kept, tokenizer, 64) for model in (reference, policy)]
    shown = re.findall(r"log p\(chosen\) - log p\(rejected\): reference ([+-][\d.]+), policy ([+-][\d.]+)", out)
    assert [float(value) for pair in shown for value in pair] == pytest.approx(expected, abs=5e-3 + 1e-4)
    assert out.count("dropped 2 of 4 pairs") == 1  # said once, when the trainer tokenized them


@pytest.mark.parametrize("cut", [False, True])
def test_the_samples_shown_are_of_distinct_prompts_each_beside_its_own_pairs_margin(tmp_path, tiny_model_dir, capsys,
                                                                                    cut):
    """Two held-out pairs of one prompt (as --group_by_prompt holds out every pair of a prompt together): the samples
    were the first pairs, so that prompt's one greedy completion was shown twice and a third prompt not at all. With
    a pair cut by --max_length, each prompt shown stays beside its own pair's margins."""
    _, held = held_out_split(16, 0.25, 42)
    rows = [{"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."}
            for i in range(16)]
    rows[held[1]]["prompt"] = rows[held[0]]["prompt"]
    if cut:
        rows[held[2]]["prompt"] = "Tell me a long story about the sea. " * 40
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = tiny_run_args(tiny_model_dir, data_file, tmp_path / "run", "--max_length", "64", "--max_eval_samples",
                         "4", "--seed", "42", "--eval_on_start", "false", "--max_steps", "1")
    assert main(args) == 0
    out = capsys.readouterr().out
    shown_rows = [rows[held[0]], rows[held[3]]] if cut else [rows[held[0]], rows[held[2]], rows[held[3]]]
    assert [line.removeprefix("prompt:    ") for line in out.splitlines() if line.startswith("prompt:    ")] == [
        row["prompt"] for row in shown_rows]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = [(sequence_logp(reference, p["prompt_ids"], p["chosen_ids"])
                     - sequence_logp(reference, p["prompt_ids"], p["rejected_ids"])).item()
                    for p in tokenize_dataset(shown_rows, tokenizer, 64)]
    shown = re.findall(r"log p\(chosen\) - log p\(rejected\): reference ([+-][\d.]+)", out)
    assert [float(value) for value in shown] == pytest.approx(expected, abs=5e-3 + 1e-4)


def test_no_samples_asked_tokenizes_no_held_out_row_and_the_run_trains(tmp_path, tiny_model_dir, capsys):
    """--num_samples 0 with the held-out split's first rows cut by --max_length: finding the sampled rows tokenized
    those rows alone and died on "no pair left" (a traceback), though most pairs fit and no sample was asked."""
    _, held = held_out_split(16, 0.25, 42)
    long = {held[0], held[1]}  # the first rows of the split, as many as truncation drops
    rows = [{"prompt": "Tell me a long story about the sea. " * 40 if i in long else f"What is {i} plus {i}?",
             "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."} for i in range(16)]
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = tiny_run_args(tiny_model_dir, data_file, tmp_path / "run", "--max_length", "64", "--max_eval_samples",
                         "4", "--seed", "42", "--eval_on_start", "false", "--max_steps", "1")
    args[args.index("--num_samples") + 1] = "0"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train pairs, 2 held-out" in out and "greedy completions" not in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["held_out_pairs"] == 2 and metrics["train"]["epoch"] > 0
    assert not (tmp_path / "run" / "samples.jsonl").exists() or not (tmp_path / "run" / "samples.jsonl").read_text()


@pytest.mark.parametrize("conversational", [True, False])
def test_greedy_completions_in_one_batch_equal_those_of_one_prompt_at_a_time(tokenizer, conversational):
    """The prompts are generated together, left-padded; each must get the text it gets alone."""
    from conftest import tiny_llama

    from dpo_min.train.report import greedy_completions

    model = tiny_llama(seed=3)
    texts = ["Hi", "How do I bake bread at home without yeast?", "Name a colour."]
    prompts = [[{"role": "user", "content": text}] for text in texts] if conversational else texts
    padding_side = tokenizer.padding_side
    together = greedy_completions(model, tokenizer, prompts, max_new_tokens=6)
    alone = [greedy_completions(model, tokenizer, [prompt], max_new_tokens=6)[0] for prompt in prompts]
    assert together == alone and all(together)
    assert tokenizer.padding_side == padding_side  # put back as it was


def test_smoothed_is_tensorboards_debiased_running_mean():
    # By hand, weight 0.5: running 0.5*1=0.5 -> /0.5 = 1; 0.25+0.5*3=1.75 -> /0.75 = 7/3; 0.875+0.5*2=1.875 -> /0.875
    assert smoothed([1.0, 3.0, 2.0], weight=0.5) == pytest.approx([1.0, 7 / 3, 1.875 / 0.875])
    assert smoothed([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])  # debiased: a constant stays itself


def test_training_curves_draw_each_step_and_its_running_mean(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, path, **kwargs: drawn.append(figure))
    history = [{"step": step, "loss": 0.7 - step / 100, "rewards/accuracies": step % 2, "rewards/margins": step / 10}
               for step in range(1, 6)] + [{"step": 5, "eval_loss": 0.6, "eval_rewards/accuracies": 0.5,
                                             "eval_rewards/margins": 0.2}]
    plot_training(history, tmp_path / "curves.png")
    accuracy_axis = drawn[0].axes[1]
    lines = {line.get_label(): list(line.get_ydata()) for line in accuracy_axis.get_lines()}
    assert lines["train, per step"] == [1, 0, 1, 0, 1]
    assert lines["train, running mean"] == pytest.approx(smoothed([1, 0, 1, 0, 1]))
    assert lines["held-out"] == [0.5]


@pytest.mark.parametrize(("steps", "pairs", "expected"), [
    (1, 4, "training: 1 step (1 epoch of 4 pairs), global batch 4 (4 per device x 1 accumulation x 1 process)"),
    (2, 4, "training: 2 steps (2 epochs of 4 pairs), global batch 4 (4 per device x 1 accumulation x 1 process)"),
    (1, 8, "training: 1 step (0.5 epochs of 8 pairs), global batch 4 (4 per device x 1 accumulation x 1 process)"),
])
def test_the_plan_line_puts_each_noun_in_the_number_it_counts(tmp_path, steps, pairs, expected):
    args = DPOMinConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, report_to="none",
                        use_cpu=True)
    assert describe_plan(args, pairs).startswith(f"{expected}, learning rate 1e-06 (linear, warmup 0)")


def test_the_reference_samples_and_margins_show_labelled_bars_that_move_at_each_token(tmp_path, tiny_model_dir,
                                                                                      capsys):
    """Before training the command samples the reference (minutes on busy cores): never without a moving bar."""
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    argv = tiny_run_args(tiny_model_dir, data_file, tmp_path / "run")
    argv[argv.index("--disable_tqdm") + 1] = "false"
    assert main(argv) == 0
    err = capsys.readouterr().err
    for label in ("the reference's greedy completions of the samples", "the reference's margins of the samples",
                  "the trained policy's margins of the samples"):
        assert f"{label}: " in err, label
    assert "token 1/4" in err and "token 4/4" in err  # --max_new_tokens 4


def test_no_figure_is_shown_as_minus_zero():
    ties = tie_figures("sigmoid")
    after = {**ties, "eval_rewards/margins": -0.00001, "eval_rewards/accuracies": 0.5}
    assert describe_change({**ties, "eval_rewards/margins": -0.0}, after) == (
        "reward accuracy 0.0000 -> 0.5000, mean margin +0.0000 -> +0.0000, loss 0.6931 -> 0.6931, drift chosen "
        "+0.0000 -> +0.0000, drift rejected +0.0000 -> +0.0000")
    assert "-0.0000" not in describe_held_out(after, [-0.00001, 0.0, 0.00001])
