"""TRL compatibility: the fields of TRL 1.16's `DPOConfig` that dpo_min has no field of its own for, and hub tags.

`DPOMinConfig` accepts every field of TRL's `DPOConfig`, so that a script written for TRL runs after changing its
import. Most are dpo_min's own fields (or TrainingArguments'), with TRL's meaning. The others are in `TRL_FIELDS`:
each is a real dataclass field with TRL's type and default (so TRL's keyword arguments and command-line flags
parse), and any other value is refused with a one-line error that names the field and says why. None is silently
ignored. Adding a TRL field is adding an entry; a field dpo_min implements leaves the table.
"""

from dataclasses import dataclass, field, make_dataclass
from typing import Any

# Tags TRL's DPOTrainer puts on the model and its card: people filter the hub on them.
TRL_TAGS = ("trl", "dpo")


@dataclass(frozen=True)
class TRLField:
    """A TRL `DPOConfig` field with no dpo_min field behind it: TRL's type and default, and why another value is
    refused."""

    type: Any
    default: Any
    refusal: str


TRL_FIELDS: dict[str, TRLField] = {
    # TRL-internal.
    "pad_token": TRLField(str | None, None, "it is deprecated in TRL; set tokenizer.pad_token on the "
                                            "processing_class instead"),
}

# The table as dataclass fields, for DPOMinConfig to inherit.
TRLOnlyFields = make_dataclass("TRLOnlyFields", [
    (name, entry.type, field(default=entry.default, metadata={
        "help": f"TRL DPOConfig field, accepted at its default {entry.default!r} only: {entry.refusal}."}))
    for name, entry in TRL_FIELDS.items()
])


def check_trl_fields(config: Any) -> None:
    """Refuse any TRL-only field set to another value than TRL's default."""
    for name, entry in TRL_FIELDS.items():
        value = getattr(config, name)
        if value != entry.default:
            raise ValueError(f"{name}={value!r} is not supported by dpo_min: {entry.refusal} (TRL DPOConfig field, "
                             f"accepted at its default {entry.default!r} only)")


def trl_hub_tags(model: Any, environ: dict[str, str]) -> list[str]:
    """The tags TRL's DPOTrainer adds to the model card: its own, `unsloth` for an Unsloth model, `hf_jobs` inside
    a Hugging Face job."""
    tags = list(TRL_TAGS)
    if hasattr(model.config, "unsloth_version"):
        tags.append("unsloth")
    if "JOB_ID" in environ:
        tags.append("hf_jobs")
    return tags
