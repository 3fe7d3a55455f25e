"""The DPO runs of tests/test_zero.py: `python tests/zero_worker.py OUT` (plain, one process) or `torchrun
--nproc_per_node 2 tests/zero_worker.py OUT --deepspeed` (each case under its DeepSpeed ZeRO stage, on DeepSpeed's
CPU accelerator over gloo). For each case
writes OUT/CASE/run.json (per-step losses; whether the policy and the reference were partitioned) and, through
save_model, OUT/CASE/saved. Every case runs in one launch: starting a process is most of the cost here."""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_llama
from test_layouts import random_pairs

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.models import convert_gguf, default_gguf_path

# (ZeRO stage, settings, reference): "path" loads a separate reference model from the checkpoint (under ZeRO-3 it
# is partitioned at load), "copy" lets the trainer copy the policy, "adapter" is LoRA's adapter switched off.
CASES = {
    "zero3_full": (3, {"padding_free": True}, "path"),
    "zero3_lora_precompute": (3, {"precompute_ref_log_probs": True, "share_prompt": True}, "adapter"),
    "zero2_full_sync": (2, {"sync_ref_model": True, "ref_model_sync_steps": 1}, "copy"),
}


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True}


def main(output_dir: Path, case: str, model_dir: Path, use_deepspeed: bool) -> None:
    stage, settings, reference = CASES[case]
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # the global batch is 4 pairs in any process count
    args = DPOMinConfig(output_dir=str(output_dir), per_device_train_batch_size=4 // processes, max_steps=3,
                        learning_rate=5e-3,
                        warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                        disable_tqdm=True, seed=7, max_grad_norm=1.0,
                        deepspeed=deepspeed_config(stage) if use_deepspeed else None, **settings)
    if use_deepspeed and processes > 1:
        import deepspeed

        # On CPU accelerate joins the processes over gloo without telling DeepSpeed, whose config would then count
        # one process (on GPUs accelerate initialises DeepSpeed's communication itself).
        deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(default_gguf_path())))
    # Loaded after the config: under ZeRO-3 from_pretrained partitions the weights as it loads them.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    trainer = DPOMinTrainer(model, str(model_dir) if reference == "path" else None, args=args,
                            train_dataset=Dataset.from_list(random_pairs(12)), processing_class=tokenizer,
                            peft_config=lora if reference == "adapter" else None)
    trainer.train()
    trainer.save_model(str(output_dir / "saved"))
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    ref = [] if trainer.ref_model is None else list(trainer.ref_model.parameters())
    if trainer.args.process_index != 0:
        return
    policy = list(trainer.model.parameters())
    (output_dir / "run.json").write_text(json.dumps({
        # This process's share of the policy's weights: 1/N of them under ZeRO-3 (padded to whole partitions).
        "local_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in policy),
        "full_numel": sum(getattr(p, "ds_numel", p.numel()) for p in policy),
        "losses": [entry["loss"] for entry in steps],
        "grad_norms": [entry["grad_norm"] for entry in steps],
        "policy_partitioned": [hasattr(p, "ds_id") for p in policy],
        "reference_partitioned": [hasattr(p, "ds_id") for p in ref],
        "reference_is_engine": type(trainer.ref_model).__name__ == "DeepSpeedEngine",
    }))


def refusals(output_dir: Path, model_dir: Path) -> None:
    """Under ZeRO-3: what is refused, and the error each gives (written to OUT/refusals.json)."""
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(default_gguf_path())))
    messages = {}
    cases = {"sync_ref_model": ({"sync_ref_model": True}, str(model_dir)), "full_without_reference": ({}, None)}
    for name, (settings, reference) in cases.items():
        args = DPOMinConfig(output_dir=str(output_dir / name), report_to="none", use_cpu=True,
                            deepspeed=deepspeed_config(3), **settings)
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # partitioned as it loads
        try:
            DPOMinTrainer(model, reference, args=args, train_dataset=Dataset.from_list(random_pairs(4)),
                          processing_class=tokenizer)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    if int(os.environ.get("RANK", "0")) == 0:
        (output_dir / "refusals.json").write_text(json.dumps(messages))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, use_deepspeed = Path(sys.argv[1]), "--deepspeed" in sys.argv
    if use_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.comm.torch

        # DeepSpeed compiles a shared-memory all-reduce for its CPU accelerator on first use (minutes of C++, and a
        # lock under ~/.cache/torch_extensions that every later run waits on if the compile is killed); gloo's own
        # collectives serve the test as well.
        deepspeed.comm.torch.build_shm_op = lambda: None
    model_dir = out / "model"
    if not model_dir.exists():
        tiny_llama(vocab_size=64).save_pretrained(model_dir)
    for name in CASES:
        main(out / name, name, model_dir, use_deepspeed)
    if use_deepspeed:
        refusals(out, model_dir)
