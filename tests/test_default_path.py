"""README's "What is where" names the files a default run enters, and this test traces one to hold it to that.

A run of `DPOMinTrainer` on `DPOMinConfig`'s defaults (only the sizes a tiny test must set), full fine-tuning and
LoRA, is traced with `sys.setprofile`: every function of `dpo_min/` it enters, by phase. The file lists are read from
README's paragraph, so the page and the test cannot drift: a training step enters exactly the default path's files;
an evaluation, a checkpoint save and the construction of the config and the trainer enter those and exactly the files
README names for each; and no phase enters a file README says the default never runs."""

import ast
import dataclasses
import inspect
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig

import dpo_min
from dpo_min import DPOMinConfig, DPOMinTrainer

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(dpo_min.__file__).parent
PREFIX = f"{PACKAGE}/"  # as the code objects name their files
# Trainer's hooks around a save: what runs inside them is the save's, not the step's.
SAVE_HOOKS = {"_save_checkpoint", "save_model"}


def readme_lists() -> dict[str, set[str]]:
    """The files README's "The default path" paragraph names for each phase, as paths under dpo_min/."""
    paragraph = (ROOT / "README.md").read_text().split("**The default path**", 1)[1].split("\n\n")[0]
    paragraph = " ".join(paragraph.split())

    def files(start: str, end: str = r"(?:;|\.(?:\s|$))") -> set[str]:
        match = re.search(re.escape(start) + r"(.*?)" + end, paragraph)
        assert match, f"README's default-path paragraph has no {start!r}"
        return set(re.findall(r"`([\w/]+\.py)`", match.group(1)))

    return {"default": files("enters exactly these files", r"lines in all"),
            "evaluate": files("an evaluation also enters"),
            "save": files("a checkpoint save also enters"),
            "construction": files("constructing the config and the trainer also enters"),
            "never": files("never runs, in any of these phases:")}


class Trace:
    """Every function of dpo_min/ entered while `sys.setprofile` runs it: {phase: {file under dpo_min/: the functions
    entered there}}, and their line spans in `spans`. A function called inside one of Trainer's save hooks counts for
    the phase "save". Code a decorator generates (a dataclass's `__init__`, `__eq__`, ...) has no file of its own:
    it counts for the module that defines the class, spanning the class's fields (what that code runs)."""

    def __init__(self) -> None:
        self.phase = "construction"
        self.entered: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.spans: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))

    def __enter__(self) -> "Trace":
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame, event, arg) -> None:
        # Called for every call of the process, torch's included: a string test first, nothing more for most.
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PREFIX):
            name, function, lines = code.co_filename[len(PREFIX):], code.co_qualname, _lines_of(code)
        elif code.co_filename.startswith("<") and str(frame.f_globals.get("__file__", "")).startswith(PREFIX):
            # exec'd with the defining module's globals (dataclasses does so): `self` is an instance of the class.
            name = frame.f_globals["__file__"][len(PREFIX):]
            owner = frame.f_locals.get("self")
            function = f"{type(owner).__qualname__}.{code.co_name} (generated)"
            lines = _field_lines(type(owner)) if owner is not None else set()
        else:
            return
        phase = self._phase_of(frame)
        self.entered[phase][name].add(function)
        self.spans[phase][name] |= lines

    def _phase_of(self, frame) -> str:
        while frame is not None:
            if frame.f_code.co_name in SAVE_HOOKS:
                return "save"
            frame = frame.f_back
        return self.phase

    def files(self) -> dict[str, set[str]]:
        return {phase: set(entered) for phase, entered in self.entered.items()}

    def share(self, phase: str, files: set[str]) -> tuple[int, int]:
        """(lines of `files` inside a function `phase` entered, lines of `files`): a nested function counts once."""
        total = sum(len((PACKAGE / name).read_text().splitlines()) for name in files)
        return sum(len(self.spans[phase].get(name, ())) for name in files), total


def _lines_of(code) -> set[int]:
    """The lines a function spans, from its first decorator to its last line."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return set(range(code.co_firstlineno, last + 1))


def _field_lines(cls: type) -> set[int]:
    """A dataclass's header and field lines: what its generated methods read."""
    if not dataclasses.is_dataclass(cls):
        return set()
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    node = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == cls.__name__)
    fields = [child for child in node.body if isinstance(child, ast.AnnAssign)]
    return set(range(node.lineno, max((child.end_lineno for child in fields), default=node.lineno) + 1))


def traced_run(tokenizer, pairs, output_dir: Path, lora: bool) -> Trace:
    """A default run, traced: building the config and the trainer, `train()` (two steps, then the checkpoint Trainer
    saves at the end) and `evaluate()`."""
    with Trace() as trace:
        args = DPOMinConfig(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2,
                            per_device_eval_batch_size=2, report_to="none")
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
        trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=pairs.select(range(4)),
                                eval_dataset=pairs.select(range(4, 6)), processing_class=tokenizer,
                                peft_config=peft_config)
        trace.phase = "step"
        trainer.train()
        trace.phase = "evaluate"
        trainer.evaluate()
    return trace


def readme_share() -> tuple[int, int, int]:
    """README's "N lines in all ..., of which M (P%) lie in functions a step enters": (M, N, P)."""
    paragraph = " ".join((ROOT / "README.md").read_text().split("**The default path**", 1)[1].split("\n\n")[0].split())
    match = re.search(r"([\d,]+) lines in all .*?, of which (\d+) \((\d+)%\) lie in functions a step enters", paragraph)
    assert match, "README's default-path paragraph gives no traced share"
    total, entered, percent = (int(group.replace(",", "")) for group in match.groups())
    return entered, total, percent


def test_readme_names_each_phases_files():
    lists = readme_lists()
    assert 3 <= len(lists["default"]) <= 6  # the default path is a few files a reader can hold at once
    assert {"collator_packed.py", "precompute.py", "trl_surface.py", "loss_family.py"} <= lists["never"]
    named = [name for names in lists.values() for name in names]
    assert all((PACKAGE / name).is_file() for name in named), named


@pytest.mark.parametrize("lora", [False, True], ids=["full fine-tuning", "LoRA"])
def test_a_default_run_enters_exactly_the_files_readme_names(tokenizer, hh_pairs, tmp_path, lora):
    lists = readme_lists()
    trace = traced_run(tokenizer, hh_pairs, tmp_path / "out", lora)
    files, entered = trace.files(), trace.entered
    assert files["step"] == lists["default"], entered["step"]
    assert files["evaluate"] - lists["default"] == lists["evaluate"], entered["evaluate"]
    assert files["save"] - lists["default"] == lists["save"], entered["save"]
    assert files["construction"] - lists["default"] == lists["construction"], entered["construction"]
    assert set().union(*files.values()) & lists["never"] == set()
    # README's share of the default path's lines that lie in functions a step enters, as traced; at least half.
    entered, total = trace.share("step", lists["default"])
    assert readme_share() == (entered, total, round(100 * entered / total)), dict(trace.spans["step"])
    assert entered >= total / 2


def test_the_trace_counts_generated_code_in_the_module_that_defines_it():
    # A dataclass's __init__ is exec'd code with no file of its own: built in a step, it still names its module.
    from dpo_min.loss_family import PairTerms

    zero = torch.zeros(1)
    with Trace() as trace:
        PairTerms(*[zero] * 9, chosen_lengths=None, rejected_lengths=None, chosen_nll=None, beta=0.1,
                  label_smoothing=0.0, hyperparameters={})
    assert trace.entered["construction"]["loss_family.py"] == {"PairTerms.__init__ (generated)"}
    source = (PACKAGE / "loss_family.py").read_text().splitlines()
    lines = trace.spans["construction"]["loss_family.py"]
    fields = [number for number, line in enumerate(source, 1)
              if min(lines) < number and line.startswith("    ") and ": " in line and "(" not in line.split(":")[0]]
    first_method = source.index("    def value(self, name: str) -> float:") + 1
    last_field = max(number for number in fields if number < first_method)
    assert source[min(lines) - 1].startswith("class PairTerms") and max(lines) == last_field  # the span: its fields


def test_the_trace_sees_a_file_the_default_never_runs():
    # The tracer itself: a packed layout enters collator_packed.py, which README says the default never runs.
    from dpo_min.trainer_setup import make_collator

    with Trace() as trace:
        make_collator(0, padding_free=True)([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}])
    assert "collator_packed.py" in trace.files()["construction"] & readme_lists()["never"]
