"""RoundsConfig: what a run of DPO rounds does, as a plain dataclass. The sampling options keep TRL GRPOConfig's
names (num_generations, max_completion_length, temperature, top_p, reward_weights) and TRL's missing_eos_penalty."""

import math
from dataclasses import asdict, dataclass, field
from typing import Any

REFERENCES = ("initial", "previous")
NO_PAIR_CHOICES = ("stop", "skip")
DEFAULT_PROMPTS_PER_BATCH = 8
# The highest sampling temperature taken. Neither TRL nor transformers bound it, but past a few units a sample is a
# draw from (near) the uniform distribution over the vocabulary: SmolLM2-135M-Instruct's next-token entropy on the
# arithmetic prompts is 58% of the uniform's at 2, 97.5% at 5 and 99.4% at 10 (its greedy token's probability 0.68,
# 0.002, 0.0002), docs/rounds.md. inf and 1e30 would sample noise and pair it.
MAX_TEMPERATURE = 10.0
# Options that came after runs were recorded: at these values settings.json leaves them out, as it did before.
RECIPE_DEFAULTS = {"prompts_per_round": None, "pairs_per_prompt": 1, "pair_rule": "best", "dynamic_sampling": False,
                   "max_num_gen_batches": 0, "skip_saturated": 0, "round_max_steps": None}
PAIR_RULES = ("best", "every")  # pairs.py: the best against the k worst, or every better against every worse


class RoundsError(ValueError):
    """One line naming what went wrong: the round, the reward function, the setting."""


@dataclass
class RoundsConfig:
    """`training` holds DPOMinConfig's keyword arguments for each round's DPO pass (output_dir is set per round);
    `peft_config` trains a LoRA adapter across the rounds instead of every weight."""

    output_dir: str
    rounds: int = 3
    num_generations: int = 4
    max_completion_length: int = 256
    temperature: float | list[float] = 1.0  # one value, or one per round (schedule.round_temperature)
    top_p: float = 1.0
    reward_weights: list[float] | None = None
    missing_eos_penalty: float | None = None
    min_margin: float = 0.0
    # The recipes' options (docs/rounds.md); at their defaults each round does what it did before they came, and
    # settings() leaves them out, so that a run from before them resumes.
    prompts_per_round: int | None = None  # None: every training prompt each round; else a fresh draw (schedule.py)
    pairs_per_prompt: int = 1  # the best sample against each of this many worst (pairs.py); with "every", the cap
    pair_rule: str = "best"  # or "every": every sample against every lower-scored one, pairs_per_prompt at most
    # Where a round's samples go (draws.py): DAPO's dynamic sampling, a round drawing more prompts until
    # prompts_per_round of them gave a pair, at most max_num_gen_batches generate() calls (verl's name; 0: no cap but
    # the pool); GRESO's skipping, a prompt whose last skip_saturated draws gave no pair drawn less (0: off).
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 0
    skip_saturated: int = 0
    # Each round's DPO pass stopped at exactly this many optimizer steps, one count per round (its pairs cycled over
    # more epochs, or cut within the first): a control at equal steps (benchmarks/compare_rounds_pay.py). None: the
    # pass runs training's epochs.
    round_max_steps: list[int] | None = None
    reference: str = "initial"
    on_no_pairs: str = "stop"
    held_out_share: float = 0.0
    # Completions per generate() call, as TRL GRPOConfig's: generation_batch_size / num_generations prompts, each with
    # all its samples. None: DEFAULT_PROMPTS_PER_BATCH prompts' worth.
    generation_batch_size: int | None = None
    seed: int = 42
    training: dict[str, Any] = field(default_factory=dict)
    peft_config: Any = None

    def __post_init__(self):
        for name in ("rounds", "num_generations", "max_completion_length"):
            if getattr(self, name) < 1:
                raise RoundsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise RoundsError(f"num_generations must be >= 2 to make a pair, got {self.num_generations}")
        size = self.generation_batch_size
        if size is not None and (size < 1 or size % self.num_generations):
            raise RoundsError(f"generation_batch_size must be a positive multiple of num_generations "
                              f"({self.num_generations}): it counts completions, as TRL GRPOConfig's; got {size}")
        self._check_temperature()
        for name in ("prompts_per_round", "pairs_per_prompt"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RoundsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise RoundsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.held_out_share < 1:
            raise RoundsError(f"held_out_share must be in [0, 1), got {self.held_out_share}")
        # A NaN or infinite weight or penalty makes every total NaN: every sample would tie with itself.
        if self.reward_weights is not None and not all(math.isfinite(weight) for weight in self.reward_weights):
            raise RoundsError(f"reward_weights must be finite numbers, got {self.reward_weights}")
        if self.missing_eos_penalty is not None and not math.isfinite(self.missing_eos_penalty):
            raise RoundsError(f"missing_eos_penalty must be a finite number, got {self.missing_eos_penalty}")
        if not (math.isfinite(self.min_margin) and self.min_margin >= 0):
            raise RoundsError(f"min_margin must be a finite number >= 0, got {self.min_margin}")
        if self.pair_rule not in PAIR_RULES:
            raise RoundsError(f"pair_rule must be one of {PAIR_RULES}, got {self.pair_rule!r}")
        self._check_draws()
        self._check_round_max_steps()
        if self.reference not in REFERENCES:
            raise RoundsError(f"reference must be one of {REFERENCES}, got {self.reference!r}")
        if self.on_no_pairs not in NO_PAIR_CHOICES:
            raise RoundsError(f"on_no_pairs must be one of {NO_PAIR_CHOICES}, got {self.on_no_pairs!r}")
        if "output_dir" in self.training:
            raise RoundsError("training: drop output_dir, each round trains under output_dir/round-K/train")
        if "reference_mode" in self.training:
            raise RoundsError("training: drop reference_mode, the rounds name each round's reference from `reference`")
        evaluation = self.training.get("eval_strategy", "no")
        if getattr(evaluation, "value", evaluation) != "no":  # a text, or TrainingArguments' IntervalStrategy
            raise RoundsError(f"training: drop eval_strategy {evaluation!r}, a round's DPO pass has no held-out pairs "
                              "(held_out_share holds out prompts, scored after each round)")

    @property
    def prompts_per_batch(self) -> int:
        """Prompts per generate() call: generation_batch_size counts their completions."""
        if self.generation_batch_size is None:
            return DEFAULT_PROMPTS_PER_BATCH
        return self.generation_batch_size // self.num_generations

    def _check_draws(self) -> None:
        for name in ("max_num_gen_batches", "skip_saturated"):
            if getattr(self, name) < 0:
                raise RoundsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dynamic_sampling and self.prompts_per_round is None:
            raise RoundsError("dynamic_sampling draws more prompts until prompts_per_round of them gave a pair: set "
                              "prompts_per_round (unset, every prompt is sampled each round and none is left to draw)")
        if self.max_num_gen_batches and not self.dynamic_sampling:
            raise RoundsError("max_num_gen_batches caps the generate() calls of dynamic sampling: add "
                              "dynamic_sampling, or drop it")
        first = -(-(self.prompts_per_round or 0) // self.prompts_per_batch)  # the round's first draw, in batches
        if self.max_num_gen_batches and self.max_num_gen_batches < first:
            raise RoundsError(f"max_num_gen_batches {self.max_num_gen_batches} is less than the {first} generate() "
                              f"call(s) of prompts_per_round {self.prompts_per_round} ({self.prompts_per_batch} "
                              "prompts a call): raise it, or leave it 0 for no cap")

    def _check_round_max_steps(self) -> None:
        steps = self.round_max_steps
        if steps is None:
            return
        if len(steps) != self.rounds:
            raise RoundsError(f"round_max_steps has {len(steps)} values for {self.rounds} rounds: give one per round")
        if not all(isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in steps):
            raise RoundsError(f"round_max_steps must be whole numbers >= 0 (a round's optimizer steps), got {steps}")
        if self.training.get("max_steps", -1) > 0:
            raise RoundsError("round_max_steps sets each round's max_steps: drop max_steps from training")

    def trains_no_step(self, round_index: int) -> bool:
        """Round K is given 0 steps: the control at equal steps of a round that trained none (it had no pair)."""
        return self.round_max_steps is not None and self.round_max_steps[round_index - 1] == 0

    def round_training(self, round_index: int) -> dict[str, Any]:
        """Round K's DPO pass options: `training`, with its round_max_steps count as max_steps (Trainer then runs
        as many epochs over the round's pairs as the steps take, the last one cut) when they are given."""
        if self.round_max_steps is None or self.trains_no_step(round_index):  # 0: no pass is built to run
            return self.training
        return {**self.training, "max_steps": self.round_max_steps[round_index - 1]}

    def _check_temperature(self) -> None:
        """One value for every round, or exactly one per round; a list of one is that value (the command's
        `--temperature 0.7` is a list), so settings.json records it as before."""
        if isinstance(self.temperature, (list, tuple)):
            values = [float(value) for value in self.temperature]
            if len(values) not in (1, self.rounds):
                raise RoundsError(f"temperature has {len(values)} values for {self.rounds} rounds: give one value, or "
                                  "one per round (a resume that adds rounds needs a temperature for each)")
            self.temperature = values[0] if len(values) == 1 else values
        values = self.temperature if isinstance(self.temperature, list) else [self.temperature]
        if not all(math.isfinite(value) and value <= MAX_TEMPERATURE for value in values):
            raise RoundsError(f"temperature must be a finite number <= {MAX_TEMPERATURE:g}, got {self.temperature}: "
                              f"at {MAX_TEMPERATURE:g} a sample is already close to a uniform draw over the vocabulary")
        if not all(value > 0 for value in values):
            raise RoundsError(f"temperature must be > 0, got {self.temperature}")

    def settings(self) -> dict[str, Any]:
        """What a resume must share with the run it continues: everything but the number of rounds (a run may be
        extended) and the output folder itself."""
        values = {name: value for name, value in asdict(self).items()
                  if name not in ("rounds", "output_dir", "peft_config")
                  and not (name in RECIPE_DEFAULTS and value == RECIPE_DEFAULTS[name])}
        values["peft_config"] = None if self.peft_config is None else _plain(self.peft_config.to_dict())
        # As completions, whether given or left to the default: the same batches are the same run.
        values["generation_batch_size"] = self.prompts_per_batch * self.num_generations
        return values


def _plain(value: Any) -> Any:
    """A peft config's dict as JSON holds it (sets as sorted lists, enums as their values)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        items = [_plain(item) for item in value]
        return sorted(items, key=str) if isinstance(value, set) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(getattr(value, "value", value))
