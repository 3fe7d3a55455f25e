"""What decides a reward function's rewards, as one sha256 that a resume compares (settings.json's reward_identity):

- a function: the whole source file of its module (its constants and helpers there), and, followed by the names its
  code reads from its module's globals, the source file of every function, class or module of the user's own code it
  reaches (installed packages and the standard library: the module file of the one it names, not followed further),
  the values it reads by name (so `SIGN = -1` set at run time counts too; a list, dict or set by its type alone: a
  reward's call log or cache lives there), its defaults and closure;
- a partial: that, plus its arguments; a callable object: its class's, plus its attributes (`Scorer(-1)` is not
  `Scorer(1)`), each read as a stable value: plain data as itself, a tensor or array by its bytes, a torch module by
  its state_dict, another object by its class and its attributes;
- a reward model (`RewardModel`): its weights as loaded (every tensor's bytes, a sha256 of what scores, not of a path
  or a file's size and time: 538 MB of SmolLM2-135M took 2.8 s on a busy 2-core CPU), its tokenizer's vocabulary
  and its chat template.

What no such reading sees is not checked: data files or services a function reads at run time, names it reaches
otherwise than by a global name (getattr, eval), code that an installed package's module imports in turn.
"""

import collections
import functools
import hashlib
import inspect
import logging
import site
import sysconfig
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpo_min.tokenizing import template_fingerprint, tokenizer_fingerprint

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_GATHERS = (list, dict, set, bytearray, collections.deque, collections.Counter, collections.defaultdict)
_DEPTH = 6  # how deep an object's attributes are read: a cycle or a vast graph stops there, by its class's name
_INSTALLED = tuple(str(Path(p).resolve()) for p in {*site.getsitepackages(), site.getusersitepackages(),
                                                    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib",
                                                                                         "purelib", "platlib"))})


def code_digest(func: Any) -> str | None:
    """sha256 of what decides a reward callable's rewards (the module docstring lists it); None without a source to
    read (a builtin)."""
    inner = getattr(func, "func", func) if isinstance(func, functools.partial) else func
    digest, sources, seen = hashlib.sha256(), {}, set()
    if inner is not func:  # a partial: the same function with other arguments is another reward
        digest.update(stable((func.args, func.keywords)).encode())
    if not inspect.isroutine(inner):
        digest.update(stable(_attributes(inner)).encode())
        inner = type(inner)
    todo = [inner]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        source = _source(obj, sources)
        if source is None or (obj is not inner and _installed(source)):
            continue  # a builtin; an installed package's code: its module file counts, what it imports is not read
        for name, value in _names_read(obj):
            followed = value if isinstance(value, (types.FunctionType, type, types.ModuleType)) else type(value)
            todo.append(followed)
            # A list, dict or set read by name is where a reward keeps what it gathers as it scores (a call log, a
            # cache): read by its type alone, so that a resume in the same process is not another reward.
            shown = type(value).__name__ if isinstance(value, _GATHERS) else stable(value)
            digest.update(f"{name}={shown}".encode())
    if _source(inner, sources) is None:
        return None
    for where in sorted(sources):
        digest.update(f"{Path(where).name}:{sources[where]}".encode())
    return digest.hexdigest()


def weights_digest(model: torch.nn.Module, tokenizer: Any) -> str:
    """sha256 of a reward model's weights as loaded (names, dtypes, shapes and bytes of its state_dict), its
    tokenizer's vocabulary and chat template: new weights in the same folder are another reward."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{_tensor(tensor)}".encode())
    digest.update(f"{tokenizer_fingerprint(tokenizer)}:{template_fingerprint(tokenizer)}".encode())
    return digest.hexdigest()


def stable(value: Any, depth: int = 0) -> str:
    """A value as text that is the same in every process that builds it alike: no id, no memory address."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _tensor(value)
    if isinstance(value, torch.nn.Module):
        return f"{_reference(type(value))}({stable(value.state_dict(), depth)})"
    if isinstance(value, (types.FunctionType, type, types.ModuleType, types.BuiltinFunctionType)):
        return _reference(value)
    if isinstance(value, functools.partial):
        return f"partial({_reference(value.func)}, {stable((value.args, value.keywords), depth)})"
    if depth >= _DEPTH:
        return _reference(type(value))
    if isinstance(value, dict):
        items = sorted((stable(k, depth + 1), stable(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(stable(v, depth + 1) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[" + ", ".join(stable(v, depth + 1) for v in value) + "]"
    if isinstance(value, logging.Logger) or _installed(_where(type(value))):
        # A library's object: its repr where that names no address (re.compile('...'), Path, Fraction), else its
        # class (a logger's repr says its level, which decides no reward).
        text = "" if isinstance(value, logging.Logger) else repr(value)
        return text if text and " at 0x" not in text else _reference(type(value))
    return f"{_reference(type(value))}({stable(_attributes(value), depth + 1)})"


def _tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type == "meta":
            return f"tensor({value.dtype}, {tuple(value.shape)}, meta)"
        raw = value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"tensor({value.dtype}, {tuple(value.shape)}, {hashlib.sha256(raw).hexdigest()})"
    if value.dtype == object:
        return f"array({[stable(v) for v in value.reshape(-1).tolist()]}, {value.shape})"
    return f"array({value.dtype}, {value.shape}, {hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()})"


def _attributes(obj: Any) -> dict[str, Any]:
    """An object's own attributes (its __dict__ and __slots__ values)."""
    found = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                found.setdefault(slot, getattr(obj, slot))
    return found


def _reference(obj: Any) -> str:
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return f"{module}:{getattr(obj, '__qualname__', '')}"


def _where(obj: Any) -> str | None:
    """The file that defines `obj` (where no file holds it, as in a notebook cell, its reference); None: a builtin."""
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):  # a builtin, or a class whose module is gone
        return None
    return str(Path(path).resolve()) if path and Path(path).is_file() else _reference(obj)


def _source(obj: Any, sources: dict[str, str]) -> str | None:
    """_where(obj), with the sha256 of that file (or of obj's own source) put in `sources`; None: no source."""
    where = _where(obj)
    if where is not None and where not in sources:
        try:
            text = Path(where).read_bytes() if Path(where).is_file() else inspect.getsource(obj).encode()
        except (OSError, TypeError):
            return None
        sources[where] = hashlib.sha256(text).hexdigest()
    return where


def _installed(where: str | None) -> bool:
    """Code of an installed package or the standard library, or a builtin (no source at all)."""
    return where is None or where.startswith(_INSTALLED)


def _names_read(obj: Any) -> Iterator[tuple[str, Any]]:
    """(name, value) of each global a function's code (a class's methods', a module's functions') names, its
    defaults and closure cells; a class's bases too."""
    if isinstance(obj, types.ModuleType):
        return
    if isinstance(obj, type):
        for base in obj.__mro__[1:-1]:
            yield base.__name__, base
        for value in vars(obj).values():
            value = getattr(value, "__func__", getattr(value, "fget", value))  # static/class methods, properties
            if isinstance(value, types.FunctionType):
                yield from _names_read(value)
        return
    if not isinstance(obj, types.FunctionType):
        return
    for name in sorted(_code_names(obj.__code__)):
        if name in obj.__globals__:
            yield name, obj.__globals__[name]
    yield "defaults", (obj.__defaults__, obj.__kwdefaults__)
    for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell
            continue


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names
