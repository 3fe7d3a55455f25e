"""The command's output folder: locked for the whole run, written in a staging sibling, published by renames.

For `--output_dir runs/a` the files beside it are
- `runs/a.lock`: an OS lock (flock) held by the run's main process from start to end; the kernel drops it when the
  process dies, however it dies, so a second run into `runs/a` learns that a live run holds the folder;
- `runs/a.partial`: the run writes here; an interrupted run's checkpoints stay here for `--resume_from_checkpoint`;
- `runs/a.replaced`: the earlier run, for the moment between the two renames that publish a new one.
Each run folder holds `MANIFEST`, the list of the files the run wrote: a later run replaces the folder only when it
holds nothing else, and deletes exactly those files.
A symbolic link is followed once, when the folder is named: the real folder is locked, staged beside and published,
so the link keeps pointing at the newest run, and nothing is ever deleted through a link.
"""

import fcntl
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..files import write_whole, writing
from .args import OutputDirError
from .resume import resolve_checkpoint

MANIFEST = "dpo_min_run.json"
STAGING_SUFFIX, BACKUP_SUFFIX, LOCK_SUFFIX = ".partial", ".replaced", ".lock"


class RunFolder:
    """`output_dir` and its siblings. Only the main process of a run locks, prepares, publishes and discards."""

    def __init__(self, output_dir: str | os.PathLike):
        self.named = Path(output_dir)  # as the user wrote it: the name a card or hub repo takes
        _check_name_lengths(self.named)
        try:
            self.output_dir = _real_folder(self.named)
            _check_name_lengths(self.output_dir)
            self._check_place()
        except OSError as error:  # a path longer than the system takes (ENAMETOOLONG), a loop of links (ELOOP)
            raise OutputDirError(f"--output_dir {_abbreviated(self.named)}: {error.strerror}") from None
        name = self.output_dir.name
        self.staging = self.output_dir.with_name(name + STAGING_SUFFIX)
        self.backup = self.output_dir.with_name(name + BACKUP_SUFFIX)
        self.lock_path = self.output_dir.with_name(name + LOCK_SUFFIX)
        for sibling in (self.staging, self.backup, self.lock_path):
            if sibling.is_symlink():  # writing or deleting there would reach the link's target
                raise OutputDirError(f"{sibling} is a symbolic link; remove it (dpo_min writes there)")
        self._lock_file = None
        self._made_parents: list[Path] = []
        self._begun = False  # the staging folder is this run's (to discard after a failure)

    def _check_place(self) -> None:
        """Refuse a folder that is a file, the working folder, or above it (replacing it would delete the caller)."""
        resolved, here = self.output_dir.resolve(), Path.cwd().resolve()
        if not self.output_dir.name or resolved == here or here.is_relative_to(resolved):
            raise OutputDirError(f"--output_dir {self.named} is the working folder or above it; name a new "
                                 "folder for the run")
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise OutputDirError(f"--output_dir {self.named} is a file")

    def check_apart_from(self, data: Iterable[tuple[str, str]]) -> None:
        """Refuse a run whose output would become its data, before anything is written: an output folder inside a
        dataset folder (a later run on that folder reads the run's files, training_curves.png included), or a
        dataset inside the output folder or its staging sibling (the publish replaces it). `data`: (the option
        that names it, a local file or folder)."""
        mine = [path.resolve() for path in (self.output_dir, self.staging)]
        for option, name in data:
            source = Path(name).resolve()
            if source.is_dir() and mine[0].is_relative_to(source):
                raise OutputDirError(f"--output_dir {self.shown} is inside the dataset folder {name} ({option}): "
                                     "a later run on that folder would read this run's files as data; write the "
                                     "run elsewhere")
            if any(source.is_relative_to(folder) for folder in mine):
                raise OutputDirError(f"{option} {name} is inside --output_dir {self.shown}, which the run replaces; "
                                     "move the data or write the run elsewhere")

    @property
    def shown(self) -> str:
        """The folder as named, and where it really is when a link leads elsewhere."""
        return str(self.named) if self.named == self.output_dir else f"{self.named} (-> {self.output_dir})"

    @contextmanager
    def claimed(self, is_main: bool, resumes_here: bool, resume_from: str | None = None) -> Iterator[str | None]:
        """The folder for one run; yields the checkpoint to resume from (`resume_from`, --resume_from_checkpoint:
        `latest` -> the newest whole one of the interrupted run; None for a new run). The main process locks and
        checks it (`prepare`) on entry and releases it on exit; a failure after `begin` discards the staging folder
        (its checkpoints kept). The other processes of a run neither lock nor look: the main one may have made the
        folder."""
        if is_main:
            self.lock()
        try:
            if is_main:
                self.prepare(resumes_here)
            yield resolve_checkpoint(resume_from, self.staging, warn=print if is_main else _quiet)
        except BaseException as error:
            if self._begun:  # a stop by a signal says in its own line what is kept
                self.discard(say=not isinstance(error, KeyboardInterrupt))
            raise
        finally:
            self.release()

    # ---- the lock -----------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take `<output_dir>.lock`, or raise naming the live run that holds it."""
        parent = self.output_dir.parent
        missing = [folder for folder in [parent, *parent.parents] if not folder.exists()]
        file = None
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self._made_parents.insert(0, folder)
            while True:
                file = open(self.lock_path, "a+")  # noqa: SIM115 - held open for the whole run
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    file.seek(0)
                    holder = file.read().strip() or "?"
                    file.close()
                    self._remove_parents()
                    raise OutputDirError(f"--output_dir {self.shown}: a live run (pid {holder}) holds it "
                                         f"({self.lock_path}); wait for it to end or choose another folder") from None
                # The holder before us may have unlinked the file between our open and our flock: then we hold a
                # lock on a file no one else will find, and must take the one at the path.
                if os.path.exists(self.lock_path) and os.fstat(file.fileno()).st_ino == os.stat(self.lock_path).st_ino:
                    break
                file.close()
            file.seek(0)
            file.truncate()
            file.write(f"{os.getpid()}\n")
            file.flush()
        except OSError as error:  # a read-only folder or file system, a parent that is a file, a full disk
            if file is not None and not file.closed:  # locked, but the pid did not fit: the file goes, as in release
                self.lock_path.unlink(missing_ok=True)
                with suppress(OSError):  # closing flushes the pid again, into the same full disk
                    file.close()
            self._remove_parents()
            raise OutputDirError(f"--output_dir {self.shown}: cannot write in "
                                 f"{Path(error.filename or self.lock_path).parent}: {error.strerror}") from None
        self._lock_file = file

    def release(self) -> None:
        """Drop the lock and its file (unlinked while held, so no other run ever takes a stale path)."""
        if self._lock_file is None:
            return
        self.lock_path.unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None
        self._remove_parents()

    def _remove_parents(self) -> None:
        for folder in self._made_parents:  # only the ones this run made, and only while empty
            try:
                folder.rmdir()
            except OSError:
                break
        self._made_parents = []

    # ---- before the run -----------------------------------------------------------------------------------------
    def prepare(self, resumes_here: bool) -> None:
        """Under the lock: finish a publish a kill cut short, then check the folder and the interrupted run, which
        only a run that resumes it (`Plan.resumes_here`) may reuse."""
        self._recover()
        foreign = self.foreign_files(self.output_dir)
        if foreign:
            raise OutputDirError(f"--output_dir {self.shown} holds files that are not a dpo_min run's "
                                 f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose another "
                                 "folder")
        if self.staging.exists() and not resumes_here:
            if read_manifest(self.staging).get("complete"):
                raise OutputDirError(f"{self.staging} holds a finished run that was not published; move it to "
                                     f"{self.output_dir} or delete it")
            raise OutputDirError(f"{self.staging} holds an interrupted run: delete it, or resume it with "
                                 "--resume_from_checkpoint latest")

    def _recover(self) -> None:
        """A kill between the renames of `publish` left the earlier run at the backup name: put it back, or drop it
        once the new run is in place."""
        if not self.backup.exists():
            return
        if self.output_dir.exists():
            _remove_run(self.backup)
        else:
            os.replace(self.backup, self.output_dir)

    @staticmethod
    def foreign_files(folder: Path) -> list[str]:
        """Files under `folder` that its manifest does not list (all of them when it has none)."""
        if not folder.is_dir():
            return []
        present = sorted(str(path.relative_to(folder)) for path in _walk(folder))
        listed = set(read_manifest(folder).get("files", []))
        # No run writes a link: one inside the folder is the user's, and deleting the run's files must not follow it.
        links = sorted(str(path.relative_to(folder)) for path in _walk(folder, links=True) if path.is_symlink())
        return links + [name for name in present if name not in listed and name not in links and name != MANIFEST]

    def begin(self, settings: dict[str, Any]) -> None:
        """Create the staging folder (or reuse the interrupted run's) and record its `resume_settings` (a resumed run
        keeps the interrupted run's record)."""
        with writing(f"{MANIFEST} to {self.staging}"):
            self.staging.mkdir(exist_ok=True)
            self._begun = True
            manifest = read_manifest(self.staging)
            manifest.setdefault("data_settings", settings)
            _write_json(self.staging / MANIFEST, {**manifest, "complete": False})

    # ---- after the run ------------------------------------------------------------------------------------------
    def publish(self) -> None:
        """Make the finished staging folder `output_dir` with renames only: earlier run -> backup, staging -> name,
        then delete the backup. SIGTERM and SIGINT wait until the renames are done; after a SIGKILL the next run's
        `prepare` completes or undoes them."""
        with writing(f"{MANIFEST} to {self.staging}"):
            self._publish()

    def _publish(self) -> None:
        manifest = read_manifest(self.staging)
        manifest["files"] = sorted(str(path.relative_to(self.staging)) for path in _walk(self.staging)
                                   if path.name != MANIFEST)
        _write_json(self.staging / MANIFEST, {**manifest, "complete": True})
        with _signals_deferred():
            foreign = self.foreign_files(self.output_dir)  # again: something may have been added during the run
            if foreign:
                raise OutputDirError(f"--output_dir {self.shown} gained files during the run ({foreign[0]}); "
                                     f"the run is kept in {self.staging}")
            if self.output_dir.exists():
                os.replace(self.output_dir, self.backup)
            os.replace(self.staging, self.output_dir)
            if self.backup.exists():
                _remove_run(self.backup)

    def discard(self, say: bool = True) -> None:
        """After a failure: drop the staging folder, unless it holds checkpoints to resume from or a finished run."""
        if not self.staging.exists():
            return
        if any(self.staging.glob("checkpoint-*")) or read_manifest(self.staging).get("complete"):
            if say:
                print(f"checkpoints of the interrupted run kept in {self.staging}", file=sys.stderr)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)


# ---- helpers ------------------------------------------------------------------------------------------------------
def _quiet(text: str) -> None:
    """The other processes of a run: the main one says it."""


def _real_folder(named: Path) -> Path:
    """`named` with every symbolic link on its way followed (the path as written when there is none). A link that
    leads nowhere is refused: the run would create a folder at a place the user did not name."""
    real = Path(os.path.realpath(named))
    for path in [named, *named.parents]:
        if path.is_symlink() and not path.exists():
            where = f"--output_dir {named}" + (f": {path}" if path != named else "")
            raise OutputDirError(f"{where} is a symbolic link to {os.readlink(path)}, which does not exist; create "
                                 "that folder or remove the link")
    return named if str(real) == os.path.abspath(named) else real


def _check_name_lengths(folder: Path) -> None:
    """Refuse a name the file system cannot hold, the run folder's with the longest suffix the run gives a sibling
    (`.replaced`): else the run would fail at its lock, or at the publish after training."""
    existing = next((parent for parent in folder.parents if os.path.isdir(parent)), Path("."))
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    last = len(folder.parts) - 1
    for index, part in enumerate(folder.parts):
        most = limit - len(BACKUP_SUFFIX) if index == last else limit
        if len(os.fsencode(part)) > most:
            why = f"a name takes at most {limit} bytes here" + (
                f", a run folder's {most} (the run names a sibling <name>{BACKUP_SUFFIX})" if index == last else "")
            raise OutputDirError(f"--output_dir {_abbreviated(folder)}: the name {_abbreviated(Path(part))} is "
                                 f"{len(os.fsencode(part))} bytes long; {why}")


def _abbreviated(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]} ({len(text)} characters)"


def _walk(folder: Path, links: bool = False) -> Iterator[Path]:
    """The files under `folder` (links to folders are not entered); with `links`, the folders' entries too."""
    for root, folders, files in os.walk(folder):
        for name in files + (folders if links else []):
            yield Path(root) / name


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _write_json(path: Path, value: Any) -> None:
    write_whole(path, json.dumps(value, indent=1) + "\n")


def _remove_run(folder: Path) -> None:
    """Delete the files `folder`'s manifest lists, then the folders left empty; anything else stays, with a note."""
    real = os.path.realpath(folder)
    for name in read_manifest(folder).get("files", []):
        path = folder / name
        if os.path.realpath(path.parent) == os.path.join(real, os.path.dirname(name)).rstrip(os.sep):
            path.unlink(missing_ok=True)  # a file whose folder is reached through a link stays
    (folder / MANIFEST).unlink(missing_ok=True)
    for root, _, _ in sorted(os.walk(folder), key=lambda entry: -len(entry[0])):
        with suppress(OSError):
            os.rmdir(root)
    if folder.exists():
        print(f"kept {folder}: it holds files no dpo_min run wrote", file=sys.stderr)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block ends, then deliver them: the renames are never cut in between."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {number: signal.signal(number, lambda number, frame: received.append(number))
                for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in received:
            os.kill(os.getpid(), number)
