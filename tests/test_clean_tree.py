"""The checkout stays clean: the commands' default output folders are ignored by git, and the tests write into
their tmp_path, not the working folder (conftest.py's session check fails a run that leaves anything at the
repository's root)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import HEREDOC, PAGES, _bash_blocks

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


def _ignored_by_git(path: str) -> bool:
    """Whether .gitignore ignores `path` (relative, from the root) by one of its folder lines ("runs/", "/runs/")."""
    folders = {line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if line.endswith("/")}
    return any(part in folders for part in Path(path).parts[:-1]) or path.rstrip("/") in folders


def test_readme_installs_into_a_virtual_environment_git_ignores():
    # README's install block began with pip: into whatever Python came first on PATH, the system's included.
    section = (ROOT / "README.md").read_text().split("## Install and run")[1].split("\n## ")[0]
    block = _bash_blocks(section)[0]
    venv = re.match(r"python3 -m venv (\S+) && source \1/bin/activate\n", block)
    assert venv, block
    assert "pip install" in block[venv.end():] and "pip install" not in block[:venv.end()]
    assert _ignored_by_git(f"{venv[1].strip('/')}/")


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_the_files_a_page_writes_land_in_a_folder_git_ignores_that_it_makes(page):
    # docs/groups.md wrote ranked.jsonl at the root of the checkout of whoever ran its example, untracked.
    text = page.read_text()
    for found in HEREDOC.finditer(text):
        name = found[1]
        assert _ignored_by_git(name), f"{page.name} writes {name} into the checkout"
        assert f"mkdir -p {Path(name).parent}" in text[:found.start()], f"{page.name}: {name}'s folder is not made"


def test_the_pages_write_files():
    assert sum(len(HEREDOC.findall(page.read_text())) for page in PAGES) >= 5  # the test above checks something
