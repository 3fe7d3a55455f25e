"""`parse_command_line`: a command line (optionally a YAML recipe first, or --config FILE) -> the three option
dataclasses of `args`, and whether the run is the demo.

Read top to bottom: the parser (HfArgumentParser over the dataclasses, with the command's and the demo's defaults),
`parse_args` and `parse_command_line`, then the options that cannot go together. The recipe and TRL's names are read
in `recipe`, the nested options checked in `kwargs_checks`.
"""

import argparse
import math
import re
import sys
from collections.abc import Callable

from transformers import HfArgumentParser

from ..config import DPOMinConfig
from ..devices import has_accelerator as _has_accelerator  # by this name: tests patch it here
from .args import (
    ARGUMENT_TYPES,
    COMMAND_DEFAULTS,
    DEMO_DEFAULTS,
    DEMO_DEFAULTS_SHOWN,
    MIXTURE_KEYS,
    PROG,
    ROUNDS_DEMO_DEFAULTS,
    ROUNDS_DEMO_PROMPT_SETTINGS,
    DataArguments,
    ModelArguments,
    UsageError,
    shown_argv,
)
from .kwargs_checks import check_nested_kwargs
from .recipe import did_you_mean, recipe_and_flags
from .rounds_args import LOAD_BEST_WITH_ROUNDS, ROUNDS_COMMAND_DEFAULTS, RoundsArguments, without_rounds


class _Parser(HfArgumentParser):
    def error(self, message: str):
        # argparse would print the usage block and exit; the command reports one line instead.
        raise UsageError(message)


_NAMES_A_DEFAULT = re.compile(r"\bdefaults?\b", re.IGNORECASE)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after an option's text, where X is the option's own default. Not after None (an
    option left unset: its text says what that means, --model's "Default: SmolLM2-135M-Instruct"), a --no_X flag
    (--X shows the default) or a text that names its default itself (--use_peft's depends on --model); a text that
    ends in the demos' "otherwise:" always takes it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or isinstance(action, argparse._StoreFalseAction) or (
                _NAMES_A_DEFAULT.search(text) and not text.endswith("otherwise:")):
            return text
        return super()._get_help_string(action)


def build_parser(demo: bool = False, rounds: bool = False, demo_prompts: bool = False) -> HfArgumentParser:
    """The parser, with the command's defaults and the demo's (`demo`: no model, no data); `demo_prompts`: a rounds
    run on the rounds demo's prompts (no data), which takes the demo's settings of a round with any model."""
    parser = _Parser(
        ARGUMENT_TYPES, prog=PROG, allow_abbrev=False, formatter_class=_HelpFormatter,
        usage=f"{PROG} [recipe.yaml | --config recipe.yaml] [--option value ...]",
        description="Direct Preference Optimization of a causal LM. With no --model and no data (no --dataset, no "
                    "mixture): the demo, a short LoRA run of SmolLM2-135M-Instruct on the embedded HH-RLHF pairs. A "
                    "YAML file of options (TRL's names accepted) may come first or follow --config; flags override "
                    "it. A flag's value is text, as written; a mapping's or a mixture's is JSON.",
        epilog="Options marked 'demo:' take that default in the demo only ('rounds demo:', in --rounds without "
               "--model and data; 'rounds demo and its prompts:', in --rounds without data, with any --model); "
               "with --model or data (--dataset, datasets, dataset_mixture, dataset_mixer), DPOMinConfig's (TRL's) "
               "defaults apply. An option shown without a default is unset unless its text names one.")
    demo_defaults = (ROUNDS_DEMO_DEFAULTS if rounds else DEMO_DEFAULTS) if demo else \
        {name: ROUNDS_DEMO_DEFAULTS[name] for name in ROUNDS_DEMO_PROMPT_SETTINGS} if rounds and demo_prompts else {}
    parser.set_defaults(**{**COMMAND_DEFAULTS, **(ROUNDS_COMMAND_DEFAULTS if rounds else {}),
                           **demo_defaults})  # the demo's win
    if not _has_accelerator():
        # A CPU-only machine: without use_cpu, transformers refuses --bf16 ("You need to assign use_cpu") and, for
        # one of several processes, accelerate would leave each training alone instead of joining them over gloo.
        parser.set_defaults(use_cpu=True)
    _complete_help(parser)
    return parser


def _complete_help(parser: HfArgumentParser) -> None:
    """Each option's help names the demos' defaults ("demo: 5e-4; rounds demo: 1e-4; otherwise:", the formatter adds
    the default); a --no_X flag's help is one line, not --X's paragraph again."""
    for action in parser._actions:
        if isinstance(action, argparse._StoreFalseAction):
            action.help = f"Same as --{action.dest} false."
        rounds_label = "rounds demo and its prompts" if action.dest in ROUNDS_DEMO_PROMPT_SETTINGS else "rounds demo"
        marks = [f"{label}: {DEMO_DEFAULTS_SHOWN.get(action.dest, table[action.dest])}"
                 for label, table in (("demo", DEMO_DEFAULTS), (rounds_label, ROUNDS_DEMO_DEFAULTS))
                 if action.dest in table and action.option_strings[0] == f"--{action.dest}"]
        if marks:  # unset otherwise (None): the text says what that means, and nothing completes "otherwise:"
            ending = "." if action.default is None else "; otherwise:"
            action.help = f"{action.help or ''} {'; '.join(marks)}{ending}".strip()


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPOMinConfig]:
    """Command line (optionally a YAML recipe first, or --config FILE) -> the three argument dataclasses.

    Raises UsageError. Without --model and without data (--dataset or a mixture, on the line or in the recipe) the
    demo's defaults apply."""
    return parse_command_line(argv)[:3]


def parse_command_line(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPOMinConfig, bool]:
    """`parse_args`, and whether the run is the demo."""
    model_args, data_args, _, args, demo = parse_with_rounds(argv)
    return model_args, data_args, args, demo


def parse_with_rounds(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, RoundsArguments,
                                                                DPOMinConfig, bool]:
    """`parse_command_line` with the options of DPO in rounds; their `given` holds the options named (flags and
    recipe keys), which each round's DPO pass takes."""
    recipe, argv, parsed_flags = recipe_and_flags(list(sys.argv[1:] if argv is None else argv))
    flags = {token[2:].split("=")[0] for token in argv if token.startswith("--")} | set(parsed_flags)
    named = set(recipe) | flags
    # The demo is the run given no data at all (and no model): a mixture in any form is data as --dataset is.
    demo = not named & {"model", "dataset", *MIXTURE_KEYS, "help"} and "-h" not in argv
    parser = build_parser(demo=demo, rounds="rounds" in named, demo_prompts=not named & {"dataset", *MIXTURE_KEYS})
    if "model" in named:
        # A model of one's own trains what TRL would train from the same keys: LoRA only when asked for (ModelConfig's
        # use_peft=False). Without one, the demo's model keeps its LoRA adapter, whatever the data.
        parser.set_defaults(use_peft=False)
    parser.set_defaults(**recipe, **parsed_flags)
    try:
        model_args, data_args, rounds_args, args, remaining = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=True, look_for_args_file=False)
    except ValueError as error:  # a dataclass refused a value in __post_init__
        if "rounds" in named and str(error).startswith("--load_best_model_at_end"):
            raise UsageError(LOAD_BEST_WITH_ROUNDS) from None
        raise UsageError(_one_line(error)) from None
    if remaining:
        flag = next((token for token in remaining if token.startswith("--")), "")
        raise UsageError(f"unknown argument(s): {shown_argv(remaining)}{did_you_mean(flag[2:].split('=')[0])}")
    _check_combinations(model_args, data_args, args, named, lambda name: f"--{name}" if name in flags else name)
    if "eval_on_start" not in named and args.loss_settings.reads_reference:
        # The policy starts as its reference: the figures before training are ties, stated (Plan.ties_at_start), not
        # measured by a pass over every held-out pair. A loss without a reference is measured at step 0.
        args.eval_on_start = False
    if without_rounds(rounds_args, named):
        raise UsageError(without_rounds(rounds_args, named))
    rounds_args.given = frozenset(named)
    return model_args, data_args, rounds_args, args, demo


def _one_line(error: ValueError) -> str:
    """A dataclass's message whole, in one line: TrainingArguments lists what it found on lines of their own ("...
    but found\n- Evaluation strategy: IntervalStrategy.NO\n- Save strategy: ..."), each strategy as its enum."""
    lines = [line.strip().removeprefix("- ") for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] + "".join(f"{' ' if i == 1 else ', '}{line}" for i, line in enumerate(lines[1:], 1))
    return re.sub(r"\b[A-Z]\w*Strategy\.(\w+)\b", lambda found: found[1].lower(), text)


def _check_combinations(model_args: ModelArguments, data_args: DataArguments, args: DPOMinConfig, named: set[str],
                        written: Callable[[str], str]) -> None:
    """Options that cannot go together, each refused naming what the user wrote (`written`: a flag, or a recipe's
    key)."""
    if data_args.eval_fraction is not None and not 0 <= data_args.eval_fraction < 1:
        raise UsageError(f"--eval_fraction must be in [0, 1), got {data_args.eval_fraction}")
    if data_args.max_eval_samples is not None and data_args.max_eval_samples < 1:
        raise UsageError(f"--max_eval_samples must be >= 1, got {data_args.max_eval_samples} (to hold out nothing: "
                         "--eval_fraction 0)")
    if not math.isfinite(args.learning_rate):
        raise UsageError(f"--learning_rate must be a finite number, got {args.learning_rate}")
    for name in ("split", "eval_split"):
        split = getattr(data_args, name)
        if isinstance(split, str) and split != split.strip():
            raise UsageError(f"{written(name)} {split!r}: a split's name has no spaces around it ({split.strip()!r})")
    _check_data_given(data_args, named, written)
    if data_args.num_samples > 0 and data_args.max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be >= 1 to sample completions, got {data_args.max_new_tokens} "
                         "(--num_samples 0 samples none)")
    if model_args.load_in_4bit and model_args.load_in_8bit:
        raise UsageError("choose one of --load_in_4bit and --load_in_8bit")
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise UsageError("--load_in_4bit/--load_in_8bit train an adapter on frozen quantized weights: add --use_peft")
    if model_args.merge_adapter and not model_args.use_peft:
        raise UsageError("--merge_adapter merges a LoRA adapter, and this run trains none: add --use_peft")
    test_size = _mixture_test_size(data_args)
    if "do_eval" in named and not args.do_eval:
        _evaluate_nothing(data_args, named, written)
    elif "eval_fraction" in named and test_size:
        raise UsageError(f"{written('eval_fraction')} and {test_size} both hold out pairs of the mixture: give one")
    check_nested_kwargs(model_args, args, named)
    _one_dtype(model_args, args, named, written)


def _check_data_given(data_args: DataArguments, named: set[str], written: Callable[[str], str]) -> None:
    """Data named, but as nothing (--dataset "", --datasets null, a recipe's dataset_name: null) and no other: a
    mistake, not the demo's pairs (which a run without any data option trains on)."""
    given = [name for name in ("dataset", *MIXTURE_KEYS) if name in named]
    values = [getattr(data_args, name) for name in given]
    if given and all(value is None or not (value.strip() if isinstance(value, str) else value) for value in values):
        shown = "null" if values[0] is None else repr(values[0])
        raise UsageError(f"{written(given[0])} {shown} names no data: give a data file, folder or datasets name (or "
                         "leave the option out for the demo's pairs)")


def _one_dtype(model_args: ModelArguments, args: DPOMinConfig, named: set[str], written: Callable[[str], str]) -> None:
    """--dtype and model_init_kwargs' dtype (or torch_dtype) set one thing, the weights' dtype: the command line's
    wins over the recipe's, two in one place that differ are refused; model_args.dtype then holds it alone."""
    kwargs = args.model_init_kwargs
    keys = [key for key in ("dtype", "torch_dtype") if isinstance(kwargs, dict) and key in kwargs]
    if not keys:
        return
    on_line = written("model_init_kwargs").startswith("--")
    given = [(f"{written('model_init_kwargs')}'s {key}", kwargs[key], on_line) for key in keys]
    if "dtype" in named:
        given.append((written("dtype"), model_args.dtype, written("dtype").startswith("--")))
    first = max(level for _, _, level in given)
    winners = [(where, value) for where, value, level in given if level == first]
    if len({value for _, value in winners}) > 1:
        raise UsageError(f"{' and '.join(f'{where} {value}' for where, value in winners)} both set the weights' "
                         "dtype: give one")
    model_args.dtype = winners[0][1]
    args.model_init_kwargs = {key: value for key, value in kwargs.items() if key not in keys} or None


def _mixture_test_size(data_args: DataArguments) -> str | None:
    """Where a mixture's test_split_size is given (its own held-out rows), or None."""
    if data_args.test_split_size is not None:
        return "test_split_size"
    mixture = data_args.dataset_mixture
    return "dataset_mixture's test_split_size" if isinstance(mixture, dict) and "test_split_size" in mixture else None


def _evaluate_nothing(data_args: DataArguments, named: set[str], written: Callable[[str], str]) -> None:
    """do_eval: false (with eval_strategy: no, else TrainingArguments sets it back to true): as in the handbook, no
    pair is held out and nothing is evaluated, so every pair trains."""
    asked = [written(name) for name in ("eval_fraction", "eval_split", "max_eval_samples", "test_split_size")
             if name in named]
    if asked:
        do_eval = "--do_eval false" if written("do_eval").startswith("--") else "do_eval: false"
        raise UsageError(f"{do_eval} evaluates nothing, but {', '.join(asked)} asks for held-out pairs: drop one")
    data_args.eval_fraction = 0.0
    # A mixture's own held-out rows (not named beside do_eval, so the recipe's default) are not held out either: the
    # handbook's dataset_mixture test_split_size, the legacy mixer's test splits (which the handbook reads, unused).
    if isinstance(data_args.dataset_mixture, dict):
        data_args.dataset_mixture = {key: value for key, value in data_args.dataset_mixture.items()
                                     if key != "test_split_size"}
    if data_args.dataset_mixer is not None:
        data_args.dataset_splits = [split for split in data_args.dataset_splits or ["train", "test"]
                                    if "test" not in split]

