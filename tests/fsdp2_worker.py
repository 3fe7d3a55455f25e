"""The DPO runs of tests/test_sharding.py: `torchrun --nproc_per_node 2 tests/fsdp2_worker.py OUT` (sharded with
FSDP2) or `python tests/fsdp2_worker.py OUT` (one process, unsharded). For each case writes OUT/CASE/run.json
(per-step losses, whether parameters were DTensors) and, through save_model, OUT/CASE/saved. Both cases run in one
launch: starting processes is most of the cost on a small machine."""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_llama
from test_layouts import random_pairs

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.models import convert_gguf, default_gguf_path

# Settings that differ between cases; the global batch is 4 pairs in either process count.
CASES = {
    "full": {"sync_ref_model": True, "ref_model_sync_steps": 1, "padding_free": True, "share_prompt": True},
    "lora": {"precompute_ref_log_probs": True, "padding_free": True},
}


def main(output_dir: str, case: str) -> None:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    args = DPOMinConfig(output_dir=output_dir, per_device_train_batch_size=4 // processes, max_steps=3,
                        learning_rate=5e-3, warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=True, disable_tqdm=True, seed=7, max_grad_norm=1.0, shard_with_fsdp2=processes > 1,
                        **CASES[case])
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(default_gguf_path())))
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    trainer = DPOMinTrainer(tiny_llama(vocab_size=64), args=args, train_dataset=Dataset.from_list(random_pairs(12)),
                            processing_class=tokenizer, peft_config=lora if case == "lora" else None)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    reference = [] if trainer.ref_model is None else list(trainer.ref_model.parameters())
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "saved"))
    if trainer.args.process_index == 0:
        steps = [entry for entry in trainer.state.log_history if "loss" in entry]
        Path(output_dir, "run.json").write_text(json.dumps({
            "losses": [entry["loss"] for entry in steps],
            "grad_norms": [entry["grad_norm"] for entry in steps],
            "trainable_dtensors": [isinstance(p, DTensor) for p in trainable],
            "reference_dtensors": [isinstance(p, DTensor) for p in reference],
            "local_shard_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trainable),
            "full_numel": sum(p.numel() for p in trainable),
        }))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in CASES:
        main(os.path.join(sys.argv[1], name), name)
