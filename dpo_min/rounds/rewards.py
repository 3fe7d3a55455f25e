"""Reward functions with TRL GRPOTrainer's contract, so reward code written for TRL runs unchanged.

A reward function is a callable `f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float |
None]` (completions as text, or for conversational prompts as one-message lists [{"role": "assistant", "content":
...}], as TRL gives them; the prompt rows' other columns repeated per completion, plus TRL's trainer_state,
log_extra and log_metric), or a path to a sequence-classification model whose first logit is the reward. A None
is "this function does not judge this sample" (TRL: NaN, left out of the weighted sum); a sample no function judges
is unscorable. TRL's missing_eos_penalty is taken off a completion that max_completion_length cut.
"""

import hashlib
import inspect
import math
import numbers
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerState

from ..models import pad_with_eos
from .config import RoundsError
from .identity import code_digest, weights_digest
from .sampling import Completion, is_conversational

RewardFunc = Callable[..., list] | str | torch.nn.Module


@dataclass
class Scores:
    """Per sample: each function's reward (None where it gave none) and the weighted sum (None: unscorable)."""

    per_function: list[dict[str, float | None]]
    total: list[float | None]
    metrics: dict[str, float] = field(default_factory=dict)  # what the functions passed to log_metric, averaged


def function_name(func: Any) -> str:
    """TRL's names: a model by its path's last part, a callable by its __name__ (a partial by its function's)."""
    if isinstance(func, torch.nn.Module):
        return str(getattr(func.config, "_name_or_path", "") or type(func).__name__).rstrip("/").split("/")[-1]
    inner = getattr(func, "func", func)
    return getattr(inner, "__name__", type(inner).__name__)


def function_reference(func: Any) -> str:
    """A reward function's full reference: module:qualname (a partial's function's, a callable object's class's), or
    a reward model's path as it was loaded."""
    if isinstance(func, RewardModel):
        return str(getattr(func.model.config, "_name_or_path", "") or func.__name__)
    inner = getattr(func, "func", func)
    owner = inner if inspect.isroutine(inner) else type(inner)
    return f"{getattr(owner, '__module__', None) or '?'}:{getattr(owner, '__qualname__', function_name(func))}"


def reward_names(funcs: Sequence[Any]) -> list[str]:
    """Each function's name in samples.jsonl and in messages: TRL's (function_name), or where two share it, each one's
    full reference (`rw:length`, `rw2:length`), then its position too where even that is shared (`rw:length#1`).
    Names that do not collide stay as runs recorded them, so those runs resume."""
    names = [function_name(func) for func in funcs]
    counts = Counter(names)
    names = [function_reference(func) if counts[name] > 1 else name for func, name in zip(funcs, names)]
    counts = Counter(names)
    return [f"{name}#{index}" if counts[name] > 1 else name for index, name in enumerate(names)]


def _source_digest(func: Any) -> str | None:
    """sha256 of a reward function's source (a partial's arguments too), or None where there is no source to read
    (a reward model, a builtin, code typed at a prompt)."""
    if isinstance(func, RewardModel):
        return None
    inner = getattr(func, "func", func)
    try:
        source = inspect.getsource(inner if inspect.isroutine(inner) else type(inner))
    except Exception:  # OSError, TypeError; a file changed since it was imported may fail to tokenize
        return None
    if inner is not func:  # a partial: the same function with other arguments is another reward
        source += repr((getattr(func, "args", ()), sorted(getattr(func, "keywords", {}).items())))
    return hashlib.sha256(source.encode()).hexdigest()


def _identity(func: Any) -> dict[str, str | None]:
    found = {"reference": function_reference(func), "source (sha256)": _source_digest(func)}
    if isinstance(func, RewardModel):
        return {**found, "weights (sha256)": weights_digest(func.model, func.tokenizer)}
    return {**found, "code (sha256)": code_digest(func)}


class RewardModel:
    """A sequence-classification model used as a reward function, TRL's way: prompt + completion (a conversation
    through the chat template), padded on the right, the first logit."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        self.model, self.tokenizer = model.eval(), tokenizer
        pad_with_eos(tokenizer)
        model.config.pad_token_id = tokenizer.pad_token_id
        self.__name__ = function_name(model)

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        if is_conversational(prompts[0]):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(next(self.model.parameters()).device)
        return self.model(**inputs).logits[:, 0].float().tolist()


def load_reward_model(path: str, trust_remote_code: bool = False) -> RewardModel:
    """A reward model's folder or hub id, loaded as TRL's GRPOTrainer loads one: sequence classification, one label.
    The one loader: the library's paths and the command's --reward_funcs (with its --trust_remote_code) come here."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
    return RewardModel(model, AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def as_callables(reward_funcs: RewardFunc | Sequence[RewardFunc]) -> list[Callable[..., list]]:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise RoundsError("reward_funcs: give at least one reward function")
    loaded = []
    for func in funcs:
        if isinstance(func, str):
            func = load_reward_model(func)
        elif isinstance(func, torch.nn.Module):
            raise RoundsError(f"reward_funcs: pass the reward model {function_name(func)} as its path, or as "
                              "RewardModel(model, tokenizer)")
        loaded.append(func)
    return loaded


def _checked(output: Any, name: str, expected: int, round_index: int) -> list[float | None]:
    where = f"round {round_index}: reward function {name!r}"
    # TRL iterates over the output: a list, a tuple, or a numpy array or torch tensor of one reward per completion.
    if not isinstance(output, (list, tuple, np.ndarray, torch.Tensor)) or getattr(output, "ndim", 1) == 0:
        raise RoundsError(f"{where} returned {type(output).__name__}, not a list of rewards")
    values = list(output)
    if len(values) != expected:
        raise RoundsError(f"{where} returned {len(values)} rewards for {expected} completions")
    read = [None if value is None else _number(value) for value in values]
    for i, (value, number) in enumerate(zip(values, read)):
        if value is not None and (number is None or not math.isfinite(number)):
            raise RoundsError(f"{where} returned {_shown(value)} for completion {i}: a reward is a finite number or "
                              "None")
    if all(value is None for value in values):
        raise RoundsError(f"{where} returned only None ({expected} completions): it judged none of them")
    return read


def _number(value: Any) -> float | None:
    """A reward read as TRL reads it (`torch.tensor(rewards, dtype=float32)` takes Python, numpy and one-element
    torch real numbers), kept in float64; None where TRL would refuse it. An int past the float range is inf, as it
    is refused."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 and not value.is_complex() else None
    elif isinstance(value, (np.ndarray, np.generic)):
        value = value.item() if value.ndim == 0 and value.dtype.kind in "biuf" else None
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python prints
        text = f"an integer of over {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= 40 else f"{text[:37]}..."


class Rewards:
    """The reward functions of a run, their weights and the length guard; `score` judges one round's samples."""

    def __init__(self, reward_funcs: RewardFunc | Sequence[RewardFunc], weights: Sequence[float] | None = None,
                 missing_eos_penalty: float | None = None):
        self.funcs = as_callables(reward_funcs)
        self.names = reward_names(self.funcs)
        if weights is not None and len(weights) != len(self.funcs):
            raise RoundsError(f"reward_weights has {len(weights)} weights for {len(self.funcs)} reward functions")
        self.weights = list(weights) if weights is not None else [1.0] * len(self.funcs)
        self.missing_eos_penalty = missing_eos_penalty

    def identity(self) -> dict[str, dict[str, str | None]]:
        """What a resume checks it has the same functions by, beyond their names: each one's full reference, the
        sha256 of its source (another `length` of the opposite sign would otherwise go on under the same name), and
        of what decides its rewards (identity.py: its module, the helpers and constants it reads, a callable
        object's attributes; a reward model's weights)."""
        return {name: _identity(func) for name, func in zip(self.names, self.funcs)}

    def score(self, prompts: list, completions: list[Completion], columns: dict[str, list], round_index: int,
              state: TrainerState | None = None) -> Scores:
        """`prompts`, `completions` and each column: one entry per sample."""
        texts = [[{"role": "assistant", "content": c.text}] for c in completions] \
            if is_conversational(prompts[0]) else [c.text for c in completions]
        logged = defaultdict(list)
        extra = {"trainer_state": state or TrainerState(), "log_extra": lambda column, values: None,
                 "log_metric": lambda name, value: logged[name].append(value)}
        by_function = []
        for func, name in zip(self.funcs, self.names):
            try:
                output = func(prompts=prompts, completions=texts, completion_ids=[c.ids for c in completions],
                              **columns, **extra)
            except Exception as error:
                raise RoundsError(f"round {round_index}: reward function {name!r} raised "
                                  f"{type(error).__name__}: {error}") from error
            by_function.append(_checked(output, name, len(completions), round_index))
        per_sample = [dict(zip(self.names, values)) for values in zip(*by_function)]
        totals = [self._total(values, c) for values, c in zip(zip(*by_function), completions)]
        for i, total in enumerate(totals):
            if total is not None and not math.isfinite(total):  # finite rewards whose weighted sum overflows
                raise RoundsError(f"round {round_index}: the weighted reward of completion {i} is {total} (its "
                                  "rewards times reward_weights overflow a float): scale the rewards down")
        return Scores(per_sample, totals, {name: sum(values) / len(values) for name, values in logged.items()})

    def _total(self, values: Sequence[float | None], completion: Completion) -> float | None:
        if all(value is None for value in values):
            return None
        total = sum(w * v for w, v in zip(self.weights, values) if v is not None)
        if completion.truncated and self.missing_eos_penalty is not None:
            total -= self.missing_eos_penalty
        return total
