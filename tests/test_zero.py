"""DeepSpeed ZeRO-2 and ZeRO-3 with two processes on DeepSpeed's CPU accelerator (over gloo) against one process
without DeepSpeed, with the same global batch: the weights are partitioned under ZeRO-3 (each process holds half),
the reference gets an engine of its own (partitioned under ZeRO-3), the precompute pass runs through an inference
engine, TR-DPO syncs under ZeRO-2, and the per-step losses and saved weights agree."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file
from zero_worker import CASES


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_worker(output_dir, *flags, processes=1):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
        str(free_port())]
    result = subprocess.run([*launcher, str(ROOT / "tests" / "zero_worker.py"), str(output_dir), *flags],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def weights(folder):
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def test_zero_runs_equal_the_plain_runs(tmp_path):
    # One test for every case: each launch runs all cases (starting a process is most of the cost), and a fixture
    # shared by several tests would be launched again by each test process of pytest-xdist.
    plain_dir, zero_dir = tmp_path / "plain", tmp_path / "zero"
    run_worker(plain_dir)
    zero_dir.mkdir()
    (zero_dir / "model").symlink_to(plain_dir / "model", target_is_directory=True)  # the same initial weights
    run_worker(zero_dir, "--deepspeed", processes=2)
    for case, (stage, _, reference) in CASES.items():
        plain, zero = (json.loads((folder / case / "run.json").read_text()) for folder in (plain_dir, zero_dir))
        assert len(zero["losses"]) == 3, case
        assert zero["losses"] == pytest.approx(plain["losses"], abs=1e-5), case
        assert zero["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-4), case
        assert not any(plain["policy_partitioned"]) and not any(plain["reference_partitioned"]), case
        assert all(zero["policy_partitioned"]) == (stage == 3), case
        if stage == 3:  # each of the two processes holds half of every weight (partitions padded to equal sizes)
            assert zero["local_numel"] <= zero["full_numel"] / 2 + 64, case
        if reference in ("path", "copy"):  # a reference model: an engine of its own, partitioned only under ZeRO-3
            assert zero["reference_is_engine"], case
            assert all(zero["reference_partitioned"]) == any(zero["reference_partitioned"]) == (stage == 3), case
        expected, saved = weights(plain_dir / case / "saved"), weights(zero_dir / case / "saved")
        assert expected.keys() == saved.keys(), case
        largest = max((expected[name].float() - saved[name].float()).abs().max().item() for name in expected)
        assert largest <= 1e-5, (case, largest)
        assert all(torch.isfinite(tensor).all() for tensor in saved.values()), case
        if reference != "adapter":  # the run moved the weights, so equal weights say something
            initial = load_file(plain_dir / "model" / "model.safetensors")
            assert max((expected[name] - initial[name]).abs().max().item() for name in expected) > 1e-3, case
    refusals = json.loads((zero_dir / "refusals.json").read_text())
    assert "sync_ref_model (TR-DPO) is not supported under DeepSpeed ZeRO-3" in refusals["sync_ref_model"]
    assert "full fine-tuning under DeepSpeed ZeRO-3 needs a reference" in refusals["full_without_reference"]
