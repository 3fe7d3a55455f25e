"""checkpoints.py: each checkpoint written whole into a staging folder and renamed into place, and only its final
path recorded (the best checkpoint) and pushed. The kill during a save is tests/test_faults.py's; the resumed run
equal to an uninterrupted one, tests/test_resume.py's."""

import ast
import hashlib
import inspect
import json
import os
import textwrap
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
import transformers.trainer
from conftest import tiny_llama
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from test_trainer import config, lora
from transformers import Trainer, TrainerCallback

from dpo_min import DPOMinConfig, DPOMinTrainer, checkpoints


class Killed(Exception):
    """Stands for a kill right after a checkpoint is saved."""


class KillAfterSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Killed


def test_the_best_checkpoint_is_recorded_by_its_path_and_a_resumed_run_keeps_it_and_ends_on_it(tmp_path, tokenizer,
                                                                                               hh_pairs):
    """With load_best_model_at_end and save_total_limit, the trainer state records the best checkpoint as
    checkpoint-N, as Trainer records it: it named a staging folder gone after the rename, so a resumed run forgot
    it, its rotation deleted the best checkpoint and the run ended on the last step's weights."""
    scores = {1: 0.0, 2: 1.0, 3: 0.5, 4: 0.2}  # the best is step 2's
    args = DPOMinConfig(**config(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, eval_strategy="steps",
                                 eval_steps=1, save_total_limit=1, load_best_model_at_end=True,
                                 metric_for_best_model="score", greater_is_better=True))
    output_dir = tmp_path / "out"

    def trainer(*callbacks):
        made = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(8)),
                             eval_dataset=hh_pairs.select(range(2)), processing_class=tokenizer, peft_config=lora(),
                             compute_metrics=lambda _: {"score": scores[made.state.global_step]},
                             callbacks=list(callbacks))
        return made

    with pytest.raises(Killed):
        trainer(KillAfterSave(2)).train()
    recorded = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert recorded["best_model_checkpoint"] == os.path.join(args.output_dir, "checkpoint-2")
    best_weights = load_file(output_dir / "checkpoint-2" / "adapter_model.safetensors")

    resumed = trainer()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert resumed.state.best_model_checkpoint == os.path.join(args.output_dir, "checkpoint-2")
    assert (output_dir / "checkpoint-2").is_dir()
    ended_on = get_peft_model_state_dict(resumed.model)
    assert ended_on.keys() == best_weights.keys()
    assert all(torch.equal(ended_on[name], best_weights[name]) for name in best_weights)


class BackgroundHub:
    """transformers' Hub client as Trainer's checkpoint push uses it, with nothing sent: `upload_folder` returns a
    job (Trainer asks for `run_as_future=True`), and the job reads its folder once the save has returned, as a
    background upload does. `uploads` holds (path in the repo, folder, the folder's files then, or None: gone)."""

    def __init__(self):
        self.pending, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, path_in_repo=None, **kwargs):
        job = Future()
        self.pending.append((job, path_in_repo, folder_path))
        return job

    def run_pending(self) -> None:
        for job, path_in_repo, folder in self.pending:
            self.uploads.append((path_in_repo, folder, sorted(os.listdir(folder)) if os.path.isdir(folder) else None))
            job.set_result(None)
        self.pending = []


class UploadAfterSave(TrainerCallback):
    def __init__(self, hub: BackgroundHub):
        self.hub = hub

    def on_save(self, args, state, control, **kwargs):
        self.hub.run_pending()


def test_a_push_uploads_each_checkpoint_from_its_final_folder(tmp_path, tokenizer, hh_pairs, monkeypatch):
    """push_to_hub with save_steps, in Python: each checkpoint push uploads checkpoint-N and the output folder,
    whole, while the upload runs; it uploaded the staging folder, which the save deleted at once."""
    hub = BackgroundHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    args = DPOMinConfig(**config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                                 hub_model_id="me/run", hub_strategy="checkpoint"))
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(4)),
                            processing_class=tokenizer, peft_config=lora(), callbacks=[UploadAfterSave(hub)])
    trainer.train()
    assert [(path_in_repo, folder) for path_in_repo, folder, _ in hub.uploads] == [
        (None, args.output_dir), ("last-checkpoint", os.path.join(args.output_dir, "checkpoint-1")),
        (None, args.output_dir), ("last-checkpoint", os.path.join(args.output_dir, "checkpoint-2"))]
    for path_in_repo, _, files in hub.uploads:
        assert files is not None and "adapter_model.safetensors" in files
        if path_in_repo:
            assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "training_args.bin"} <= set(files)
    # Trainer's own record of the run names the output folder, never a staging one.
    assert torch.load(os.path.join(args.output_dir, "checkpoint-2", "training_args.bin"),
                      weights_only=False).output_dir == args.output_dir


def _calls(function) -> set[str]:
    """The names a function calls: `f(...)`, `self.f(...)`, `self.state.f(...)` -> f."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))}


def test_the_installed_trainers_save_checkpoint_is_the_source_save_whole_was_read_against():
    """A private method copied in steps: any change to it, even one that keeps its calls, is read again by a person."""
    installed = hashlib.sha256(inspect.getsource(Trainer._save_checkpoint).encode()).hexdigest()
    assert installed in checkpoints.SAVE_CHECKPOINT_SHA256, (
        f"transformers {transformers.__version__} changed Trainer._save_checkpoint (sha256 {installed}): read "
        "dpo_min/checkpoints.py's save_whole against it, then add the hash")


def test_save_whole_takes_the_steps_of_trainers_save_checkpoint():
    """checkpoints.save_whole takes the steps of transformers' Trainer._save_checkpoint in its own order: if
    transformers adds a step (another file in a checkpoint), this fails rather than the checkpoints going without."""
    steps = {"store_flos", "save_model", "_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state", "state",
             "save_to_json", "_push_from_checkpoint", "rotate_checkpoints"}
    barriers = {"rendezvous", "barrier", "is_torch_xla_available", "is_sagemaker_mp_enabled"}
    plumbing = {"join", "exists", "isinstance", "append", "_get_output_dir"}
    assert _calls(Trainer._save_checkpoint) - barriers - plumbing == steps
    assert steps <= _calls(checkpoints.save_whole) | _calls(checkpoints._write)
