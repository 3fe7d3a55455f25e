"""A local dataset folder's files, all of them: datasets reads a folder by globbing lower-case extensions, skips
hidden files and does not follow links to folders, reads one file type only and, where some files are named by
split, those alone; so a file it would leave out is named here and the load refused (`check_one_file_type`), never
trained without."""

import os
from collections.abc import Mapping
from typing import Any

import yaml
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.load import _ALL_ALLOWED_EXTENSIONS, infer_module_for_data_files_list

# datasets 5 reads .md and .toml files as "harbor" task data; beside preference files they are a folder's notes.
NOTES = ("harbor",)


def file_type(name: str) -> tuple[str, ...] | None:
    """A data file's type by datasets' own rule, its extension in any case: ('json',), ('csv',), ('csv', 'sep',
    '\\t') for .tsv (the csv reader with another separator: another type); None for a note or a non-data file."""
    module, kwargs = infer_module_for_data_files_list([name.lower()])
    if module in (None, *NOTES):
        return None
    return (module, *(item for pair in sorted(kwargs.items()) for item in pair))


def every_file(base: str) -> list[str]:
    """Every file under `base` (relative paths), hidden ones and those behind links to folders too. A broken link
    is refused: it names a file that is not there."""
    found, seen = [], set()
    for folder, folders, files in os.walk(base, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            folders.clear()
            continue
        seen.add(real)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise ValueError(f"{path}: a broken link (to {os.readlink(path)}); remove it, or point it at the file")
            found.append(os.path.relpath(path, base))
    return sorted(found)


def check_every_file_read(base: str, read: list[str]) -> None:
    """Refuse the folder when a data file under it is not among those datasets reads (`read`), naming the file."""
    left_out = [name for name in every_file(base) if file_type(name) and name not in set(read)]
    if left_out:
        more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
        raise ValueError(f"{os.path.join(base, left_out[0])}: {_why_left_out(base, left_out[0])}{more}")


def _why_left_out(base: str, name: str) -> str:
    parts = name.split(os.sep)
    for depth in range(1, len(parts)):
        folder = os.path.join(base, *parts[:depth])
        if os.path.islink(folder):
            return (f"{os.path.join(*parts[:depth])} is a link to a folder, which datasets does not follow, so it "
                    "would leave this file out; copy the files into the folder, or name them (data_files)")
    if any(part.startswith((".", "__")) for part in parts):
        return "datasets leaves hidden files out (a name starting '.' or '__'); rename it, or remove it"
    stem, extension = _split_extension(parts[-1])
    if extension != extension.lower():
        return (f"datasets reads only lower-case extensions and would leave this file out; rename it to "
                f"{stem}{extension.lower()}")
    return "datasets would leave this file out; name the files to read (data_files)"


def _split_extension(name: str) -> tuple[str, str]:
    """'b.JSONL.GZ' -> ('b', '.JSONL.GZ'): the data extension with its compression one."""
    stem, extension = os.path.splitext(name)
    if extension.lower() in (".gz", ".zst", ".bz2", ".xz", ".lz4", ".zip") and "." in stem:
        stem, inner = os.path.splitext(stem)
        extension = inner + extension
    return stem, extension


def check_one_file_type(folder: str, load_kwargs: Mapping[str, Any]) -> list[str]:
    """datasets reads a folder's files of its commonest type only (`infer_module_for_data_files`, then a filter on
    that type), only its split-named files where some are, and none it cannot glob (`check_every_file_read`): such a
    folder is refused, naming the files, rather than read in part. Files that a README's `configs:` or `data_files`
    name are read as named. Returns the files datasets reads (relative to the folder), [] where they are named."""
    base = os.path.join(folder, load_kwargs["data_dir"]) if load_kwargs.get("data_dir") else folder
    if load_kwargs.get("data_files") is not None or _readme_configs(base):
        return []

    def found(patterns: Mapping[str, list[str]]) -> list[str]:
        files = DataFilesDict.from_patterns(patterns, base_path=base, allowed_extensions=_ALL_ALLOWED_EXTENSIONS)
        return sorted(os.path.relpath(file, base) for split in files.values() for file in split)
    try:
        in_splits, every = found(get_data_patterns(base)), found({"all": ["**"]})
    except Exception:  # no data files that datasets can glob
        in_splits = every = []
    check_every_file_read(base, every)
    by_type: dict[tuple[str, ...], list[str]] = {}
    for name in every:
        kind = file_type(name)  # datasets' own rule, one file at a time
        if kind is not None:
            by_type.setdefault(kind, []).append(name)
    if len(by_type) > 1:
        listed = "; ".join(f"{_type_name(kind)}: {_some(names)}" for kind, names in by_type.items())
        raise ValueError(f"{base}: holds data files of {len(by_type)} types, and datasets would read one type "
                         f"only: {listed}; keep one type in the folder, or name a file")
    # Files named by split (train.jsonl, test-*.parquet) make datasets read those alone and leave out the others.
    left_out = sorted(set(name for names in by_type.values() for name in names) - set(in_splits))
    if left_out:
        raise ValueError(f"{base}: datasets reads its files by split name ({_some(in_splits)}) and would leave out "
                         f"{_some(left_out)}; name every file by its split, or keep one split's files there")
    return [os.path.join(base, name) for names in by_type.values() for name in names]


def _type_name(kind: tuple[str, ...]) -> str:
    """('csv', 'sep', '\t') -> "csv (sep '\t')"."""
    options = ", ".join(f"{name} {value!r}" for name, value in zip(kind[1::2], kind[2::2]))
    return f"{kind[0]} ({options})" if options else kind[0]


def _some(names: list[str]) -> str:
    """'2 files (a.jsonl, b.jsonl)', at most three named."""
    return (f"{len(names)} file{'s' * (len(names) > 1)} ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})")


def _readme_configs(folder: str) -> bool:
    """The folder's README.md front matter has `configs:` (a hub dataset's card naming its data files)."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme):
        return False
    with open(readme, encoding="utf-8", errors="replace") as file:
        text = file.read()
    if not text.startswith("---"):
        return False
    try:
        header = yaml.safe_load(text.split("---", 2)[1])
    except yaml.YAMLError as error:  # datasets reads the front matter too, and its error names no file
        mark = getattr(error, "problem_mark", None)  # its line in the front matter, which starts on line 1
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{readme}: its YAML front matter does not parse: {getattr(error, 'problem', error)}"
                         f"{where}") from None
    return isinstance(header, Mapping) and "configs" in header
