"""What README.md and --help say of the command's options holds: TRL's names for them, the defaults of the command
itself, the demo's held-out pairs."""

import dataclasses
import gzip
import re
from collections import Counter
from pathlib import Path

import pytest
import trl
from datasets import Dataset

from dpo_min import DPOMinConfig
from dpo_min.compat import TRL_NAMES
from dpo_min.train import command_line, main
from dpo_min.train.args import DEMO_DEFAULTS, DataArguments, ModelArguments
from dpo_min.train.command_line import parse_args
from dpo_min.train.pairs import EMBEDDED_DATA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_trl_name_given_for_an_option_is_trls_field_and_means_that_option():
    # README's "`--dtype` (TRL: `torch_dtype`)" named a field TRL 1.16 no longer has (its ModelConfig says dtype).
    trl_fields = {option.name for kind in (trl.ScriptArguments, trl.ModelConfig, trl.DPOConfig)
                  for option in dataclasses.fields(kind)}
    given = re.findall(r"`--(\w+)` \(TRL: `(\w+)`\)", README)
    given += [(option.name, name) for kind in (ModelArguments, DataArguments) for option in dataclasses.fields(kind)
              for name in re.findall(r"\(TRL: (\w+)\)", option.metadata.get("help", ""))]
    assert len(given) >= 6  # README's --model, --dataset, --eval_split; the help's four
    assert [(option, name) for option, name in given if name not in trl_fields or TRL_NAMES.get(name) != option] == []


def test_readme_names_every_default_of_the_command_itself(monkeypatch):
    # DPOMinConfig given only the defaults README names is the config the command makes (use_cpu was left out).
    monkeypatch.setattr(command_line, "_has_accelerator", lambda: False)
    # eval_on_start=True is the command's for a loss without a reference (README: one that reads it starts from ties).
    model_args, data_args, args = parse_args(["--dataset", "x.jsonl", "--loss_type", "simpo"])
    assert not parse_args(["--dataset", "x.jsonl"])[2].eval_on_start
    sentence = re.search(r"The only defaults of the command itself, for every run, are\s+(.*?)\.\s", README, re.S)
    named = dict(re.findall(r"`(\w+)=(\w+)`", sentence.group(1)))
    assert set(named) >= {"output_dir", "eval_on_start", "ddp_find_unused_parameters"}
    assert "for a loss without a reference" in " ".join(sentence.group(1).split())
    library = DPOMinConfig(loss_type="simpo", **{name: getattr(args, name) for name in named})
    assert {option.name for option in dataclasses.fields(args) if getattr(args, option.name) != getattr(
        library, option.name)} == set()
    assert all(getattr(DPOMinConfig(), name) != getattr(args, name) for name in named)  # each is the command's own
    assert model_args == ModelArguments() and data_args == DataArguments(dataset="x.jsonl")


def test_the_demo_holds_out_more_pairs_than_it_scores_in_full_batches():
    # DEMO_DEFAULTS' comments: the held-out share, as datasets rounds it, holds the pairs scored, in full batches.
    with gzip.open(EMBEDDED_DATA, "rt", encoding="utf-8") as file:
        rows = sum(1 for line in file if line.strip())
    split = Dataset.from_dict({"row": list(range(rows))}).train_test_split(test_size=DEMO_DEFAULTS["eval_fraction"])
    assert len(split["test"]) >= DEMO_DEFAULTS["max_eval_samples"]
    assert DEMO_DEFAULTS["max_eval_samples"] % DEMO_DEFAULTS["per_device_eval_batch_size"] == 0


def _help_paragraphs(capsys) -> dict[str, str]:
    """--help as the command prints it: {option (as --name writes it): its paragraph, on one line}."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    paragraphs = {}
    for block in capsys.readouterr().out.split("\n  --")[1:]:
        head, _, rest = block.split("\n\n")[0].partition("\n")
        inline = re.split(r" {2,}", head.strip(), maxsplit=1)[1:]  # a short option's help starts on its own line
        paragraphs[head.split()[0].rstrip(",")] = " ".join(" ".join([*inline, rest]).split())
    assert len(paragraphs) > 200  # every option of the four groups (a broken split would check nothing)
    return paragraphs


def test_help_shows_a_default_only_where_it_is_the_options_own(capsys):
    paragraphs = _help_paragraphs(capsys)
    # "(default: None)" told nothing, and followed texts that name the real default (--model's "Default: SmolLM2-135M").
    assert [name for name, text in paragraphs.items() if text.endswith("(default: None)")] == []
    # A demo's defaults end "otherwise:" only where the default that completes the sentence is printed.
    assert [name for name, text in paragraphs.items() if text.endswith("otherwise:")] == []
    assert "(default:" not in paragraphs["use_peft"]  # on without --model, off with one: its text says which
    assert "Default: SmolLM2-135M-Instruct" in paragraphs["model"]
    assert paragraphs["learning_rate"].endswith("otherwise: (default: 1e-06)")
    assert paragraphs["lora_r"].endswith("(default: 16)")


def test_help_describes_each_option_once(capsys):
    paragraphs = _help_paragraphs(capsys)
    said = {name: re.sub(r" \(default: [^)]*\)$", "", text) for name, text in paragraphs.items()}
    told = Counter(said.values())  # --use_peft's paragraph was --no_use_peft's too, but for its "(default: ...)"
    assert [name for name, text in said.items() if told[text] > 1] == []
    assert paragraphs["no_use_peft"] == "Same as --use_peft false."
    assert paragraphs["no_disable_dropout"] == "Same as --disable_dropout false."


def test_help_says_what_plackett_luce_needs_and_where_the_layouts_are(capsys, tmp_path):
    paragraphs = _help_paragraphs(capsys)
    loss_type = paragraphs["loss_type"]
    assert "plackett_luce needs --group_by_prompt" in loss_type
    assert "per_device_train_batch_size counts whole groups" in loss_type
    with pytest.raises(ValueError, match="needs group_by_prompt"):  # what the help says is what the config refuses
        DPOMinConfig(output_dir=str(tmp_path), loss_type="plackett_luce")
    assert DPOMinConfig(output_dir=str(tmp_path), loss_type="plackett_luce", group_by_prompt=True).listwise
    assert "prompt, completions, scores" in paragraphs["dataset"] and "docs/data.md" in paragraphs["dataset"]
    for option, page in (("dataset", "docs/data.md"), ("group_by_prompt", "docs/groups.md"),
                         ("loss_type", "docs/groups.md")):
        assert page in paragraphs[option], option
        assert (ROOT / page).is_file()
