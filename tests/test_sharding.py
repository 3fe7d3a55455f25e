"""FSDP2 applied by dpo_min (shard_with_fsdp2) shards on CPU over gloo: two processes hold half of every weight and
train exactly as one unsharded process with the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_llama
from datasets import Dataset
from safetensors.torch import load_file
from test_layouts import random_pairs
from test_trainer import config

from dpo_min import DPOMinConfig, DPOMinTrainer

WORKER = ROOT / "tests" / "fsdp2_worker.py"
WEIGHTS = {"full": "model.safetensors", "lora": "adapter_model.safetensors"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def results(output_dir, case):
    run_file, weights = output_dir / case / "run.json", output_dir / case / "saved" / WEIGHTS[case]
    return json.loads(run_file.read_text()), load_file(weights)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case of tests/fsdp2_worker.py, in one unsharded process and in two sharded ones."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    run([sys.executable, str(WORKER), str(one)])
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(WORKER), str(two)])
    return one, two


# full: full fine-tuning, the frozen reference copy sharded too, TR-DPO mixing it every step, packed shared prompts.
# lora: LoRA adapters sharded with the base weights, the reference log-probs precomputed on every rank first.
@pytest.mark.parametrize("case", ["full", "lora"])
def test_two_sharded_processes_train_as_one_unsharded_process(runs, case):
    (one_run, one_weights), (two_run, two_weights) = (results(output_dir, case) for output_dir in runs)
    assert all(two_run["trainable_dtensors"]) and not any(one_run["trainable_dtensors"])
    assert all(two_run["reference_dtensors"]) and len(two_run["reference_dtensors"]) == (case == "full") * 21
    assert two_run["local_shard_numel"] == two_run["full_numel"] // 2  # each process holds half of every weight
    assert len(one_run["losses"]) == len(two_run["losses"]) == 3
    torch.testing.assert_close(two_run["losses"], one_run["losses"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two_run["grad_norms"], one_run["grad_norms"], rtol=0, atol=1e-5)
    # The saved weights are gathered whole (not rank 0's shard) and equal the unsharded run's.
    assert one_weights.keys() == two_weights.keys() and one_weights
    for name, weight in one_weights.items():
        torch.testing.assert_close(two_weights[name], weight, rtol=0, atol=1e-5, msg=name)
    assert len(set(one_run["losses"])) == 3  # training moved the weights


def test_shard_with_fsdp2_in_one_process_is_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="shard_with_fsdp2 needs several processes"):
        DPOMinTrainer(tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, shard_with_fsdp2=True)),
                      train_dataset=Dataset.from_list(random_pairs(2)), processing_class=tokenizer)
