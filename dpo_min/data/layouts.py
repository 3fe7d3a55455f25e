"""Preference data as people publish it: one table of named layouts, each turning a row into prompt/chosen/rejected.

A dataset's layout is detected once, from its columns and their kinds (text, message list, ...), never row by row.
Adding a published layout is adding one `Layout` entry to `LAYOUTS`; the first entry whose `recognise` accepts
the columns wins, so the more specific layouts come first. A row that does not fit the detected layout raises
`ValueError("row N: field 'F' ...")` (an `Unpaired` if it cannot be a pair); nothing is guessed, no text dropped. A
`system` column is the system message of every layout (`to_pair` applies it, after the layout's adapter). Layouts of
a label or of scores (and the check that no label column goes unread) are in `labelled.py`; their entries are here.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import labelled
from .given_ids import given_columns
from .labelled import check_label_option, check_labels_read, hh_messages, require
from .options import PREFERENCE_LABELS, LayoutOptions
from .ranked import ranked
from .unpaired import NO_COMMON_PROMPT, Unpaired
from .validation import validate_pair

# Columns carried from the source row to the pair: TRL hands both to the chat template.
CARRIED_COLUMNS = ("tools", "chat_template_kwargs")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAPPING_HINT = ("name the columns with --prompt_column/--chosen_column/--rejected_column [--system_column] "
                "(columns={'prompt': ..., 'chosen': ..., 'rejected': ...} in load_preference_dataset)")


@dataclass(frozen=True)
class Layout:
    """A published layout: `recognise(kinds, first_row)` says whether the columns are this layout's (kinds maps
    each column to 'text', 'messages', 'turn', 'null' or 'other'); `to_pair(row, index, options)` returns
    {prompt, chosen, rejected}, a list of them (a ranked row: ranked.py), or None for a row the layout itself says to
    skip (a tie).

    reads_only: for a layout whose prompt is implicit, the columns it reads. Any other text column might be the
    prompt it would drop, so data that has one is refused (None: the layout reads its prompt from a column).
    labels: the columns named like a preference label (`labelled.unread_labels`) that the layout's rule accounts
    for; any other is refused. rule: how a label or scores become the pair, where that is a choice (logged);
    skips: the rows `to_pair` returns None for (dropped and counted)."""

    name: str
    example: str  # a dataset published in this layout, for the log line and README
    recognise: Callable[[Mapping[str, str], Mapping[str, Any]], bool]
    to_pair: Callable[[Mapping[str, Any], int, LayoutOptions], dict[str, Any] | list[dict[str, Any]] | None]
    reads_only: tuple[str, ...] | None = None
    labels: tuple[str, ...] = ()
    rule: str = ""
    skips: str = "ties"

    def described(self) -> str:
        return f"{self.example}; {self.rule}" if self.rule else self.example


def value_kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "messages"
    if isinstance(value, dict):
        return "turn"
    return "null" if value is None else "other"


def feature_kind(feature: Any) -> str:
    """The kind of a `datasets` feature, matching `value_kind` of the values it holds."""
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return "text"
    if dtype == "null":
        return "null"
    if isinstance(feature, (list, tuple)) or type(feature).__name__ in ("List", "Sequence", "LargeList"):
        return "messages"
    return "turn" if isinstance(feature, dict) else "other"


# ---- the adapters ---------------------------------------------------------------------------------------------
def _with_system(prompt: Any, system: Any, index: int) -> Any:
    """The prompt with the row's system message: the first turn of a message list, or a string's opening paragraph."""
    if system is None or system == "":
        return prompt
    if not isinstance(system, str):
        raise ValueError(f"row {index}: field 'system' must be a string, got {type(system).__name__}")
    if not isinstance(prompt, list):
        return f"{system}\n\n{prompt}" if isinstance(prompt, str) else prompt
    first = prompt[0] if prompt else None
    if isinstance(first, dict) and first.get("role") == "system":  # LLaMA-Factory: the conversation's own wins
        if first.get("content") != system:
            raise ValueError(f"row {index}: field 'system' differs from the prompt's own system turn; keep one")
        return prompt
    return [{"role": "system", "content": system}, *prompt]


def _explicit(row: Mapping[str, Any], index: int, options: LayoutOptions, prompt_field: str = "prompt") -> dict:
    # A null prompt (or an empty CSV cell) in data with a prompt column is an error, never an implicit prompt.
    if row.get(prompt_field) is None:
        raise ValueError(f"row {index}: field '{prompt_field}' is missing (the data has a '{prompt_field}' column)")
    require(row, index, "chosen", "rejected")
    return {"prompt": row[prompt_field], "chosen": row["chosen"], "rejected": row["rejected"]}


def _alpaca(row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict:
    """LLaMA-Factory's alpaca preference rows: the prompt is instruction and input joined by a newline (each left out
    when empty), after the turns of `history` ([[instruction, response], ...]) where the data has that column."""
    require(row, index, "instruction", "chosen", "rejected")
    for name in ("instruction", "input"):
        if not isinstance(row.get(name) or "", str):
            raise ValueError(f"row {index}: field '{name}' must be a string, got {type(row[name]).__name__}")
    query = "\n".join(part for part in (row["instruction"], row.get("input")) if part)
    if "history" not in row:
        return {"prompt": query, "chosen": row["chosen"], "rejected": row["rejected"]}
    turns = []
    for turn in row["history"] or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(text, str) for text in turn)):
            raise ValueError(f"row {index}: field 'history' must be a list of [instruction, response] pairs")
        turns += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    return {"prompt": [*turns, {"role": "user", "content": query}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}


def _shared_prefix(chosen: Any, rejected: Any, index: int) -> dict[str, Any]:
    """The implicit prompt: the longest common prefix of chosen and rejected (as TRL's `extract_prompt`)."""
    if not isinstance(chosen, (str, list)):
        raise ValueError(f"row {index}: field 'chosen' must be a string or a message list, got {type(chosen).__name__}")
    if type(chosen) is not type(rejected):
        raise ValueError(f"row {index}: field 'rejected' must be of the same kind as 'chosen' (string or messages)")
    split = 0
    for split in range(min(len(chosen), len(rejected))):
        if chosen[split] != rejected[split]:
            if isinstance(chosen, str) and split > 0 and chosen[split - 1] == " ":
                split -= 1  # the space belongs to the completion, as TRL does
            break
    else:
        split = min(len(chosen), len(rejected))
    return {"prompt": chosen[:split], "chosen": chosen[split:], "rejected": rejected[split:]}


def _implicit(row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict:
    require(row, index, "chosen", "rejected")
    if options.no_prompt and isinstance(row["chosen"], str):
        return {"prompt": "", "chosen": row["chosen"], "rejected": row["rejected"]}
    pair = _shared_prefix(row["chosen"], row["rejected"], index)
    if isinstance(pair["prompt"], str) and not pair["prompt"].strip():
        raise Unpaired(NO_COMMON_PROMPT, f"row {index}: field 'chosen' shares no prompt with 'rejected' (the implicit "
                       f"prompt is empty): name the prompt column ({MAPPING_HINT.split(' (')[0]}), or say the data "
                       "has no prompts (--no_prompt)")
    return pair


def _ultrafeedback_h4(row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict:
    pair = _implicit(row, index, options)
    if not isinstance(row["prompt"], str):
        raise ValueError(f"row {index}: field 'prompt' must be a string, got {type(row['prompt']).__name__}")
    users = [turn.get("content") for turn in pair["prompt"] if isinstance(turn, dict) and turn.get("role") == "user"]
    if not users or users[-1] is None or users[-1].strip() != row["prompt"].strip():
        raise ValueError(f"row {index}: field 'prompt' differs from the user turn that chosen and rejected share")
    return pair


def _sharegpt(row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict:
    def message(turn: Any, field: str) -> dict[str, str]:
        if not isinstance(turn, dict) or turn.get("from") not in _SHAREGPT_ROLES:
            raise ValueError(f"row {index}: field '{field}' must be {{'from': human|gpt|system, 'value': str}}")
        return {"role": _SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")}

    require(row, index, "chosen", "rejected")
    if not isinstance(row["conversations"], list):
        raise ValueError(f"row {index}: field 'conversations' must be a list of turns")
    return {"prompt": [message(turn, "conversations") for turn in row["conversations"]],
            "chosen": [message(row["chosen"], "chosen")], "rejected": [message(row["rejected"], "rejected")]}


def _hh(row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict:
    require(row, index, "chosen", "rejected")
    for name in ("chosen", "rejected"):
        if not isinstance(row[name], str) or not row[name].startswith("\n\nHuman:"):
            raise ValueError(f"row {index}: field '{name}' must be a transcript string starting '\\n\\nHuman:'")
    chosen, rejected = hh_messages(row["chosen"]), hh_messages(row["rejected"])
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(f"row {index}: field '{name}' does not end with an '\\n\\nAssistant:' turn")
    if chosen[:-1] != rejected[:-1]:
        raise Unpaired(NO_COMMON_PROMPT, f"row {index}: field 'rejected' differs from 'chosen' before the last "
                       "Assistant turn")
    return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


def _has(*names: str, **kinds: str) -> Callable[[Mapping[str, str], Mapping[str, Any]], bool]:
    """Recognise columns by name, and some by kind: 'text', 'messages', 'absent', or several joined by '|'."""
    def fits(columns: Mapping[str, str], name: str, kind: str) -> bool:
        allowed = kind.split("|")
        return columns[name] in allowed if name in columns else "absent" in allowed

    def recognise(columns: Mapping[str, str], first_row: Mapping[str, Any]) -> bool:
        return set(names) <= set(columns) and all(fits(columns, name, kind) for name, kind in kinds.items())
    return recognise


def _is_hh(columns: Mapping[str, str], first_row: Mapping[str, Any]) -> bool:
    chosen = first_row.get("chosen")
    return "prompt" not in columns and isinstance(chosen, str) and chosen.startswith("\n\nHuman:")


LAYOUTS: tuple[Layout, ...] = (
    Layout("sharegpt", "LLaMA-Factory dpo_en_demo", _has("conversations", "chosen", "rejected"), _sharegpt),
    Layout("pku_saferlhf", "PKU-Alignment/PKU-SafeRLHF",
           _has("prompt", "response_0", "response_1", "better_response_id", "safer_response_id"),
           labelled.pku_saferlhf, labels=PREFERENCE_LABELS),
    Layout("pku_saferlhf_single", "PKU-Alignment/PKU-SafeRLHF-single-dimension",
           _has("prompt", "response_0", "response_1", "better_response_id"), labelled.pku_saferlhf_single,
           labels=("better_response_id",)),
    Layout("shp", "stanfordnlp/SHP", _has("history", "human_ref_A", "human_ref_B", "labels"), labelled.shp,
           labels=("labels", "score_A", "score_B", "score_ratio")),  # labels: score_A > score_B
    Layout("helpsteer3", "nvidia/HelpSteer3 (preference)",
           _has("context", "response1", "response2", "overall_preference"), labelled.helpsteer3,
           labels=("overall_preference", "individual_preference")),  # overall: the annotators' aggregate
    Layout("helpsteer2", "nvidia/HelpSteer2 preference/preference.jsonl.gz",
           _has("split", "prompt", "response_1", "response_2", "preference_strength"), labelled.helpsteer2,
           labels=("preference_strength", "preference_statement", "preference_elaboration",
                   "three_most_similar_preferences", "all_preferences_unprocessed"),
           rule="negative strength: response_1 is chosen", skips="ties, and rows of another split than --row_split"),
    Layout("ranked", "k scored answers to one prompt", _has("prompt", "completions", "scores"), ranked,
           rule="every answer against every lower-scored one",
           skips="rows whose answers are one text, or straddle each other: one text scored above and below another"),
    Layout("ultrafeedback_raw", "openbmb/UltraFeedback", _has("instruction", "completions"),
           labelled.ultrafeedback_raw,
           rule="H4's binarization: chosen = the highest overall_score, rejected = a seeded random other completion",
           skips="rows with fewer than two completions"),
    Layout("chatbot_arena", "lmsys/chatbot_arena_conversations", _has("conversation_a", "conversation_b", "winner"),
           labelled.chatbot_arena, labels=("winner",),
           rule="the winner's answer is chosen",
           skips="ties, and multi-turn rows whose conversations differ before the last answer"),
    Layout("nectar", "berkeley-nest/Nectar", _has("prompt", "answers"), labelled.nectar,
           rule="rank 1 against a seeded random lower-ranked answer"),
    Layout("summarize_from_feedback", "openai/summarize_from_feedback (comparisons)",
           _has("info", "summaries", "choice"), labelled.summarize_from_feedback, labels=("choice",),
           rule="TRL's tldr_preference.py: chosen = summaries[choice]"),
    Layout("webgpt_comparisons", "openai/webgpt_comparisons",
           _has("question", "answer_0", "answer_1", "score_0", "score_1"), labelled.webgpt_comparisons,
           labels=("score_0", "score_1"), rule="the higher score is chosen"),
    Layout("orca", "Intel/orca_dpo_pairs", _has("question", "chosen", "rejected", prompt="absent"),
           lambda row, index, options: _explicit(row, index, options, prompt_field="question")),
    Layout("alpaca", "LLaMA-Factory alpaca preference data (instruction, input, chosen, rejected)",
           _has("instruction", "chosen", "rejected", prompt="absent", chosen="text"), _alpaca),
    Layout("ultrafeedback_h4", "HuggingFaceH4/ultrafeedback_binarized",
           _has("prompt", "chosen", "rejected", "messages", prompt="text", chosen="messages"), _ultrafeedback_h4),
    Layout("implicit_conversational", "trl-lib/ultrafeedback_binarized, argilla/dpo-mix-7k, tulu-3 mixture",
           _has("chosen", "rejected", chosen="messages", prompt="absent|text"), _implicit),
    Layout("explicit_prompt", "standard or conversational pairs", _has("prompt", "chosen", "rejected"), _explicit),
    Layout("hh_transcripts", "Anthropic/hh-rlhf", _is_hh, _hh),
    Layout("implicit_standard", "chosen/rejected strings sharing their prompt",
           _has("chosen", "rejected", prompt="absent"), _implicit, reads_only=("chosen", "rejected")),
)
LAYOUT_NAMES = tuple(layout.name for layout in LAYOUTS)
KEPT_WHOLE = ("nectar", "ultrafeedback_raw")  # ranked data published binarized: every_ranked_pair keeps every pair


def detect_layout(kinds: Mapping[str, str], first_row: Mapping[str, Any] | None = None,
                  options: LayoutOptions | None = None) -> Layout:
    """The layout of a dataset with these column kinds. Raises ValueError naming the columns and the options."""
    options = options or LayoutOptions()
    for layout in LAYOUTS:
        if layout.recognise(kinds, first_row or {}):
            _check_nothing_unread(layout, kinds, options)
            check_label_option(layout.name, layout.labels, kinds, options)
            check_labels_read(layout.name, kinds, (*layout.labels, options.label_column or ""), bool(layout.labels))
            return layout
    columns = f"no known preference layout has the columns [{', '.join(kinds)}]"
    if "response" in kinds and not {"chosen", "rejected"} & set(kinds):
        # One answer with its scores (HelpSteer2's attribute files): it has an answer, so it is no prompt-only data.
        raise ValueError(f"{columns}: a 'response' is one answer (with scores, as HelpSteer2's attribute files), "
                         "neither a pair nor prompt-only data; DPO reads pairs: HelpSteer2's are its preference file "
                         "(preference/preference.jsonl.gz, the helpsteer2 layout)")
    if "prompt" in kinds and not {"chosen", "rejected", "completion"} & set(kinds):
        # TRL's prompt-only layout (GRPO's data): no answers to prefer. DPO in rounds writes and scores them.
        raise ValueError(f"{columns}: they are prompt-only "
                         "data (a prompt, no chosen and rejected answers), whose answers DPO in rounds samples and "
                         "scores (--rounds N --reward_funcs module:function; dpo_min.rounds.run_rounds); if the "
                         f"answers are there, {MAPPING_HINT}")
    raise ValueError(f"{columns}: {MAPPING_HINT}")


def _check_nothing_unread(layout: Layout, kinds: Mapping[str, str], options: LayoutOptions) -> None:
    # A layout with an implicit prompt takes the answers' common opening as the prompt: a text column it does not
    # read (alpaca's 'instruction' under another name, a 'question') would be dropped, and the wrong prompt trained.
    if layout.reads_only is None or options.no_prompt:
        return
    read = {*layout.reads_only, "system", *CARRIED_COLUMNS}
    unread = [name for name, kind in kinds.items() if kind in ("text", "messages") and name not in read]
    if unread:
        raise ValueError(f"no known preference layout reads the column '{unread[0]}' of [{', '.join(kinds)}], and "
                         f"the {layout.name} layout would take the answers' common opening as the prompt instead: "
                         f"if it holds the prompt, name it (--prompt_column {unread[0]}); else remove the column, "
                         "or say the data has no prompts (--no_prompt)")


def gives_several_pairs(layout: Layout, options: LayoutOptions) -> bool:
    """Whether a row may give several pairs (ranked.py): the ranked layout, or a binarized one kept whole."""
    return layout.name == "ranked" or (options.every_ranked_pair and layout.name in KEPT_WHOLE)


def layout_by_name(name: str) -> Layout:
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise ValueError(f"unknown layout {name!r}; known layouts: {', '.join(LAYOUT_NAMES)}")


# ---- validation of the result -----------------------------------------------------------------------------------
def to_pair(layout: Layout, row: Mapping[str, Any], index: int,
            options: LayoutOptions) -> dict[str, Any] | list[dict[str, Any]] | None:
    """Row -> validated {prompt, chosen, rejected, carried columns}, or None for a row the layout skips; a ranked row
    (ranked.py) -> a list of them, its pairs."""
    if not isinstance(row, Mapping):
        raise ValueError(f"row {index}: expected an object with chosen/rejected fields, got {type(row).__name__}")
    pair = layout.to_pair(row, index, options)
    if pair is None:
        return None
    if isinstance(pair, list):
        return [_validated(one, row, index, options) for one in pair]
    return _validated(pair, row, index, options)


def _validated(pair: dict[str, Any], row: Mapping[str, Any], index: int, options: LayoutOptions) -> dict[str, Any]:
    if options.label_column is not None:
        pair = labelled.apply_label(pair, row, index, options)
    if options.as_messages and isinstance(pair["prompt"], str):
        pair = _as_messages(pair)
    pair["prompt"] = _with_system(pair["prompt"], row.get("system"), index)
    validate_pair(pair, index)
    pair.update({name: row[name] for name in CARRIED_COLUMNS if row.get(name) is not None})
    pair.update(given_columns(row, index))  # a pair's token ids beside its text, trained as given (given_ids.py)
    return pair


def _as_messages(pair: dict[str, Any]) -> dict[str, Any]:
    prompt = pair["prompt"]
    return {"prompt": [{"role": "user", "content": prompt}] if prompt else [],
            "chosen": [{"role": "assistant", "content": pair["chosen"]}],
            "rejected": [{"role": "assistant", "content": pair["rejected"]}]}
