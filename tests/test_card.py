"""The model card dpo_min writes, and the push to the Hub (the upload replaced by a recorder: no network)."""

import json
from types import SimpleNamespace

import huggingface_hub
import pytest
from conftest import write_hh_rows

from dpo_min.card import base_model_name, hub_repo_id, model_card
from dpo_min.config import DPOMinConfig
from dpo_min.models import cache_dir
from dpo_min.report import wilson_interval
from dpo_min.train import main


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
    assert hub_repo_id(tmp_path / "runs" / "my-dpo.partial") == "my-dpo"
    assert hub_repo_id(tmp_path / "my-dpo", hub_model_id="me/other") == "me/other"


def test_card_of_the_default_model_names_the_hub_model_not_the_cache():
    args = DPOMinConfig(output_dir="unused", max_steps=8, learning_rate=5e-4)
    card = model_card(model=None, kind="adapter", dataset="Anthropic/hh-rlhf", train_pairs=32, held_out_pairs=100,
                      args=args, lora={"r": 16}, before={"eval_rewards/accuracies": 0.0},
                      after={"eval_rewards/accuracies": 0.62}, repo_id="demo")
    assert base_model_name(None) in card.split("---")[1] and str(cache_dir()) not in card
    assert "| reward accuracy, 95% interval (Wilson) | [0.000, 0.037] | [0.522, 0.709] |" in card
    assert "datasets:\n- Anthropic/hh-rlhf" in card and "| learning_rate | 0.0005 |" in card


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
    assert f"| DPO loss | {metrics['before']['eval_loss']:.4f} | {after['eval_loss']:.4f} |" in card
    assert "| beta | 0.2 |" in card and "| loss_type | sigmoid |" in card and "| lora_r | 16 |" in card
    assert f"`{data_file}`: 4 preference pairs trained on, 3 held out."  # 2 steps of 2 in card
    assert "![training curves](training_curves.png)" in card and (output_dir / "training_curves.png").exists()
    import transformers
    assert f"- transformers: {transformers.__version__}" in card and "rafailov2023direct" in card


def test_merged_model_is_pushed_with_its_card_under_the_output_folders_name(tmp_path, tiny_model_dir, monkeypatch):
    uploads = []

    class RecordingApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploads.append((repo_id, folder_path, sorted(p.name for p in __import__("pathlib").Path(folder_path)
                                                         .iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "my-dpo"
    assert main(tiny_args(tiny_model_dir, data_file, output_dir, "--merge_adapter", "--push_to_hub")) == 0
    [(repo_id, folder, files)] = uploads
    assert repo_id == "my-dpo" and folder == str(output_dir)
    assert {"model.safetensors", "config.json", "README.md", "training_curves.png"} <= set(files)
    card = (output_dir / "README.md").read_text()
    assert "library_name: transformers" in card and "with a LoRA adapter merged in" in card
    assert "AutoModelForCausalLM.from_pretrained('my-dpo')" in card
