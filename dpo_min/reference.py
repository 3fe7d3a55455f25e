"""The reference: which model computes pi_ref, decided once at construction, and everything the trainer asks of it.

`choose_reference` picks one of, in this order:
- none (`NoReference`): the loss reads no reference (simpo, cpo, `reference_free`), so there is no copy and no
  reference forward;
- `ref_model` (`ModelReference`): a separate frozen model, given by the caller;
- for a PEFT model: the adapter named `ref_adapter_name` (`AdapterReference`); the model with its adapter disabled
  (`AdapterOff`: for a `peft_config`, or, as TRL, an adapter on `target_parameters` under peft < 0.20, which cannot
  hold a second one); otherwise a frozen copy of the adapter the model arrives with (`AdapterReference`; TR-DPO with
  a `peft_config` also gets such a copy, to move);
- full fine-tuning with `precompute_ref_log_probs`: the model itself, before its first step (`PolicyReference`);
- otherwise a frozen copy of the model (`ModelReference`).
The trainer then asks the chosen reference, through the `Reference` interface every kind implements, for the model
that computes a batch's reference log-probs (`computing`, in the spirit of torchtune's `with torch.no_grad(),
disable_adapter(model)`), the weights and settings the precompute cache key hashes, TR-DPO's sync, and a one-line
description; it never asks which kind it holds.
"""

import abc
import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from packaging.version import Version
from transformers import TrainerCallback

from .scale import sharding, zero

try:
    from peft import LoraConfig, PeftModel, get_peft_model
except ImportError:  # peft is a dependency, but keep the full fine-tuning path importable without it
    LoraConfig = PeftModel = get_peft_model = type(None)

logger = logging.getLogger(__name__)
REF_ADAPTER = "ref"


def is_peft(model: Any) -> bool:
    return isinstance(model, PeftModel) and model is not None


@torch.no_grad()
def _mix_into(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor], alpha: float) -> None:
    """target <- alpha * source + (1 - alpha) * target, name by name (TRL's SyncRefModelCallback arithmetic)."""
    for name, value in source.items():
        target[name].mul_(1.0 - alpha).add_(value, alpha=alpha)


def _adapter_parameters(model: "PeftModel", adapter: str) -> dict[str, torch.Tensor]:
    """The parameters of one adapter, keyed by their name with the adapter's name taken out."""
    tag = f".{adapter}."
    return {name.replace(tag, "."): param for name, param in model.named_parameters() if tag in name}


def _same_shapes(policy: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    if {name: p.shape for name, p in policy.items()} != {name: p.shape for name, p in reference.items()}:
        raise ValueError("sync_ref_model needs a reference (model or adapter) with the policy's parameters")


def _add_adapter_copy(model: "PeftModel", name: str) -> str:
    """Add adapter `name`, frozen, with the weights of the active adapter; the active adapter stays active."""
    active = model.active_adapter
    model.add_adapter(name, model.peft_config[active])
    _mix_into(_adapter_parameters(model, name), _adapter_parameters(model, active), alpha=1.0)
    model.set_adapter(active)  # only the active adapter trains
    return name


class Reference(abc.ABC):
    """The interface of a reference: what the trainer asks of it, whichever kind it is. Not used as is: each kind
    below subclasses it and overrides what it has; the defaults are those of a reference with no model or adapter
    of its own (its weights are the policy's, no sync, nothing to prepare)."""

    description: str  # one line, for the log and the model card
    model: torch.nn.Module | None = None  # a separate reference model (prepared for the run), if any
    adapter: str | None = None  # the name of a reference adapter of the policy, if any
    cache_name = "model"  # what the precompute cache key calls this kind
    mode: str | None = None  # the DPOMinConfig.reference_mode that named it; None: chosen from what was given

    @abc.abstractmethod
    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The module whose forward gives the reference log-probs, for the duration of the block."""

    def weights(self, policy: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The tensors the reference log-probs depend on (for the precompute cache key)."""
        policy = extract_model_from_parallel(policy)
        trained = f".{policy.active_adapter}." if is_peft(policy) else None
        # keep_vars: ZeRO-3's placeholders carry what gathers them (a plain state_dict would hash empty tensors).
        return sharding.gathered((name, tensor) for name, tensor in policy.state_dict(keep_vars=True).items()
                                 if trained is None or trained not in name)

    def cache_settings(self, args: Any) -> dict[str, Any]:
        """What else the reference log-probs depend on, for the precompute cache key."""
        return {"reference": self.cache_name, "ld_alpha": args.ld_alpha, "max_length": args.max_length,
                "max_prompt_length": args.max_prompt_length, "truncation_mode": args.truncation_mode}

    def check_sync(self, policy: torch.nn.Module) -> None:
        """Raise unless TR-DPO can sync this reference towards the policy."""
        raise ValueError("sync_ref_model needs a reference (model or adapter) with the policy's parameters")

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference."""
        raise ValueError("no reference weights to sync: the reference log-probs were precomputed")

    def modules(self) -> list[torch.nn.Module]:
        """Models of the reference's own, which the trainer prepares as it prepares the policy."""
        return []

    def prepare(self, accelerator: Any, deepspeed: bool) -> None:
        """Place the reference for the run, once the accelerator exists."""
        return None  # nothing of its own to place

    def fixed_before_training(self) -> bool:
        """True when the reference is the policy itself, so its log-probs exist only before the first step."""
        return False


class NoReference(Reference):
    """No reference: the loss reads none (simpo, cpo, `reference_free`), or `ref_model` was set to None."""

    description = "none (the loss reads no reference)"

    def __init__(self, description: str | None = None):
        if description is not None:
            self.description = description

    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        raise ValueError("this loss reads no reference log-probs")
        yield policy  # a generator, like the others


class ModelReference(Reference):
    """A separate frozen model: `ref_model`, or a copy of the model for full fine-tuning. `model` is that model, and
    after `prepare` the model prepared for the run (a DeepSpeed engine, or what the accelerator makes of it);
    `_unwrapped` is the model inside, whose weights the cache key hashes and TR-DPO mixes."""

    def __init__(self, model: torch.nn.Module, description: str = "ref_model, a separate frozen model"):
        self.model: torch.nn.Module = model
        self.description = description

    def _unwrapped(self) -> torch.nn.Module:
        return extract_model_from_parallel(self.model, keep_torch_compile=False)

    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield self.model

    def weights(self, policy: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        return sharding.gathered(self._unwrapped().state_dict(keep_vars=True).items())

    def check_sync(self, policy: torch.nn.Module) -> None:
        if is_peft(policy):
            raise ValueError("sync_ref_model with a PeftModel syncs a reference adapter: omit ref_model")
        _same_shapes(dict(policy.named_parameters()), dict(self._unwrapped().named_parameters()))

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        policy, reference = extract_model_from_parallel(policy), self._unwrapped()
        sharding.reshard(policy, reference)
        _mix_into(dict(reference.named_parameters()), dict(policy.named_parameters()), alpha)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def prepare(self, accelerator: Any, deepspeed: bool) -> None:
        self.model = zero.inference_engine(self.model, accelerator) if deepspeed \
            else accelerator.prepare_model(self.model, evaluation_mode=True)


class PolicyReference(Reference):
    """Full fine-tuning with precomputed log-probs: the model itself, before its first step."""

    description = "the model before its first step (log-probs precomputed)"

    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield policy

    def fixed_before_training(self) -> bool:
        return True


class AdapterOff(Reference):
    """A PEFT model with its adapter disabled: the base model."""

    description = "the base model (the adapter disabled)"
    cache_name = "adapter disabled"

    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        with extract_model_from_parallel(policy).disable_adapter():
            yield policy


class AdapterReference(Reference):
    """Another adapter of the PEFT model, frozen, made active for the reference forward."""

    def __init__(self, adapter: str, description: str):
        self.adapter, self.description = adapter, description
        self.cache_name = f"adapter {adapter}"

    @contextlib.contextmanager
    def computing(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        peft_model = extract_model_from_parallel(policy)
        active = peft_model.active_adapter
        peft_model.set_adapter(self.adapter, inference_mode=True)
        try:
            yield policy
        finally:
            peft_model.set_adapter(active)

    def check_sync(self, policy: torch.nn.Module) -> None:
        _same_shapes(_adapter_parameters(policy, policy.active_adapter), _adapter_parameters(policy, self.adapter))

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        policy = extract_model_from_parallel(policy)
        sharding.reshard(policy)
        _mix_into(_adapter_parameters(policy, self.adapter), _adapter_parameters(policy, policy.active_adapter), alpha)


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO: after every `ref_model_sync_steps` optimizer steps, move the reference towards the policy."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.sync()


def _no_second_adapter(model: "PeftModel") -> bool:
    """A LoRA on `target_parameters` (MoE expert weights) under peft 0.17-0.19, which cannot hold a second such
    adapter (peft#3340, fixed in 0.20): TRL 1.16 then disables the adapter for the reference instead of copying it."""
    import peft

    config = model.peft_config[model.active_adapter]
    old_peft = Version("0.17.0") <= Version(peft.__version__) < Version("0.20.0")
    return old_peft and isinstance(config, LoraConfig) and bool(getattr(config, "target_parameters", None))


def _peft_reference(model: "PeftModel", args: Any, from_peft_config: bool) -> Reference:
    if from_peft_config:
        # The adapter disabled is the reference, unless TR-DPO must move it: then it needs weights of its own, a copy
        # of the fresh adapter (equal to the bare model while B = 0).
        return AdapterReference(_add_adapter_copy(model, REF_ADAPTER), "a copy of the fresh adapter (TR-DPO)") \
            if args.sync_ref_model else AdapterOff()
    if args.ref_adapter_name is not None:
        return AdapterReference(args.ref_adapter_name, f"adapter {args.ref_adapter_name!r}")
    if _no_second_adapter(model):
        logger.warning("peft<0.20 cannot add a frozen reference adapter beside one on target_parameters (peft#3340): "
                       "the reference is the model with its adapter disabled, as in TRL; upgrade peft for a copy")
        return AdapterOff()
    # An adapter may arrive already trained: the reference is that adapter as it starts, kept frozen.
    return AdapterReference(_add_adapter_copy(model, REF_ADAPTER), "a frozen copy of the adapter the model came with")


def _set_up_adapters(model: Any, args: Any, ref_model: Any, peft_config: Any) -> tuple[Any, bool]:
    """Wrap the model in `peft_config` or pick its trained adapter; return it and whether peft_config wrapped it."""
    named = [name for name in (args.model_adapter_name, args.ref_adapter_name) if name is not None]
    if named and (not is_peft(model) or ref_model is not None):
        raise ValueError("model_adapter_name / ref_adapter_name name adapters of the PeftModel passed as model "
                         "(without ref_model)")
    if peft_config is not None:
        if is_peft(model):
            raise ValueError("pass either a PeftModel or a peft_config, not both")
        # Under ZeRO-3 the adapter keeps the base weights' dtype: ZeRO-3 gathers each layer's parameters in one
        # buffer of one dtype, and peft would otherwise upcast the adapter to float32 (TRL does the same).
        return get_peft_model(model, peft_config, autocast_adapter_dtype=zero.zero_stage(args) != 3), True
    for name in named:
        if name not in model.peft_config:
            raise ValueError(f"no adapter named {name!r} in the model; it has {sorted(model.peft_config)}")
    if args.model_adapter_name is not None:
        model.set_adapter(args.model_adapter_name)  # also freezes every other adapter
    return model, False


def needs_second_load(args: Any, trains_adapter: bool) -> bool:
    """Whether the reference must be passed as ref_model, the model loaded a second time: full fine-tuning under ZeRO-3
    whose loss reads a reference it does not precompute (the partitioned policy cannot be copied, and
    `choose_reference` refuses it). The command asks this (`Plan.reload_reference`) before it loads the model."""
    return (zero.zero_stage(args) == 3 and not trains_adapter and not args.precompute_ref_log_probs
            and args.loss_settings.reads_reference)


def choose_reference(model: Any, ref_model: Any, args: Any, peft_config: Any,
                     reads_reference: bool) -> tuple[Any, Reference]:
    """The model (wrapped in `peft_config`, if given) and its reference, checked against TR-DPO's needs."""
    model, wrapped = _set_up_adapters(model, args, ref_model, peft_config)
    if not reads_reference:  # a ref_model given to such a loss is not kept
        why = "reference_free" if args.reference_free else f"loss_type {', '.join(args.loss_type)}"
        reference = NoReference(f"none ({why}: the loss reads no reference)")
    elif getattr(args, "reference_mode", None) is not None:  # named: no branch below decides it
        reference = _named_reference(args.reference_mode, model, ref_model, args, wrapped)
    elif ref_model is not None:
        reference = ModelReference(ref_model.eval().requires_grad_(False), _given_reference(ref_model, model))
    elif is_peft(model):
        reference = _peft_reference(model, args, wrapped)
    elif args.precompute_ref_log_probs:
        reference = PolicyReference()
    elif zero.is_partitioned(model):  # a copy of ZeRO-3's placeholders would be no model at all
        raise ValueError("full fine-tuning under DeepSpeed ZeRO-3 needs a reference: pass ref_model (an id or path, "
                         "loaded partitioned), or precompute_ref_log_probs=True, or a peft_config")
    else:
        reference = ModelReference(copy.deepcopy(model).eval().requires_grad_(False), "a frozen copy of the model")
    if args.sync_ref_model:
        reference.check_sync(model)
    if args.precompute_ref_log_probs and reads_reference and not reference.fixed_before_training():
        reference.description += ", log-probs precomputed"
    return model, reference


def _given_reference(ref_model: Any, model: Any) -> str:
    """ref_model by its name; the same name as the policy's is the base model loaded again (the command does so
    for full fine-tuning under ZeRO-3, where the partitioned policy cannot be copied)."""
    name = getattr(ref_model, "name_or_path", "") or ""
    if name and name == getattr(model, "name_or_path", None):
        return f"the base model loaded a second time as ref_model ({name}), frozen"
    return f"ref_model {name}, a separate frozen model" if name else "ref_model, a separate frozen model"


# What each reference_mode needs of the models given, and says when they do not fit.
_MODE_NEEDS = {"ref_model": "a ref_model", "adapter_off": "a bare model and a peft_config",
               "adapter_at_start": "a PeftModel and no ref_model or peft_config",
               "policy_at_start": "a model without an adapter and no ref_model or peft_config"}


def _named_reference(mode: str, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
    """The reference `mode` names (config.REFERENCE_MODES), built directly: a caller that names its reference (the
    rounds) gets that one whatever order the inferring branches of `choose_reference` take, or a ValueError when the
    models given cannot be it."""
    fits = {"ref_model": ref_model is not None, "adapter_off": is_peft(model) and wrapped,
            "adapter_at_start": is_peft(model) and not wrapped and ref_model is None,
            "policy_at_start": not is_peft(model) and ref_model is None}
    if not fits[mode]:
        raise ValueError(f"reference_mode={mode!r} needs {_MODE_NEEDS[mode]}")
    if mode == "ref_model":
        reference = ModelReference(ref_model.eval().requires_grad_(False), _given_reference(ref_model, model))
    elif mode == "adapter_off":  # TR-DPO moves it: a copy of the fresh adapter, equal to it off while B = 0
        reference = AdapterReference(_add_adapter_copy(model, REF_ADAPTER), "a copy of the fresh adapter (TR-DPO)") \
            if args.sync_ref_model else AdapterOff()
    elif mode == "adapter_at_start":
        reference = AdapterReference(_add_adapter_copy(model, REF_ADAPTER),
                                     "a frozen copy of the adapter the model came with")
    elif args.precompute_ref_log_probs:
        reference = PolicyReference()
    elif zero.is_partitioned(model):
        raise ValueError("reference_mode='policy_at_start' under DeepSpeed ZeRO-3 needs precompute_ref_log_probs")
    else:
        reference = ModelReference(copy.deepcopy(model).eval().requires_grad_(False), "a frozen copy of the model")
    reference.mode = mode
    return reference
