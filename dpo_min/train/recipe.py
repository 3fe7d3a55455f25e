"""A recipe and the flags -> the command's options in dpo_min's names: a YAML recipe (a key given twice refused, TRL's
`env:` block applied), TRL's and the handbook's names translated (`compat`'s tables), each value as the option takes
it (a flag's text as written, a mapping's or a mixture's JSON parsed).

`recipe_and_flags` is the entry; `command_line.parse_command_line` hands its result to HfArgumentParser.
"""

import difflib
import json
import os
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml

from ..compat import RECIPE_KEYS, TRL_NAMES, TRL_WITHOUT_COUNTERPART, check_trl_option
from .args import MIXTURE_KEYS, MIXTURE_OPTIONS, UsageError, known_options, option_types, shown


def recipe_and_flags(argv: list[str]) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """(the recipe's options, the tokens for argparse, the flags parsed here); a flag overrides the recipe's key,
    and data on the command line replaces the recipe's: --dataset X trains X alone, a mixture flag drops dataset."""
    recipe_path = _one_recipe(argv.pop(0), argv) if argv and argv[0].endswith((".yaml", ".yml")) else _pop_config(argv)
    recipe = _read_recipe(recipe_path) if recipe_path else {}
    if "model" in recipe and recipe["model"] is None:  # TRL's default written out: no model, as the key left out
        del recipe["model"]
    argv, parsed_flags = _translate_argv(argv)
    flags = {token[2:].split("=")[0] for token in argv if token.startswith("--")} | set(parsed_flags)
    if "dataset" in flags and not flags & set(MIXTURE_KEYS):
        for name in (*MIXTURE_KEYS, *MIXTURE_OPTIONS):
            recipe.pop(name, None)
    if flags & set(MIXTURE_KEYS) and "dataset" not in flags:
        recipe.pop("dataset", None)
    return recipe, argv, parsed_flags


def _pop_config(argv: list[str]) -> str | None:
    """Remove `--config FILE` (or `--config=FILE`) from argv, as `trl dpo --config` takes it."""
    for index, token in enumerate(argv):
        if token == "--config":
            if index + 1 >= len(argv):
                raise UsageError("--config needs a YAML file")
            path = argv[index + 1]
            del argv[index:index + 2]
            return _one_recipe(path, argv)
        if token.startswith("--config="):
            del argv[index]
            return _one_recipe(token.split("=", 1)[1], argv)
    return None


def _one_recipe(path: str, argv: list[str]) -> str:
    if any(token == "--config" or token.startswith("--config=") for token in argv):
        raise UsageError(f"one recipe per run: {path} and a second --config are given (merge them into one file)")
    return path


def _read_recipe(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            values = yaml.load(file, Loader=_RecipeLoader) or {}
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:  # a binary file (--config model.safetensors) or another encoding
        raise UsageError(f"{path} is not a YAML recipe: not UTF-8 text (byte {error.start})") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{path} must hold a mapping of option: value")
    if "env" in values:
        _apply_env(values.pop("env"), path)
    recipe, spelled, types = {}, _SpelledOnce(path), option_types()
    for name, value in values.items():
        for option, option_value in _translate(str(name), value, path).items():
            if option not in known_options():
                raise UsageError(f"{path}: unknown option {name!r}{did_you_mean(str(name))}")
            spelled.check(str(name), option)
            recipe[option] = _recipe_value(f"{path}: {name}", option, option_value, types[option])
    return recipe


def _recipe_value(where: str, option: str, value: Any, hint: Any) -> Any:
    """A recipe's value (`where`: "recipe.yaml: key") as the option takes it. argparse converts a flag's text, not a
    recipe's values: 2.5, [1, 2], null or YAML 1.1's `no` (false) would reach an option unchanged."""
    kinds, key = _kinds(hint), where.rpartition(": ")[2]
    if hint in (int, int | None) and isinstance(value, (float, bool)):
        raise UsageError(f"{where} must be an integer, got {shown(option, value)}")
    if value is None and not kinds & {type(None), Any}:
        raise UsageError(f"{where} cannot be null; give a value, or leave the key out for the default")
    if isinstance(value, (list, dict)) and not kinds & {list, dict, Any} and option not in MIXTURE_KEYS:
        raise UsageError(f"{where} takes a single value, got {shown(option, value)}")
    if isinstance(value, bool) and not kinds & {bool, Any}:
        raise UsageError(f"{where} is not true/false, got {value} (YAML reads no, off and false as false; quote "
                         f"the word: {key}: \"no\")")
    if type(value) in (int, float) and str in kinds and not kinds & {int, float, dict, list, Any}:
        return str(value)  # text, as the flag's (--split 2024, --test_split_size 0.1): not a number str methods fail on
    if list in kinds and str not in kinds and value is not None and not isinstance(value, (list, dict)):
        return [value]  # a one-item list, as the flag form (--lora_target_modules q_proj) gives; not its characters
    return value


class _RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML, and so TRL, keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, as YAML means
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in lines:
                raise yaml.YAMLError(f"key {key!r} is given twice, on lines {lines[key]} and {line}: give it once")
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _apply_env(env: Any, path: str) -> None:
    """TRL's `env:` block, applied as TRL 1.16 applies it (trl/scripts/utils.py, parse_args_and_config): each
    variable set to str(value) in this process's environment as the recipe is read, before any option is parsed."""
    if not isinstance(env, dict):
        raise UsageError(f"{path}: env must be a mapping of variable: value, got {env!r}")
    for key, value in env.items():
        os.environ[str(key)] = str(value)


# ---- names and values -----------------------------------------------------------------------------------------------
def did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, sorted(known_options() | set(TRL_NAMES) | set(RECIPE_KEYS)), n=1)
    return f" (did you mean --{close[0]}?)" if close else ""


def _translate(name: str, value: Any, where: str) -> dict[str, Any]:
    """An option as TRL, the handbook or dpo_min writes it -> {dpo_min's option: value}; {} for one that changes
    nothing here. Raises UsageError for a value dpo_min cannot honour."""
    if name.replace("-", "_") in TRL_NAMES | TRL_WITHOUT_COUNTERPART | RECIPE_KEYS:
        name = name.replace("-", "_")
    if name in RECIPE_KEYS:
        try:
            return RECIPE_KEYS[name](value)
        except ValueError as error:
            raise UsageError(f"{where}: {error}") from None
    if name in TRL_NAMES:
        return {TRL_NAMES[name]: value}
    if name in TRL_WITHOUT_COUNTERPART and name not in known_options():
        try:
            check_trl_option(name, value)
        except ValueError as error:
            raise UsageError(f"{where}: {error}") from None
        return {}
    return {name: value}


class _SpelledOnce:
    """Refuses two spellings of one option in one place (warmup_ratio and warmup_steps, dataset_name and dataset)."""

    def __init__(self, where: str):
        self.where, self.spelling = where, {}

    def check(self, written: str, option: str) -> None:
        first = self.spelling.setdefault(option, written)
        if first.replace("-", "_") != written.replace("-", "_"):
            raise UsageError(f"{self.where}: {first} and {written} both set {option}: give one of them")


def _translate_argv(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(the tokens for argparse, {option: value} of the flags whose text is parsed here: mappings and mixtures).

    A flag's value is text and reaches its option as written; argparse converts it to the option's type. Only a
    mapping's or a mixture's text is parsed (JSON), and the value of a translated handbook or TRL key (YAML, as its
    recipe would give it: --warmup_ratio 0.1, --do_train true)."""
    translated, parsed, index, spelled = [], {}, 0, _SpelledOnce("the command line")
    while index < len(argv):
        token = argv[index]
        index += 1
        if not token.startswith("--"):
            translated.append(token)
            continue
        name, equals, inline = token[2:].partition("=")
        has_value = not equals and index < len(argv) and not argv[index].startswith("--")
        text = inline if equals else argv[index] if has_value else None
        written = [f"={inline}"] if equals else [argv[index]] if has_value else []
        index += has_value
        value = True if text is None else _flag_value(name, text)
        for option, option_value in _translate(name, value, f"--{name}").items():
            spelled.check(f"--{name}", option)
            if option in _structured_options() and (option in MIXTURE_KEYS or str(option_value).lstrip()[:1] == "{"):
                parsed[option] = _parse_json(option_value, f"--{name}")
            elif option_value is value:  # the same value under our name: the tokens as written
                translated.extend([f"--{option}{written[0]}"] if equals else [f"--{option}", *written])
            else:
                translated.append(f"--{option}={option_value}")
    return translated, parsed


def _flag_value(name: str, text: str) -> Any:
    """A flag's text; YAML-read only for the keys whose translation reads the value (RECIPE_KEYS and TRL's options
    without a counterpart take what a recipe would give them)."""
    if name.replace("-", "_") not in RECIPE_KEYS | TRL_WITHOUT_COUNTERPART:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UsageError(f"--{name}: cannot read {text!r}: {str(error).splitlines()[0]}") from None


def _parse_json(value: Any, flag: str) -> Any:
    # JSON, as documented for these flags: YAML's flow style would read {"lr": 1e-5}'s 1e-5 as a string.
    if not isinstance(value, str):
        raise UsageError(f"{flag} needs a JSON value")
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(f"{flag} must be JSON (or write it in the YAML recipe): {error}") from None


def _structured_options() -> set[str]:
    """The options whose value is a mapping (their flag's JSON text is parsed here) and the three mixture forms."""
    return {name for name, hint in option_types().items() if dict in _kinds(hint)} | set(MIXTURE_KEYS)


def _kinds(hint: Any) -> set[Any]:
    """The plain types a field's type admits: {int, NoneType} for `int | None`, {list} for `list[str]`."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    return {get_origin(member) or member for member in members}

