"""What README.md and --help say of the command's options holds: TRL's names for them, the defaults of the command
itself, the demo's held-out pairs."""

import dataclasses
import gzip
import re
from pathlib import Path

import trl
from datasets import Dataset

from dpo_min import DPOMinConfig
from dpo_min.compat import TRL_NAMES
from dpo_min.train import command_line
from dpo_min.train.args import DEMO_DEFAULTS, DataArguments, ModelArguments
from dpo_min.train.command_line import parse_args
from dpo_min.train.pairs import EMBEDDED_DATA

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


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
    model_args, data_args, args = parse_args(["--dataset", "x.jsonl"])
    sentence = re.search(r"The only defaults of the command itself, for every run, are\s+(.*?)\.\s", README, re.S)
    named = dict(re.findall(r"`(\w+)=(\w+)`", sentence.group(1)))
    assert set(named) >= {"output_dir", "eval_on_start", "ddp_find_unused_parameters"}
    library = DPOMinConfig(**{name: getattr(args, name) for name in named})
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
