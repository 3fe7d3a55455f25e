"""The folders show the design: the DPO core at dpo_min's top, the data, the command (dpo_min.train), scale-out and
the rounds (dpo_min.rounds, above the core) as folders, and imports that point one way. Every import is read from
the source (those inside functions too), so a lazy import cannot hide a wrong direction."""

import ast
import re
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dpo_min"
# Each part, and the parts it may import from. The command is the only client of everything.
MAY_IMPORT = {
    "core": {"core", "data", "scale"},
    "data": {"data"},
    "scale": {"scale"},
    "command": {"core", "data", "scale", "command", "rounds"},
    "rounds": {"core", "rounds"},  # of the core, the modules README names (a test below), by their public names
}


def part_of(module: str) -> str:
    """'dpo_min.data.mixtures' -> 'data'; 'dpo_min.train.card' -> 'command'; a top-level module -> 'core'."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("data", "scale", "rounds"):
        return parts[1]
    return "command" if len(parts) > 1 and parts[1] == "train" else "core"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """The dpo_min modules a file imports, relative imports resolved ('from . import zero' -> dpo_min.scale.zero)."""
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dpo_min")}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if not stem.startswith("dpo_min"):
                continue
            for alias in node.names:  # `from . import zero` names a module; `from .zero import f` names a function
                candidate = f"{stem}.{alias.name}"
                where = PACKAGE.parent.joinpath(*candidate.split("."))
                is_module = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                found.add(candidate if is_module else stem)
    return found


def wrong_imports() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            if part_of(imported) not in MAY_IMPORT[part_of(importer)]:
                wrong.append(f"{importer} ({part_of(importer)}) imports {imported} ({part_of(imported)})")
    return wrong


def test_imports_point_one_way():
    assert wrong_imports() == []


def test_modules_import_each_other_without_a_cycle():
    graph = {module_name(path): imported_modules(path) - {module_name(path)} for path in PACKAGE.rglob("*.py")}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        raise AssertionError(f"import cycle: {' -> '.join(error.args[1])}") from None


def test_the_rule_catches_a_core_module_that_imports_the_command(tmp_path, monkeypatch):
    # The walk itself, on a package with one wrong import inside a function: it must be found.
    fake = tmp_path / "dpo_min"
    (fake / "train").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "card.py").write_text("")
    (fake / "trainer.py").write_text("def f():\n    from .train import card\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert wrong_imports() == ["dpo_min.trainer (core) imports dpo_min.train.card (command)"]


def test_the_core_is_the_files_at_the_top():
    top = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert {"config", "collator", "logps", "losses", "reference", "trainer", "models"} <= top
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()} == {
        "data", "train", "scale", "rounds"}


def test_the_rule_catches_the_rounds_reaching_into_the_command_or_the_data(tmp_path, monkeypatch):
    fake = tmp_path / "dpo_min"
    for folder in ("train", "data", "rounds"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "train" / "args.py").write_text("")
    (fake / "data" / "loading.py").write_text("")
    (fake / "trainer.py").write_text("")
    (fake / "rounds" / "loop.py").write_text("from dpo_min import trainer\nfrom ..train import args\n"
                                             "from ..data.loading import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert wrong_imports() == ["dpo_min.rounds.loop (rounds) imports dpo_min.data.loading (data)",
                               "dpo_min.rounds.loop (rounds) imports dpo_min.train.args (command)"]


def test_the_core_reads_the_data_through_tokenizing_alone():
    # The trainer, the collator and the reference cache import no data module (the collator owns the batch's column
    # names); `tokenizing` is the core's one door into data/, and the package's __init__ re-exports the loaders.
    reaching = {path.stem: sorted(name for name in imported_modules(path) if part_of(name) == "data")
                for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "tokenizing")}
    assert {stem: names for stem, names in reaching.items() if names} == {}


def test_no_module_defines_what_pytest_would_collect_where_it_is_imported():
    # pytest collects a top-level `test*` function (or `Test*` class) in every test module that imports it.
    found = [f"{module_name(path)}.{node.name}" for path in sorted(PACKAGE.rglob("*.py"))
             for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.lower().startswith("test")]
    assert found == []


def test_the_rounds_use_the_core_modules_the_layout_page_names_by_their_public_names():
    # docs/layout.md's row for dpo_min/rounds/ names the core modules the rounds ask; they import those and no other,
    # and only public names of them (from `dpo_min` itself, only what it exports).
    import dpo_min

    row = next(line for line in (PACKAGE.parent / "docs" / "layout.md").read_text().splitlines()
               if line.startswith("| `dpo_min/rounds/` |"))
    named = {f"dpo_min.{name}" for name in re.findall(r"`(\w+)\.py`", row)}
    paths = sorted((PACKAGE / "rounds").glob("*.py"))
    core = {name for path in paths for name in imported_modules(path) if part_of(name) == "core"}
    assert core - {"dpo_min"} == named
    names = {(node.module, alias.name) for path in paths for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom) and (node.level == 2 or (node.module or "").startswith("dpo_min"))
             for alias in node.names}
    assert [name for _, name in names if name.startswith("_")] == []
    assert {name for module, name in names if module == "dpo_min"} <= set(dpo_min.__all__)
