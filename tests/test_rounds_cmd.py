"""`python -m dpo_min.train --rounds N`: the command on a tiny model leaves each round's files; bad input is one
line; the rounds' demo takes its own defaults (its data and reward: tests/test_rounds_arithmetic.py)."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from dpo_min import load_preference_dataset
from dpo_min.files import staging_path
from dpo_min.rounds import rewards as rounds_rewards
from dpo_min.split import held_out_split
from dpo_min.train import main
from dpo_min.train.args import EVAL_FRACTION, ROUNDS_DEMO_DEFAULTS, ROUNDS_DEMO_PROMPT_SETTINGS
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import EMBEDDED_PROMPTS, load_prompts, rounds_config
from dpo_min.train.rounds import runner as rounds_cmd
from dpo_min.train.rounds_args import RoundsArguments

ROOT = Path(__file__).resolve().parent.parent
ARITHMETIC = ROOT / "data" / "arithmetic-prompts.jsonl"  # the first rounds demo's 96 prompts, kept as an example
PROMPTS = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()[:5]]
REWARDS = '''
def letters(completions, **_):
    """Varies between random samples: the share of letters in the completion."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def prompts_file(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)


def test_the_command_runs_two_rounds_on_a_tiny_model_and_leaves_each_rounds_files(tmp_path, tiny_model_dir,
                                                                                   prompts_file):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    command = [sys.executable, "-m", "dpo_min.train", "--rounds", "2", "--model", str(tiny_model_dir), "--use_peft",
               "--lora_r", "4", "--dataset", str(prompts_file),
               "--reward_funcs", "my_rewards:letters", "dpo_min.rounds.arithmetic:last_integer_reward",
               "--reward_weights", "1", "2", "--num_generations", "3", "--max_completion_length", "8",
               "--temperature", "1.0", "--eval_fraction", "0.2", "--learning_rate", "5e-3",
               "--per_device_train_batch_size", "2", "--loss_type", "sigmoid", "sft", "--output_dir", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [(line["round"], line["status"], line["prompts"], line["samples"]) for line in lines] == \
        [(1, "trained", 4, 12), (2, "trained", 4, 12)]
    samples = [json.loads(line) for line in (out / "round-1" / "samples.jsonl").read_text().splitlines()]
    for sample in samples:  # each function's reward, and the sum as --reward_weights weigh it
        assert set(sample["rewards"]) == {"letters", "last_integer_reward"}
        rewards = sample["rewards"]
        assert sample["total"] == pytest.approx(rewards["letters"] + 2 * rewards["last_integer_reward"])
    pairs = load_preference_dataset(str(out / "round-2" / "pairs.jsonl"))  # read back as the command reads data
    assert len(pairs) == lines[1]["pairs"] > 0
    assert (out / "round-2" / "checkpoint" / "adapter_model.safetensors").is_file()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["training"]["learning_rate"] == 5e-3 and settings["training"]["loss_type"] == ["sigmoid", "sft"]
    assert settings["held_out_share"] == 0.2 and settings["peft_config"]["r"] == 4
    assert [line["round"] for line in map(json.loads, (out / "held_out.jsonl").read_text().splitlines())] == [0, 1, 2]
    assert "held-out after round 2" in result.stdout and not (tmp_path / "run.lock").exists()


LOAD_BEST = ("--load_best_model_at_end is not supported with --rounds (a round's DPO pass has no held-out pairs to "
             "rate its checkpoints by; the held-out prompts, --eval_fraction, are scored after each round: "
             "held_out.jsonl)")


def run_main(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("extra", "code", "message"), [
    (["--rounds", "0"], 2, "--rounds must be >= 1, got 0"),
    (["--rounds", "1", "--reward_funcs", "nosuch:fn"], 2,
     "--reward_funcs nosuch:fn: cannot import nosuch (ModuleNotFoundError: No module named 'nosuch')"),
    (["--rounds", "1", "--reward_funcs", "os.path:nosuch"], 2,
     "--reward_funcs os.path:nosuch: os.path has no function 'nosuch'"),
    (["--rounds", "1"], 2,
     "--rounds on your --dataset needs --reward_funcs (module:function, or a reward model's path)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--reward_weights", "1", "2"], 2,
     "--reward_weights has 2 weights for 1 --reward_funcs"),
    (["--num_generations", "8"], 2, "num_generations is an option of DPO in rounds: add --rounds N (docs/rounds.md)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--num_generations", "1"], 2,
     "--num_generations must be >= 2 to make a pair, got 1"),
    (["--rounds", "1", "--reward_funcs", "./no/such/rm"], 2,
     "--reward_funcs ./no/such/rm: no such reward model folder (and it is not a hub id either)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--reward_weights", "nan"], 2,
     "--reward_weights must be finite numbers, got [nan]"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--missing_eos_penalty", "inf"], 2,
     "--missing_eos_penalty must be a finite number, got inf"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--max_eval_samples", "8"], 2,
     "--max_eval_samples is not read with --rounds (a share of --dataset's prompts is held out: --eval_fraction)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--eval_strategy", "steps"], 2,
     "--eval_strategy steps is not read with --rounds (a round's DPO pass has no held-out pairs; the held-out prompts, "
     "--eval_fraction, are scored after each round: held_out.jsonl)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--eval_on_start", "true"], 2,
     "--eval_on_start True is not read with --rounds (a round's DPO pass has no held-out pairs; the held-out prompts, "
     "--eval_fraction, are scored after each round: held_out.jsonl)"),
    (["--rounds", "1", "--reward_funcs", "accuracy_reward", "--temperature", "inf"], 2,
     "--temperature must be a finite number <= 10, got inf: at 10 a sample is already close to a uniform draw over "
     "the vocabulary"),
    (["--rounds", "2", "--reward_funcs", "accuracy_reward", "--temperature", "0.7", "1e30"], 2,
     "--temperature must be a finite number <= 10, got [0.7, 1e+30]: at 10 a sample is already close to a uniform "
     "draw over the vocabulary"),
    # Trainer's advice (match --eval_strategy to --save_strategy) cannot be taken with --rounds; it was cut at "found"
    (["--rounds", "1", "--load_best_model_at_end", "true"], 2, LOAD_BEST),
    (["--rounds", "1", "--load_best_model_at_end", "true", "--save_strategy", "no"], 2, LOAD_BEST),
])
def test_a_bad_command_line_is_one_line(tmp_path, prompts_file, capsys, extra, code, message):
    argv = ["--dataset", str(prompts_file), "--output_dir", str(tmp_path / "out"), *extra]
    assert run_main(argv, capsys) == (code, f"python -m dpo_min.train: error: {message}")
    assert not (tmp_path / "out").exists()


def test_trust_remote_code_reaches_the_reward_models_loading(tmp_path, prompts_file, capsys, monkeypatch):
    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise OSError("stopped before loading")
    # The one loader of reward models is dpo_min.rounds.rewards.load_reward_model; the command passes the flag to it.
    monkeypatch.setattr(rounds_rewards.AutoModelForSequenceClassification, "from_pretrained", from_pretrained)
    (tmp_path / "rm").mkdir()
    argv = ["--rounds", "1", "--dataset", str(prompts_file), "--reward_funcs", str(tmp_path / "rm"),
            "--trust_remote_code", "--output_dir", str(tmp_path / "out")]
    assert run_main(argv, capsys) == (1, f"python -m dpo_min.train: error: --reward_funcs {tmp_path / 'rm'}: "
                                         "stopped before loading")
    assert seen == {"num_labels": 1, "trust_remote_code": True}


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "Hi", "chosen": "a", "rejected": "b"}],
     "{file} holds answers (chosen, rejected), not prompts only: --rounds samples its own (drop those columns), or "
     "train the pairs without --rounds"),
    ([{"question": "What is 2 + 2?"}],
     "{file}: no 'prompt' column (it has question); --rounds reads prompt-only rows (--prompt_column names yours)"),
    ([{"prompt": "What is 2 + 2?"}, {"prompt": ""}], "{file}: row 1: field 'prompt' is empty"),
    # What the DPO pass refuses, refused before the model loads: not after sampling and scoring
    ([{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}],
     "{file}: row 0: field 'prompt' ends with an assistant turn; a prompt ends where the answer the rounds sample "
     "begins"),
    ([{"prompt": [{"role": "user", "content": "Hi"}]}, {"prompt": [{"role": "user", "content": None}]}],
     "{file}: row 1: field 'prompt' has a message that is not {{'role': system|user|assistant|tool, 'content': str}}: "
     "{{'role': 'user', 'content': None}}"),
    ([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}],
     "{file}: row 0: field 'prompt' has a message that is not {{'role': system|user|assistant|tool, 'content': str}}: "
     "{{'role': 'user', 'content': [{{'type': 'text', 'text': 'Hi'}}]}}"),
    ([{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "}]}],
     "{file}: row 0: field 'prompt' has an empty message: {{'role': 'user', 'content': ' '}}"),
], ids=["pairs", "no-prompt", "empty-text", "assistant-last", "null-content", "content-parts", "empty-message"])
def test_a_dataset_that_is_not_prompt_only_is_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch, rows,
                                                       message):
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    monkeypatch.setattr(rounds_cmd, "run_rounds", lambda *a, **k: pytest.fail("the rounds started"))
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--dataset", str(data), "--reward_funcs",
            "accuracy_reward", "--output_dir", str(tmp_path / "out")]
    assert run_main(argv, capsys) == (1, f"python -m dpo_min.train: error: {message.format(file=data)}")


def test_a_prompt_column_beside_a_prompt_column_is_one_line_before_the_model_loads(tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [{"question": "What is 2 + 2?", "prompt": "old", "solution": "4"}])
    argv = ["--rounds", "1", "--model", str(tmp_path / "no_model"), "--dataset", str(data), "--prompt_column",
            "question", "--reward_funcs", "accuracy_reward", "--output_dir", str(tmp_path / "out")]
    # It was datasets' traceback from rename_column; the words are the offline mapping's.
    assert run_main(argv, capsys) == (1, f"python -m dpo_min.train: error: {data}: columns: 'prompt' is mapped from "
                                         "the column 'question' (--prompt_column question), and the data has a "
                                         "'prompt' column too: which one is meant is not said; drop or rename one of "
                                         "them")
    assert not (tmp_path / "out").exists()

def test_prompts_that_all_fill_max_length_are_refused_before_the_first_sample(tmp_path, tiny_model_dir, capsys,
                                                                               prompts_file, monkeypatch):
    monkeypatch.setattr(rounds_cmd, "run_rounds", lambda *a, **k: pytest.fail("the rounds started"))
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--dataset", str(prompts_file), "--reward_funcs",
            "accuracy_reward", "--max_length", "8", "--output_dir", str(tmp_path / "out")]
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"python -m dpo_min.train: error: {prompts_file}: every training prompt fills "
                                    "max_length=8 (the shortest has 43 tokens): a round's DPO pass would drop every "
                                    "pair; raise max_length")


def test_a_share_that_holds_out_every_prompt_is_refused_before_the_model_loads(tmp_path, capsys):
    data = write_jsonl(tmp_path / "one.jsonl", PROMPTS[:1])
    argv = ["--rounds", "1", "--model", str(tmp_path / "no_model"), "--dataset", str(data), "--reward_funcs",
            "accuracy_reward", "--eval_fraction", "0.5", "--output_dir", str(tmp_path / "out")]
    assert run_main(argv, capsys) == (2, "python -m dpo_min.train: error: --eval_fraction 0.5 of 1 prompt(s) holds "
                                         "out every one, leaving none to train on: lower it, or give more prompts")


def test_a_draw_larger_than_the_training_prompts_is_refused_before_the_model_loads(tmp_path, capsys):
    data = write_jsonl(tmp_path / "three.jsonl", PROMPTS[:3])
    argv = ["--rounds", "1", "--model", str(tmp_path / "no_model"), "--dataset", str(data), "--reward_funcs",
            "accuracy_reward", "--eval_fraction", "0.3", "--prompts_per_round", "5", "--output_dir",
            str(tmp_path / "out")]
    assert run_main(argv, capsys) == (2, "python -m dpo_min.train: error: --prompts_per_round 5 is more than the 2 "
                                         "training prompt(s) (held-out ones are never drawn): lower it, or leave it "
                                         "unset to sample every prompt each round")


BY_POSITION = '''
def by_position(completions, **_):
    return [float(i) for i in range(len(completions))]
'''


def test_an_error_of_a_rounds_dpo_pass_is_one_line(tmp_path, tiny_model_dir, prompts_file, capsys, monkeypatch):
    from dpo_min.rounds import loop

    def refusing_pass(*args, **kwargs):  # as the core refuses a pair (the rounds' own pairs leave it nothing to)
        raise ValueError("row 0: field 'chosen': the chat template refused it: roles must alternate")
    monkeypatch.setattr(loop, "DPOMinTrainer", refusing_pass)
    (tmp_path / "position_rewards.py").write_text(BY_POSITION)
    monkeypatch.chdir(tmp_path)  # the reward module imports from the working folder
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--dataset", str(prompts_file), "--reward_funcs",
            "position_rewards:by_position", "--max_completion_length", "2", "--eval_fraction", "0",
            "--output_dir", str(tmp_path / "out")]
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == ("python -m dpo_min.train: error: round 1: the DPO pass refused "
                                    "round-1/pairs.jsonl: row 0: field 'chosen': the chat template refused it: roles "
                                    "must alternate"), err


# What a round's checkpoint save meets on a full or failing disk (torch.save of its training_args.bin; torch's zip
# writer reports a short write in its own words) -> the line: the offline command's (tests/test_run_dir.py's DISK_FULL).
ROUND_SAVE_FAULTS = {
    "full disk": (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left on device writing {checkpoint}"),
    "torch's short write": (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                            "could not write {checkpoint} ([enforce fail at inline_container.cc:672] . unexpected pos "
                            "576 vs 534): is the disk full?"),
    "failing disk": (OSError(errno.EIO, os.strerror(errno.EIO)), "could not write {checkpoint}: Input/output error"),
}


@pytest.mark.parametrize("fault", ROUND_SAVE_FAULTS)
def test_a_full_or_failing_disk_at_a_rounds_checkpoint_is_one_line(tmp_path, tiny_model_dir, prompts_file, capsys,
                                                                   monkeypatch, fault):
    error, message = ROUND_SAVE_FAULTS[fault]
    save = torch.save

    def fill(obj, file, *args, **kwargs):
        if str(file).endswith("training_args.bin"):
            raise error
        return save(obj, file, *args, **kwargs)
    monkeypatch.setattr(torch, "save", fill)
    (tmp_path / "position_rewards.py").write_text(BY_POSITION)
    monkeypatch.chdir(tmp_path)  # the reward module imports from the working folder
    out = tmp_path / "out"
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--dataset", str(prompts_file), "--reward_funcs",
            "position_rewards:by_position", "--max_completion_length", "2", "--eval_fraction", "0",
            "--save_strategy", "no", "--output_dir", str(out)]
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    checkpoint = out / "round-1" / "checkpoint"
    assert err.splitlines()[-1] == f"python -m dpo_min.train: error: {message.format(checkpoint=checkpoint)}"
    # The round's checkpoint is absent, not cut: its samples and pairs stay, for the same command to train again.
    assert sorted(os.listdir(out / "round-1")) == ["generated.jsonl", "pairs.jsonl", "phase_seconds.json",
                                                   "samples.jsonl", "train", "train_metrics.json"]


TIES_AFTER_ROUND_ONE = '''
def ties_after_round_one(completions, trainer_state, **_):
    """Pairs in round 1 (no step trained yet), a tie for every prompt after."""
    return [float(i) if trainer_state.global_step == 0 else 0.0 for i in range(len(completions))]
'''


@pytest.mark.parametrize(("rounds", "said"), [
    ("1", "wrote 1 round(s) to {out} in {s} s: rounds.jsonl and round-K/{{samples,pairs}}.jsonl; round 1 gave no pair "
          "(round-K/samples.jsonl holds the rewards): not trained, no checkpoint, the policy unchanged; the policy "
          "now: the model as given, untrained"),
    ("2", "wrote 2 round(s) to {out} in {s} s: rounds.jsonl, round-K/{{samples,pairs}}.jsonl and round-K/checkpoint; "
          "round 2 gave no pair (round-K/samples.jsonl holds the rewards): not trained, no checkpoint, the policy "
          "unchanged; the policy now: round-1/checkpoint"),
], ids=["every round ties", "round 2 ties"])
def test_rounds_that_give_no_pair_say_no_checkpoint_was_written_and_where_the_policy_is(
        tmp_path, tiny_model_dir, prompts_file, capsys, monkeypatch, rounds, said):
    module = f"tie_rewards_{rounds}"  # a module name per case: an imported one stays in sys.modules
    (tmp_path / f"{module}.py").write_text(TIES_AFTER_ROUND_ONE if rounds == "2" else BY_POSITION.replace(
        "float(i)", "0.0"))
    monkeypatch.chdir(tmp_path)  # the reward module imports from the working folder
    out = tmp_path / "out"
    reward = f"{module}:ties_after_round_one" if rounds == "2" else f"{module}:by_position"
    argv = ["--rounds", rounds, "--model", str(tiny_model_dir), "--dataset", str(prompts_file), "--reward_funcs",
            reward, "--max_completion_length", "2", "--eval_fraction", "0", "--save_strategy", "no",
            "--on_no_pairs", "skip", "--disable_tqdm", "true", "--output_dir", str(out)]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    seconds = last.split(" in ")[1].split(" s:")[0]
    assert last == said.format(out=out, s=seconds)  # it said round-K/checkpoint, which no round had written
    assert sorted(path.name for path in out.glob("round-*/checkpoint")) == ["checkpoint"] * (rounds == "2")


def test_an_output_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path, prompts_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["--rounds", "1", "--dataset", str(prompts_file), "--reward_funcs", "accuracy_reward", "--output_dir",
            str(out)]
    assert run_main(argv, capsys) == (2, f"python -m dpo_min.train: error: --output_dir {out} holds files that are "
                                         "not a rounds run's (no settings.json); choose another folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "prompts.jsonl"]  # no lock left behind


def test_a_first_settings_write_killed_before_its_rename_leaves_a_folder_the_same_command_runs_in(
        tmp_path, tiny_model_dir, prompts_file, capsys):
    # A SIGKILL while settings.json is written leaves only the writer's staging file: the package's own, not a
    # foreign file that would refuse the folder for good.
    out = tmp_path / "out"
    out.mkdir()
    staging = staging_path(out / rounds_cmd.SETTINGS_FILE)
    staging.write_text('{"num_generations": 2, "tempera')
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--dataset", str(prompts_file), "--reward_funcs",
            "dpo_min.rounds.arithmetic:last_integer_reward", "--num_generations", "2", "--max_completion_length", "2",
            "--eval_fraction", "0", "--output_dir", str(out)]
    code, err = run_main(argv, capsys)
    assert code == 0 and "error" not in err, err
    assert json.loads((out / "settings.json").read_text())["num_generations"] == 2 and not staging.exists()
    assert [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()] == [1]


def test_a_resume_with_another_model_dtype_or_chat_template_is_refused_naming_old_and_new(tmp_path, tiny_model_dir,
                                                                                          prompts_file, capsys):
    # Each would go on: the finished round's adapter on another base, or the next round sampled through another
    # template or dtype. Refused as the offline resume refuses them, with the values the plan records for it.
    out = tmp_path / "out"
    argv = ["--rounds", "1", "--model", str(tiny_model_dir), "--use_peft", "--lora_r", "4", "--dataset",
            str(prompts_file), "--reward_funcs", "dpo_min.rounds.arithmetic:last_integer_reward",
            "--num_generations", "2", "--max_completion_length", "4", "--eval_fraction", "0",
            "--save_strategy", "no", "--output_dir", str(out)]
    assert run_main(argv, capsys)[0] == 0
    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other_model)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    for extra, changed in [
            (["--model", str(other_model)], f"model[model] {tiny_model_dir} -> {other_model}"),
            (["--dtype", "bfloat16"], "model[dtype] float32 -> bfloat16"),
            (["--chat_template", template], f"model[chat_template] None -> {digest}"),
            (["--lora_r", "8"], "peft_config[r] 4 -> 8")]:
        code, err = run_main([*argv, *extra, "--rounds", "2"], capsys)  # the model loads first: its bar, then
        assert (code, err.splitlines()[-1]) == (1, f"python -m dpo_min.train: error: {out} holds a run with other "
                                                   f"settings ({changed}): resume it with the same ones, or give "
                                                   "another output_dir")
    assert json.loads((out / "settings.json").read_text())["model"]["model"] == str(tiny_model_dir)


def test_rounds_with_no_model_and_no_data_take_the_demos_defaults_and_prompts(tmp_path):
    plan = resolve(["--rounds", "3", "--output_dir", str(tmp_path / "out")])
    config = rounds_config(plan, None)
    assert plan.demo and plan.model.use_peft and plan.model.model is None  # SmolLM2-135M-Instruct with LoRA
    reached = {**vars(config), **config.training, "chat_template": plan.model.chat_template,
               "eval_fraction": config.held_out_share}
    for name, value in ROUNDS_DEMO_DEFAULTS.items():  # each where the run reads it ('none': no integration, [])
        assert reached[name] == ([] if value == "none" else value), name
    assert config.rounds == 3 and "output_dir" not in config.training and "seed" not in config.training
    assert load_prompts(plan) == [json.loads(line) for line in EMBEDDED_PROMPTS.read_text().splitlines()]
    assert EMBEDDED_PROMPTS.name == "arithmetic-pool.jsonl"  # the 3,000-prompt pool, 64 of them held out
    assert len(held_out_split(3000, config.held_out_share, plan.args.seed)[1]) == 64
    offline = resolve(["--output_dir", str(tmp_path / "offline")])  # the offline demo keeps its own
    assert offline.rounds is None and offline.args.learning_rate != ROUNDS_DEMO_DEFAULTS["learning_rate"]


def test_rounds_with_a_model_and_no_data_take_the_demos_prompts_with_its_round_settings(tmp_path):
    # The demo's 3,000 prompts at RoundsConfig's defaults were every prompt every round, ~11,400 samples each.
    argv = ["--rounds", "3", "--model", "my/model", "--output_dir", str(tmp_path / "out")]
    plan = resolve(argv)
    config = rounds_config(plan, None)
    assert not plan.demo and load_prompts(plan) == load_prompts(resolve(argv[:2] + argv[4:]))  # the demo's pool
    reached = {**vars(config), "eval_fraction": config.held_out_share}
    for name in ROUNDS_DEMO_PROMPT_SETTINGS:
        assert reached[name] == ROUNDS_DEMO_DEFAULTS[name], name
    # Its training options and template are the model's own, as offline (DPOMinConfig's defaults, TRL's).
    assert config.training == {"ddp_find_unused_parameters": False} and plan.model.chat_template is None
    assert rounds_config(resolve([*argv, "--prompts_per_round", "8"]), None).prompts_per_round == 8  # a flag wins
    own = rounds_config(resolve([*argv, "--dataset", "p.jsonl", "--reward_funcs", "accuracy_reward"]), None)
    assert (own.prompts_per_round, own.held_out_share) == (None, EVAL_FRACTION)  # prompts of one's own: the defaults


def test_every_rounds_option_is_in_help_and_readme(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    shown, readme = capsys.readouterr().out, (ROOT / "README.md").read_text()
    for option in (f.name for f in fields(RoundsArguments) if f.init):
        assert f"--{option} " in shown and f"--{option}" in readme, option
