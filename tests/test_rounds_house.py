"""DPO in rounds uses the command's and the core's services, each decision with one owner (issue 39, "One house"):
the one held-out split, generation_batch_size as TRL counts it, the reference named rather than inferred, every file
written whole by dpo_min.files."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate import PartialState
from conftest import tiny_llama
from datasets import Dataset
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from dpo_min import DPOMinConfig, files
from dpo_min.reference import choose_reference
from dpo_min.rounds import RoundsConfig, RoundsError, run_rounds
from dpo_min.rounds import loop as rounds_loop
from dpo_min.rounds.policy import Policy
from dpo_min.rounds.prompts import split_held_out
from dpo_min.split import held_out_split
from dpo_min.train.pairs import _split

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ---- the one split ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2, 5, 7, 20, 96])
@pytest.mark.parametrize("share", [0.05, 0.2, 1 / 3, 0.4])
@pytest.mark.parametrize("seed", [0, 7, 42])
def test_the_rounds_hold_out_the_rows_the_commands_split_holds_out(count, share, seed):
    rows = Dataset.from_dict({"row": list(range(count))})
    plan = SimpleNamespace(eval_fraction=share, seed=seed, args=SimpleNamespace(group_by_prompt=False))
    train, held = _split(rows, plan)
    ours = split_held_out(count, share, seed)
    assert ours == (sorted(train["row"]), sorted(held["row"]))
    assert (train["row"], held["row"]) == tuple(held_out_split(count, share, seed))  # the command's, in its order


def test_the_one_split_refuses_a_share_that_holds_out_every_row_for_both_callers():
    with pytest.raises(ValueError, match="holds out every one"):
        held_out_split(1, 0.5, seed=0)
    with pytest.raises(RoundsError, match=r"^held_out_share 0\.5 of 1 prompt\(s\) holds out every one"):
        split_held_out(1, 0.5, seed=0)
    assert held_out_split(3, 0.0, seed=0) == ([0, 1, 2], [])


# ---- generation_batch_size counts completions, as TRL GRPOConfig's -----------------------------------------------
def test_generation_batch_size_counts_completions_and_a_batch_holds_whole_prompts(tmp_path, tokenizer):
    assert RoundsConfig(output_dir="x", num_generations=4, generation_batch_size=8).prompts_per_batch == 2
    assert RoundsConfig(output_dir="x", num_generations=4).prompts_per_batch == 8  # the default: 8 prompts' worth
    assert RoundsConfig(output_dir="x", num_generations=4).settings()["generation_batch_size"] == 32
    with pytest.raises(RoundsError, match=r"^generation_batch_size must be a positive multiple of num_generations "
                                          r"\(4\): it counts completions, as TRL GRPOConfig's; got 6$"):
        RoundsConfig(output_dir="x", num_generations=4, generation_batch_size=6)
    calls = []

    def generate(model, prompt_ids, settings):
        calls.append(len(prompt_ids) * settings.num_return_sequences)
        return [[tokenizer.eos_token_id]] * (len(prompt_ids) * settings.num_return_sequences)
    config = RoundsConfig(output_dir=str(tmp_path), num_generations=3, generation_batch_size=6)
    run = SimpleNamespace(config=config, tokenizer=tokenizer, prompt_ids=[[1, 2]] * 5, generate_fn=generate,
                          state=PartialState())
    settings = rounds_loop.GenerationSettings(3, 4, True)
    rounds_loop._sample_shared(run, SimpleNamespace(generation_config=None), list(range(5)), settings)
    assert calls == [6, 6, 3]  # completions per generate() call: 2 prompts x 3, then the last prompt's 3


# ---- the reference, named ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("peft", "reference", "trained", "mode", "description"), [
    (True, "initial", True, "adapter_off", "the base model (the adapter disabled)"),
    (True, "previous", False, "adapter_off", "the base model (the adapter disabled)"),
    (True, "previous", True, "adapter_at_start", "a frozen copy of the adapter the model came with"),
    (False, "initial", False, "ref_model", "ref_model, a separate frozen model"),
    (False, "previous", False, "policy_at_start", "a frozen copy of the model"),
])
def test_each_round_names_its_reference_and_the_trainer_builds_that_one(tmp_path, peft, reference, trained, mode,
                                                                        description):
    policy = Policy(tiny_llama(), LORA if peft else None, reference)
    if trained:  # a finished round's adapter
        policy.adapter = get_peft_model_state_dict(get_peft_model(tiny_llama(), copy.deepcopy(LORA)))
    assert policy.reference_mode == mode
    run = SimpleNamespace(config=RoundsConfig(output_dir=str(tmp_path)))
    args = rounds_loop._training_args(run, tmp_path, 1, policy)
    assert args.reference_mode == mode
    given = policy.trainer_models()
    _, chosen = choose_reference(given["model"], given["ref_model"], args, given["peft_config"], True)
    # The kind the trainer built is the one the rounds named, in the same word (reference.REFERENCES).
    assert (chosen.kind, chosen.description) == (mode, description)


def test_a_named_reference_the_models_do_not_fit_is_refused(tmp_path):
    args = DPOMinConfig(output_dir=str(tmp_path), reference_mode="ref_model", report_to="none")
    with pytest.raises(ValueError, match=r"^reference_mode='ref_model' needs a ref_model$"):
        choose_reference(tiny_llama(), None, args, None, True)
    with pytest.raises(ValueError, match="reference_mode must be one of"):
        DPOMinConfig(output_dir=str(tmp_path), reference_mode="initial")
    with pytest.raises(RoundsError, match="drop reference_mode"):
        RoundsConfig(output_dir="x", training={"reference_mode": "adapter_off"})


# ---- every file written whole -------------------------------------------------------------------------------------
def test_a_kill_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "settings.json"
    files.write_whole(target, "old")

    class Killed(BaseException):
        pass
    with pytest.raises(Killed), files.staged(target) as staging:
        staging.write_text("half")
        raise Killed
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]
    with files.staged(target):  # a writer that wrote nothing leaves the file as it was
        pass
    assert target.read_text() == "old"


def test_every_file_of_a_rounds_run_is_written_whole(tmp_path, tokenizer, monkeypatch):
    renamed = []
    replace = files.os.replace

    def recorded(source, target):
        renamed.append(Path(target))
        return replace(source, target)
    monkeypatch.setattr(files.os, "replace", recorded)
    prompts = [{"prompt": f"Count to {i}:", "n": i} for i in range(5)]
    config = RoundsConfig(output_dir=str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=3,
                          held_out_share=0.4, peft_config=LORA,
                          training={"per_device_train_batch_size": 2, "save_strategy": "no", "disable_tqdm": True})
    run_rounds(tiny_llama(), tokenizer, prompts, lambda completions, **_: [float(len(c)) for c in completions],
               config)
    root = tmp_path / "run"
    # round-K/train/ is the DPO pass's own folder: DPOMinTrainer stages its checkpoints itself.
    written = [path for path in root.rglob("*") if path.is_file() and "train" not in path.relative_to(root).parts]
    assert {"settings.json", "phase_seconds.json", "train_metrics.json", "held_out.png"} <= {p.name for p in written}
    assert [path for path in written if not any(path == r or r in path.parents for r in renamed)] == []
    assert [path for path in root.rglob("*.writing")] == []
