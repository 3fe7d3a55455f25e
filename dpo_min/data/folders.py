"""A local dataset folder's files, all of them: datasets reads a folder by globbing lower-case extensions, skips
hidden files and does not follow links to folders, so a file it would leave out is named here and the load refused
(`check_every_file_read`), never trained without."""

import os

from datasets.load import infer_module_for_data_files_list

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
