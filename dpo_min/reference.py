"""The reference: which model computes pi_ref, decided once at construction (`choose_reference`), and what the trainer
asks of it besides a step: the weights the precompute cache key hashes, TR-DPO's sync, its placement for the run.

A training step enters none of this file. It reads the decision, a `Reference`, through one context manager where the
step takes the reference's forward (`DPOMinTrainer.reference_model` in trainer.py: `with torch.no_grad(),
self.reference_model() as model:`, as torchtune's recipe writes `with torch.no_grad(), disable_adapter(model):`).

`choose_reference` decides, in this order:
- none (kind "none"): the loss reads no reference (simpo, cpo, `reference_free`), so there is no copy and no
  reference forward;
- the reference `reference_mode` names, when the config names one (the rounds do): built whatever the branches below
  would infer, or a ValueError when the models given cannot be it;
- `ref_model` (kind "model"): a separate frozen model, given by the caller;
- for a PEFT model: the adapter named `ref_adapter_name` (kind "adapter"); the model with its adapter disabled (kind
  "adapter_off": for a `peft_config`, or, as TRL, an adapter on `target_parameters` under peft < 0.20, which cannot
  hold a second one); otherwise a frozen copy of the adapter the model arrives with (kind "adapter"; TR-DPO with a
  `peft_config` also gets such a copy, to move);
- full fine-tuning with `precompute_ref_log_probs`: the model itself, before its first step (kind "policy");
- otherwise a frozen copy of the model (kind "model").
"""

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
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
# What each kind of reference is; `DPOMinTrainer.reference_model` runs each one's forward.
KINDS = {"none": "no reference: the loss reads none", "model": "a separate frozen model (`model`)",
         "policy": "the policy itself, before its first step", "adapter_off": "the policy with its adapter disabled",
         "adapter": "another adapter of the policy (`adapter`), frozen, active for the reference's forward"}


@dataclass
class Reference:
    """Which model computes pi_ref: one of `KINDS`, decided once by `choose_reference`, described in one line."""

    kind: str
    description: str  # one line, for the log and the model card
    model: torch.nn.Module | None = None  # kind "model": that model (after `prepare`, as prepared for the run)
    adapter: str | None = None  # kind "adapter": the name of the policy's reference adapter
    mode: str | None = None  # the DPOMinConfig.reference_mode that named it; None: chosen from what was given

    def modules(self) -> list[torch.nn.Module]:
        """Models of the reference's own, which the trainer prepares as it prepares the policy."""
        return [] if self.model is None else [self.model]

    def prepare(self, accelerator: Any, deepspeed: bool) -> None:
        """Place a reference model of its own for the run, once the accelerator exists."""
        if self.model is not None:
            self.model = zero.inference_engine(self.model, accelerator) if deepspeed \
                else accelerator.prepare_model(self.model, evaluation_mode=True)

    def weights(self, policy: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The tensors the reference log-probs depend on (for the precompute cache key)."""
        # keep_vars: ZeRO-3's placeholders carry what gathers them (a plain state_dict would hash empty tensors).
        if self.model is not None:
            return sharding.gathered(_unwrapped(self.model).state_dict(keep_vars=True).items())
        policy = extract_model_from_parallel(policy)
        trained = f".{policy.active_adapter}." if is_peft(policy) else None
        return sharding.gathered((name, tensor) for name, tensor in policy.state_dict(keep_vars=True).items()
                                 if trained is None or trained not in name)

    def cache_settings(self, args: Any) -> dict[str, Any]:
        """What else the reference log-probs depend on, for the precompute cache key."""
        name = {"adapter_off": "adapter disabled", "adapter": f"adapter {self.adapter}"}.get(self.kind, "model")
        return {"reference": name, "ld_alpha": args.ld_alpha, "max_length": args.max_length,
                "max_prompt_length": args.max_prompt_length, "truncation_mode": args.truncation_mode}

    def check_sync(self, policy: torch.nn.Module) -> None:
        """Raise unless TR-DPO can sync this reference towards the policy."""
        if self.kind == "model" and is_peft(policy):
            raise ValueError("sync_ref_model with a PeftModel syncs a reference adapter: omit ref_model")
        if self.kind == "model":
            _same_shapes(dict(policy.named_parameters()), dict(_unwrapped(self.model).named_parameters()))
        elif self.kind == "adapter":
            _same_shapes(_adapter_parameters(policy, policy.active_adapter), _adapter_parameters(policy, self.adapter))
        else:
            raise ValueError("sync_ref_model needs a reference (model or adapter) with the policy's parameters")

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference."""
        policy = extract_model_from_parallel(policy)
        if self.kind == "model":
            reference = _unwrapped(self.model)
            sharding.reshard(policy, reference)
            _mix_into(dict(reference.named_parameters()), dict(policy.named_parameters()), alpha)
        elif self.kind == "adapter":
            sharding.reshard(policy)
            _mix_into(_adapter_parameters(policy, self.adapter), _adapter_parameters(policy, policy.active_adapter),
                      alpha)
        else:
            raise ValueError("no reference weights to sync: the reference log-probs were precomputed")


class SyncReferenceCallback(TrainerCallback):
    """TR-DPO: after every `ref_model_sync_steps` optimizer steps, move the reference towards the policy."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.sync()


def is_peft(model: Any) -> bool:
    return isinstance(model, PeftModel) and model is not None


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside what the accelerator or DeepSpeed made of it: the weights the cache key hashes, TR-DPO mixes."""
    return extract_model_from_parallel(model, keep_torch_compile=False)


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


def _no_second_adapter(model: "PeftModel") -> bool:
    """A LoRA on `target_parameters` (MoE expert weights) under peft 0.17-0.19, which cannot hold a second such
    adapter (peft#3340, fixed in 0.20): TRL 1.16 then disables the adapter for the reference instead of copying it."""
    import peft

    config = model.peft_config[model.active_adapter]
    old_peft = Version("0.17.0") <= Version(peft.__version__) < Version("0.20.0")
    return old_peft and isinstance(config, LoraConfig) and bool(getattr(config, "target_parameters", None))


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
    mode = getattr(args, "reference_mode", None)
    if not reads_reference:  # a ref_model given to such a loss is not kept
        why = "reference_free" if args.reference_free else f"loss_type {', '.join(args.loss_type)}"
        reference = Reference("none", f"none ({why}: the loss reads no reference)")
    elif mode is not None:  # named: the models given must fit it
        _check_fits(mode, model, ref_model, wrapped)
        reference = _built(mode, model, ref_model, args, wrapped)
        reference.mode = mode
    elif ref_model is None and is_peft(model) and not wrapped and args.ref_adapter_name is not None:
        reference = Reference("adapter", f"adapter {args.ref_adapter_name!r}", adapter=args.ref_adapter_name)
    else:
        reference = _built(_inferred_mode(model, ref_model, wrapped), model, ref_model, args, wrapped)
    if args.sync_ref_model:
        reference.check_sync(model)
    if args.precompute_ref_log_probs and reads_reference and reference.kind != "policy":
        reference.description += ", log-probs precomputed"
    return model, reference


def _inferred_mode(model: Any, ref_model: Any, wrapped: bool) -> str:
    """The reference_mode the models given imply, when the config names none."""
    if ref_model is not None:
        return "ref_model"
    if not is_peft(model):
        return "policy_at_start"
    if not wrapped and _no_second_adapter(model):
        logger.warning("peft<0.20 cannot add a frozen reference adapter beside one on target_parameters (peft#3340): "
                       "the reference is the model with its adapter disabled, as in TRL; upgrade peft for a copy")
        return "adapter_off"
    # An adapter may arrive already trained: the reference is that adapter as it starts, kept frozen.
    return "adapter_off" if wrapped else "adapter_at_start"


# What each reference_mode needs of the models given, and says when they do not fit.
_MODE_NEEDS = {"ref_model": "a ref_model", "adapter_off": "a bare model and a peft_config",
               "adapter_at_start": "a PeftModel and no ref_model or peft_config",
               "policy_at_start": "a model without an adapter and no ref_model or peft_config"}


def _check_fits(mode: str, model: Any, ref_model: Any, wrapped: bool) -> None:
    fits = {"ref_model": ref_model is not None, "adapter_off": is_peft(model) and wrapped,
            "adapter_at_start": is_peft(model) and not wrapped and ref_model is None,
            "policy_at_start": not is_peft(model) and ref_model is None}
    if not fits[mode]:
        raise ValueError(f"reference_mode={mode!r} needs {_MODE_NEEDS[mode]}")


def _built(mode: str, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
    """The reference of a reference_mode (config.REFERENCE_MODES), named or inferred."""
    if mode == "ref_model":
        return Reference("model", _given_reference(ref_model, model), model=ref_model.eval().requires_grad_(False))
    if mode == "adapter_off" and wrapped and args.sync_ref_model:
        # TR-DPO moves it: a copy of the fresh adapter, equal to the adapter off while B = 0.
        return Reference("adapter", "a copy of the fresh adapter (TR-DPO)",
                         adapter=_add_adapter_copy(model, REF_ADAPTER))
    if mode == "adapter_off":
        return Reference("adapter_off", "the base model (the adapter disabled)")
    if mode == "adapter_at_start":
        return Reference("adapter", "a frozen copy of the adapter the model came with",
                         adapter=_add_adapter_copy(model, REF_ADAPTER))
    if args.precompute_ref_log_probs:
        return Reference("policy", "the model before its first step (log-probs precomputed)")
    if zero.is_partitioned(model):  # a copy of ZeRO-3's placeholders would be no model at all
        raise ValueError("full fine-tuning under DeepSpeed ZeRO-3 needs a reference: pass ref_model (an id or path, "
                         "loaded partitioned), or precompute_ref_log_probs=True, or a peft_config")
    return Reference("model", "a frozen copy of the model", model=copy.deepcopy(model).eval().requires_grad_(False))


def _given_reference(ref_model: Any, model: Any) -> str:
    """ref_model by its name; the same name as the policy's is the base model loaded again (the command does so
    for full fine-tuning under ZeRO-3, where the partitioned policy cannot be copied)."""
    name = getattr(ref_model, "name_or_path", "") or ""
    if name and name == getattr(model, "name_or_path", None):
        return f"the base model loaded a second time as ref_model ({name}), frozen"
    return f"ref_model {name}, a separate frozen model" if name else "ref_model, a separate frozen model"
