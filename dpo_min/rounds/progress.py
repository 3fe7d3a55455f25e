"""What a rounds run shows while it works: a labelled progress bar for each phase that takes more than a moment
(the held-out greedy pass, a round's sampling, scoring and DPO pass), on the main process, following the training
options' disable_tqdm as the DPO pass's own bar does. Sampling a round takes minutes on a CPU; without these,
nothing is printed meanwhile."""

from tqdm.auto import tqdm
from transformers import ProgressCallback


def phase_bar(label: str, total: int, unit: str, hidden: bool) -> tqdm:
    """A bar for one phase (on several processes, this process's share of it); gone once the phase ends, its
    result then said in a line of its own."""
    return tqdm(total=total, desc=label, unit=unit, leave=False, dynamic_ncols=True, disable=hidden)


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
