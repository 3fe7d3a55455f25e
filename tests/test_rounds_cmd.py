"""`python -m dpo_min.train --rounds N`: the command on a tiny model leaves each round's files; bad input is one
line; the rounds' demo takes its own defaults; the arithmetic prompts are generated deterministically and their
reward reads the last integer of a completion."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from dpo_min import load_preference_dataset
from dpo_min.rounds import rewards as rounds_rewards
from dpo_min.rounds.arithmetic import last_integer, last_integer_reward
from dpo_min.split import held_out_split
from dpo_min.train import main
from dpo_min.train import rounds as rounds_cmd
from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS
from dpo_min.train.plan import resolve
from dpo_min.train.rounds import EMBEDDED_PROMPTS, load_prompts, rounds_config
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


def test_an_output_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path, prompts_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["--rounds", "1", "--dataset", str(prompts_file), "--reward_funcs", "accuracy_reward", "--output_dir",
            str(out)]
    assert run_main(argv, capsys) == (2, f"python -m dpo_min.train: error: --output_dir {out} holds files that are "
                                         "not a rounds run's (no settings.json); choose another folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "prompts.jsonl"]  # no lock left behind


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


def test_every_rounds_option_is_in_help_and_readme(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    shown, readme = capsys.readouterr().out, (ROOT / "README.md").read_text()
    for option in (f.name for f in fields(RoundsArguments) if f.init):
        assert f"--{option} " in shown and f"--{option}" in readme, option


# ---- the demo's data and reward -----------------------------------------------------------------------------------
def load_generator(name: str = "make_arithmetic"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_arithmetic_prompts_are_the_generators_output_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_arithmetic.py"), str(tmp_path / "a.jsonl")],
                   check=True)
    assert (tmp_path / "a.jsonl").read_bytes() == ARITHMETIC.read_bytes()


def test_the_arithmetic_prompts_follow_the_rule_in_data_readme():
    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()]
    generator = load_generator()
    assert len(rows) == generator.ROWS and len({json.dumps(row) for row in rows}) == len(rows)
    for index, row in enumerate(rows):
        (message,) = row["prompt"]
        a, op, b = message["content"].removeprefix("What is ").removesuffix("? Answer with the number.").split()
        a, b = int(a), int(b)
        kind = index % 4  # single-digit +, -, *, then two-digit + with no carry
        assert op == "+-*+"[kind] and message["role"] == "user"
        if kind < 3:
            assert 2 <= a <= 9 and 2 <= b <= 9
        else:
            assert all(1 <= n // 10 <= 4 and n % 10 <= 4 for n in (a, b))  # no column sums past 9
        assert row["solution"] == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
    digest = hashlib.sha256(ARITHMETIC.read_bytes()).hexdigest()
    assert f"`{digest}`" in (ROOT / "data" / "README.md").read_text()  # the sha256 data/README.md gives


# ---- the arithmetic pool (issue 39): fresh prompts every round -----------------------------------------------------
POOL = ROOT / "data" / "arithmetic-pool.jsonl"


def test_the_arithmetic_pool_is_its_generators_output_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_arithmetic_pool.py"), str(tmp_path / "p.jsonl")],
                   check=True)
    assert (tmp_path / "p.jsonl").read_bytes() == POOL.read_bytes()


def test_the_arithmetic_pool_follows_the_rule_in_data_readme():
    rows = [json.loads(line) for line in POOL.read_text().splitlines()]
    generator = load_generator("make_arithmetic_pool")
    assert len(rows) == generator.ROWS == 3000 and len({json.dumps(row["prompt"]) for row in rows}) == len(rows)
    kinds = []
    for row in rows:
        (message,) = row["prompt"]
        a, op, b = message["content"].removeprefix("What is ").removesuffix("? Reply with only the number.").split()
        a, b = int(a), int(b)
        assert message["role"] == "user" and 10 <= a <= 99 and 2 <= b <= 98
        if b <= 9:  # a two-digit number and a one-digit one: no carry, no borrow
            assert (a % 10 + b <= 9) if op == "+" else (a % 10 >= b)
        else:  # two two-digit numbers: no carry and a sum under 100; the larger first, no borrow
            assert (a % 10 + b % 10 <= 9 and a + b <= 99) if op == "+" else (a > b and a % 10 >= b % 10)
        kinds.append((op, b <= 9))
        assert row["solution"] == (a + b if op == "+" else a - b) >= 0
    assert [kinds.count(kind) for kind in [("+", True), ("-", True), ("+", False), ("-", False)]] == \
        [300, 300, 1200, 1200]
    digest = hashlib.sha256(POOL.read_bytes()).hexdigest()
    assert f"`{digest}`" in (ROOT / "data" / "README.md").read_text()  # the sha256 data/README.md gives


@pytest.mark.parametrize(("text", "expected"), [
    ("3 + 2 = 5", 5),  # the first integer is an operand
    ("47 + 38 = 85.", 85),
    ("The answer is 51", 51),
    ("90 - 99 = -9", -9),
    ("8.5, so 7", 7),  # a decimal is no integer
    ("about 8.5", None),
    ("no digits", None),
])
def test_last_integer_reads_the_last_whole_number(text, expected):
    assert last_integer(text) == expected


def test_the_reward_is_exact_match_of_the_last_integer_for_text_and_messages():
    completions = ["83 + 31 = 114", "83 + 31 = 113", "114 is 83 + 31", "none"]
    assert last_integer_reward(completions=completions, solution=[114] * 4) == [1.0, 0.0, 0.0, 0.0]
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert last_integer_reward(completions=messages, solution=["114"] * 4, prompts=[None] * 4) == [1.0, 0.0, 0.0, 0.0]
