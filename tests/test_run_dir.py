"""The output folder: nothing but a run's own files is ever deleted, one live run per folder, a kill at any moment
of a publish leaves a whole run under the name, and only whole checkpoints resume a run."""

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, write_hh_rows
from safetensors.torch import save_file

from dpo_min import train as train_command
from dpo_min.models import cache_dir
from dpo_min.train import main, run_dir
from dpo_min.train.resume import checkpoint_problems, resolve_checkpoint
from dpo_min.train.run_dir import MANIFEST, OutputDirError, RunFolder

FORK = multiprocessing.get_context("fork")
# Options with which a run on 12 pairs goes through (so that, without the checks, it would reach the replace).
RUNNABLE = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--eval_fraction", "0.25", "--num_samples", "0",
            "--disable_tqdm", "true"]


def write_run(folder: Path, files: dict[str, str]) -> Path:
    """A finished run of ours in `folder`'s staging sibling, published with its manifest."""
    run = RunFolder(folder)
    run.begin({"per_device_train_batch_size": 2})
    for name, text in files.items():
        (run.staging / name).parent.mkdir(parents=True, exist_ok=True)
        (run.staging / name).write_text(text)
    run.publish()
    return folder


def tree(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): path.read_text() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ---- 1. only a run's own files are deleted --------------------------------------------------------------------
def test_a_folder_with_a_metrics_file_and_other_files_is_refused_and_kept(tmp_path, capsys, tiny_model_dir):
    folder = tmp_path / "p"
    (folder / "s").mkdir(parents=True)
    (folder / "metrics.json").write_text("{}")
    (folder / "keep.txt").write_text("k")
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(folder), *RUNNABLE])
    assert code == 2
    assert "holds files that are not a dpo_min run's (keep.txt, metrics.json)" in one_error_line(capsys)
    assert tree(folder) == {"keep.txt": "k", "metrics.json": "{}"} and (folder / "s").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["p", "pairs.jsonl"]


@pytest.mark.parametrize("name", [".", ".."])
def test_the_working_folder_or_above_is_a_usage_error(tmp_path, capsys, monkeypatch, tiny_model_dir, name):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for folder in (work, tmp_path):
        (folder / "metrics.json").write_text("{}")
    data = write_hh_rows(work / "pairs.jsonl", 12)
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", name, *RUNNABLE])
    assert code == 2
    assert f"--output_dir {name} is the working folder or above it" in one_error_line(capsys)
    assert sorted(os.listdir(work)) == ["metrics.json", "pairs.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["metrics.json", "work"]


def test_replacing_a_run_removes_exactly_the_files_its_manifest_lists(tmp_path):
    folder = write_run(tmp_path / "run", {"a.txt": "old", "checkpoint-1/x.bin": "old"})
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["files"] == ["a.txt", "checkpoint-1/x.bin"] and manifest["complete"] is True
    write_run(folder, {"b.txt": "new"})
    assert tree(folder) == {"b.txt": "new", MANIFEST: (folder / MANIFEST).read_text()}
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no backup, staging or lock left

    (folder / "notes.txt").write_text("mine")  # a file no run wrote: the folder is no longer ours to replace
    with pytest.raises(OutputDirError, match=r"holds files that are not a dpo_min run's \(notes.txt\)"):
        RunFolder(folder).prepare(False)
    run = RunFolder(folder)
    run.begin({})
    (run.staging / "c.txt").write_text("newer")
    with pytest.raises(OutputDirError, match="gained files during the run"):
        run.publish()
    assert (folder / "notes.txt").read_text() == "mine" and (run.staging / "c.txt").exists()


# ---- 2. one live run per folder ---------------------------------------------------------------------------------
def hold_lock(output_dir, ready, stop):
    run = RunFolder(output_dir)
    run.lock()
    run.begin({})
    (run.staging / "checkpoint-2").mkdir()
    ready.set()
    stop.wait(60)
    run.release()


@pytest.mark.parametrize("resume", [[], ["--resume_from_checkpoint", "latest"]], ids=["new", "resume-latest"])
def test_a_second_run_into_a_live_runs_folder_says_so_and_touches_nothing(tmp_path, capsys, resume):
    ready, stop = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=hold_lock, args=(tmp_path / "run", ready, stop))
    holder.start()
    try:
        assert ready.wait(60)
        before = tree(tmp_path)
        code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "run"), *resume])
        assert code == 2
        assert f"a live run (pid {holder.pid}) holds it" in one_error_line(capsys)
        assert tree(tmp_path) == before and (tmp_path / "run.partial" / "checkpoint-2").is_dir()
    finally:
        stop.set()
        holder.join()
    assert sorted(os.listdir(tmp_path)) == ["run.partial"]  # the holder dropped its lock file
    RunFolder(tmp_path / "run").lock()  # and the lock is free again


def test_the_lock_of_a_killed_run_is_free(tmp_path):
    ready, stop = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=hold_lock, args=(tmp_path / "run", ready, stop))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    run = RunFolder(tmp_path / "run")
    run.lock()  # the kernel released the dead process's lock; its stale file is reused
    run.release()
    assert not (tmp_path / "run.lock").exists()


def test_two_commands_started_together_publish_one_run_and_the_other_says_why(tmp_path, tiny_model_dir):
    data = write_hh_rows(tmp_path / "pairs.jsonl", 8)
    argv = [sys.executable, "-m", "dpo_min.train", "--model", str(tiny_model_dir), "--dataset", str(data),
            "--output_dir", str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--eval_fraction", "0", "--num_samples", "0", "--disable_tqdm", "true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Started together, both reach the lock within a second of each other; the winner holds it for its whole run.
    processes = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    results = sorted((process.returncode, *output) for process, output in zip(processes, outputs))
    (ok_code, ok_out, ok_err), (refused_code, refused_out, refused_err) = results
    assert ok_code == 0, ok_err[-2000:]
    assert refused_code == 2 and "a live run (pid" in refused_err.strip().splitlines()[-1]
    assert "wrote" in ok_out and "wrote" not in refused_out
    assert sorted(os.listdir(tmp_path)) == ["pairs.jsonl", "run"]
    assert json.loads((tmp_path / "run" / MANIFEST).read_text())["complete"] is True


def test_an_unwritable_parent_is_one_line(tmp_path, capsys, monkeypatch):
    # Tests run as root, for whom chmod does not forbid writing: the refusal the OS would give is injected.
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(run_dir, "open", refuse, raising=False)
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "sub" / "run")])
    assert code == 2
    assert f"cannot write in {tmp_path / 'sub'}: Permission denied" in one_error_line(capsys)
    assert not os.listdir(tmp_path)  # the parent it made for the lock is gone again


class FullDisk:
    """A file whose writes reach a full disk when flushed, as a small write does (the buffer takes it)."""

    def __init__(self, file):
        self.file = file

    def __getattr__(self, name):
        return getattr(self.file, name)

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_for_the_locks_pid_is_one_line_and_leaves_no_lock_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_dir, "open", lambda *args, **kwargs: FullDisk(open(*args, **kwargs)),  # noqa: SIM115
                        raising=False)
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "sub" / "run")])
    assert code == 2
    assert f"cannot write in {tmp_path / 'sub'}: No space left on device" in one_error_line(capsys)
    assert not os.listdir(tmp_path)  # neither the lock file nor the parent made for it


def test_an_output_folder_name_too_long_for_the_file_system_is_one_line_before_anything(tmp_path, capsys):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    # The reference: the file system itself refuses the longest sibling the run would name for a folder one byte
    # over, and takes it for the longest name accepted.
    longest = limit - len(run_dir.BACKUP_SUFFIX)
    with pytest.raises(OSError) as refused:
        (tmp_path / ("x" * (longest + 1) + run_dir.BACKUP_SUFFIX)).mkdir()
    assert refused.value.errno == errno.ENAMETOOLONG
    (tmp_path / ("x" * longest + run_dir.BACKUP_SUFFIX)).mkdir()
    (tmp_path / ("x" * longest + run_dir.BACKUP_SUFFIX)).rmdir()
    RunFolder(tmp_path / ("x" * longest))
    for name in ("x" * (longest + 1), "x" * 300, "x" * 300 + "/run"):
        code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / name)])
        assert code == 2
        size = len(name.split("/")[0])
        assert (f"the name {'x' * 40}...{'x' * 12} ({size} characters) is {size} bytes long; a name takes at most "
                f"{limit} bytes here") in one_error_line(capsys)
        assert not os.listdir(tmp_path)


# ---- 3. a kill at any moment of a publish -----------------------------------------------------------------------
def publish_and_die(output_dir, step, signal_number):
    signal.signal(signal.SIGTERM, train_command._stop)  # as the command's cli()
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def kill(reached):
        if reached == step:
            os.kill(os.getpid(), signal_number)

    run = RunFolder(output_dir)
    run.lock()
    run.begin({})
    (run.staging / "weights.txt").write_text("new")
    # The kill comes right after one of publish's steps: the two renames and the old run's removal.
    renames = {(run.output_dir, run.backup): "backup", (run.staging, run.output_dir): "rename"}
    replace, remove_run = os.replace, run_dir._remove_run

    def replace_then_kill(source, target):
        replace(source, target)
        kill(renames.get((Path(source), Path(target))))

    def remove_then_kill(folder):
        remove_run(folder)
        kill("cleanup" if Path(folder) == run.backup else None)
    os.replace, run_dir._remove_run = replace_then_kill, remove_then_kill  # a forked child: its own modules
    try:
        run.publish()
    finally:
        run.release()


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["SIGKILL", "SIGTERM", "SIGINT"])
@pytest.mark.parametrize("step", ["backup", "rename", "cleanup"])
def test_a_kill_during_publish_leaves_one_whole_run_under_the_name(tmp_path, step, signal_number):
    output_dir = write_run(tmp_path / "run", {"weights.txt": "old", "checkpoint-1/state.json": "old"})
    child = FORK.Process(target=publish_and_die, args=(output_dir, step, signal_number))
    child.start()
    child.join()
    if signal_number == signal.SIGKILL:
        assert child.exitcode == -signal.SIGKILL
    else:  # SIGTERM and Ctrl-C wait for the renames: the new run is published, then the process stops
        assert child.exitcode != 0
        assert tree(output_dir)["weights.txt"] == "new" and not (tmp_path / "run.replaced").exists()
    # Whatever the moment, the next run into the folder (which takes the lock first) finds one whole run under the
    # name, and the new one is either that run or whole in the staging folder.
    run = RunFolder(output_dir)
    run.lock()
    with pytest.raises(OutputDirError) if (tmp_path / "run.partial").exists() else _nothing():
        run.prepare(False)
    run.release()
    published = tree(output_dir)
    assert json.loads(published.pop(MANIFEST))["complete"] is True
    if published == {"weights.txt": "new"}:
        assert sorted(os.listdir(tmp_path)) == ["run"]
    else:
        assert step == "backup" and published == {"weights.txt": "old", "checkpoint-1/state.json": "old"}
        assert tree(tmp_path / "run.partial")["weights.txt"] == "new"
        assert json.loads((tmp_path / "run.partial" / MANIFEST).read_text())["complete"] is True
        assert sorted(os.listdir(tmp_path)) == ["run", "run.partial"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- 4. only whole checkpoints resume --------------------------------------------------------------------------
def write_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    save_file({"lora_A": torch.zeros(2, 2)}, folder / "adapter_model.safetensors")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"state": torch.ones(3)}, folder / name)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return folder


def test_latest_takes_the_newest_whole_checkpoint_and_names_the_skipped_ones(tmp_path):
    staging = tmp_path / "run.partial"
    for step in (2, 4, 6):
        write_checkpoint(staging / f"checkpoint-{step}")
    (staging / "checkpoint-6" / "optimizer.pt").unlink()
    (staging / "checkpoint-4" / "scheduler.pt").write_bytes((staging / "checkpoint-4" / "scheduler.pt")
                                                            .read_bytes()[:-30])
    warnings = []
    assert resolve_checkpoint("latest", staging, warn=warnings.append) == str(staging / "checkpoint-2")
    assert warnings == ["--resume_from_checkpoint latest: skipped incomplete checkpoint-6 (no optimizer.pt); "
                        "checkpoint-4 (scheduler.pt is truncated)"]
    assert checkpoint_problems(staging / "checkpoint-2") == []


def test_the_folder_phase_finds_the_checkpoint_to_resume_under_its_lock(tmp_path, capsys):
    # issue 57: the folder, claimed, yields the newest whole checkpoint of its interrupted run (the skipped ones named
    # by the main process alone), and a new run gets None.
    folder = RunFolder(tmp_path / "run")
    for step in (2, 4):
        write_checkpoint(folder.staging / f"checkpoint-{step}")
    (folder.staging / "checkpoint-4" / "optimizer.pt").unlink()
    with folder.claimed(is_main=True, resumes_here=True, resume_from="latest") as checkpoint:
        assert checkpoint == str(folder.staging / "checkpoint-2")
        assert folder.lock_path.exists()  # found under the lock
    assert capsys.readouterr().out == ("--resume_from_checkpoint latest: skipped incomplete checkpoint-4 (no "
                                       "optimizer.pt)\n")
    with folder.claimed(is_main=False, resumes_here=True, resume_from="latest") as checkpoint:
        assert checkpoint == str(folder.staging / "checkpoint-2")
    assert capsys.readouterr().out == ""  # the other processes of a run find it too, and say nothing
    with RunFolder(tmp_path / "new").claimed(is_main=True, resumes_here=False) as checkpoint:
        assert checkpoint is None


@pytest.mark.parametrize("damage, problem", [
    (lambda c: (c / "optimizer.pt").unlink(), "no optimizer.pt"),
    (lambda c: (c / "scheduler.pt").unlink(), "no scheduler.pt"),
    (lambda c: (c / "rng_state.pth").unlink(), "no rng_state.pth"),
    (lambda c: (c / "trainer_state.json").write_text('{"global_'), "trainer_state.json is truncated"),
    (lambda c: (c / "adapter_model.safetensors").write_bytes((c / "adapter_model.safetensors").read_bytes()[:-4]),
     "adapter_model.safetensors is truncated"),
    (lambda c: (c / "adapter_model.safetensors").unlink(), "no model weights"),
    (lambda c: None, "no such folder"),
    # Trainer's save_only_model layout: it was "incomplete: no optimizer.pt, ...", without naming the option
    (lambda c: [(c / name).unlink() for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth")],
     "was saved with --save_only_model: it holds the weights alone, no optimizer state, so it cannot resume a run: "
     "train from its weights in a new run, or save checkpoints without --save_only_model to resume"),
], ids=["optimizer", "scheduler", "rng", "state", "weights-truncated", "weights", "missing", "save_only_model"])
def test_an_explicit_incomplete_checkpoint_is_one_line_before_the_model_loads(tmp_path, capsys, damage, problem):
    checkpoint = tmp_path / "old.partial" / "checkpoint-2"
    if problem != "no such folder":
        write_checkpoint(checkpoint)
    damage(checkpoint)
    # The model path does not exist: the checkpoint is refused before anything tries to load it.
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "run"),
                 "--resume_from_checkpoint", str(checkpoint)])
    assert code == 2
    assert f"--resume_from_checkpoint {checkpoint}" in (line := one_error_line(capsys)) and problem in line
    assert "run.partial" not in os.listdir(tmp_path)


# ---- 6. a resumed run reaches the same pairs -------------------------------------------------------------------
def test_resuming_with_another_batch_size_is_refused_naming_both_values(tmp_path, capsys):
    run = RunFolder(tmp_path / "run")
    settings = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "world_size": 1, "max_steps": 8,
                "num_train_epochs": 3.0, "seed": 42, "data_seed": None}
    run.begin(settings)
    write_checkpoint(run.staging / "checkpoint-2")
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "run"), "--max_steps", "8",
                 "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                 "--resume_from_checkpoint", "latest"])
    assert code == 2
    line = one_error_line(capsys)
    assert "per_device_train_batch_size 2 -> 4, gradient_accumulation_steps 1 -> 2" in line
    assert json.loads((run.staging / MANIFEST).read_text())["data_settings"] == settings  # the record stays
    assert (run.staging / "checkpoint-2").is_dir()
    # With the interrupted run's values the same checkpoint passes the checks and goes on to the (missing) model.
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "run"), "--max_steps", "8",
                 "--per_device_train_batch_size", "2", "--resume_from_checkpoint", "latest"])
    assert code == 1 and "no-model" in capsys.readouterr().err.strip().splitlines()[-1]


# ---- 5. symbolic links: followed once, never deleted through --------------------------------------------------
def test_a_link_to_a_run_publishes_into_the_real_folder_and_keeps_the_link(tmp_path, capsys, tiny_model_dir):
    runs = tmp_path / "runs"
    runs.mkdir()
    write_run(runs / "run-1", {"weights.txt": "old"})
    (runs / "latest").symlink_to("run-1", target_is_directory=True)
    assert RunFolder(runs / "latest").lock_path == RunFolder(runs / "run-1").lock_path == runs / "run-1.lock"
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(runs / "latest"),
                 "--use_peft", *RUNNABLE])
    assert code == 0, capsys.readouterr().err
    assert "kept" not in capsys.readouterr().err
    assert sorted(os.listdir(runs)) == ["latest", "run-1"] and os.readlink(runs / "latest") == "run-1"
    published = os.listdir(runs / "run-1")
    assert "weights.txt" not in published and "adapter_model.safetensors" in published  # the new run, whole
    assert "\n# latest\n" in (runs / "run-1" / "README.md").read_text()  # named as the user named the folder


def test_a_run_into_the_real_folder_waits_for_a_run_through_its_link(tmp_path):
    (tmp_path / "run-1").mkdir()
    (tmp_path / "latest").symlink_to("run-1")
    holder = RunFolder(tmp_path / "latest")
    holder.lock()
    try:
        with pytest.raises(OutputDirError, match="a live run"):
            RunFolder(tmp_path / "run-1").lock()
    finally:
        holder.release()


def test_a_link_to_a_foreign_folder_is_refused_and_the_folder_kept(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "out").symlink_to(tmp_path / "mine")
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "out")])
    assert code == 2
    line = one_error_line(capsys)
    assert f"--output_dir {tmp_path / 'out'} (-> {tmp_path / 'mine'}) holds files that are not" in line
    assert tree(tmp_path / "mine") == {"notes.txt": "mine"} and sorted(os.listdir(tmp_path)) == ["mine", "out"]


def test_a_link_inside_a_run_folder_is_foreign_and_nothing_is_deleted_through_it(tmp_path):
    folder = write_run(tmp_path / "run", {"a.txt": "old", "checkpoint-1/x.bin": "old"})
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.bin").write_text("precious")
    (folder / "checkpoint-1" / "x.bin").unlink()
    (folder / "checkpoint-1").rmdir()
    (folder / "checkpoint-1").symlink_to(outside, target_is_directory=True)  # the listed file now lies outside
    with pytest.raises(OutputDirError, match=r"holds files that are not a dpo_min run's \(checkpoint-1\)"):
        RunFolder(folder).prepare(False)
    run_dir._remove_run(folder)  # and even asked to delete the run, the file behind the link stays
    assert (outside / "x.bin").read_text() == "precious" and (folder / "checkpoint-1").is_symlink()


def test_a_dangling_link_is_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "latest").symlink_to(tmp_path / "run-2")
    code = main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "latest")])
    assert code == 2
    assert (f"--output_dir {tmp_path / 'latest'} is a symbolic link to {tmp_path / 'run-2'}, which does not exist"
            in one_error_line(capsys))
    assert sorted(os.listdir(tmp_path)) == ["latest"]  # no folder, staging or lock made through it


# ---- a run never reads its own output as data (issue 25) -----------------------------------------------------------
def data_options(tmp_path: Path, form: str, data: Path) -> list[str]:
    """`data` named by --dataset or by a recipe's mixture in the given form."""
    if form == "--dataset":
        return ["--dataset", str(data)]
    text = {"datasets": f"datasets:\n- path: {data}\n",
            "datasets.data_files": f"datasets:\n- path: json\n  data_files: {{train: [{data}]}}\n",
            "dataset_mixture": f"dataset_mixture:\n  datasets:\n  - id: {data}\n",
            "dataset_mixer": f"dataset_mixer:\n  {data}: 1.0\n"}[form]
    (tmp_path / "recipe.yaml").write_text(text)
    return ["--config", str(tmp_path / "recipe.yaml")]


@pytest.mark.parametrize("form", ["--dataset", "datasets", "dataset_mixture", "dataset_mixer"])
def test_an_output_folder_inside_a_dataset_folder_is_refused_before_anything_is_written(tmp_path, capsys, form):
    data = tmp_path / "data"
    data.mkdir()
    write_hh_rows(data / "pairs.jsonl", 4)
    given = data_options(tmp_path, form, data)
    output_dir = data / "runs" / "a"  # nested: the parents the lock would make count as written too
    before = sorted(os.listdir(tmp_path))
    # No model exists: a run that got past the check would fail on it instead.
    code = main(["--model", str(tmp_path / "no-model"), *given, "--output_dir", str(output_dir), *RUNNABLE])
    assert code == 2
    option = {"--dataset": "--dataset", "datasets": "datasets[0].path", "dataset_mixture":
              "dataset_mixture.datasets[0].id", "dataset_mixer": "dataset_mixer"}[form]
    assert one_error_line(capsys) == (f"python -m dpo_min.train: error: --output_dir {output_dir} is inside the "
                                      f"dataset folder {data} ({option}): a later run on that folder would read "
                                      "this run's files as data; write the run elsewhere")
    assert sorted(os.listdir(data)) == ["pairs.jsonl"] and sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("form", ["--dataset", "datasets.data_files", "dataset_mixer"])
def test_a_dataset_inside_the_output_folder_is_refused_before_anything_is_written(tmp_path, capsys, form):
    output_dir = write_run(tmp_path / "a", {"samples.jsonl": "{}\n"})  # an earlier run's own file, as data
    data = output_dir / "samples.jsonl"
    given = data_options(tmp_path, form, data)
    earlier, before = tree(output_dir), sorted(os.listdir(tmp_path))
    code = main(["--model", str(tmp_path / "no-model"), *given, "--output_dir", str(output_dir), *RUNNABLE])
    assert code == 2
    option = {"--dataset": "--dataset", "datasets.data_files": "datasets[0].data_files",
              "dataset_mixer": "dataset_mixer"}[form]
    assert f"{option} {data} is inside --output_dir {output_dir}, which the run replaces" in one_error_line(capsys)
    assert tree(output_dir) == earlier and sorted(os.listdir(tmp_path)) == before


def test_a_dataset_beside_the_output_folder_is_not_refused(tmp_path):
    data = write_hh_rows(tmp_path / "pairs.jsonl", 4)
    RunFolder(tmp_path / "runs" / "a").check_apart_from([("--dataset", str(data)), ("--dataset", str(tmp_path / "d"))])
    # ... while the same folder named through a link is seen for what it is
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(OutputDirError, match="inside the dataset folder"):
        RunFolder(tmp_path / "runs" / "a").check_apart_from([("--dataset", str(tmp_path / "link"))])


# ---- a full disk (issue 25): one line naming what and where, the earlier run and whole checkpoints kept -----------
def fail_on_call(number: int, error: BaseException, real, wanted=lambda *args: True):
    """`real`, except that its `number`-th wanted call raises `error` (a write the disk has no room for)."""
    calls = []

    def write(*args, **kwargs):
        if wanted(*args):
            calls.append(args)
            if len(calls) == number:
                raise error
        return real(*args, **kwargs)
    return write


NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words
DISK_FULL = {  # where the write fails -> (what to patch, the save that fails, what the run names, extra options)
    "final weights": ("safetensors", 1, "no space left on device writing the final weights to {staging}",
                      ["--save_strategy", "no"]),
    "checkpoint weights": ("safetensors", 2, "no space left on device writing checkpoint-2 to {staging}",
                           ["--save_strategy", "steps", "--save_steps", "1"]),
    "checkpoint optimizer": ("torch", 2, "could not write checkpoint-2 to {staging} ([enforce fail at "
                             "inline_container.cc:672] . unexpected pos 576 vs 534): is the disk full?",
                             ["--save_strategy", "steps", "--save_steps", "1"]),
    "reference cache": ("torch cache", 1, "could not write the reference log-probs to their cache ({cache}) ([enforce "
                        "fail at inline_container.cc:672] . unexpected pos 576 vs 534): is the disk full?",
                        ["--save_strategy", "no", "--precompute_ref_log_probs", "true"]),
    # a text file is written to its staging name (dpo_min.files), then renamed
    "card": (".README.md.writing", 1, "no space left on device writing README.md to {staging}",
             ["--save_strategy", "no"]),
    # issue 30: the first run file (before the model loads), and a failing or read-only disk, not only a full one
    "first run file": (f".{MANIFEST}.writing", 1, "no space left on device writing dpo_min_run.json to {staging}",
                       ["--save_strategy", "no"]),
    "metrics, failing disk": (".metrics.json.writing EIO", 1,
                              "could not write metrics.json to {staging}: Input/output error",
                              ["--save_strategy", "no"]),
    "card, read-only": (".README.md.writing EROFS", 1,
                        "could not write README.md to {staging}: Read-only file system",
                        ["--save_strategy", "no"]),
}


@pytest.mark.parametrize("where", DISK_FULL)
def test_a_full_disk_is_one_line_and_the_earlier_run_and_whole_checkpoints_stay(tmp_path, capsys, monkeypatch,
                                                                                 tiny_model_dir, where):
    import pathlib

    import safetensors.torch
    from safetensors import SafetensorError

    patched, failing_call, message, extra = DISK_FULL[where]
    output_dir = write_run(tmp_path / "a", {"adapter_model.safetensors": "earlier", "README.md": "earlier card"})
    earlier = tree(output_dir)
    if patched == "safetensors":  # every save_file (transformers', peft's) goes through it
        monkeypatch.setattr(safetensors.torch, "serialize_file", fail_on_call(
            failing_call, SafetensorError(NO_SPACE), safetensors.torch.serialize_file))
    elif patched.startswith("torch"):  # torch's zip writer on a full disk says no more than this
        def wanted(obj, file, *rest):  # the checkpoint's optimizer.pt, or the cache's open temporary file
            return str(file).endswith("optimizer.pt") if patched == "torch" else not isinstance(file, (str, Path))
        monkeypatch.setattr(torch, "save", fail_on_call(
            failing_call, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
            torch.save, wanted))
    else:  # a text file: its name, and the errno its write fails with (ENOSPC unless named)
        name, _, code = patched.partition(" ")
        number = getattr(errno, code or "ENOSPC")
        monkeypatch.setattr(pathlib.Path, "write_text", fail_on_call(
            failing_call, OSError(number, os.strerror(number)), pathlib.Path.write_text,
            lambda path, *rest: path.name == name))
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(output_dir), "--use_peft",
                 *RUNNABLE, *extra])
    assert code == 1
    staging = tmp_path / "a.partial"
    # stderr less transformers' progress bars ("Loading weights: 100%|...| 21/21 [00:00<...]")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]
    expected = message.format(staging=staging, cache=cache_dir() / "ref_logps")
    assert lines[-1] == f"python -m dpo_min.train: error: {expected}"
    assert tree(output_dir) == earlier
    if "steps" in extra:  # the checkpoint before the full disk stays, whole, to resume from; the cut one is gone
        assert sorted(os.listdir(staging)) == ["checkpoint-1", MANIFEST] and not checkpoint_problems(
            staging / "checkpoint-1")
        assert lines[:-1] == [f"checkpoints of the interrupted run kept in {staging}"]
    else:
        assert not staging.exists() and len(lines) == 1
    assert sorted(os.listdir(tmp_path)) == ["a", *(["a.partial"] if "steps" in extra else []), "pairs.jsonl"]


def test_latest_names_save_only_model_when_its_checkpoints_are_all_there_is(tmp_path, capsys, monkeypatch,
                                                                             tiny_model_dir):
    import safetensors.torch
    from safetensors import SafetensorError

    # A run with --save_only_model cut after checkpoint-1 (its second save meets a full disk): Trainer's own layout.
    monkeypatch.setattr(safetensors.torch, "serialize_file", fail_on_call(
        2, SafetensorError(NO_SPACE), safetensors.torch.serialize_file))
    data = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    argv = ["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(tmp_path / "a"),
            "--use_peft", *RUNNABLE, "--save_strategy", "steps", "--save_steps", "1", "--save_only_model", "true"]
    assert main(argv) == 1
    capsys.readouterr()
    staging = tmp_path / "a.partial"
    assert checkpoint_problems(staging / "checkpoint-1") == ["saved with --save_only_model: no optimizer state"]
    monkeypatch.undo()
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 2
    assert one_error_line(capsys) == (
        f"python -m dpo_min.train: error: --resume_from_checkpoint latest: no whole checkpoint in {staging} "
        "(incomplete: checkpoint-1 (saved with --save_only_model: no optimizer state)); a checkpoint saved with "
        "--save_only_model holds the weights alone, no optimizer state, so it cannot resume a run: train from its "
        "weights in a new run, or save checkpoints without --save_only_model to resume")
