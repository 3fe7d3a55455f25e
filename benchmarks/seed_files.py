"""The per-seed files of a benchmark protocol (benchmarks/protocols/*.json) and their reading by `--table`
(issue 54, item 6). A seed file records the protocol's name, its seed, the protocol's digest and the arguments each arm
ran with (paths relative to the repository); `--table` reads the protocol and refuses, in one line naming the file and
what differs, a file that cannot be read or is cut short, lacks a field or an arm, or whose seed, arguments or
digest are not the protocol's: the tests are computed over seeds run under one protocol or not at all."""

import argparse
import difflib
import hashlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

ROOT = Path(__file__).resolve().parent.parent
PROTOCOLS = ROOT / "benchmarks" / "protocols"
RELATIVE_OPTIONS = ("--dataset", "--output_dir")  # recorded relative to the repository when they are in it


class SeedFileForm(NamedTuple):
    """What one script's protocol and seed files hold: the protocol's fields it reads, a seed file's fields for a
    protocol (`outcomes` names the arms), and the arguments the protocol gives a seed (a list, or one per arm)."""

    protocol_fields: dict
    fields_of: Callable[[dict], dict]
    argv_of: Callable[[dict, int], list | dict]


def protocol_digest(protocol: dict) -> str:
    """sha256 of the protocol as canonical JSON, all but its seed list: its options, arms, tests and words are fixed
    before its seeds run, so any later edit makes it another protocol, and the seeds run before it another's."""
    fixed = {key: value for key, value in protocol.items() if key != "seeds"}
    canonical = json.dumps(fixed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def recorded_argv(argv: list[str]) -> list[str]:
    """`argv` as a seed file records it: a path in the repository relative to it, so that a file reads the same on
    every machine (the runs are given absolute paths, for they may run from another folder)."""
    recorded = list(argv)
    for i, item in enumerate(argv[:-1]):
        path = Path(argv[i + 1])
        if item in RELATIVE_OPTIONS and path.is_absolute() and path.is_relative_to(ROOT):
            recorded[i + 1] = path.relative_to(ROOT).as_posix()
    return recorded


def refuse(message: str) -> NoReturn:
    sys.exit(f"--table: {message}")


def read_json(path: str | Path, what: str) -> dict:
    """The JSON object in `path`, or one line saying why there is none (missing, unreadable, cut short)."""
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        refuse(f"{path}: {what} cannot be read ({error.strerror or error})")
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        refuse(f"{path}: {what} is not whole JSON (cut short?): {error}")
    if not isinstance(found, dict):
        refuse(f"{path}: {what} holds a JSON {type(found).__name__}, not an object")
    return found


def field_problem(figures: dict, shape: dict, where: str = "") -> str | None:
    """The first field of `shape` that `figures` lacks or holds in another form, in words; None when all are there.
    `shape` maps a field to a type, to a nested shape (an object), or to a number n (a list of n integers)."""
    for name, form in shape.items():
        field = f"{where}{name}"
        if name not in figures:
            return f"field '{field}' is missing"
        value = figures[name]
        if isinstance(form, dict):
            problem = (f"field '{field}' is not an object" if not isinstance(value, dict)
                       else field_problem(value, form, f"{field}."))
        elif isinstance(form, int):
            whole = isinstance(value, list) and len(value) == form and all(isinstance(x, int) for x in value)
            problem = None if whole else f"field '{field}' is not a list of {form} integers"
        else:
            problem = None if isinstance(value, form) else f"field '{field}' is not a {form.__name__}"
        if problem:
            return problem
    return None


def argument_changes(recorded: list, expected: list) -> str:
    """What `recorded` changes in `expected`, option by option ('--num_train_epochs 3' is '... 1'; '--x' is missing)."""
    changes = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=expected, b=recorded, autojunk=False).get_opcodes():
        option = [expected[i1 - 1]] if i1 and not str(expected[i1]).startswith("--") and tag == "replace" else []
        old, new = " ".join(map(str, option + expected[i1:i2])), " ".join(map(str, option + recorded[j1:j2]))
        changes += {"equal": [], "delete": [f"'{old}' is missing"], "insert": [f"'{new}' is added"],
                    "replace": [f"'{old}' is '{new}' here"]}[tag]
    return "; ".join(changes)


def without_output_dir(argv: list) -> list:
    """`argv` with --output_dir's value left out: where a seed wrote is the runner's choice, not the protocol's."""
    return [item for i, item in enumerate(argv) if not (i and argv[i - 1] == "--output_dir")]


def argv_problem(recorded, expected) -> str | None:
    """How the recorded arguments (a list, or one per arm) differ from those the protocol gives the seed, as a seed
    file records them."""
    recorded, expected = (x if isinstance(x, dict) else {None: x} for x in (recorded, expected))
    if set(recorded) != set(expected):
        return f"its arguments are for arms {sorted(recorded)}, the protocol's arms {sorted(expected)}"
    for arm, argv in expected.items():
        if not isinstance(recorded[arm], list):
            return f"its arguments{f' (arm {arm})' if arm else ''} are not a list"
        changes = argument_changes(without_output_dir(recorded[arm]), without_output_dir(recorded_argv(argv)))
        if changes:
            return f"its arguments{f' (arm {arm})' if arm else ''} differ from the protocol's: {changes}"
    return None


def load_protocol(paths: list[str], files: list[dict], given: str | None, fields: dict) -> tuple[dict, str]:
    """The protocol `--table` checks the files against: `given`, or the one they all name in benchmarks/protocols."""
    names = {figures["protocol"] for figures in files}
    if given is None and len(names) != 1:
        refuse("the files are of different protocols (" + ", ".join(f"{path}: {figures['protocol']}"
                                                                    for path, figures in zip(paths, files)) + ")")
    where = given or (PROTOCOLS / f"{names.pop()}.json").relative_to(ROOT).as_posix()  # named as the docs name it
    protocol = read_json(given or ROOT / where, "the protocol")
    if problem := field_problem(protocol, fields):
        refuse(f"{where}: the protocol's {problem} (is it a protocol of this script?)")
    return protocol, where


def seed_problem(figures: dict, protocol: dict, where: str, shape: dict, argv_of) -> str | None:
    """What keeps one seed file out of the protocol's table, in words (None: nothing): a field or an arm missing, the
    seed, the arguments (`argv_of(protocol, seed)` gives the protocol's) or the digest not the protocol's, outcomes
    that are not 0/1 or not one per held-out prompt in every arm."""
    problem = field_problem(figures, shape)
    if problem:
        return problem
    seed, arms = figures["seed"], list(shape["outcomes"])
    if figures["protocol"] != protocol["name"]:
        return f"it ran under protocol {figures['protocol']}, not {where}'s {protocol['name']}"
    if seed not in protocol["seeds"]:
        return f"seed {seed} is not one of the protocol's {protocol['seeds']}: a protocol's seeds are fixed"
    problem = argv_problem(figures["argv"], argv_of(protocol, seed))
    if problem:
        return problem
    if figures["protocol_digest"] != protocol_digest(protocol):
        return (f"its protocol digest {figures['protocol_digest'][:12]} is not {where}'s "
                f"({protocol_digest(protocol)[:12]}): it ran under another version of the protocol")
    extra = [arm for arm in figures["outcomes"] if arm not in arms]
    if extra:
        return f"its outcomes hold arm(s) {extra} that the protocol does not name (its arms: {arms})"
    mixed = [arm for arm in arms if any(outcome not in (0, 1) for outcome in figures["outcomes"][arm])]
    if mixed:
        return f"the outcomes of arm {mixed[0]} hold a value other than 0 (wrong) or 1 (right)"
    lengths = {"held-out prompts": len(figures["held_rows"])} | {arm: len(figures["outcomes"][arm]) for arm in arms}
    if len(set(lengths.values())) != 1:
        return (f"the arms of seed {seed} were scored on unequal numbers of prompts "
                f"({', '.join(f'{arm} {n}' for arm, n in lengths.items())}): they are paired prompt by prompt")
    return None


def read_seeds(paths: list[str], given_protocol: str | None, form: SeedFileForm) -> tuple[dict, list[dict]]:
    """The protocol and its seeds' figures (by seed), each file checked against it (`seed_problem`, in the script's
    `form`) and each seed given once: the pooled counts and the paired tests read the arms prompt by prompt (a seed
    given twice counted its prompts twice as if independent). Refused in one line otherwise, before anything prints."""
    files = [read_json(path, "the seed file") for path in paths]
    for path, figures in zip(paths, files):
        if problem := field_problem(figures, {"protocol": str}):
            refuse(f"{path}: {problem}")
    protocol, where = load_protocol(paths, files, given_protocol, form.protocol_fields)
    shape, first_path = form.fields_of(protocol), {}
    for path, figures in zip(paths, files):
        if problem := seed_problem(figures, protocol, where, shape, form.argv_of):
            refuse(f"{path}: {problem}")
        if figures["seed"] in first_path:
            refuse(f"seed {figures['seed']} is given twice ({first_path[figures['seed']]}, {path}): each seed counts "
                   "once in the pooled counts and the paired tests")
        first_path[figures["seed"]] = path
    return protocol, sorted(files, key=lambda figures: figures["seed"])


def run_or_table(doc: str, script: str, run_seed: Callable[[dict, int, Path], dict],
                 print_table: Callable[[list[str], str | None], None]) -> None:
    """A protocol runner's command line: `--protocol P --seed S --out DIR [--json FILE]` runs one seed's arms (each
    arm's folder under --out, reused by a rerun) and writes its seed file whole; `--table FILES` prints the table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", help="the committed protocol file: rounds, options, arms, seeds (with --table: "
                        "the one the files are checked against; by default benchmarks/protocols/NAME.json of the "
                        "name they record)")
    parser.add_argument("--seed", type=int, help="one of the protocol's seeds")
    parser.add_argument("--out", default=script, help="where every arm writes (a finished arm is reused)")
    parser.add_argument("--json", default=None, help="also write the figures to this file (for --table)")
    parser.add_argument("--table", nargs="+", default=None, help="print the table and tests of these --json files")
    args = parser.parse_args()
    if args.table:
        return print_table(args.table, args.protocol)
    if not (args.protocol and args.seed is not None):
        parser.error("give --protocol FILE and --seed S (or --table FILES)")
    figures = run_seed(json.loads(Path(args.protocol).read_text()), args.seed, Path(args.out))
    if args.json:
        from dpo_min.files import write_whole

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_whole(args.json, json.dumps(figures, indent=1))  # whole or not at all: --table reads it
    print(json.dumps({k: v for k, v in figures.items() if k not in ("outcomes", "argv", "held_rows")}, indent=1))
    print(f"\nreproduce: python benchmarks/{script}.py {shlex.join(sys.argv[1:])}")
    return None
