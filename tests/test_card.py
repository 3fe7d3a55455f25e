"""The model card dpo_min writes, and the push to the Hub (the upload replaced by a recorder: no network)."""

import json
import logging
import os

import pytest
import torch
from conftest import SECRET, write_hh_rows

from dpo_min import dpo_loss
from dpo_min.config import DPOMinConfig
from dpo_min.data.mixtures import load_mixture
from dpo_min.intervals import wilson_interval
from dpo_min.losses import LOSS_TYPES
from dpo_min.models import cache_dir
from dpo_min.train import main, trained_sources
from dpo_min.train.args import DataArguments
from dpo_min.train.card import base_model_name, model_card
from dpo_min.train.command_line import parse_args
from dpo_min.train.hub import hub_repo_id


def tiny_args(model_dir, data_file, output_dir, *extra):
    return ["--model", str(model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
            "--eval_fraction", "0.25", "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "3", "--learning_rate", "5e-3", "--num_samples", "1",
            "--max_new_tokens", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--use_peft", *extra]


@pytest.mark.parametrize("successes, trials, expected", [
    (50, 100, (0.4038, 0.5962)), (0, 10, (0.0, 0.2775)), (10, 10, (0.7225, 1.0)), (62, 100, (0.5221, 0.7090)),
])
def test_wilson_interval_matches_hand_computed_values(successes, trials, expected):
    # By hand: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), z = 1.96.
    assert wilson_interval(successes, trials) == pytest.approx(expected, abs=1e-4)


def test_repo_id_comes_from_the_output_folder_never_its_staging_name(tmp_path):
    assert hub_repo_id(tmp_path / "runs" / "my-dpo") == "my-dpo"
    (tmp_path / "run-1").mkdir()
    (tmp_path / "latest").symlink_to("run-1")
    assert hub_repo_id(tmp_path / "latest") == "latest"  # the name the user wrote, not the link's target
    assert hub_repo_id(tmp_path / "runs" / "my-dpo.partial") == "my-dpo"
    assert hub_repo_id(tmp_path / "my-dpo", hub_model_id="me/other") == "me/other"


def test_card_of_the_default_model_names_the_hub_model_not_the_cache():
    args = DPOMinConfig(output_dir="unused", max_steps=8, learning_rate=5e-4)
    card = model_card(model=None, kind="adapter", datasets={"Anthropic/hh-rlhf": 32}, train_pairs=32,
                      held_out_pairs=100, args=args, reference="the base model (the adapter disabled)",
                      lora={"r": 16}, before={"eval_rewards/accuracies": 0.0},
                      after={"eval_rewards/accuracies": 0.62}, repo_id="demo")
    assert base_model_name(None) in card.split("---")[1] and str(cache_dir()) not in card
    assert "| reward accuracy, 95% interval (Wilson) | [0.000, 0.037] | [0.522, 0.709] |" in card
    assert "datasets:\n- Anthropic/hh-rlhf\ntags:" in card and "| learning_rate | 0.0005 |" in card


def test_card_of_a_mixture_names_every_dataset_that_trained(tmp_path):
    first, second = write_hh_rows(tmp_path / "first.jsonl", 6), write_hh_rows(tmp_path / "second.jsonl", 4)
    mixture = load_mixture([{"path": str(first)}, {"path": str(second), "split": "train[:50%]"}], seed=0)["train"]
    sources = trained_sources(mixture, DataArguments(dataset="ignored/by-a-mixture"))
    assert sources == {str(first): 6, str(second): 2}  # counted from the pairs themselves
    args = DPOMinConfig(output_dir="unused")
    card = model_card(model="org/base", kind="adapter", datasets={"org/pairs-a": 5, **sources}, train_pairs=13,
                      held_out_pairs=0, args=args, reference="a frozen copy of the model", lora=None, before={},
                      after={}, repo_id="mix")
    assert "datasets:\n- org/pairs-a\ntags:" in card  # local files are named in the text, not as hub datasets
    assert (f"A mixture of 3 datasets, 13 preference pairs trained on, 0 held out; the pairs each gave to training:"
            f"\n\n- `org/pairs-a`: 5\n- `{first}`: 6\n- `{second}`: 2\n") in card
    assert "ignored/by-a-mixture" not in card and "hh-rlhf" not in card


def card_of(**options):
    args = DPOMinConfig(output_dir="unused", report_to="none", use_cpu=True, **options)
    return model_card(model="org/base", kind="adapter", datasets={"org/pairs": 4}, train_pairs=4, held_out_pairs=2,
                      args=args, reference="r", lora=None, before={"eval_loss": 0.7, "eval_rewards/accuracies": 0.0},
                      after={"eval_loss": 0.6, "eval_rewards/accuracies": 0.5}, repo_id="card"), args.loss_settings


def card_rows(card):
    return {line.split(" | ")[0].removeprefix("| "): line for line in card.splitlines() if line.startswith("| ")}


POLICY, REFERENCE, LENGTHS = (torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -5.0])), (
    torch.tensor([-5.0, -7.0]), torch.tensor([-5.5, -6.5])), torch.tensor([3.0, 5.0])


def loss_of(name, **options):
    return dpo_loss(*POLICY, *REFERENCE, loss_type=name, chosen_lengths=LENGTHS, rejected_lengths=LENGTHS,
                    **options)[0]


@pytest.mark.parametrize("options, zero", [
    ({"loss_type": "sigmoid"}, True), ({"loss_type": "sft"}, True), ({"loss_type": ["sigmoid", "simpo"]}, True),
    ({"loss_type": "cpo"}, False), ({"loss_type": "simpo"}, False), ({"loss_type": ["simpo", "sigmoid"]}, False),
    ({"loss_type": ["sft", "cpo"]}, False), ({"loss_type": "sigmoid", "reference_free": True}, False),
], ids=["sigmoid", "sft", "sigmoid+simpo", "cpo", "simpo", "simpo+sigmoid", "sft+cpo", "reference_free"])
def test_the_card_says_the_rewards_are_0_before_training_only_where_they_are(options, zero):
    # The reference: dpo_loss's rewards for a policy that is its own reference, as before training (the trainer
    # gives no reference log-probs where the loss reads none).
    card, settings = card_of(**options)
    reference = POLICY if settings.reads_reference else (None, None)
    _, chosen, rejected = dpo_loss(*POLICY, *reference, settings, chosen_lengths=LENGTHS, rejected_lengths=LENGTHS)
    assert (not chosen.any() and not rejected.any()) == zero
    assert ("before training the policy is the reference, so they are 0" in card) == zero
    assert ("no reference enters them, so before training they are the base model's own, not 0" in card) != zero


def test_the_card_lists_the_hyperparameters_each_loss_type_reads():
    # Found by changing each hyperparameter in dpo_loss (not from the table): a value a loss type refuses
    # (alpha beside a loss without AlphaPO's rewards) is one it does not read.
    changes = {"label_smoothing": 0.2, "alpha": 0.3, "simpo_gamma": 0.3, "discopop_tau": 0.1}
    read_by = {}
    for name in LOSS_TYPES:
        readers = read_by[name] = set()
        for option, value in changes.items():
            try:
                if not torch.equal(loss_of(name, label_smoothing=0.1), loss_of(name, **{"label_smoothing": 0.1,
                                                                                         option: value})):
                    readers.add(option)
            except ValueError:
                pass
        grouped = {"group_by_prompt": True} if name == "plackett_luce" else {}  # it ranks a prompt's answers
        rows = card_rows(card_of(loss_type=name, label_smoothing=0.1, **grouped)[0])
        assert set(rows) & set(changes) == readers and "beta" in rows, name
    assert read_by["simpo"] == {"label_smoothing", "alpha", "simpo_gamma"}


def test_the_cards_loss_row_is_named_by_its_loss_types_and_weights():
    options = {"loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 1.0], "cpo_alpha": 0.5}
    card, settings = card_of(**options)
    assert card_rows(card)["loss (0.8 × sigmoid + 1 × sft + 0.5 × NLL)"].endswith("| 0.7000 | 0.6000 |")
    assert card_rows(card)["loss_weights"] == "| loss_weights | 0.8, 1 |" and "| cpo_alpha | 0.5 |" in card
    # What the name says is the loss dpo_loss takes: each loss type's, weighted, plus cpo_alpha times the NLL (sft).
    combined = dpo_loss(*POLICY, *REFERENCE, settings, chosen_lengths=LENGTHS, rejected_lengths=LENGTHS)[0]
    torch.testing.assert_close(combined, 0.8 * loss_of("sigmoid") + 1.0 * loss_of("sft") + 0.5 * loss_of("sft"))
    assert "| loss (hinge) |" in card_of(loss_type="hinge")[0] and "DPO loss" not in card


def test_adapter_card_shows_the_run(tmp_path, tiny_model_dir):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, data_file, output_dir, "--beta", "0.2")) == 0
    card = (output_dir / "README.md").read_text()
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert "More Information Needed" not in card  # PEFT's template is gone
    assert f"base_model: {tiny_model_dir}\nlibrary_name: peft" in card
    after = metrics["after"]
    assert (f"| reward accuracy | {metrics['before']['eval_rewards/accuracies']:.3f} | "
            f"{after['eval_rewards/accuracies']:.3f} |") in card
    assert f"| loss (sigmoid) | {metrics['before']['eval_loss']:.4f} | {after['eval_loss']:.4f} |" in card
    assert "| beta | 0.2 |" in card and "| loss_type | sigmoid |" in card and "| lora_r | 16 |" in card
    assert "| reference | the base model (the adapter disabled) |" in card  # the trainer's own description
    assert f"`{data_file}`: 4 preference pairs trained on, 3 held out."  # 2 steps of 2 in card
    assert "![training curves](training_curves.png)" in card and (output_dir / "training_curves.png").exists()
    import transformers
    assert f"- transformers: {transformers.__version__}" in card and "rafailov2023direct" in card


def test_merged_model_is_pushed_with_its_card_under_the_output_folders_name(tmp_path, tiny_model_dir, fake_hub):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "my-dpo"
    assert main(tiny_args(tiny_model_dir, data_file, output_dir, "--merge_adapter", "--push_to_hub")) == 0
    [(repo_id, folder, files)] = fake_hub.uploads
    assert repo_id == "my-dpo" and folder == str(output_dir)
    assert {"model.safetensors", "config.json", "README.md", "training_curves.png"} <= set(files)
    card = (output_dir / "README.md").read_text()
    assert "library_name: transformers" in card and "with a LoRA adapter merged in" in card
    assert "AutoModelForCausalLM.from_pretrained('my-dpo')" in card


@pytest.mark.parametrize("extra, whoami_error, code, message", [
    (["--hub_model_id", "runs/my run"], None, 2, "'runs/my run' is not a hub repository name"),
    ([], ConnectionError("[Errno -2] Name or service not known"), 1,
     "cannot reach the Hub as a logged-in user ([Errno -2] Name or service not known)"),
], ids=["invalid-name", "offline"])
def test_push_to_hub_is_checked_before_any_work(tmp_path, capsys, fake_hub, extra, whoami_error, code, message):
    fake_hub.whoami_error = whoami_error
    # No model and no data exist: a run that got past the check would fail on them instead.
    assert main(["--model", str(tmp_path / "no-model"), "--dataset", str(tmp_path / "no.jsonl"), "--output_dir",
                 str(tmp_path / "out"), "--push_to_hub", *extra]) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not os.listdir(tmp_path)


def test_a_failed_push_after_publishing_is_one_line_and_the_run_stays(tmp_path, tiny_model_dir, fake_hub, capsys):
    fake_hub.create_repo_error = ConnectionError("the network went down")
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "my-dpo"
    assert main(tiny_args(tiny_model_dir, data_file, output_dir, "--push_to_hub")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"python -m dpo_min.train: error: the push to my-dpo failed (the network went down); the run "
                         f"is safe in {output_dir}: upload it with `hf upload my-dpo {output_dir}`")
    assert json.loads((output_dir / "dpo_min_run.json").read_text())["complete"] is True
    assert (output_dir / "adapter_model.safetensors").exists()


def test_a_hub_token_is_used_for_the_push_and_written_nowhere(tmp_path, tiny_model_dir, fake_hub, capsys, caplog):
    # Trainer pickles the whole TrainingArguments into training_args.bin (the folder and every checkpoint), which
    # the push uploads: the token must reach the Hub client and no file, log or TensorBoard event.
    token, used = "hf_dpoMinSecret0123456789abcdef", fake_hub.tokens
    caplog.set_level(logging.DEBUG)
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "my-dpo"
    assert main(tiny_args(tiny_model_dir, data_file, output_dir, "--push_to_hub", "--hub_token", token,
                          "--save_strategy", "steps", "--save_steps", "1", "--report_to", "tensorboard")) == 0
    assert used and set(used) == {token}  # the check before the run and the push both had it
    files = [path for path in output_dir.rglob("*") if path.is_file()]
    written = {str(path.relative_to(output_dir)) for path in files}
    assert {"training_args.bin", "checkpoint-1/training_args.bin", "checkpoint-2/training_args.bin",
            "dpo_min_run.json", "README.md"} <= written
    assert any("tfevents" in name for name in written)
    assert [path for path in files if token.encode() in path.read_bytes()] == []
    captured = capsys.readouterr()
    assert token not in captured.out + captured.err + caplog.text


def test_hub_model_revision_pushes_to_that_branch(tmp_path, fake_hub):
    from dpo_min.train.hub import push_to_hub

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: org/model\nhub_model_revision: dpo-beta-0.01\n")
    _, _, args = parse_args(["--config", str(recipe)])
    push_to_hub(tmp_path, "me/zephyr", revision=args.hub_revision)
    assert fake_hub.calls == [("create_repo", "me/zephyr", None), ("create_branch", "me/zephyr", "dpo-beta-0.01"),
                              ("upload_folder", "me/zephyr", "dpo-beta-0.01")]
    fake_hub.calls.clear()
    push_to_hub(tmp_path, "me/zephyr")  # no revision: the main branch, as before
    assert fake_hub.calls == [("create_repo", "me/zephyr", None), ("upload_folder", "me/zephyr", None)]


def test_offline_with_a_hub_token_does_not_ask_for_one(monkeypatch):
    from huggingface_hub import constants

    from dpo_min.train.hub import check_hub_access

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as error:
        check_hub_access("me/model", token=SECRET)
    assert "offline mode is enabled" in str(error.value) and "pass --hub_token" not in str(error.value)
    assert "check --hub_token and that the Hub can be reached" in str(error.value) and SECRET not in str(error.value)
    with pytest.raises(OSError, match="log in with `hf auth login` or pass --hub_token"):
        check_hub_access("me/model")
