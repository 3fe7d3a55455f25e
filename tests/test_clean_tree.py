"""The checkout stays clean: the commands' default output folders are ignored by git, and the tests write into
their tmp_path, not the working folder (conftest.py's session check fails a run that leaves anything at the
repository's root)."""

import os
import subprocess
import sys
from pathlib import Path

from dpo_min.train.args import COMMAND_DEFAULTS
from dpo_min.train.rounds_args import ROUNDS_COMMAND_DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
# They build TRL's DPOTrainer, which makes its output_dir: given "unused", they left an empty unused/ behind.
TRL_TRAINER_TESTS = ["tests/test_data.py::test_token_ids_equal_trl",
                     "tests/test_layouts_published.py::test_tool_use_rows_give_the_tools_to_the_chat_template_as_trl"]


def test_gitignore_names_the_default_output_folder_of_each_command():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for folder in (COMMAND_DEFAULTS["output_dir"], ROUNDS_COMMAND_DEFAULTS["output_dir"]):  # offline, --rounds
        assert f"{folder}/" in ignored, folder


def test_the_tests_that_build_trls_trainer_leave_nothing_in_the_working_folder(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p",
                             "no:randomly", "--rootdir", str(ROOT), *[str(ROOT / test) for test in TRL_TRAINER_TESTS]],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == []
