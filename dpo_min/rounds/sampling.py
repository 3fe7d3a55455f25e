"""Samples from the current policy: num_generations completions per prompt, in batches of left-padded prompts with the
KV cache, seeded per batch. The prompts come as ids, rendered once by the core's renderer
(`tokenizing.render_prompts`), so the DPO pass trains on the ids that were sampled from. A `generate_fn` replaces
`model.generate` (an inference engine such as vLLM) and only has to return token ids; cutting at EOS, decoding and
the truncation flag stay here, the same for both.

generate_fn(model, prompt_ids, settings) -> completion token ids: `prompt_ids` is a list of token-id lists,
`settings` a `GenerationSettings`; it returns len(prompt_ids) * settings.num_return_sequences lists, prompt i's
samples at [i * n, (i + 1) * n). Seeding it is its own business (settings.seed says which seed this batch has).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpo_min.tokenizing import end_token_ids


@dataclass(frozen=True)
class GenerationSettings:
    num_return_sequences: int
    max_new_tokens: int
    do_sample: bool
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Completion:
    """One sample: its text (as the reward functions receive it), its token ids up to and including the first EOS,
    and whether max_completion_length cut it before any EOS."""

    text: str
    ids: list[int]
    truncated: bool


GenerateFn = Callable[[Any, list[list[int]], GenerationSettings], list[list[int]]]


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list)


def _left_padded(prompt_ids: Sequence[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


@torch.no_grad()
def hf_generate(model: Any, prompt_ids: list[list[int]], settings: GenerationSettings, pad_id: int,
                streamer: Any = None) -> list[list[int]]:
    """The default generate_fn: `model.generate` on one left-padded batch, KV cache on, seeded; `streamer` is told
    of each new token (progress.TokenSteps moves a bar by it)."""
    was_training = model.training
    model.eval()
    batch = _left_padded(prompt_ids, pad_id, next(model.parameters()).device)
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": None} \
        if settings.do_sample else {"temperature": None, "top_p": None, "top_k": None}
    torch.manual_seed(settings.seed)
    try:
        output = model.generate(**batch, do_sample=settings.do_sample, max_new_tokens=settings.max_new_tokens,
                                num_return_sequences=settings.num_return_sequences, use_cache=True,
                                pad_token_id=pad_id, streamer=streamer, **sampling)
    finally:
        model.train(was_training)
    return output[:, batch["input_ids"].shape[1]:].tolist()


def _completion(ids: list[int], eos_ids: set[int], tokenizer: Any, max_new_tokens: int) -> Completion:
    """Cut at the first EOS (kept, as TRL keeps it); a completion with none that filled max_new_tokens is cut."""
    end = next((i for i, token in enumerate(ids) if token in eos_ids), None)
    ids = ids[:max_new_tokens] if end is None else ids[:end + 1]
    return Completion(tokenizer.decode(ids, skip_special_tokens=True), ids, end is None)


def sample(model: Any, tokenizer: Any, prompt_ids: Sequence[list[int]], settings: GenerationSettings,
           batch_size: int, generate_fn: GenerateFn | None = None, streamer: Any = None) -> list[list[Completion]]:
    """settings.num_return_sequences completions for each prompt (its ids, as rendered), in order; batch b is seeded
    settings.seed + b. `streamer` goes to model.generate (a generate_fn has its own progress)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generate = generate_fn or (lambda m, ids, s: hf_generate(m, ids, s, pad_id, streamer))
    eos_ids, n = end_token_ids(model, tokenizer), settings.num_return_sequences
    groups = []
    for b, start in enumerate(range(0, len(prompt_ids), batch_size)):
        ids = [list(one) for one in prompt_ids[start:start + batch_size]]
        batch_settings = GenerationSettings(**{**settings.__dict__, "seed": settings.seed + b})
        outputs = generate(model, ids, batch_settings)
        if len(outputs) != len(ids) * n:
            raise ValueError(f"generate_fn returned {len(outputs)} completions for {len(ids)} prompts x {n}")
        completions = [_completion(list(out), eos_ids, tokenizer, settings.max_new_tokens) for out in outputs]
        groups += [completions[i * n:(i + 1) * n] for i in range(len(ids))]
    return groups
