"""What a valid pair is, checked once per pair as it is read (`layouts.to_pair`): a prompt and two answers, all text
or all message lists (a known role, text content, valid unicode), neither answer empty, the two different. A ranked
row's answers are checked by the same rules one by one, each named by its place in the row (ranked.py).
"""

from typing import Any

from .unpaired import NO_ANSWER, SAME_ANSWERS, Unpaired

_ROLES = ("system", "user", "assistant", "tool")


def validate_pair(pair: dict[str, Any], index: int) -> None:
    conversational = isinstance(pair["prompt"], list)
    if conversational:
        validate_turns(pair["prompt"], index, "prompt")
        if pair["prompt"][-1]["role"] == "assistant":
            raise ValueError(f"row {index}: field 'prompt' ends with an assistant turn; the completion goes in chosen")
    elif not isinstance(pair["prompt"], str):
        raise ValueError(f"row {index}: field 'prompt' must be a string, got {type(pair['prompt']).__name__}")
    else:
        validate_text(pair["prompt"], index, "prompt")
    for name in ("chosen", "rejected"):
        validate_answer(pair[name], index, name, conversational)
    if pair["chosen"] == pair["rejected"]:
        raise Unpaired(SAME_ANSWERS, f"row {index}: field 'rejected' is identical to 'chosen'")


def validate_answer(answer: Any, index: int | str, name: str, conversational: bool) -> None:
    """An answer to a conversational prompt is a message list that starts with an assistant turn, to a text prompt a
    string; an empty one is `Unpaired` (NO_ANSWER)."""
    if not conversational:
        if not isinstance(answer, str):
            raise ValueError(f"row {index}: field '{name}' must be a string, got {type(answer).__name__}")
        validate_text(answer, index, name)
        if not answer.strip():
            raise Unpaired(NO_ANSWER, f"row {index}: field '{name}' is an empty completion")
        return
    validate_turns(answer, index, name)
    if answer[0]["role"] != "assistant":
        raise ValueError(f"row {index}: field '{name}' must start with an assistant turn, not {answer[0]['role']!r}")
    if not any((turn["content"] or "").strip() or turn.get("tool_calls")
               for turn in answer if turn["role"] == "assistant"):
        raise Unpaired(NO_ANSWER, f"row {index}: field '{name}' is an empty completion")


def validate_text(text: str, index: int | str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates: no tokenizer can encode them
        raise ValueError(f"row {index}: field '{name}' is not valid unicode ({error.reason})") from None


def validate_turns(messages: Any, index: int | str, name: str) -> None:
    """Each message of a non-empty list: a known role, text content (none only for an assistant turn that calls
    tools), valid unicode, a system turn only as the prompt's first. The prompt-only layout checks its rows by it."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"row {index}: field '{name}' must be a non-empty list of messages")
    for position, turn in enumerate(messages):
        # An assistant turn that calls tools may have no text.
        calls_tools = isinstance(turn, dict) and turn.get("role") == "assistant" and turn.get("tool_calls")
        if not isinstance(turn, dict) or turn.get("role") not in _ROLES or not (
                isinstance(turn.get("content"), str) or (calls_tools and turn.get("content") is None)):
            raise ValueError(f"row {index}: field '{name}' has a message that is not {{'role': "
                             f"{'|'.join(_ROLES)}, 'content': str}}: {str(turn)[:80]}")
        if turn["content"] is not None:
            validate_text(turn["content"], index, name)
        if turn["role"] == "system" and (position > 0 or name != "prompt"):
            raise ValueError(f"row {index}: field '{name}' has a system message that is not the prompt's first")
