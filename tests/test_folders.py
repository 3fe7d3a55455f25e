"""A dataset folder: every file in it is read, or the load is refused in one line naming the file (data/folders.py).

The reference is datasets itself: each case below, loaded by `datasets.load_dataset(folder)` alone, reads fewer rows
than the folder holds (or says "No (supported) data files found"), which the first assertion of each test shows."""

import gzip
import json
import os

import pytest
from datasets import Dataset, load_dataset

from dpo_min.data.loading import load_preference_dataset


def rows(count: int, tag: str) -> list[dict[str, str]]:
    return [{"prompt": f"{tag}{i}?", "chosen": "yes", "rejected": "no"} for i in range(count)]


def write(path, pairs) -> None:
    text = "".join(json.dumps(row) + "\n" for row in pairs)
    if path.name.lower().endswith(".parquet"):
        Dataset.from_list(pairs).to_parquet(str(path))
    elif path.name.lower().endswith(".gz"):
        with gzip.open(path, "wt") as file:
            file.write(text)
    else:
        path.write_text(text)


def datasets_rows(folder) -> int | str:
    """What datasets alone reads of the folder: its row count, or its error's first words."""
    try:
        return len(load_dataset(str(folder), split="train"))
    except Exception as error:
        return str(error)[:34]


@pytest.mark.parametrize("name, why", [
    ("B.JSONL", "datasets reads only lower-case extensions and would leave this file out; rename it to B.jsonl"),
    ("b.Parquet", "datasets reads only lower-case extensions and would leave this file out; rename it to b.parquet"),
    ("b.JSONL.GZ", "datasets reads only lower-case extensions and would leave this file out; rename it to "
                   "b.jsonl.gz"),
    (".b.jsonl", "datasets leaves hidden files out (a name starting '.' or '__'); rename it, or remove it"),
])
def test_a_file_datasets_would_leave_out_of_a_folder_is_refused_naming_it(tmp_path, name, why):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write(folder / "a.jsonl", rows(10, "A"))
    write(folder / name, rows(10, "B"))
    assert datasets_rows(folder) == 10  # of 20: the other file silently left out
    with pytest.raises(ValueError) as raised:
        load_preference_dataset(str(folder))
    assert str(raised.value) == f"{folder / name}: {why}"


def test_a_folder_holding_only_an_upper_case_file_names_it_not_no_data_files(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write(folder / "A.JSONL", rows(10, "A"))
    assert datasets_rows(folder) == "No (supported) data files found in"
    with pytest.raises(ValueError, match=r"pairs/A\.JSONL: datasets reads only lower-case extensions .* A\.jsonl$"):
        load_preference_dataset(str(folder))


def test_a_sub_folder_that_is_a_link_and_a_broken_file_link_are_refused_naming_them(tmp_path):
    folder, elsewhere = tmp_path / "pairs", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    write(folder / "a.jsonl", rows(10, "A"))
    write(elsewhere / "b.jsonl", rows(10, "B"))
    (folder / "more").symlink_to(elsewhere, target_is_directory=True)
    assert datasets_rows(folder) == 10
    with pytest.raises(ValueError, match=r"pairs/more/b\.jsonl: more is a link to a folder, which datasets does not "
                                         r"follow, so it would leave this file out; copy the files"):
        load_preference_dataset(str(folder))
    (folder / "more").unlink()
    (folder / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    assert datasets_rows(folder) == 10
    with pytest.raises(ValueError, match=rf"pairs/b\.jsonl: a broken link \(to {tmp_path}/gone\.jsonl\); remove it"):
        load_preference_dataset(str(folder))
    (folder / "b.jsonl").unlink()
    (folder / "b.jsonl").symlink_to(elsewhere / "b.jsonl")  # a link to a file is read, as datasets reads it
    (folder / ".gitattributes").write_text("*.jsonl filter=lfs\n")  # hidden, but not a data file
    assert sorted(load_preference_dataset(str(folder))["prompt"]) == sorted(
        [f"A{i}?" for i in range(10)] + [f"B{i}?" for i in range(10)])


def test_csv_beside_tsv_is_refused_as_two_types_naming_both(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    (folder / "a.csv").write_text("prompt,chosen,rejected\nq,yes,no\n")
    (folder / "b.tsv").write_text("prompt\tchosen\trejected\nr\tyes\tno\n")
    assert datasets_rows(folder) == "An error occurred while generating"
    with pytest.raises(ValueError, match=r"pairs: holds data files of 2 types, and datasets would read one type only: "
                                         r"csv: 1 file \(a\.csv\); csv \(sep '\\t'\): 1 file \(b\.tsv\)"):
        load_preference_dataset(str(folder))


def test_an_unreadable_file_of_a_folder_is_named(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write(folder / "a.jsonl", rows(3, "A"))
    (folder / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd not zstd")
    (folder / "c.jsonl").write_text('{"prompt": "q", "chosen": "y", "rejected": "n"}\n{"prompt": "q",\n')
    with pytest.raises(ValueError) as raised:
        load_preference_dataset(str(folder))
    assert str(raised.value).startswith(f"{folder / 'b.jsonl.zst'}: could not be read as json: ")
    (folder / "b.jsonl.zst").unlink()
    with pytest.raises(ValueError) as raised:
        load_preference_dataset(str(folder))
    assert str(raised.value) == f"{folder / 'c.jsonl'}: line 2 is not JSON: Expecting property name enclosed in " \
                                "double quotes (column 16)"


def test_a_readme_whose_yaml_does_not_parse_is_named(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write(folder / "a.jsonl", rows(3, "A"))
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: [a.jsonl\n---\n")
    with pytest.raises(ValueError, match=rf"^{folder / 'README.md'}: its YAML front matter does not parse: expected "
                                         r"',' or '\]', but got '<stream end>' \(line 5\)$"):
        load_preference_dataset(str(folder))


def test_the_command_refuses_a_folder_with_a_file_left_out_in_one_line(tmp_path, capsys, tiny_model_dir):
    from dpo_min.train import main

    folder = tmp_path / "pairs"
    folder.mkdir()
    write(folder / "a.jsonl", rows(10, "A"))
    write(folder / "B.JSONL", rows(10, "B"))
    code = main(["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"), "--dataset", str(folder)])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and error == [f"python -m dpo_min.train: error: {folder / 'B.JSONL'}: datasets reads only "
                                   "lower-case extensions and would leave this file out; rename it to B.jsonl"]
    assert not os.path.exists(tmp_path / "out")
