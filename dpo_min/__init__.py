"""dpo_min: Direct Preference Optimization (DPO) of causal language models on transformers.Trainer."""

from .collator import DPODataCollator
from .collator_packed import PackedDPODataCollator
from .config import DPOMinConfig
from .data.loading import load_preference_dataset
from .data.mixtures import load_mixture
from .logps import sequence_logps
from .losses import dpo_loss
from .models import load_model_and_tokenizer
from .tokenizing import tokenize_dataset
from .trainer import DPOMinTrainer

__all__ = [
    "DPODataCollator",
    "DPOMinConfig",
    "DPOMinTrainer",
    "PackedDPODataCollator",
    "dpo_loss",
    "load_mixture",
    "load_model_and_tokenizer",
    "load_preference_dataset",
    "sequence_logps",
    "tokenize_dataset",
]
__version__ = "0.1.0"
