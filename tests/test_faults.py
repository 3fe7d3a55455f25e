"""Numerical faults stop training loudly; checkpoints are all-or-nothing; runs are deterministic."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT, stopping_reference, tiny_llama, write_hh_rows
from test_trainer import config, lora, step_logs
from transformers.trainer_utils import get_last_checkpoint

import dpo_min.trainer as trainer_module
from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.train.resume import checkpoint_problems


def test_non_finite_loss_names_the_step_and_quantity_and_keeps_the_checkpoint(tmp_path, tokenizer, hh_pairs,
                                                                               monkeypatch):
    real_sequence_logps = trainer_module.sequence_logps
    calls = []

    def logps_with_an_inf_in_the_third_policy_forward(model, batch, **kwargs):
        result = real_sequence_logps(model, batch, **kwargs)
        calls.append(1)
        if len(calls) == 5:  # each step: policy, then reference; call 5 is step 3's policy forward
            result.logps = result.logps + torch.tensor([float("-inf")] + [0.0] * (len(result.logps) - 1))
        return result

    monkeypatch.setattr(trainer_module, "sequence_logps", logps_with_an_inf_in_the_third_policy_forward)
    args = DPOMinConfig(**config(tmp_path, max_steps=4, save_strategy="steps", save_steps=1))
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs, processing_class=tokenizer,
                            peft_config=lora())
    with pytest.raises(FloatingPointError, match=r"step 3: .*policy chosen logps"):
        trainer.train()
    last = get_last_checkpoint(args.output_dir)
    assert last.endswith("checkpoint-2")
    assert os.path.exists(os.path.join(last, "adapter_model.safetensors"))


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_non_finite_gradient_stops_before_the_optimizer_step(tmp_path, tokenizer, hh_pairs, max_grad_norm):
    model = tiny_llama()
    args = DPOMinConfig(**config(tmp_path, max_steps=3, max_grad_norm=max_grad_norm))
    trainer = DPOMinTrainer(model, args=args, train_dataset=hh_pairs,
                            processing_class=tokenizer, ref_model=tiny_llama())
    target = model.model.layers[1].mlp.down_proj.weight
    target.register_hook(lambda grad: grad * float("nan") if trainer.state.global_step == 1 else grad)
    with pytest.raises(FloatingPointError, match=r"step 2: non-finite gradient in .*layers.1.mlp.down_proj"):
        trainer.train()
    assert torch.isfinite(target).all()  # the poisoned step never reached the weights


def test_same_seed_gives_bit_identical_losses(tmp_path, tokenizer, hh_pairs):
    runs = []
    for _ in range(2):
        trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path)), train_dataset=hh_pairs,
                                processing_class=tokenizer, peft_config=lora())
        trainer.train()
        runs.append([(entry["loss"], entry["rewards/margins"], entry["grad_norm"]) for entry in step_logs(trainer)])
    assert runs[0] == runs[1]


def test_bf16_model_keeps_log_probs_and_loss_in_float32(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama().to(torch.bfloat16), args=DPOMinConfig(**config(tmp_path)),
                            train_dataset=hh_pairs, processing_class=tokenizer, peft_config=lora())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.dtype == torch.float32
    assert trainer.reference_logps(batch).logps.dtype == torch.float32


KILL_DURING_SAVE = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, "tests")
    from conftest import tiny_llama, HH_PATH
    from transformers import AutoTokenizer, Trainer
    from dpo_min import DPOMinConfig, DPOMinTrainer, load_preference_dataset
    from dpo_min.models import convert_gguf, default_gguf_path

    real_save_rng_state = Trainer._save_rng_state
    def save_rng_state_then_stall(self, output_dir):
        real_save_rng_state(self, output_dir)
        if self.state.global_step == 2:
            print("SAVING", flush=True)
            time.sleep(600)
    Trainer._save_rng_state = save_rng_state_then_stall
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(default_gguf_path())))
    pairs = load_preference_dataset(str(HH_PATH)).select(range(8))
    args = DPOMinConfig(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=4, save_steps=1,
                        report_to="none", max_length=128, use_cpu=True, disable_tqdm=True)
    DPOMinTrainer(tiny_llama(), args=args, train_dataset=pairs, processing_class=tokenizer).train()
''')


def test_kill_during_save_leaves_only_complete_checkpoints(tmp_path):
    output_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, str(output_dir)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in process.stdout:
            if line.strip() == "SAVING":
                break
        process.kill()  # SIGKILL while checkpoint-2 is half written
    finally:
        process.wait(timeout=60)
    assert process.returncode == -9
    assert os.path.isdir(output_dir / ".staging-checkpoint-2")  # the half-written one
    assert get_last_checkpoint(str(output_dir)).endswith("checkpoint-1")
    assert os.path.exists(output_dir / "checkpoint-1" / "trainer_state.json")


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_stop_the_command_in_the_same_one_line_keeping_whole_checkpoints(
        tmp_path, tiny_model_dir, signal_number):
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    staging = tmp_path / "run.partial"
    argv = [sys.executable, "-m", "dpo_min.train", "--model", str(tiny_model_dir), "--dataset", str(data),
            "--output_dir", str(tmp_path / "run"), "--max_steps", "1000", "--save_strategy", "steps",
            "--save_steps", "1", "--per_device_train_batch_size", "2", "--num_samples", "0", "--disable_tqdm", "true"]
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while not (staging / "checkpoint-2").is_dir() and process.poll() is None:
            time.sleep(0.1)
        process.send_signal(signal_number)  # while the run trains on and saves checkpoint-3, -4, ...
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal_number
    # stderr less transformers' progress bars ("Loading weights: 100%|...| 21/21 [00:00<...]")
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert lines == [f"python -m dpo_min.train: stopped by {signal.Signals(signal_number).name}; checkpoints of the "
                     f"interrupted run kept in {staging} (add --resume_from_checkpoint latest to go on from the "
                     "newest)"]
    checkpoints = sorted(staging.glob("checkpoint-*"))
    assert len(checkpoints) >= 2 and not any(checkpoint_problems(path) for path in checkpoints)
    assert sorted(os.listdir(tmp_path)) == ["pairs.jsonl", "run.partial"]  # no lock file, no staging leftovers


def test_ctrl_c_in_the_reference_pass_keeps_its_finished_batches_and_says_the_same_command_goes_on(
        tmp_path, tiny_model_dir, capsys, monkeypatch):
    from dpo_min.train import main

    monkeypatch.setenv("DPO_MIN_CACHE", str(tmp_path / "cache"))
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    argv = ["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(tmp_path / "run"),
            "--num_train_epochs", "1", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--eval_fraction", "0", "--num_samples", "0", "--precompute_ref_log_probs", "true",
            "--disable_tqdm", "true"]  # 12 pairs: 6 batches of 2
    with monkeypatch.context() as patch:
        patch.setattr(DPOMinTrainer, "reference_logps", stopping_reference(4)[0])
        assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m dpo_min.train: stopped by SIGINT; the reference log-probs of 3 of 6 batches cached: the same "
        "command starts after them")
    counted, calls = stopping_reference(0)  # counts, stops never
    with monkeypatch.context() as patch:
        patch.setattr(DPOMinTrainer, "reference_logps", counted)
        assert main(argv) == 0
    assert len(calls) == 3  # the batches the stopped pass had not finished
