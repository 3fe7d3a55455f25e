"""Writing a file whole: the package's one way to put a single file where a reader (a resume, a user, another process)
may look: the command's metrics, card, plot and run records, the reference log-prob cache, the rounds' files. The
bytes go to a hidden sibling first and are renamed onto the name: a rename within a folder is atomic, so a kill or a
full disk leaves the old file or the new one, never part of one, and no temporary behind.

The writers that do not come through here, each for its reason (tests/test_files.py fails on any other):
- a folder staged and renamed by its owner: the run folder and its lock (`train/run_dir.py`), a checkpoint around
  Trainer's own save (`checkpoints.py`), a converted .gguf model (`models.py`: a temporary folder per process, for
  several may convert the same file at once);
- files written inside the run's staging folder, which is published whole: the trained weights
  (`train/finish.py`), the completions appended at each evaluation (`train/report.py`);
- a plot drawn onto the staged path its caller hands it (`train/report.py`, `rounds/held_out.py`, `rounds/spend.py`);
- a bad reference cache entry moved aside, not written (`ref_cache.py`);
- the rounds' save that every process joins and only the main one, inside `staged`, writes (`rounds/policy.py`)."""

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

# A full disk or quota: the errors the command and the rounds name in one line ("no space left on device writing X").
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Writes the machine refuses: a full disk or quota, a file system read-only (or remounted so after an error), a
# failing disk, a file over the system's size limit.
WRITE_FAULTS = (*NO_SPACE, errno.EROFS, errno.EIO, errno.EFBIG)
_WRITING = "dpo_min_writing"  # the attribute `writing` puts on an error: what the failed writer was writing


def write_fault(error: BaseException) -> int | None:
    """The WRITE_FAULTS errno of an OSError, or in the words of safetensors' Rust writer ("... (os error 28)")."""
    if isinstance(error, OSError) and error.errno in WRITE_FAULTS:
        return error.errno
    text = str(error)
    number = next((int(found) for found in re.findall(r"\(os error (\d+)\)", text)), None)
    if number in WRITE_FAULTS:
        return number
    return next((number for number in NO_SPACE if os.strerror(number) in text), None)


def write_failure(error: BaseException, where: str) -> str | None:
    """The one line that names a write the machine refused (`where`: "what to where"), or None when `error` is no
    such failure. The command's offline phases and the rounds both ask here, so a full disk
    reads alike in either."""
    text = str(error)
    fault = write_fault(error)
    # torch's zip writer says only "unexpected pos N vs M" (or "file write failed") when a write comes up short.
    short_write = "PytorchStreamWriter" in text or "unexpected pos" in text
    if fault is None and not short_write:
        return None
    if fault in NO_SPACE:
        return f"no space left on device writing {where}"
    if fault is not None:
        return f"could not write {where}: {os.strerror(fault)}"
    return f"could not write {where} ({text.strip().splitlines()[0]}): is the disk full?"


@contextmanager
def writing(what: str) -> Iterator[None]:
    """The writer names itself: an error raised inside the block carries `what` it was writing ("what to where"),
    for the caller that turns a write fault into one line (`write_failure`, `named_write`) to say, rather than guess
    it from the functions the error passed. A writer inside another keeps its own name: the innermost is the one that
    failed."""
    try:
        yield
    except Exception as error:
        if named_write(error) is None:
            with suppress(AttributeError, TypeError):  # an exception type that takes no attributes stays unnamed
                setattr(error, _WRITING, what)
        raise


def named_write(error: BaseException) -> str | None:
    """What the writer that raised `error` was writing (`writing`), or None where no writer named itself."""
    return getattr(error, _WRITING, None)


def staging_path(path: str | os.PathLike) -> Path:
    """The hidden sibling `path` is staged at, `.<name>.writing` (a writer that reads the format from the name, as
    matplotlib does, is told the format). One name per target, not per process: each file has one writer (a run's
    main process), and a writer killed before its rename leaves a staging that the next write of the same name
    clears, rather than one left behind for good."""
    path = Path(path)
    return path.with_name(f".{path.name}.writing")


@contextmanager
def staged(path: str | os.PathLike) -> Iterator[Path]:
    """Yields where to write `path` (a file, or a folder a writer fills); renamed onto `path` when the block ends,
    replacing what was there (a folder too), and removed when the block raises. A writer that wrote nothing there
    leaves `path` as it was."""
    path = Path(path)
    staging = staging_path(path)
    _remove(staging)  # a killed writer's
    try:
        yield staging
        if not staging.exists() and not staging.is_symlink():  # the writer found nothing to write
            return
        if path.is_dir() and not path.is_symlink():  # os.replace does not replace a folder that holds files
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        _remove(staging)
        raise


def _remove(staging: Path) -> None:
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.unlink(missing_ok=True)


def write_whole(path: str | os.PathLike, data: str | bytes) -> None:
    """`data` (text as UTF-8) into `path`, whole or not at all."""
    with staged(path) as staging:
        if isinstance(data, bytes):
            staging.write_bytes(data)
        else:
            staging.write_text(data, encoding="utf-8")
