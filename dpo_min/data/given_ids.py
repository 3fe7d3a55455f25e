"""A pair's token ids given beside its text (`prompt_ids`, `chosen_ids`, `rejected_ids`: a round's pairs.jsonl), and
what made them: the tokenizer, by a sha256 of its vocabulary (`ids_tokenizer`), and the chat template that rendered a
message prompt, by a sha256 of its text (`ids_template`). The DPO pass trains on such ids as given, so before it does
they are checked to be the row's and this run's: the fingerprints a row records equal this run's, the prompt ids are
the prompt as this run renders it, and each completion's ids decode to its text as a sample's ids were decoded
(`tokenizer.decode(ids, skip_special_tokens=True)`, `rounds/sampling.py`). That decoding hides special tokens, so a
completion's ids hold one only where a sample ends: as their last id, one of the ids a sample stops on (`end_ids`: the
tokenizer's EOS and the model's generation_config EOS, `end_token_ids`; the tokenizer's EOS alone without a model).
A row without fingerprints (written before they were, or by hand) is checked by its text alone. Each refusal is a
ValueError naming the field (its caller names the row)."""

import hashlib
import json
import weakref
from collections.abc import Collection, Mapping
from typing import Any

GIVEN_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
MADE_BY = ("ids_tokenizer", "ids_template")
_AGAIN = "drop the id columns to tokenize the text again"
# A vocabulary's sha256 by tokenizer, with the size it was taken at: a tokenizer's vocabulary does not change but by
# added tokens, and hashing 49,152 entries for every pair would cost more than tokenizing it.
_VOCABULARIES: "weakref.WeakKeyDictionary[Any, tuple[int, str]]" = weakref.WeakKeyDictionary()


def given_columns(row: Mapping[str, Any], index: Any) -> dict[str, Any]:
    """The row's ids, all three or none, with what made them where the row says."""
    given = {name: row[name] for name in GIVEN_IDS if row.get(name) is not None}
    if given and len(given) < len(GIVEN_IDS):
        raise ValueError(f"row {index}: field '{min(set(GIVEN_IDS) - set(given))}' is missing: a pair's ids are "
                         f"given all three ({', '.join(GIVEN_IDS)}) or none")
    return {**given, **{name: row[name] for name in MADE_BY if given and row.get(name) is not None}}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary (token -> id, added tokens included): what an id means."""
    size, digest = _VOCABULARIES.get(tokenizer, (None, ""))
    if size != len(tokenizer):
        vocabulary = json.dumps(tokenizer.get_vocab(), sort_keys=True)
        size, digest = len(tokenizer), hashlib.sha256(vocabulary.encode()).hexdigest()
        _VOCABULARIES[tokenizer] = size, digest
    return digest


def template_fingerprint(tokenizer: Any) -> str | None:
    """sha256 of the chat template's text (of its named templates as JSON, where it has several); None without one."""
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()


def made_by(tokenizer: Any, prompt: Any) -> dict[str, str | None]:
    """The fingerprints a writer of given ids records beside them; a text prompt is rendered by no template."""
    return {"ids_tokenizer": tokenizer_fingerprint(tokenizer),
            "ids_template": template_fingerprint(tokenizer) if isinstance(prompt, list) else None}


def check_made_by(pair: Mapping[str, Any], tokenizer: Any) -> None:
    """The fingerprints the pair records (none: nothing to compare) against this run's tokenizer and template."""
    made = pair.get("ids_tokenizer")
    if made is not None and made != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"field 'ids_tokenizer': the ids were made by another tokenizer (vocabulary sha256 "
                         f"{str(made)[:12]}) than this run's ({tokenizer_fingerprint(tokenizer)[:12]}): train with "
                         f"the tokenizer that made them, or {_AGAIN}")
    made, ours = pair.get("ids_template"), template_fingerprint(tokenizer)
    if made is not None and made != ours:
        raise ValueError(f"field 'ids_template': the prompt ids were rendered by another chat template (sha256 "
                         f"{str(made)[:12]}) than this run's ({'none' if ours is None else ours[:12]}): train with "
                         f"the template that rendered them, or {_AGAIN}")


def end_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a sample: the tokenizer's EOS and the model's generation_config EOS (a chat model's
    end-of-turn token is often only the latter). None for `model`: the tokenizer's EOS alone."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, (list, tuple)) else {configured}
    return {token for token in ids if token is not None}


def special_ids(tokenizer: Any) -> set[int]:
    """The ids that decoding with skip_special_tokens=True leaves out: the special tokens, and every added token
    marked special (SmolLM2's <repo_name> is in no special-token attribute, yet decoding skips it)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def special_inside(ids: list[int], specials: Collection[int], end_ids: Collection[int]) -> int | None:
    """The position of a completion's first special id that is not its one closing end id (what a sample ends
    with), or None: decoding hides it, so the text cannot show it was there."""
    inside = ids[:-1] if ids and ids[-1] in end_ids else ids
    return next((i for i, token in enumerate(inside) if token in specials), None)


def check_text(pair: Mapping[str, Any], ids: Mapping[str, list[int]], rendered_prompt: list[int],
               tokenizer: Any, end_ids: Collection[int] | None = None) -> None:
    """The ids against the pair's text: the prompt's as this run renders it (`rendered_prompt`), each completion's
    without a special id but a closing one of `end_ids` (None: the tokenizer's EOS), decoded as a sample's were."""
    if ids["prompt_ids"] != rendered_prompt:
        differs = next((i for i, (a, b) in enumerate(zip(ids["prompt_ids"], rendered_prompt)) if a != b),
                       min(len(ids["prompt_ids"]), len(rendered_prompt)))
        raise ValueError(f"field 'prompt_ids': the ids are not the row's prompt as this run renders it (its "
                         f"tokenizer, chat template and chat_template_kwargs): they differ from token {differs} on; "
                         f"render the prompt as the run that made them did, or {_AGAIN}")
    end_ids = end_token_ids(None, tokenizer) if end_ids is None else set(end_ids)
    specials = special_ids(tokenizer)
    for name in ("chosen", "rejected"):
        text = _completion_text(pair[name], name)
        at = special_inside(ids[f"{name}_ids"], specials, end_ids)
        if at is not None:
            token = ids[f"{name}_ids"][at]
            ends = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in sorted(end_ids)) or "none"
            raise ValueError(f"field '{name}_ids': id {token} ({tokenizer.convert_ids_to_tokens(token)}) at position "
                             f"{at} is a special token, which decoding hides from the text: a completion's ids hold "
                             f"one only as their last id, one that ends a sample ({ends}); {_AGAIN}")
        decoded = tokenizer.decode(ids[f"{name}_ids"], skip_special_tokens=True)
        if decoded != text:
            raise ValueError(f"field '{name}_ids': the ids decode to {_shown(decoded)}, not to the row's {name} text "
                             f"{_shown(text)}: the text was changed, or the ids are another's; {_AGAIN}")


def _completion_text(completion: Any, name: str) -> str:
    """A completion's text: itself, or the content of its one assistant message (as the rounds write it)."""
    if isinstance(completion, str):
        return completion
    if len(completion) == 1 and isinstance(completion[0].get("content"), str):
        return completion[0]["content"]
    raise ValueError(f"field '{name}': given ids are checked against a completion of one text or one assistant "
                     f"message with text, got {len(completion)} message(s); {_AGAIN}")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57]) + "..."
