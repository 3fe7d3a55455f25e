"""dpo_min/devices.py: the one check for an accelerator, and what the command tells DeepSpeed from it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from conftest import write_hh_rows
from test_train import tiny_run_args

from dpo_min import devices

ROOT = Path(__file__).resolve().parent.parent


def test_deepspeed_is_told_the_cpu_only_where_there_is_no_accelerator_and_nothing_was_set(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "unset by the test")  # restored (removed) at the end, whatever happens
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(devices, "has_accelerator", lambda: True)
    devices.deepspeed_on_cpu()
    assert "DS_ACCELERATOR" not in os.environ  # DeepSpeed finds the GPU itself
    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    devices.deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    devices.deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "xpu"  # the user's own choice stays


def test_a_run_prints_no_deepspeed_accelerator_warning(tmp_path, tiny_model_dir):
    # The test extra installs DeepSpeed, and accelerate imports it in every run (unwrap_model, when the trainer is
    # built): without DS_ACCELERATOR DeepSpeed printed "[WARNING] ... Setting accelerator to CPU" on stdout.
    assert importlib.util.find_spec("deepspeed") is not None
    argv = tiny_run_args(tiny_model_dir, write_hh_rows(tmp_path / "pairs.jsonl", 12), tmp_path / "run",
                         "--max_steps", "1")
    code = (f"import sys\nfrom dpo_min.train import main\ncode = main({argv!r})\n"
            "print('deepspeed imported:', 'deepspeed' in sys.modules)\nsys.exit(code)")
    env = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed imported: True" in result.stdout  # else the check below would hold trivially
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
