"""What a rounds run shows while it works: a labelled progress bar for each phase that takes more than a moment
(the held-out greedy pass, a round's sampling, scoring and DPO pass), on the main process, following the training
options' disable_tqdm as the DPO pass's own bar does. Sampling a round takes minutes on a CPU; without these,
nothing is printed meanwhile."""

from typing import Any

from tqdm.auto import tqdm
from transformers import ProgressCallback
from transformers.generation.streamers import BaseStreamer


def phase_bar(label: str, total: int, unit: str, hidden: bool) -> tqdm:
    """A bar for one phase (on several processes, this process's share of it); gone once the phase ends, its
    result then said in a line of its own."""
    return tqdm(total=total, desc=label, unit=unit, leave=False, dynamic_ncols=True, disable=hidden)


class TokenSteps(BaseStreamer):
    """`model.generate`'s streamer as a sign of life: a batch of prompts takes minutes on busy cores, and the bar
    counts prompts, so its postfix counts the batch's new tokens ("token 17/64") and the bar moves at each one."""

    def __init__(self, bar: tqdm, max_new_tokens: int):
        self.bar, self.max_new_tokens, self.tokens = bar, max_new_tokens, -1

    def put(self, value: Any) -> None:
        self.tokens += 1  # generate puts the prompt first, then each new token
        if self.tokens:
            self.bar.set_postfix_str(f"token {self.tokens}/{self.max_new_tokens}")

    def end(self) -> None:
        self.tokens = -1


class RoundBar(ProgressCallback):
    """Trainer's progress bar, labelled with the round, without its lines of logged dicts (rounds.jsonl keeps the
    metrics)."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def on_train_begin(self, args, state, control, **kwargs):
        # ProgressCallback's, with the label given as the bar is made: a bar prints itself when made.
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, desc=self.label, dynamic_ncols=True)
        self.current_step = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass
