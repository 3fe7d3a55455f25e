"""run_rounds end to end on a tiny random Llama with the SmolLM2 tokenizer: what each round leaves, the reference
`initial` kept fixed, every loss type, resume at each phase, bad rewards and rounds with no pair.

Whole runs are slow, so the finished runs that several tests read are made once per module (`lora_run`,
`full_run`, `previous_run`); a test that needs its own run (a kill, a failing reward) makes it small."""

import copy
import errno
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dpo_min import DPOMinTrainer, load_preference_dataset, sequence_logps
from dpo_min.losses import LOSS_TYPES
from dpo_min.rounds import RoundsConfig, RoundsError, run_rounds
from dpo_min.rounds import loop as rounds_loop
from dpo_min.rounds.prompts import check_room, prompt_rows, split_held_out

PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)}
           for i in range(5)]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
# Every step checkpointed: a kill mid-round resumes from one, and the shared run is the kills' uninterrupted twin.
CHECKPOINTS = {"save_strategy": "steps", "save_steps": 1}


def tiny_policy() -> LlamaForCausalLM:
    """Smaller than conftest's tiny_llama (one layer of width 16; the SmolLM2 vocabulary, which the prompts need)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                        tie_word_embeddings=False))


def letters(completions, solution, **_):
    """A reward that varies between random samples: how many of the completion's characters are letters, plus
    whether the solution's digit appears."""
    return [sum(ch.isalpha() for ch in c[0]["content"]) + float(s in c[0]["content"])
            for c, s in zip(completions, solution)]


def constant(completions, **_):
    return [1.0] * len(completions)


def settings(folder, name="run", **overrides):
    """5 prompts, 2 held out: 3 pairs a round at most, 2 DPO steps of batch 2."""
    training = {"per_device_train_batch_size": 2, "learning_rate": 5e-3, "disable_tqdm": True, **CHECKPOINTS,
                **overrides.pop("training", {})}
    return RoundsConfig(**{"output_dir": str(folder / name), "rounds": 2, "num_generations": 3,
                           "max_completion_length": 4, "held_out_share": 0.4, "seed": 7, "training": training,
                           "peft_config": LORA, **overrides})


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return AutoTokenizer.from_pretrained(str(smollm_path))


def shared_run(tmp_path_factory, tokenizer, **overrides):
    """A finished run for a module's tests, in its own DPO_MIN_CACHE (the per-test one is not set up yet)."""
    folder = tmp_path_factory.mktemp("rounds")
    model = tiny_policy()
    pi_0 = copy.deepcopy(model).eval()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPO_MIN_CACHE", str(folder / "cache"))
        return run_rounds(model, tokenizer, PROMPTS, letters, settings(folder, **overrides)), pi_0, folder


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tokenizer):
    """LoRA, reference `initial`, 3 rounds: read by most tests, and the uninterrupted twin of the killed runs."""
    return shared_run(tmp_path_factory, tokenizer, rounds=3)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tokenizer):
    return shared_run(tmp_path_factory, tokenizer, rounds=3, peft_config=None)


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory, tokenizer):
    return shared_run(tmp_path_factory, tokenizer, reference="previous")


def pair_batch(trainer):
    return {name: value for name, value in trainer.data_collator([trainer.train_dataset[0]]).items()}


def reference_logps(result, batch):
    """The log-probs of the reference the last round's trainer chose, computed on the policy as it stands."""
    with torch.no_grad(), result.policy.current() as policy, result.trainer.reference_model(policy) as model:
        return sequence_logps(model.eval(), batch).logps


@pytest.mark.parametrize("run", ["lora_run", "full_run"])
def test_three_rounds_with_reference_initial_keep_pi_0s_log_probs(request, run):
    result, pi_0, _ = request.getfixturevalue(run)
    assert [line["status"] for line in result.rounds] == ["trained"] * 3
    batch = pair_batch(result.trainer)
    with torch.no_grad():
        expected = sequence_logps(pi_0, batch).logps
    assert torch.equal(reference_logps(result, batch), expected)
    with torch.no_grad(), result.policy.current() as policy:  # and the policy did move away from it
        assert not torch.allclose(sequence_logps(policy.eval(), batch).logps, expected, atol=1e-4)


@pytest.mark.parametrize("run", ["previous_run", "lora_run"], ids=["previous", "initial"])
def test_reference_previous_is_the_last_rounds_policy(request, run):
    result, _, _ = request.getfixturevalue(run)
    # The last round's first step: against the last round's policy the implicit rewards start at exactly 0; against
    # pi_0 they hold what the rounds before learned.
    first = result.trainer.state.log_history[0]
    assert (first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0) == (run == "previous_run")


def test_each_round_leaves_samples_pairs_the_command_reads_a_checkpoint_and_a_line(lora_run):
    result, _, folder = lora_run
    run = folder / "run"
    lines = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert lines == result.rounds and [line["round"] for line in lines] == [1, 2, 3]
    held = [json.loads(line) for line in (run / "held_out.jsonl").read_text().splitlines()]
    assert [line["round"] for line in held] == [0, 1, 2, 3] and all(line["n"] == 2 for line in held)
    assert (run / "held_out.png").stat().st_size > 0
    for line in lines:
        round_dir = run / f"round-{line['round']}"
        samples = [json.loads(row) for row in (round_dir / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == line["samples"] == 3 * 3  # 3 training prompts (2 of 5 held out), 3 samples each
        assert {row["prompt_index"] for row in samples}.isdisjoint(held_indices(run))
        assert all(row["total"] == row["rewards"]["letters"] for row in samples)
        assert line["pairs"] + sum(line["dropped"].values()) == line["prompts"] == 3
        pairs = load_preference_dataset(str(round_dir / "pairs.jsonl"))
        assert len(pairs) == line["pairs"] and pairs[0]["prompt"] == PROMPTS[samples[0]["prompt_index"]]["prompt"]
        assert (round_dir / "checkpoint" / "adapter_model.safetensors").is_file()
        assert set(line["seconds"]) == {"sampling", "scoring", "training"}
        assert {"loss", "rewards/margins", "steps"} <= set(line["dpo"])


def held_indices(run):
    sampled = {json.loads(row)["prompt_index"] for row in (run / "round-1/samples.jsonl").read_text().splitlines()}
    return sorted(set(range(len(PROMPTS))) - sampled)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_a_round(tmp_path, tokenizer, loss_type):
    # The core tests every loss's numbers; here a round runs with it: 1 round, 2 prompts, 1 step, no checkpoint.
    needs = {"label_smoothing": 1e-3} if loss_type == "exo_pair" else {}  # EXO's eps must be in (0, 1)
    needs |= {"group_by_prompt": True} if loss_type == "plackett_luce" else {}  # it ranks each prompt's samples
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=2,
                      training={"loss_type": [loss_type], "save_strategy": "no", **needs})
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], letters, config)
    assert result.rounds[0]["status"] == "trained" and result.rounds[0]["dpo"]["steps"] == 1


def test_a_round_says_its_dpo_figures_in_its_line_not_trainers_dict_per_step(tmp_path, tokenizer, capsys):
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=2,
                      training={"save_strategy": "no", "per_device_train_batch_size": 1})
    line = run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], letters, config).rounds[0]
    out = capsys.readouterr().out
    dpo = line["dpo"]
    assert dpo["steps"] == 2 and f"; DPO: 2 steps, mean loss {dpo['loss']:.4f}, reward accuracy " \
        f"{dpo['rewards/accuracies']:.2f}, margin {dpo['rewards/margins']:+.4f}" in out
    assert "{'loss'" not in out and "'train_runtime'" not in out  # Trainer's dicts, one a step, every round


STOPPED = ("round 1: no prompt gave a pair (3 all_tied); the run stopped there (on_no_pairs='stop') and stops there "
           "again when resumed: to go on, start another output_dir with settings that give pairs (more "
           "num_generations, a higher temperature, another reward, or on_no_pairs='skip')")


def test_a_round_with_no_pair_stops_or_skips_as_chosen(tmp_path, tokenizer, capsys):
    stopped = run_rounds(tiny_policy(), tokenizer, PROMPTS, constant, settings(tmp_path, name="stop"))
    assert stopped.stopped == STOPPED
    assert len(stopped.rounds) == 1
    capsys.readouterr()
    again = run_rounds(tiny_policy(), tokenizer, PROMPTS, constant, settings(tmp_path, name="stop"))
    assert again.stopped == STOPPED and STOPPED in capsys.readouterr().out  # said again, not a silent return
    skipped = run_rounds(tiny_policy(), tokenizer, PROMPTS, constant, settings(tmp_path, name="skip",
                                                                               on_no_pairs="skip"))
    assert [line["status"] for line in skipped.rounds] == ["no pair: skip"] * 2 and skipped.stopped is None
    assert not (tmp_path / "skip/round-1/checkpoint").exists()


@pytest.mark.parametrize(("overrides", "changed"), [
    ({"temperature": 0.5}, "temperature 1.0 -> 0.5"),
    ({"training": {"learning_rate": 1e-3}}, "training[learning_rate] 0.005 -> 0.001"),
    ({"peft_config": LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")},
     "peft_config[r] 4 -> 8"),
], ids=["sampling", "training", "lora"])
def test_a_resume_with_other_settings_is_refused_in_one_line(lora_run, tokenizer, overrides, changed):
    _, _, folder = lora_run
    written = {path: path.stat().st_mtime_ns for path in (folder / "run").rglob("*")}
    with pytest.raises(RoundsError) as error:
        run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(folder, rounds=4, **overrides))
    assert str(error.value) == (f"{folder / 'run'} holds a run with other settings ({changed}): resume it with the "
                                "same ones, or give another output_dir")
    assert {path: path.stat().st_mtime_ns for path in (folder / "run").rglob("*")} == written  # nothing touched


def other_template(tokenizer):
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return changed


@pytest.mark.parametrize(("change", "changed"), [
    (lambda model, tok: (setattr(model.config, "_name_or_path", "other/model"), tok)[1],
     'model[name_or_path] "" -> other/model'),
    (lambda model, tok: (model.to(torch.bfloat16), tok)[1], "model[dtype] float32 -> bfloat16"),
    (lambda model, tok: other_template(tok), "model[chat_template (sha256)] {old} -> {new}"),
], ids=["model", "dtype", "chat_template"])
def test_a_resume_with_another_model_dtype_or_chat_template_is_refused_naming_old_and_new(lora_run, tokenizer,
                                                                                          change, changed):
    # What the numbers depend on, read off the model and tokenizer given: another base would get the finished
    # rounds' adapter and train the next round on it.
    _, _, folder = lora_run
    model = tiny_policy()
    changed_tokenizer = change(model, tokenizer)
    def digest(tok):
        return hashlib.sha256(tok.chat_template.encode()).hexdigest()[:12]
    changed = changed.format(old=digest(tokenizer), new=digest(changed_tokenizer))
    with pytest.raises(RoundsError) as error:
        run_rounds(model, changed_tokenizer, PROMPTS, letters, settings(folder, rounds=4))
    assert str(error.value) == (f"{folder / 'run'} holds a run with other settings ({changed}): resume it with the "
                                "same ones, or give another output_dir")


def test_the_trainer_handed_back_saves_the_trained_adapter(lora_run, tmp_path):
    result, _, folder = lora_run
    result.trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "adapter_model.safetensors"))
    trained = load_file(str(folder / "run" / "round-3" / "checkpoint" / "adapter_model.safetensors"))
    assert saved and saved.keys() == trained.keys()
    assert all(torch.equal(saved[name], trained[name]) for name in trained)


@pytest.mark.parametrize("where", ["round-1/generated.jsonl", "round-1/generated.partial.jsonl", "round-1/checkpoint"])
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, tokenizer, monkeypatch, where):
    full = OSError(errno.ENOSPC, "No space left on device")
    if where.endswith(".jsonl"):
        write_text = Path.write_text

        def fill(path, *args, **kwargs):
            if path.name == f".{Path(where).name}.writing":  # the file staged, dpo_min.files.staging_path
                raise full
            return write_text(path, *args, **kwargs)
        monkeypatch.setattr(Path, "write_text", fill)
    else:
        monkeypatch.setattr(DPOMinTrainer, "_save", lambda *a, **k: (_ for _ in ()).throw(full))
    config = settings(tmp_path, rounds=1, held_out_share=0.0, training={"save_strategy": "no"})
    with pytest.raises(RoundsError) as error:
        run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, config)
    assert str(error.value) == f"no space left on device writing {tmp_path / 'run' / where}"


def test_a_reward_that_fails_in_round_2_keeps_round_1_and_the_round_resumes_unsampled(tmp_path, tokenizer,
                                                                                      monkeypatch):
    calls = []

    def flaky(completions, **_):
        calls.append(len(completions))
        if len(calls) == 2:  # round 1 scores once (held-out prompts are off here); round 2 is the second call
            raise KeyError("answer")
        return [float(len(c[0]["content"])) for c in completions]
    config = settings(tmp_path, held_out_share=0.0, training={"save_strategy": "no"})
    with pytest.raises(RoundsError, match=r"^round 2: reward function 'flaky' raised KeyError: 'answer'$"):
        run_rounds(tiny_policy(), tokenizer, PROMPTS, flaky, config)
    assert len((tmp_path / "run/rounds.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "run/round-1/checkpoint").is_dir() and (tmp_path / "run/round-2/generated.jsonl").is_file()
    monkeypatch.setattr(rounds_loop, "_generate", lambda *a: pytest.fail("round 2's samples were generated again"))
    result = run_rounds(tiny_policy(), tokenizer, PROMPTS, flaky, config)
    assert [line["round"] for line in result.rounds] == [1, 2]


def by_position(completions, **_):
    return [float(i) for i in range(len(completions))]


def refusing_pass(*args, **kwargs):
    """A DPO pass that refuses its pairs as the core does (tokenizing's message for a template that refuses a row):
    since the pair rule leaves out what the pass would drop, the rounds' own data cannot make it refuse."""
    raise ValueError("row 0: field 'chosen': the chat template refused it: roles must alternate\nmore lines")


def test_an_error_of_a_rounds_dpo_pass_is_one_line_naming_the_round_and_its_pairs(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(rounds_loop, "DPOMinTrainer", refusing_pass)
    config = settings(tmp_path, rounds=1, held_out_share=0.0, num_generations=2, training={"save_strategy": "no"})
    with pytest.raises(RoundsError) as error:
        run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], by_position, config)
    assert str(error.value) == ("round 1: the DPO pass refused round-1/pairs.jsonl: row 0: field 'chosen': the chat "
                                "template refused it: roles must alternate")
    assert len((tmp_path / "run/round-1/pairs.jsonl").read_text().splitlines()) == 2  # the round's files kept


TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                   "function": {"name": "add", "arguments": {}}}]}


@pytest.mark.parametrize(("prompt", "message"), [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "row 0: field 'prompt' ends with an assistant turn; a prompt ends where the answer the rounds sample begins"),
    ([{"role": "user", "content": None}], "row 0: field 'prompt' has a message that is not {'role': "
     "system|user|assistant|tool, 'content': str}: {'role': 'user', 'content': None}"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "row 0: field 'prompt' has a message that is "
     "not {'role': system|user|assistant|tool, 'content': str}: {'role': 'user', 'content': [{'type': 'text', "
     "'text': 'Hi'}]}"),
    ([{"role": "user", "content": ""}], "row 0: field 'prompt' has an empty message: {'role': 'user', 'content': ''}"),
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}],
     "row 0: field 'prompt' has a system message that is not the prompt's first"),
    ("\ud800 lone surrogate", "row 0: field 'prompt' is not valid unicode (surrogates not allowed)"),
    ([{"role": "user", "content": "Add 2 and 3."}, TOOL_CALL, {"role": "tool", "content": "5"}], None),
], ids=["assistant-last", "null-content", "content-parts", "empty-message", "system-later", "surrogate",
        "tool-call-accepted"])
def test_a_prompt_the_dpo_pass_would_refuse_is_refused_before_anything_is_sampled(prompt, message):
    # The DPO pass's own rules (dpo_min.tokenizing.check_prompt); a tool call without text passes there and here.
    if message is None:
        assert prompt_rows([{"prompt": prompt}]) == [{"prompt": prompt}]
        return
    with pytest.raises(RoundsError) as error:
        prompt_rows([{"prompt": prompt}])
    assert str(error.value) == message


def test_a_held_out_share_that_would_hold_out_every_prompt_is_refused_not_capped():
    assert split_held_out(2, 0.5, seed=0)[1] != [] and len(split_held_out(2, 0.5, seed=0)[0]) == 1
    with pytest.raises(RoundsError, match=r"^held_out_share 0\.5 of 1 prompt\(s\) holds out every one, leaving none "
                                          r"to train on: lower it, or give more prompts$"):
        split_held_out(1, 0.5, seed=0)  # it held out none: the share was capped at count - 1


def test_training_prompts_that_all_fill_max_length_are_refused_before_sampling(tokenizer):
    rows = [{"prompt": PROMPTS[0]["prompt"]}]
    length = len(tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, return_dict=True)[
        "input_ids"])
    with pytest.raises(RoundsError, match=rf"^every training prompt fills max_length={length} \(the shortest has "
                                          rf"{length} tokens\): a round's DPO pass would drop every pair"):
        check_room(rows, [0], tokenizer, {"max_length": length})
    check_room(rows, [0], tokenizer, {"max_length": length + 1})  # one token of room: a pair can be trained
    check_room(rows, [0], tokenizer, {"max_length": length, "max_prompt_length": length - 1})  # cut first
    check_room(rows, [], tokenizer, {"max_length": 2})  # no training prompt: nothing to fill


class Killed(BaseException):
    """A kill: not an Exception, so nothing on the way catches it."""


def kill_in(monkeypatch, target, name, round_to_kill=2):
    original = getattr(target, name)

    def killed(*args, **kwargs):
        # The round by its number, or by its folder (round-K) for a phase that takes the folder alone.
        if any(arg == round_to_kill for arg in args if isinstance(arg, int)) or \
                kwargs.get("round_index") == round_to_kill or \
                any(isinstance(arg, Path) and arg.name == f"round-{round_to_kill}" for arg in args):
            raise Killed(name)
        return original(*args, **kwargs)
    monkeypatch.setattr(target, name, killed)


def same_rounds(resumed, whole):
    """The same lines but for the time taken; the DPO metrics to float tolerance, num_tokens (the running token
    count, which a resumed DPO pass carries on from its checkpoint) included."""
    assert len(resumed) == len(whole)
    for mine, theirs in zip(resumed, whole):
        assert {k: v for k, v in mine.items() if k not in ("seconds", "dpo")} == \
            {k: v for k, v in theirs.items() if k not in ("seconds", "dpo")}
        assert "num_tokens" in mine["dpo"] and mine["dpo"] == pytest.approx(theirs["dpo"], rel=1e-5)


@pytest.mark.parametrize("phase", ["_generate", "_score", "_train", "_evaluate", "mid_training"])
def test_a_run_killed_at_any_phase_resumes_where_it_stopped_to_the_same_result(tmp_path, tokenizer, monkeypatch,
                                                                               lora_run, phase):
    # The uninterrupted twin is the shared 3-round run: a 2-round run is its first 2 rounds (`rounds` only says
    # when to stop).
    whole, _, _ = lora_run
    with monkeypatch.context() as patch:
        if phase == "mid_training":
            original = DPOMinTrainer._save_checkpoint

            def save_then_die(self, model, trial):
                original(self, model, trial)
                if "round-2" in self.args.output_dir:
                    raise Killed("after checkpoint-1 of round 2")
            patch.setattr(DPOMinTrainer, "_save_checkpoint", save_then_die)
        else:
            kill_in(patch, rounds_loop, phase)
        with pytest.raises(Killed):
            run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path))
    done_before = {path.name for path in (tmp_path / "run/round-2").iterdir()}
    if phase in ("_score", "_train", "_evaluate", "mid_training"):  # sampled before the kill: not sampled again
        monkeypatch.setattr(rounds_loop, "_generate", lambda *a: pytest.fail("sampled again"))
    if phase in ("_train", "_evaluate", "mid_training"):
        monkeypatch.setattr(rounds_loop, "_score", lambda *a: pytest.fail("scored again"))
    if phase == "mid_training":  # round 2 trains 2 steps: the resume has one left
        assert whole.rounds[1]["dpo"]["steps"] == 2
        assert "checkpoint-1" in {path.name for path in (tmp_path / "run/round-2/train").iterdir()}
    if phase == "_evaluate":
        assert "checkpoint" in done_before
        monkeypatch.setattr(rounds_loop, "_train", lambda *a: pytest.fail("trained again"))
    resumed = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path))
    same_rounds(resumed.rounds, whole.rounds[:2])
    assert resumed.held_out == whole.held_out[:3]


def test_every_rows_columns_reach_the_rewards_none_where_a_row_lacks_one():
    rows = [{"prompt": "a"}, {"prompt": "b", "solution": "2"}, {"prompt": "c", "level": 3, "completion": "x"}]
    columns = rounds_loop._columns(SimpleNamespace(rows=rows), [0, 1, 2], per_row=2)
    assert columns == {"solution": [None, None, "2", "2", None, None], "level": [None, None, None, None, 3, 3]}


def test_a_pair_whose_prompt_fills_max_length_is_counted_before_training_and_pairs_is_what_trains(tmp_path,
                                                                                                  tokenizer):
    short = len(tokenizer.apply_chat_template(PROMPTS[0]["prompt"], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])
    long_prompt = {"prompt": [{"role": "user", "content": "What is " + "1 + " * 60 + "1?"}], "solution": "61"}
    config = settings(tmp_path, rounds=1, held_out_share=0.0, training={"max_length": short + 8,
                                                                       "save_strategy": "no"})
    result = run_rounds(tiny_policy(), tokenizer, [*PROMPTS[:3], long_prompt], letters, config)
    line = result.rounds[0]
    assert line["dropped"]["prompt_fills_max_length"] == 1
    assert line["pairs"] == len(result.trainer.train_dataset) == 4 - sum(line["dropped"].values())


@pytest.mark.parametrize("killed_call, phase_file, calls_after", [
    (2, "held_out-0.partial.jsonl", 1 + 3 + 2),  # the second held-out prompt before round 1
    (4, "round-1/generated.partial.jsonl", 2 + 2),  # the second batch of round 1's samples
], ids=["held-out greedy", "sampling"])
def test_a_stop_inside_a_sampling_pass_keeps_its_finished_batches_and_the_rerun_is_the_same_run(
        tmp_path, tokenizer, monkeypatch, killed_call, phase_file, calls_after):
    """One prompt a batch (generation_batch_size 3 of num_generations 3): 2 held-out and 3 training prompts give
    generate() calls 1-2 (held-out before round 1), 3-5 (round 1's samples), 6-7 (held-out after round 1)."""
    config = {"rounds": 1, "generation_batch_size": 3}
    whole = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path, "whole", **config))
    original, calls = rounds_loop.sample, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == killed_call and not stopped:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(rounds_loop, "sample", counted)
    stopped = False
    with pytest.raises(KeyboardInterrupt):
        run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path, **config))
    kept = [json.loads(line) for line in (tmp_path / "run" / phase_file).read_text().splitlines()]
    assert [line["batch"] for line in kept] == [0]  # the batch finished before the stop
    stopped, calls[:] = True, []
    resumed = run_rounds(tiny_policy(), tokenizer, PROMPTS, letters, settings(tmp_path, **config))
    assert len(calls) == calls_after  # the kept batch is not generated again
    same_rounds(resumed.rounds, whole.rounds)
    assert resumed.held_out == whole.held_out
    assert (tmp_path / "run/round-1/generated.jsonl").read_text() == \
        (tmp_path / "whole/round-1/generated.jsonl").read_text()
    assert not list((tmp_path / "run").rglob("*.partial.jsonl"))  # each replaced by its phase's file
