"""The phases of `DPOMinTrainer`'s constructor before `Trainer.__init__`: validate the arguments (no model needed;
the config checked itself when built), load the models and the tokenizer as TRL does, make the tokenizer and the
model agree on the pad token, check what needs the model before any data is tokenized, and prepare the models
(packed attention, no dropout, FSDP2 sharding). The reference is chosen between the last two
(`reference.choose_reference`); the trainer tokenizes the data itself, with datasets' progress bars as
`datasets_progress_bars` sets them.
"""

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import datasets
import torch
from datasets import Dataset, IterableDataset
from transformers import TrainingArguments

from .collator import DPODataCollator
from .collator_groups import GroupedDPODataCollator
from .collator_packed import PackedDPODataCollator
from .compat import TRL_ITERABLE_REFUSAL, trl_default_output_dir
from .config import DPOMinConfig
from .grouping import check_rankings
from .models import load_causal_lm, load_tokenizer, pad_with_eos
from .scale import sharding, zero
from .scale.attention import check_packed_model, packed_attention, use_packed_attention
from .tokenizing import ROW_POSITION, end_token_ids, is_tokenized, special_ids, tokenize_dataset

logger = logging.getLogger(__name__)


def _router_aux_loss_coef(model_config: Any, coef: float | None) -> float:
    """The weight of the router load-balancing loss: the config's own unless given; 0 for a model without routers."""
    text_config = model_config.get_text_config()
    is_moe = hasattr(text_config, "output_router_logits")
    if coef and not is_moe:
        raise ValueError(f"router_aux_loss_coef is {coef}, but the model ({type(model_config).__name__}) is not a "
                         "mixture-of-experts model with router logits")
    if not is_moe:
        return 0.0
    return getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef


def _from_pretrained_kwargs(args: DPOMinConfig, quantization_config: Any, **defaults: Any) -> dict[str, Any]:
    """`args.model_init_kwargs` completed as TRL completes them for a model it loads from an id."""
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError("quantization_config is set both as a trainer argument and in model_init_kwargs: set "
                             "it once")
        kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):  # where device_map="auto" fails
        kwargs["device_map"] = None
    kwargs.setdefault("device_map", None if args.device.type in ("cpu", "mps") else "auto")
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    for key, value in defaults.items():
        kwargs.setdefault(key, value)
    return kwargs


def _check_layout(model_config: Any, args: DPOMinConfig) -> None:
    if not args.packed:
        return
    check_packed_model(model_config)  # raises for a family or an attention not tested packed
    layer_types = getattr(model_config, "layer_types", None) or ["sliding_attention"]
    if args.shares_prompt and getattr(model_config, "sliding_window", None) and "sliding_attention" in layer_types:
        raise ValueError("share_prompt's and group_by_prompt's 4D attention mask has no sliding window, and this "
                         "model uses one "
                         f"(sliding_window={model_config.sliding_window})")


# ---- the constructor's phases: validate (no model needed), load, prepare the models, prepare the data -------------
def validated_args(model: Any, ref_model: Any, args: DPOMinConfig | None, train_dataset: Any, eval_dataset: Any,
                    compute_metrics: Any, quantization_config: Any) -> DPOMinConfig:
    """The checks of the arguments as given (the config checked itself when built); the config, or TRL's default."""
    if isinstance(ref_model, TrainingArguments):
        raise TypeError("the second positional argument is ref_model, as in TRL's DPOTrainer: pass the config "
                        "as args=...")
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model must be another object than model (omit it to get a frozen copy)")
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = DPOMinConfig(output_dir=trl_default_output_dir(name))
    if not isinstance(args, DPOMinConfig):
        raise TypeError(f"args must be a DPOMinConfig, got {type(args).__name__}")
    if train_dataset is None:
        raise ValueError("`train_dataset` is required (as in TRL's DPOTrainer)")
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if args.precompute_ref_log_probs and any(isinstance(d, IterableDataset) for d in (train_dataset, *evals)):
        raise ValueError(TRL_ITERABLE_REFUSAL)
    if args.listwise and (args.world_size > 1 or any(isinstance(d, IterableDataset) for d in (train_dataset, *evals))):
        raise ValueError("loss_type plackett_luce trains batches of whole groups, of varied sizes: in one process, "
                         "on data with a length (no stream)")
    if compute_metrics is not None and args.packed:
        raise ValueError("compute_metrics receives [2B, T] logits (as TRL), which the padding_free and "
                         "share_prompt layouts do not compute: turn them off to use compute_metrics")
    if quantization_config is not None and not isinstance(model, str):
        raise ValueError("quantization_config applies to a model loaded from an id or a path; this model is "
                         "already loaded")
    # Here rather than in the config: the stage may come from the launcher's environment, which the trainer reads.
    if args.sync_ref_model and zero.zero_stage(args) == 3:
        raise ValueError("sync_ref_model (TR-DPO) is not supported under DeepSpeed ZeRO-3: its mixing would "
                         "need every weight gathered; use ZeRO-2, or FSDP2 (shard_with_fsdp2), where it runs")
    return args


def load_models_and_tokenizer(model: Any, ref_model: Any, args: DPOMinConfig, processing_class: Any,
                              quantization_config: Any) -> tuple[Any, Any, Any]:
    """Models given as ids or paths loaded as TRL loads them, and the tokenizer (from the model's id or path unless
    given); loaded models and the tokenizer as they are otherwise (`agree_on_pad_token` comes next)."""
    if isinstance(model, str):
        init_kwargs = _from_pretrained_kwargs(args, quantization_config)
        model = load_causal_lm(model, **init_kwargs)
    elif args.model_init_kwargs is not None:
        logger.warning("model_init_kwargs is ignored: the model is already loaded (as TRL)")
    if isinstance(ref_model, str):
        init_kwargs = _from_pretrained_kwargs(args, quantization_config, dtype=model.dtype,
                                              attn_implementation=model.config._attn_implementation)
        ref_model = load_causal_lm(ref_model, **init_kwargs)
    if processing_class is None:
        source = model.config._name_or_path
        if not source:
            raise ValueError("processing_class (the tokenizer) is required: the model has no id or path to load "
                             "one from")
        revision = (args.model_init_kwargs or {}).get("revision")
        processing_class = load_tokenizer(source, revision=revision, trust_remote_code=args.trust_remote_code)
    return model, ref_model, processing_class


def agree_on_pad_token(model: Any, processing_class: Any) -> None:
    """Give the tokenizer a pad token (EOS) if it has none, and set the model's config and generation config to its
    id, as TRL does (the config is saved with the model)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad_with_eos(tokenizer)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def check_model(model: Any, args: DPOMinConfig) -> float:
    """The checks that need the model, before any data is tokenized; the router load-balancing loss's weight."""
    _check_layout(model.config, args)
    router_aux_loss_coef = _router_aux_loss_coef(model.config, args.router_aux_loss_coef)
    if router_aux_loss_coef and args.shares_prompt:
        raise ValueError("share_prompt's and group_by_prompt's 4D attention mask cannot go into the router "
                         "load-balancing loss: set router_aux_loss_coef=0 or drop share_prompt and group_by_prompt")
    return router_aux_loss_coef


def prepare_models(modules: list[torch.nn.Module], args: DPOMinConfig) -> None:
    """Policy and reference alike: packed attention for the packed layouts, no dropout, FSDP2 sharding."""
    for module in modules:
        if args.packed:
            use_packed_attention(module)
        if args.disable_dropout:
            for submodule in module.modules():
                if isinstance(submodule, torch.nn.Dropout):
                    submodule.p = 0.0
        if args.shard_with_fsdp2:
            sharding.shard_model(module, args.device.type)


def make_collator(pad_token_id: int, padding_free: bool = False, share_prompt: bool = False,
                  dense_mask: bool = True, pad_to_multiple_of: int | None = None, group_by_prompt: bool = False,
                  rank_groups: bool = False) -> Callable:
    """The collator of a layout: padded (collator.py) unless `padding_free` or `share_prompt` (collator_packed.py),
    or `group_by_prompt` (collator_groups.py; `rank_groups` for plackett_luce)."""
    if group_by_prompt:
        return GroupedDPODataCollator(pad_token_id, padding_free=padding_free, pad_to_multiple_of=pad_to_multiple_of,
                                      dense_mask=dense_mask, rank_groups=rank_groups)
    if padding_free or share_prompt:
        return PackedDPODataCollator(pad_token_id, padding_free=padding_free, share_prompt=share_prompt,
                                     dense_mask=dense_mask, pad_to_multiple_of=pad_to_multiple_of)
    return DPODataCollator(pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


def default_collator(model: Any, tokenizer: Any, args: DPOMinConfig) -> Callable:
    """The collator for the config's layout, when none is given (as TRL makes its own)."""
    dense_mask = not args.packed or packed_attention(
        model.config._attn_implementation).dense_mask
    return make_collator(tokenizer.pad_token_id, args.padding_free, args.share_prompt, dense_mask,
                         args.pad_to_multiple_of, args.group_by_prompt, args.listwise)


@contextlib.contextmanager
def datasets_progress_bars(show: bool):
    """datasets' bars (tokenizing a large set takes a while) follow disable_tqdm, then return to how they were."""
    were_shown = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if were_shown else datasets.disable_progress_bars)()


def tokenized(dataset: Any, tokenizer: Any, args: DPOMinConfig, model: Any = None,
              end_ids: set[int] | None = None) -> Any:
    """Raw rows -> tokenized pairs, with the config's truncation; None and tokenized data pass through. A pair's
    given ids may close on a token that ends the model's samples (`end_token_ids`; or `end_ids`, where given)."""
    if isinstance(dataset, dict):
        return {name: tokenized(split, tokenizer, args, model, end_ids) for name, split in dataset.items()}
    if dataset is not None and not is_tokenized(dataset):
        # The main process tokenizes first; the others then read its datasets cache instead of tokenizing again.
        with args.main_process_first(desc="tokenizing the pairs"), \
                datasets_progress_bars(not args.disable_tqdm and args.local_process_index == 0):
            dataset = tokenize_dataset(dataset, tokenizer, args.max_length, args.max_prompt_length,
                                       args.truncation_mode, num_proc=args.dataset_num_proc,
                                       chat_template_kwargs=args.chat_template_kwargs,
                                       end_ids=end_token_ids(model, tokenizer) if end_ids is None else end_ids)
    if args.group_by_prompt and args.listwise:  # each group's ranking, checked once, before anything trains
        check_rankings(dataset, args.max_length)
    return dataset


@contextlib.contextmanager
def _data_log_quiet():
    """The data log's drop warnings held back: the trainer says them when it tokenizes these rows."""
    data_log = logging.getLogger("dpo_min.data")
    level = data_log.level
    data_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        data_log.setLevel(level)


def _numbered(dataset: Dataset) -> Dataset:
    return dataset.add_column(ROW_POSITION, list(range(len(dataset))))


def kept_rows(dataset: Dataset, tokenizer: Any, args: DPOMinConfig, model: Any = None) -> list[int]:
    """The positions in `dataset` of the pairs `tokenized` keeps, in order: it drops those truncation leaves
    unusable, so the n-th tokenized pair need not be the n-th row (the command shows each row beside its pair)."""
    with _data_log_quiet():
        return tokenized(_numbered(dataset), tokenizer, args, model)[ROW_POSITION]


def grouped_prompts(dataset: Dataset, tokenizer: Any, args: DPOMinConfig) -> list[tuple[int, ...] | None]:
    """Each row's prompt ids as the trainer groups them (`prompt_groups` of the ids `tokenized` gives: rendered,
    trimmed at the seam, truncated), None for a row it drops. Before the model loads, so a pair's given ids may
    close on any special token here: the trainer checks them against the model's own end ids."""
    ends = special_ids(tokenizer) | end_token_ids(None, tokenizer)
    with _data_log_quiet():
        pairs = tokenized(_numbered(dataset), tokenizer, args, end_ids=ends)
    prompts: list[tuple[int, ...] | None] = [None] * len(dataset)
    for position, ids in zip(pairs[ROW_POSITION], pairs["prompt_ids"]):
        prompts[position] = tuple(ids)
    return prompts
