"""README.md and docs/: every `dpo_min.train` command they show parses as written, and every page they link exists.

Parsing is the part of "works as written" a test can afford for all of them: an option renamed or removed, a value
the parser refuses, a recipe path that moved. The runs themselves are covered by the tests of each feature."""

import json
import re
import shlex
from pathlib import Path

import pytest

from dpo_min.train.command_line import parse_args

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENTRY = re.compile(r"(?:python -m dpo_min\.train|dpo-min-train|-m dpo_min\.train)(?=\s|$)")


HEREDOC = re.compile(r"^ *cat > (\S+) <<'(\w+)'\n(.*?)^ *\2$", flags=re.M | re.S)


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```bash\n(.*?)^ *```", text, flags=re.M | re.S)


def _train_commands() -> list[tuple[str, str, dict[str, str]]]:
    """(page, the arguments after the entry point, the files the page's blocks write with heredocs before it)."""
    commands = []
    for page in PAGES:
        files: dict[str, str] = {}
        for block in _bash_blocks(page.read_text()):
            files.update({name: body for name, _, body in HEREDOC.findall(block)})
            for line in HEREDOC.sub("", block).replace("\\\n", " ").splitlines():
                match = ENTRY.search(line.strip())
                if match and not line.strip().startswith("#"):
                    commands.append((page.relative_to(ROOT).as_posix(), line.strip()[match.end():], dict(files)))
    return commands


COMMANDS = _train_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 10  # a broken extraction would make the test below pass on nothing


@pytest.mark.parametrize(("page", "arguments", "files"), COMMANDS,
                         ids=[f"{page}:{args[:60]}" for page, args, _ in COMMANDS])
def test_every_command_in_the_pages_parses(page, arguments, files, tmp_path, monkeypatch):
    # Run where the page's own heredocs wrote their files, with the checkout's folders beside them.
    for folder in ("data", "recipes", "tests", "shared"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(arguments, comments=True)
    if "--bf16" in argv:  # a GPU command: on this CPU machine bf16 parses only beside use_cpu
        argv += ["--use_cpu", "true"]
    parse_args(argv)  # raises UsageError (with the one-line message) for anything the command would refuse


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_local_link_in_the_pages_exists(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [target for target in targets if "://" not in target and not (page.parent / target).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_readme_gives_the_default_paths_line_counts():
    # README's "What is where" names the four files a default training step enters (tests/test_default_path.py traces
    # it) with their line counts, and their sum.
    text = (ROOT / "README.md").read_text()
    paragraph = " ".join(text.split("**The default path**", 1)[1].split("\n\n")[0].split())
    quoted = dict(re.findall(r"`(\w+\.py)` \((\d+) lines", paragraph))
    assert sorted(quoted) == ["collator.py", "logps.py", "metrics.py", "trainer.py"]
    counts = {name: len((ROOT / "dpo_min" / name).read_text().splitlines()) for name in quoted}
    assert {name: int(lines) for name, lines in quoted.items()} == counts
    assert f"{sum(counts.values()):,} lines in all" in paragraph


def test_the_layout_pages_table_of_the_core_names_every_file_at_dpo_mins_top():
    # "The core is all the files at the top of dpo_min/": the table a reader follows (docs/layout.md) names each.
    table = (ROOT / "docs" / "layout.md").read_text().split("Read the files in this order:", 1)[1].split("\n\n", 2)[1]
    top = {path.name for path in (ROOT / "dpo_min").glob("*.py")} - {"__init__.py"}
    assert top - set(re.findall(r"`(\w+\.py)`", table)) == set()


def test_the_demos_printout_opens_with_the_lines_the_demo_prints(capsys):
    # docs/demo.md's printout as the demo prints it now: the data phase's one line (the layout read), then, after the
    # model line, the plan line (its counts' nouns singular where they count one).
    from dpo_min.train import resolve
    from dpo_min.train.pairs import load_pairs
    from dpo_min.train.report import describe_plan

    page = (ROOT / "docs" / "demo.md").read_text().split("## The demo's output as printed", 1)[1]
    printout = page.split("```text\n", 1)[1].splitlines()
    plan = resolve([])
    capsys.readouterr()
    train_pairs, _ = load_pairs(plan)
    assert capsys.readouterr().out.splitlines() == printout[:1]
    assert printout[1].startswith(f"model {plan.model_name} | {len(train_pairs)} train pairs")
    assert printout[2] == describe_plan(plan.args, len(train_pairs))


def test_the_rows_data_md_counts_from_0_are_the_rows_errors_name(tmp_path):
    # Messages say `row 0`, `row 20`: the page says which line of a file that is, and the loader agrees.
    from dpo_min.data.loading import load_preference_dataset

    text = " ".join((ROOT / "docs" / "data.md").read_text().split())
    jsonl_line, jsonl_row = map(int, re.search(r"a JSON Lines file's line (\d+) is `row (\d+)`", text).groups())
    csv_line, csv_row = map(int, re.search(r"a CSV file's line (\d+) \(its header is line 1\) is `row (\d+)`",
                                           text).groups())
    lines = {"jsonl": [json.dumps({"prompt": f"p{n}", "chosen": "c", "rejected": "r"}) for n in range(5)],
             "csv": ["prompt,chosen,rejected", *(f"p{n},c,r" for n in range(5))]}
    lines["jsonl"][jsonl_line - 1] = json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"})
    lines["csv"][csv_line - 1] = "p,same,same"
    for kind, row in (("jsonl", jsonl_row), ("csv", csv_row)):
        path = tmp_path / f"pairs.{kind}"
        path.write_text("\n".join(lines[kind]) + "\n")
        with pytest.raises(ValueError, match=rf"pairs\.{kind}: row {row}: field 'rejected' is identical"):
            load_preference_dataset(str(path), strict_pairs=True)


def test_the_groups_line_groups_md_quotes_is_what_the_command_prints_for_its_counts():
    # docs/groups.md's measured run: its groups line as describe_groups writes it for the counts the line gives, of
    # the train pairs its model line names, which with the held-out ones are the bundled file's pairs.
    from dpo_min.data.loading import load_preference_dataset
    from dpo_min.train.group_tokens import describe_groups

    page = (ROOT / "docs" / "groups.md").read_text()
    [line] = [line for line in page.splitlines() if line.startswith("groups: ") and "arithmetic" not in line]
    found = re.fullmatch(r"groups: (\d+) prompts, (\d+) pairs .* batches of (\d+) pairs compute (\d+) tokens in groups "
                         r".*, (\d+) with share_prompt .* and (\d+) as two sequences a pair .*", line)
    prompts, pairs, batch, groups, shared, apart = map(int, found.groups())
    tokens = {"groups": groups, "share_prompt": shared, "two sequences": apart}
    assert line == describe_groups(prompts, pairs, batch, tokens)
    train, held_out = map(int, re.search(r"\| (\d+) train pairs, (\d+) held-out \|", page).groups())
    assert train == pairs and train + held_out == len(load_preference_dataset(str(ROOT / "data" /
                                                                                   "arithmetic-groups.jsonl")))
    assert f"--per_device_train_batch_size {batch} " in " ".join(page.split())


def collected_count() -> int:
    """How many tests the suite collects: this session's count where it collected every test file (README's test
    command), else a collection of its own (a run of one file collects part of the suite)."""
    import subprocess
    import sys

    import conftest

    files = {node.split("::")[0] for node in conftest.COLLECTED}
    if files >= {f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")}:
        return len(conftest.COLLECTED)
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return int(re.search(r"(\d+) tests? collected", result.stdout)[1])


def test_the_test_counts_readme_quotes_are_what_the_suite_collects():
    section = (ROOT / "README.md").read_text().split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    quoted = {int(count.replace(",", "")) for count in re.findall(r"(\d[\d,]*) tests\b", section)}
    assert quoted == {collected_count()}, "README's Test section quotes another count than the suite collects"
