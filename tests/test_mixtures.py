"""Mixtures in their publishers' three forms (TRL's `datasets:`, the handbook's `dataset_mixture:` and legacy
`dataset_mixer:`), local dataset folders, and the handbook's DPO recipes run as published (issue 19)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset

from dpo_min.data.loading import load_preference_dataset
from dpo_min.data.mixtures import handbook_mixture, legacy_mixer, load_mixture, trl_mixture

ROOT = Path(__file__).resolve().parent.parent
TRL_RECIPES = ROOT / "tests" / "recipes"
# Our own recipes in the handbook's form, and the handbook's published ones where the steering repo's shared/ folder
# beside the checkout holds copies (this repository keeps none: they are the handbook's files, not ours).
HANDBOOK_RECIPES = sorted(TRL_RECIPES.glob("handbook_form_*.yaml")) + sorted(
    (ROOT.parent / "shared" / "handbook_recipes").glob("*.yaml"))


def _messages(prompt: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def _rows(name: str, split: str, count: int) -> list[dict]:
    """Conversational pairs with the columns the hub dataset has (the extra ones too), each one's prompt unique."""
    rows = []
    for i in range(count):
        prompt = f"{name} {split} {i}: name a color."
        row = {"prompt": prompt, "chosen": _messages(prompt, "Blue."), "rejected": _messages(prompt, "Loud."),
               "messages": _messages(prompt, "Blue."), "score_chosen": 8.0, "score_rejected": 2.0}
        if name == "smoltalk2":
            row = {"prompt": row["prompt"], "chosen": row["chosen"][1:], "rejected": row["rejected"][1:],
                   "chat_template_kwargs": {"enable_thinking": False}, "source": "tulu"}
            row["prompt"] = _messages(prompt, "")[:1]
        rows.append(row)
    return rows


# (hub id, config, {split: rows}): small stand-ins, in the layout of the hub dataset's repository.
STAND_INS = [
    ("HuggingFaceH4/ultrafeedback_binarized", "default", {"train_prefs": 14, "test_prefs": 6, "train_sft": 3}),
    ("HuggingFaceH4/cai-conversation-harmless", "default", {"train_prefs": 10, "test_prefs": 4}),
    ("HuggingFaceH4/orca_dpo_pairs", "default", {"train_prefs": 9, "test_prefs": 5}),
    ("argilla/dpo-mix-7k", "default", {"train": 12, "test": 4}),
    ("HuggingFaceTB/smoltalk2", "Preference", {"llama_3.1_tulu_3_8b_preference_mixture_no_think": 10,
                                              "tulu_3_8b_pref_mix_Qwen3_32B_Qwen3_0.6B_think": 8}),
]


def write_hub_folder(folder: Path, config: str, splits: dict[str, int], readme: bool = True) -> None:
    """data/<split>-00000-of-00001.parquet per split, and a README.md whose `configs:` names them, as on the hub."""
    short = folder.name.split("_")[0]
    data_dir = folder / (config if config != "default" else "data")
    data_dir.mkdir(parents=True)
    for split, count in splits.items():
        Dataset.from_list(_rows(short, split, count)).to_parquet(data_dir / f"{split}-00000-of-00001.parquet")
    if readme:
        files = [{"split": split, "path": f"{data_dir.name}/{split}-*"} for split in splits]
        header = yaml.safe_dump({"configs": [{"config_name": config, "data_files": files}]}, sort_keys=False)
        (folder / "README.md").write_text(f"---\n{header}---\n# a stand-in of {folder.name}\n")


@pytest.fixture(scope="module")
def hub_copies(tmp_path_factory) -> Path:
    """A folder holding local copies of the recipes' datasets at their hub ids (as `git clone`s of them would be)."""
    root = tmp_path_factory.mktemp("hub_copies")
    for name, config, splits in STAND_INS:
        write_hub_folder(root / name, config, splits, readme=name != "argilla/dpo-mix-7k")
    return root


# ---- the publishers' loaders, written out from their sources for the independent count ---------------------------
def handbook_counts(mixture: dict, test_split_size) -> tuple[int, int]:
    """alignment-handbook src/alignment/data.py: int(n * weight) rows each, then train_test_split(test_size)."""
    total = 0
    for entry in mixture["datasets"]:
        rows = len(load_dataset(entry["id"], entry.get("config"), split=entry.get("split", "train")))
        total += int(rows * entry.get("weight", 1.0))
    size = test_split_size if test_split_size is not None else mixture.get("test_split_size")
    held = 0 if size is None else size if isinstance(size, int) else math.ceil(size * total)
    return total - held, held


def legacy_counts(mixer: dict, splits: list[str]) -> tuple[int, int]:
    """The handbook's mix_datasets: int(fraction * n) of each train split, every test split whole."""
    train = held = 0
    for name, fraction in mixer.items():
        for split in splits:
            rows = len(load_dataset(name, split=split))
            train, held = (train + int(fraction * rows), held) if "train" in split else (train, held + rows)
    return train, held


# ---- the recipes, run as published -------------------------------------------------------------------------------
# Only locations, CUDA-only options and sizes are changed, on the command line.
SIZES = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "8",
         "--gradient_accumulation_steps", "1", "--max_length", "32", "--max_prompt_length", "16",
         "--dataset_num_proc", "1", "--num_samples", "0", "--logging_steps", "1", "--save_strategy", "no",
         "--eval_on_start", "false"]
CPU = ["--bf16", "false", "--torch_dtype", "float32", "--push_to_hub", "false", "--report_to", "none"]
RECIPE_OVERRIDES = {
    "zephyr-7b-beta__config_qlora.yaml": ["--load_in_4bit", "false", "--attn_implementation", "sdpa",
                                          "--optim", "adamw_torch"],
    "handbook_form_legacy_qlora.yaml": ["--load_in_4bit", "false", "--attn_implementation", "sdpa",
                                        "--optim", "adamw_torch"],
    "smollm3__apo.yaml": ["--attn_implementation", "sdpa", "--use_liger_kernel", "false", "--model_revision", "main"],
}
HANDBOOK_RECIPE_PATHS = {path.name: path for path in HANDBOOK_RECIPES}
@pytest.fixture
def one_thread():
    """A tiny model gains nothing from a second thread, and on the shared 2-core machine loses a lot to it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mixture_lines(records) -> list[str]:
    return [record.getMessage() for record in records if record.name == "dpo_min.data" and
            record.getMessage().startswith("mixture: ")]


def count_rows(lines: list[str]) -> tuple[int, int]:
    """(train rows, held-out rows) from the run's own mixture lines."""
    train = held = 0
    for line in lines:
        if line.startswith("mixture: held out: "):
            taken = int(re.match(r"mixture: held out: (\d+) of", line).group(1))
            held, train = held + taken, train - taken
        elif "held-out rows" in line:
            held += int(re.search(r": (\d+) held-out rows", line).group(1))
        else:
            train += int(re.search(r"\]: (\d+) rows: ", line).group(1))
    return train, held


@pytest.mark.parametrize("recipe_name", sorted(HANDBOOK_RECIPE_PATHS))
def test_a_handbook_dpo_recipe_trains_the_pairs_its_loader_gives(recipe_name, hub_copies, tiny_model_dir, tmp_path,
                                                                 monkeypatch, capsys, caplog,
                                                                 one_thread):
    from dpo_min.train import main

    recipe_path = HANDBOOK_RECIPE_PATHS[recipe_name]
    recipe = yaml.safe_load(recipe_path.read_text())
    monkeypatch.chdir(hub_copies)  # the recipe's hub ids are folders here, as datasets resolves them
    test_split_size = 3 if "test_split_size" in recipe.get("dataset_mixture", {}) else None
    sizes = SIZES + (["--test_split_size", str(test_split_size)] if test_split_size else [])
    output_dir = tmp_path / "run"
    code = main(["--config", str(recipe_path), "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                 str(output_dir), *CPU, *sizes, *RECIPE_OVERRIDES.get(recipe_name, [])])
    out = capsys.readouterr()
    assert code == 0, out.err
    if "dataset_mixture" in recipe:
        expected = handbook_counts(recipe["dataset_mixture"], test_split_size)
    else:
        expected = legacy_counts(recipe["dataset_mixer"], recipe.get("dataset_splits", ["train", "test"]))
    lines = mixture_lines(caplog.records)
    assert count_rows(lines) == expected, lines
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["held_out_pairs"] == expected[1]
    assert metrics["train_pairs"] == min(expected[0], 2)  # max_steps 1 of batch 2 reaches 2 of them


# ---- the forms, row for row against their loaders ----------------------------------------------------------------
def test_trl_mixture_gives_the_rows_of_trls_own_get_dataset_in_its_order(hub_copies, monkeypatch):
    from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, get_dataset

    monkeypatch.chdir(hub_copies)
    entries = [{"path": "HuggingFaceH4/ultrafeedback_binarized", "split": "train_prefs",
                "columns": ["chosen", "rejected"], "fraction": 0.7},
               {"path": "HuggingFaceH4/orca_dpo_pairs", "name": "default", "split": "test_prefs",
                "columns": ["chosen", "rejected"], "fraction": 0.3}]
    theirs = get_dataset(DatasetMixtureConfig(datasets=[DatasetConfig(**entry) for entry in entries]))["train"]
    ours = trl_mixture(entries)
    # 5 orca rows are 0.3 of a 16.67-row mixture: round(0.7 * 16.67) = 12 ultrafeedback rows, round(0.3 * ...) = 5.
    assert len(ours.train) == len(theirs) == 17 and ours.held_out is None
    assert ours.train["chosen"] == [row[1:] for row in theirs["chosen"]]  # the prompt turn split off, in order
    assert [row[0]["content"] for row in theirs["chosen"]] == [turn[0]["content"] for turn in ours.train["prompt"]]
    assert any("first 12 of 14 rows" in line for line in ours.lines)
    split = load_mixture(entries, test_split_size=0.25, seed=3)
    assert (len(split["train"]), len(split["test"])) == (12, 5)  # train_test_split: ceil(0.25 * 17) held out
    both = list(split["train"]["prompt"]) + list(split["test"]["prompt"])
    assert sorted(both, key=str) == sorted(ours.train["prompt"], key=str)


def test_trl_mixture_without_fraction_concatenates_whole_splits_and_reads_data_files(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "a", "rejected": "b"}) + "\n"
                            for i in range(5)))
    mixture = trl_mixture([{"path": "json", "data_files": str(path)}, {"path": str(path), "split": "train[:2]"}])
    assert mixture.train["prompt"] == ["Q0", "Q1", "Q2", "Q3", "Q4", "Q0", "Q1"]


def test_handbook_mixture_gives_the_rows_of_its_loader(hub_copies, monkeypatch):
    monkeypatch.chdir(hub_copies)
    spec = {"datasets": [{"id": "HuggingFaceH4/ultrafeedback_binarized", "config": "default", "split": "train_prefs",
                          "columns": ["chosen", "rejected"], "weight": 0.5},
                         {"id": "argilla/dpo-mix-7k", "split": "train", "columns": ["chosen", "rejected"]}],
            "seed": 7, "test_split_size": 0.2}
    ours = handbook_mixture(spec)
    # The handbook's get_dataset, step by step: shuffle(seed).select(int(n * weight)), concatenate, shuffle(seed),
    # train_test_split(test_size, seed).
    parts = []
    for entry in spec["datasets"]:
        raw = load_dataset(entry["id"], entry.get("config"), split=entry["split"]).select_columns(entry["columns"])
        parts.append(raw.shuffle(seed=7).select(range(int(len(raw) * entry.get("weight", 1.0)))))
    theirs = concatenate_datasets(parts).shuffle(seed=7).train_test_split(test_size=0.2, seed=7)
    assert (len(ours.train), len(ours.held_out)) == (len(theirs["train"]), len(theirs["test"])) == (15, 4)
    assert ours.train["chosen"] == [row[1:] for row in theirs["train"]["chosen"]]
    assert ours.held_out["chosen"] == [row[1:] for row in theirs["test"]["chosen"]]
    assert any("held out: 4 of the mixture's 19 rows" in line for line in ours.lines)


def test_legacy_mixer_takes_the_first_train_rows_and_holds_out_every_test_split(hub_copies, monkeypatch):
    monkeypatch.chdir(hub_copies)
    ours = legacy_mixer({"HuggingFaceH4/ultrafeedback_binarized": 0.5}, ["train_prefs", "test_prefs"])
    train = load_dataset("HuggingFaceH4/ultrafeedback_binarized", split="train_prefs").select(range(7))
    # The first 7 train rows (ultrafeedback_h4 layout: the prompt column is the prompt), shuffled with seed 42.
    assert [turns[0]["content"] for turns in ours.train["prompt"]] == list(train.shuffle(seed=42)["prompt"])
    assert len(ours.held_out) == 6
    with pytest.raises(ValueError, match="exactly one train split"):
        legacy_mixer({"HuggingFaceH4/ultrafeedback_binarized": 1.0}, ["train_prefs", "train_sft", "test_prefs"])


@pytest.mark.parametrize(("entry", "message"), [
    ({"path": "a.jsonl", "columns": "prompt"}, r"columns is the list of columns to keep"),
    ({"path": "a.jsonl", "frac": 1}, r"unknown: \['frac'\]"),
])
def test_an_unknown_entry_key_is_refused_saying_what_to_write(entry, message):
    with pytest.raises(ValueError, match=message):
        trl_mixture([entry])


def test_trl_fraction_on_some_entries_only_is_refused_as_trl_does(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(ValueError, match="`fraction` must be set for either all datasets"):
        trl_mixture([{"path": str(path), "fraction": 1}, {"path": str(path)}])


@pytest.mark.parametrize("share", [math.nan, math.inf])
def test_a_share_that_is_not_finite_is_refused_naming_the_entry_and_the_field(tmp_path, share):
    path = write_prompts(tmp_path / "p.jsonl", "P", 3)
    # TRL's fraction: nan said "every fraction is 0", inf "min() arg is an empty sequence".
    with pytest.raises(ValueError) as error:
        trl_mixture([{"path": path, "fraction": 1}, {"path": path, "fraction": share}])
    assert str(error.value) == f"datasets[1]: fraction is its share of the mixture, a finite number >= 0, got {share!r}"
    with pytest.raises(ValueError, match=r"^dataset_mixture.datasets\[0\]: weight is the fraction of its rows taken"):
        handbook_mixture({"datasets": [{"id": path, "weight": share}]})
    with pytest.raises(ValueError, match=rf"^dataset_mixer: {re.escape(path)}: a fraction of its train rows in "):
        legacy_mixer({path: share}, ["train"])

def test_rename_columns_is_datasets_mapping_from_the_source_column_to_the_new_name(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Q{i}", "good": "a", "bad": "b"}) + "\n" for i in range(3)))
    mixture = trl_mixture([{"path": str(path), "rename_columns": {"instruction": "prompt", "good": "chosen",
                                                                  "bad": "rejected"}}])
    assert mixture.train["prompt"] == ["Q0", "Q1", "Q2"]


def write_prompts(path: Path, tag: str, count: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{tag}{i}", "chosen": "a", "rejected": "b"}) + "\n"
                            for i in range(count)))
    return str(path)


@pytest.mark.parametrize("form", ["trl", "handbook", "legacy"])
def test_a_share_of_zero_takes_no_row_of_that_dataset_and_says_so(tmp_path, form):
    zero, other = write_prompts(tmp_path / "zero.jsonl", "Z", 20), write_prompts(tmp_path / "other.jsonl", "O", 6)
    mixture, said = {
        "trl": (lambda: trl_mixture([{"path": zero, "fraction": 0}, {"path": other, "fraction": 1}]),
                "0 rows: fraction 0 (share 0) of a 6-row mixture: its first 0 of 20 rows"),
        "handbook": (lambda: handbook_mixture({"datasets": [{"id": zero, "weight": 0}, {"id": other}]}),
                     "0 rows: weight 0 of its 20 rows, shuffled with seed 0"),
        "legacy": (lambda: legacy_mixer({zero: 0.0, other: 1.0}, ["train"]),
                   "0 rows: fraction 0.0 of its 20 rows, the first ones"),
    }[form]
    made = mixture()
    # Before issue 25: "the dataset holds no rows", for a file of 20 rows.
    assert sorted(made.train["prompt"]) == [f"O{i}" for i in range(6)]
    assert f"{zero}[train]: {said}" in made.lines


def test_a_mixture_whose_every_share_takes_no_row_is_one_line(tmp_path):
    zero = write_prompts(tmp_path / "zero.jsonl", "Z", 3)
    with pytest.raises(ValueError, match=rf"^the mixture takes no rows: {re.escape(zero)}\[train\]: 0 rows: weight 0.2 "
                                         r"of its 3 rows, shuffled with seed 0$"):
        handbook_mixture({"datasets": [{"id": zero, "weight": 0.2}]})


# ---- local folders (item 4) --------------------------------------------------------------------------------------
def test_a_hub_layout_folder_is_read_by_split_and_config_and_a_missing_split_is_named(hub_copies):
    folder = hub_copies / "HuggingFaceTB" / "smoltalk2"
    pairs = load_preference_dataset(str(folder), "tulu_3_8b_pref_mix_Qwen3_32B_Qwen3_0.6B_think", config="Preference")
    assert len(pairs) == 8 and "chat_template_kwargs" in pairs.column_names
    no_readme = hub_copies / "argilla" / "dpo-mix-7k"
    assert len(load_preference_dataset(str(no_readme), "test")) == 4
    with pytest.raises(ValueError, match=r"dpo-mix-7k: no split 'validation'; it has train, test$"):
        load_preference_dataset(str(no_readme), "validation")


def test_save_to_disk_folders_whole_or_one_split_honour_the_split(tmp_path):
    rows = [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b"} for i in range(6)]
    DatasetDict(train=Dataset.from_list(rows[:4]), test=Dataset.from_list(rows[4:])).save_to_disk(tmp_path / "dd")
    assert load_preference_dataset(str(tmp_path / "dd"), "test")["prompt"] == ["Q4", "Q5"]
    assert load_preference_dataset(str(tmp_path / "dd"), "train[1:3]")["prompt"] == ["Q1", "Q2"]
    with pytest.raises(ValueError, match=r"dd: no split 'valid'; it has train, test"):
        load_preference_dataset(str(tmp_path / "dd"), "valid")
    with pytest.raises(ValueError, match=r"a save_to_disk folder has no configs; drop config 'x'"):
        load_preference_dataset(str(tmp_path / "dd"), "test", config="x")
    Dataset.from_list(rows).save_to_disk(tmp_path / "one")
    assert len(load_preference_dataset(str(tmp_path / "one"))) == 6


def test_the_command_trains_on_a_dataset_folder_with_its_eval_split(hub_copies, tiny_model_dir, tmp_path, one_thread):
    from dpo_min.train import main

    folder = hub_copies / "HuggingFaceH4" / "orca_dpo_pairs"
    output_dir = tmp_path / "run"
    code = main(["--model", str(tiny_model_dir), "--dataset", str(folder), "--split", "train_prefs",
                 "--eval_split", "test_prefs", "--output_dir", str(output_dir), *SIZES])
    assert code == 0
    assert json.loads((output_dir / "metrics.json").read_text())["held_out_pairs"] == 5


def test_trls_mixture_recipe_trains_the_pairs_trls_get_dataset_gives(hub_copies, tiny_model_dir, tmp_path,
                                                                     monkeypatch, caplog, one_thread):
    from trl.scripts.utils import DatasetMixtureConfig, get_dataset

    from dpo_min.train import main

    recipe_path = TRL_RECIPES / "trl_datasets_mixture.yaml"
    recipe = yaml.safe_load(recipe_path.read_text())
    monkeypatch.chdir(hub_copies)
    theirs = get_dataset(DatasetMixtureConfig(datasets=recipe["datasets"], test_split_size=recipe["test_split_size"]))
    output_dir = tmp_path / "run"
    code = main(["--config", str(recipe_path), "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                 str(output_dir), *CPU, *SIZES])
    assert code == 0
    lines = mixture_lines(caplog.records)
    assert count_rows(lines) == (len(theirs["train"]), len(theirs["test"])) == (15, 4), lines
    # 9 orca rows at a share of 0.25 would allow 36; the 14 ultrafeedback rows at 0.75 allow 18.67: 14 + 5 rows.
    assert [line.split(": ")[2] for line in lines[:2]] == ["14 rows", "5 rows"]
    assert json.loads((output_dir / "metrics.json").read_text())["held_out_pairs"] == 4


@pytest.mark.parametrize(("recipe", "flags", "message"), [
    ("datasets: [{path: P}]\ndataset_mixer: {P: 1.0}\n", [], "one mixture per run: datasets and dataset_mixer"),
    ("datasets: [{path: P}]\ntest_split_size: 2\n", ["--eval_fraction", "0.5"],
     "--eval_fraction and test_split_size both hold out pairs of the mixture: give one"),
    ("datasets: [{path: P}]\n", ["--eval_split", "test"], "--eval_split picks a split of one dataset"),
    ("dataset_mixer: {P: 1.0}\ndataset_splits: [train]\n", ["--test_split_size", "2"],
     "dataset_mixer holds out its test splits"),
    ("", ["--dataset", "P", "--test_split_size", "2"], "test_split_size belongs to a mixture"),
    ("dataset_mixture: {datasets: [{id: P, weight: 2}]}\n", [], "weight is the fraction of its rows taken, in [0, 1]"),
    ("datasets: [{path: P, fraction: 1}, {path: P, fraction: .nan}]\n", [],
     "datasets[1]: fraction is its share of the mixture, a finite number >= 0, got nan"),
    ("datasets: [{path: P, fraction: .inf}]\n", [],
     "datasets[0]: fraction is its share of the mixture, a finite number >= 0, got inf"),
])
def test_the_command_refuses_an_ambiguous_mixture_in_one_line(recipe, flags, message, tmp_path, tiny_model_dir,
                                                              capsys):
    from dpo_min.train import main

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(4)))
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(recipe.replace("P", str(path)))
    argv = ["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"),
            *[flag.replace("P", str(path)) for flag in flags]]
    code = main((["--config", str(recipe_path)] if recipe else []) + argv)
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and len(err.splitlines()) == 1 and message.replace("P", str(path)) in err, err
    assert not (tmp_path / "run").exists()


def test_a_streamed_trl_mixture_concatenates_the_streams_and_refuses_fraction(tmp_path):
    paths = []
    for name in ("a", "b"):
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"prompt": f"{name}{i}", "chosen": "x", "rejected": "y"}) + "\n"
                                     for i in range(3)))
    mixture = trl_mixture([{"path": str(path)} for path in paths], streaming=True)
    assert [row["prompt"] for row in mixture.train] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    with pytest.raises(ValueError, match="`fraction` is not supported with streaming"):
        trl_mixture([{"path": str(path), "fraction": 1} for path in paths], streaming=True)
    with pytest.raises(ValueError, match="a streamed mixture cannot be split"):
        trl_mixture([{"path": str(path)} for path in paths], streaming=True, test_split_size=2)
