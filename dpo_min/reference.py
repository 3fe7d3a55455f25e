"""The reference: which model computes pi_ref, decided once at construction (`choose_reference`), and what the trainer
asks of it besides a step: the weights and settings the precompute cache key hashes, TR-DPO's sync, its placement for
the run.

Its kind is named in the words DPOMinConfig.reference_mode takes, one class each, which holds what that kind does
(`Reference`'s docstring) but its forward. A training step enters none of this file: it runs the reference's forward
in one context manager, by kind (`DPOMinTrainer.reference_model` in trainer.py: `with torch.no_grad(),
self.reference_model() as model:`, as torchtune's recipe writes `with torch.no_grad(), disable_adapter(model):`).

`choose_reference` decides, in this order:
- none (kind None, `NoReference`): the loss reads no reference (simpo, cpo, `reference_free`), so there is no copy and
  no reference forward;
- the reference `reference_mode` names, when the config names one (the rounds do): built whatever the branches below
  would infer, or a ValueError when the models given cannot be it;
- `ref_model` (kind "ref_model", `RefModel`): a separate frozen model, given by the caller;
- for a PEFT model: the adapter named `ref_adapter_name` (kind "adapter_at_start", `AdapterAtStart`); the model with
  its adapter disabled (kind "adapter_off", `AdapterOff`: for a `peft_config`, or, as TRL, an adapter on
  `target_parameters` under peft < 0.20, which cannot hold a second one); otherwise a frozen copy of the adapter the
  model arrives with (kind "adapter_at_start"; TR-DPO with a `peft_config` also gets such a copy, of the fresh adapter,
  to move);
- full fine-tuning with `precompute_ref_log_probs`: the model itself, before its first step (kind "policy_at_start",
  `PolicyBeforeFirstStep`);
- otherwise a frozen copy of the model (kind "policy_at_start", `PolicyAtStart`).
"""

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

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
_NO_SYNC = "sync_ref_model needs a reference (model or adapter) with the policy's parameters"


@dataclass
class Reference:
    """Which model computes pi_ref, decided once by `choose_reference`, described in one line. One class per kind,
    each holding what its kind does: what it needs of the models given and how it is built (the four that
    DPOMinConfig.reference_mode names, `REFERENCES`), its part of the precompute cache key (`cache_name`), TR-DPO's
    sync. `kind` is the reference_mode word (config.REFERENCE_MODES), None for none; its forward is the one thing
    dispatched on it, in `DPOMinTrainer.reference_model`, so that a step stays in trainer.py. This base refuses a
    sync, which only a reference with weights of its own (a model, an adapter) can take."""

    kind: ClassVar[str | None] = None
    # True: the policy itself, no copy, whose log-probs exist only before its first step (precompute.py refuses after).
    before_first_step: ClassVar[bool] = False
    description: str  # one line, for the log and the model card
    model: torch.nn.Module | None = None  # a model of its own (after `prepare`, as prepared for the run)
    adapter: str | None = None  # the name of the policy's reference adapter

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
        return {"reference": self.cache_name(), "ld_alpha": args.ld_alpha, "max_length": args.max_length,
                "max_prompt_length": args.max_prompt_length, "truncation_mode": args.truncation_mode}

    def cache_name(self) -> str:
        # Hashed into the cache's file names (ref_cache.cache_key): a change orphans every user's cache.
        return "model"

    def check_sync(self, policy: torch.nn.Module) -> None:
        """Raise unless TR-DPO can sync this reference towards the policy."""
        raise ValueError(_NO_SYNC)

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference."""
        raise ValueError("no reference weights to sync: the reference log-probs were precomputed")


class NoReference(Reference):
    """None: the loss reads no reference (simpo, cpo, `reference_free`): no copy, no reference forward."""


class RefModel(Reference):
    """ref_model: a separate frozen model (`model`), given by the caller."""

    kind = "ref_model"
    needs = "a ref_model"  # said when the models given do not fit a reference_mode

    @staticmethod
    def fits(model: Any, ref_model: Any, wrapped: bool) -> bool:
        return ref_model is not None

    @classmethod
    def build(cls, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
        return cls(_given_reference(ref_model, model), model=ref_model.eval().requires_grad_(False))

    def check_sync(self, policy: torch.nn.Module) -> None:
        if is_peft(policy):
            raise ValueError("sync_ref_model with a PeftModel syncs a reference adapter: omit ref_model")
        _same_shapes(dict(policy.named_parameters()), dict(_unwrapped(self.model).named_parameters()))

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        policy, reference = extract_model_from_parallel(policy), _unwrapped(self.model)
        sharding.reshard(policy, reference)
        _mix_into(dict(reference.named_parameters()), dict(policy.named_parameters()), alpha)


class PolicyAtStart(RefModel):
    """policy_at_start, full fine-tuning: a frozen copy of the model made at construction (`model`, synced as a
    ref_model is); with its log-probs precomputed, the model itself (`PolicyBeforeFirstStep`)."""

    kind = "policy_at_start"
    needs = "a model without an adapter and no ref_model or peft_config"

    @staticmethod
    def fits(model: Any, ref_model: Any, wrapped: bool) -> bool:
        return not is_peft(model) and ref_model is None

    @classmethod
    def build(cls, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
        if args.precompute_ref_log_probs:
            return PolicyBeforeFirstStep("the model before its first step (log-probs precomputed)")
        if zero.is_partitioned(model):  # a copy of ZeRO-3's placeholders would be no model at all
            raise ValueError("full fine-tuning under DeepSpeed ZeRO-3 needs a reference: pass ref_model (an id or "
                             "path, loaded partitioned), or precompute_ref_log_probs=True, or a peft_config")
        return cls("a frozen copy of the model", model=copy.deepcopy(model).eval().requires_grad_(False))


class PolicyBeforeFirstStep(Reference):
    """policy_at_start with its log-probs precomputed: the model itself, no copy; only the precompute pass reads it,
    before the first step (after it, the trained policy scored against itself would give ln 2)."""

    kind = "policy_at_start"
    before_first_step = True


class AdapterOff(Reference):
    """adapter_off, the default with LoRA: the policy with its adapter disabled, no second copy of the weights
    (torchtune's `disable_adapter`)."""

    kind = "adapter_off"
    needs = "a bare model and a peft_config"

    @staticmethod
    def fits(model: Any, ref_model: Any, wrapped: bool) -> bool:
        return is_peft(model) and wrapped

    @classmethod
    def build(cls, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
        if wrapped and args.sync_ref_model:  # TR-DPO moves it: a copy of the fresh adapter, the adapter off while B = 0
            return AdapterAtStart("a copy of the fresh adapter (TR-DPO)", adapter=_add_adapter_copy(model, REF_ADAPTER))
        return cls("the base model (the adapter disabled)")

    def cache_name(self) -> str:
        return "adapter disabled"


class AdapterAtStart(Reference):
    """adapter_at_start: another adapter of the policy (`adapter`), frozen, active for the reference's forward: a copy
    of the adapter the model came with (of the fresh one, under TR-DPO), or the one `ref_adapter_name` names (TRL's
    adapter loaded twice)."""

    kind = "adapter_at_start"
    needs = "a PeftModel and no ref_model or peft_config"

    @staticmethod
    def fits(model: Any, ref_model: Any, wrapped: bool) -> bool:
        return is_peft(model) and not wrapped and ref_model is None

    @classmethod
    def build(cls, model: Any, ref_model: Any, args: Any, wrapped: bool) -> Reference:
        if args.ref_adapter_name is not None:  # TRL's: the adapter loaded twice, one of them named the reference
            return cls(f"adapter {args.ref_adapter_name!r}", adapter=args.ref_adapter_name)
        return cls("a frozen copy of the adapter the model came with", adapter=_add_adapter_copy(model, REF_ADAPTER))

    def cache_name(self) -> str:
        return f"adapter {self.adapter}"

    def check_sync(self, policy: torch.nn.Module) -> None:
        _same_shapes(_adapter_parameters(policy, policy.active_adapter), _adapter_parameters(policy, self.adapter))

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        policy = extract_model_from_parallel(policy)
        sharding.reshard(policy)
        _mix_into(_adapter_parameters(policy, self.adapter), _adapter_parameters(policy, policy.active_adapter), alpha)


# The references DPOMinConfig.reference_mode names, by its word; `choose_reference` builds the one named or inferred.
REFERENCES = {built.kind: built for built in (RefModel, AdapterOff, AdapterAtStart, PolicyAtStart)}


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
        raise ValueError(_NO_SYNC)


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
        reference = NoReference(f"none ({why}: the loss reads no reference)")
    elif mode is not None:  # named: the models given must fit it
        if args.ref_adapter_name is not None and mode != "adapter_at_start":
            raise ValueError(f"ref_adapter_name={args.ref_adapter_name!r} names an adapter_at_start reference, not "
                             f"reference_mode={mode!r}'s: leave one of them out")
        if not REFERENCES[mode].fits(model, ref_model, wrapped):
            raise ValueError(f"reference_mode={mode!r} needs {REFERENCES[mode].needs}")
        reference = REFERENCES[mode].build(model, ref_model, args, wrapped)
    elif ref_model is None and is_peft(model) and not wrapped and args.ref_adapter_name is not None:
        reference = AdapterAtStart.build(model, ref_model, args, wrapped)
    else:
        reference = REFERENCES[_inferred_mode(model, ref_model, wrapped)].build(model, ref_model, args, wrapped)
    if args.sync_ref_model:
        reference.check_sync(model)
    if args.precompute_ref_log_probs and reads_reference and not reference.before_first_step:
        reference.description += ", log-probs precomputed"  # the model before its first step says so already
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


def _given_reference(ref_model: Any, model: Any) -> str:
    """ref_model by its name; the same name as the policy's is the base model loaded again (the command does so
    for full fine-tuning under ZeRO-3, where the partitioned policy cannot be copied)."""
    name = getattr(ref_model, "name_or_path", "") or ""
    if name and name == getattr(model, "name_or_path", None):
        return f"the base model loaded a second time as ref_model ({name}), frozen"
    return f"ref_model {name}, a separate frozen model" if name else "ref_model, a separate frozen model"
