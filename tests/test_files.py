"""files.py says it is the package's one way to write a file whole, and names every writer that is not, with its
reason. Every write call in dpo_min/ is read from the source: one outside `files.staged` (or the rounds'
`written_whole`, built on it) in a module files.py does not name fails, and so does a module it names that no longer
writes by other means."""

import ast
import re
from pathlib import Path

import dpo_min.files

PACKAGE = Path(dpo_min.files.__file__).parent
# Calls that put bytes on disk or move a file onto a name: module functions, and methods of any object.
MODULE_WRITES = {("os", "replace"), ("os", "rename"), ("torch", "save"), ("json", "dump"), ("shutil", "copy"),
                 ("shutil", "copyfile"), ("shutil", "copytree"), ("shutil", "move")}
METHOD_WRITES = {"write_text", "write_bytes", "savefig", "save_pretrained", "save_model", "save_state"}
STAGERS = {"staged", "written_whole"}  # files.staged, and rounds.store.written_whole around it


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _is_write(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and (func.value.id, func.attr) in \
            MODULE_WRITES:
        return True
    if isinstance(func, ast.Attribute) and func.attr in METHOD_WRITES:
        return True
    if isinstance(func, ast.Name) and func.id == "open":
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        return isinstance(mode, ast.Constant) and any(letter in mode.value for letter in "wax+")
    return False


def unstaged_writes(source: str) -> list[int]:
    """The lines of the write calls in `source` that no `with staged(...)` (or `written_whole`) block encloses."""
    found = []

    def visit(node: ast.AST, staged: bool) -> None:
        if isinstance(node, ast.With):
            staged = staged or any(isinstance(item.context_expr, ast.Call) and _name(item.context_expr.func) in STAGERS
                                   for item in node.items)
        if isinstance(node, ast.Call) and _is_write(node) and not staged:
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, staged)

    visit(ast.parse(source), False)
    return found


def test_every_writer_outside_files_py_is_one_files_py_names():
    writers = {path.relative_to(PACKAGE).as_posix(): lines for path in sorted(PACKAGE.rglob("*.py"))
               if (lines := unstaged_writes(path.read_text()))}
    named = set(re.findall(r"`([\w/]+\.py)`", dpo_min.files.__doc__))
    assert {name: lines for name, lines in writers.items() if name not in named | {"files.py"}} == {}
    assert named - set(writers) == set()  # a module named that writes through files.py now: the list is stale


def test_the_scan_finds_a_write_and_trusts_a_staged_one():
    source = ("import json, os\n"
              "def a(path, data):\n    with open(path, 'w') as file:\n        json.dump(data, file)\n"
              "def b(path):\n    with staged(path) as staging:\n        staging.write_text('x')\n"
              "def c(path):\n    os.replace(path, path + '.bad')\n    open(path).read()\n")
    assert unstaged_writes(source) == [3, 4, 9]


# ---- a write that fails names itself (issue 57): the writer says what it was writing, nothing reads a traceback ----
def test_a_failed_write_carries_the_name_its_innermost_writer_gave():
    import errno
    import os

    from dpo_min.files import named_write, write_failure, writing

    try:
        with writing("the run to its folder"), writing("metrics.json to its folder"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as error:
        assert named_write(error) == "metrics.json to its folder"  # the inner writer is the one that failed
        assert write_failure(error, named_write(error)) == "no space left on device writing metrics.json to its folder"
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as error:
        assert named_write(error) is None  # no writer named it: the caller's own words apply


def test_the_reference_cache_names_its_write_when_the_disk_fails(tmp_path, monkeypatch):
    import torch

    from dpo_min import ref_cache
    from dpo_min.files import named_write

    monkeypatch.setenv("DPO_MIN_CACHE", str(tmp_path))

    def short_write(*args, **kwargs):  # torch's zip writer on a full disk says no more than this
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", short_write)
    try:
        ref_cache.save("key", torch.zeros(2), torch.zeros(2))
    except RuntimeError as error:
        assert named_write(error) == f"the reference log-probs to their cache ({tmp_path / 'ref_logps'})"
    else:
        raise AssertionError("the failing write did not raise")
    assert list((tmp_path / "ref_logps").iterdir()) == []  # nothing half-written is left behind
