"""The options of `python -m dpo_min.train --rounds N` (DPO in rounds, train/rounds/ runs it), a group of the
command's parser. The sampling options keep TRL GRPOConfig's names; the defaults are RoundsConfig's, read from it.
Each round's DPO pass takes the command's training options (learning_rate, loss_type, beta, LoRA, ...)."""

from dataclasses import MISSING, dataclass, field, fields

from ..rounds.config import NO_PAIR_CHOICES, PAIR_RULES, REFERENCES, RoundsConfig

_DEFAULT = {option.name: option.default for option in fields(RoundsConfig) if option.default is not MISSING}

# The output folder of a rounds run when --output_dir is not given: not the offline run's, which a rounds run
# refuses to write into (and the other way round).
ROUNDS_COMMAND_DEFAULTS = {"output_dir": "dpo_min_rounds"}


@dataclass
class RoundsArguments:
    _argument_group_name = "DPO in rounds (--rounds N; docs/rounds.md)"

    rounds: int | None = field(default=None, metadata={
        "help": "Run N rounds of DPO on the policy's own samples: each round samples --num_generations completions "
                "of every --dataset prompt (a prompt-only file or folder), scores them with --reward_funcs, pairs "
                "the best against the worst and trains one DPO pass on the pairs. With no --model and no data: the "
                "demo on the embedded arithmetic pool. Run the same command again to resume."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions in TRL GRPOTrainer's contract: module:function (or TRL's module.function, or a "
                "name in trl.rewards such as accuracy_reward), the working folder importable; or a reward model's "
                "folder or hub id (sequence classification). Several are summed, weighted by --reward_weights. "
                "Default for the embedded prompts: dpo_min.rounds.arithmetic:last_integer_reward."})
    reward_weights: list[float] | None = field(default=None, metadata={
        "help": "One weight per reward function (TRL GRPOConfig's); default all 1."})
    num_generations: int = field(default=_DEFAULT["num_generations"], metadata={
        "help": "Completions sampled per prompt each round (TRL GRPOConfig's; RLHFlow Online-RLHF, Online-DPO-R1 and "
                "DPO-VP sample 8)."})
    max_completion_length: int = field(default=_DEFAULT["max_completion_length"], metadata={
        "help": "Most new tokens of a sampled completion (TRL GRPOConfig's)."})
    temperature: list[float] = field(default_factory=lambda: [_DEFAULT["temperature"]], metadata={
        "help": "Sampling temperature: one value for every round, or one per round (0.7 1.0 1.2 for three rounds), "
                "raised over the rounds as DPO-VP does."})
    top_p: float = field(default=_DEFAULT["top_p"], metadata={"help": "Nucleus sampling's top_p."})
    missing_eos_penalty: float | None = field(default=None, metadata={
        "help": "TRL's: a completion cut by --max_completion_length (no EOS) loses this much reward."})
    min_margin: float = field(default=_DEFAULT["min_margin"], metadata={
        "help": "A prompt's pair is dropped (and counted) when its best reward minus its worst is under this."})
    reference: str = field(default=_DEFAULT["reference"], metadata={
        "help": "The DPO reference: initial (pi_0, as RLHFlow Online-RLHF keeps it; with LoRA the adapter switched "
                "off) or previous (the last round's policy, as Self-Rewarding, SPIN, TR-DPO arXiv 2404.09656 and "
                "Online-DPO-R1). Each round's DPO pass takes --loss_type: sigmoid sft adds the NLL term on the chosen "
                "answer (Iterative RPO arXiv 2404.19733, DPOP arXiv 2402.13228).", "choices": list(REFERENCES)})
    prompts_per_round: int | None = field(default=None, metadata={
        "help": "Sample a fresh draw of N training prompts each round (RLHFlow Online-RLHF, Online-DPO-R1: a new "
                "prompt set each iteration): seeded by --seed and the round, without replacement until the pool is "
                "used up, then a new pass over it; held-out prompts are never drawn. Default: every prompt, every "
                "round."})
    pairs_per_prompt: int = field(default=_DEFAULT["pairs_per_prompt"], metadata={
        "help": "Pair each prompt's best sample against each of its K worst (GroupDPO, arXiv 2604.15602: more than "
                "one pair per prompt); a worst of the best's text, of an earlier pair's, tied with the best or under "
                "--min_margin makes no pair. Default 1: best against worst. With --pair_rule every: the most pairs a "
                "prompt gives."})
    pair_rule: str = field(default=_DEFAULT["pair_rule"], metadata={
        "help": "best: each prompt's best sample against its --pairs_per_prompt worst. every: every sample against "
                "every lower-scored one (a 0/1 reward: every right answer against every wrong one), each pair of "
                "texts once, widest margins first, spread over the samples, --pairs_per_prompt at most a prompt.",
        "choices": list(PAIR_RULES)})
    dynamic_sampling: bool = field(default=_DEFAULT["dynamic_sampling"], metadata={
        "help": "DAPO's dynamic sampling (verl's filter_groups): a round sets aside the prompts whose samples give no "
                "pair (all alike) and draws further training prompts, seeded, never held-out, never twice in a "
                "round, until --prompts_per_round prompts gave a pair or --max_num_gen_batches is spent. Every "
                "completion sampled counts in the round's samples. Needs --prompts_per_round."})
    max_num_gen_batches: int = field(default=_DEFAULT["max_num_gen_batches"], metadata={
        "help": "With --dynamic_sampling: the most generate() calls (of --generation_batch_size completions) a round "
                "makes, its first draw's included (verl's name; 0: no cap but the training prompts, which a policy "
                "whose samples all tie would sample whole)."})
    skip_saturated: int = field(default=_DEFAULT["skip_saturated"], metadata={
        "help": "GRESO's pre-sampling skip: a training prompt whose last N draws in a row gave no pair is skipped "
                "with probability 1 - 2^-(streak - N + 1) (1/2, then 3/4, ...), seeded; the round draws another in "
                "its place. Read from the rounds' samples.jsonl, so a resume skips alike. 0: off."})
    round_max_steps: list[int] | None = field(default=None, metadata={
        "help": "Run each round's DPO pass for exactly this many optimizer steps, one count per round (12 9 24 for "
                "three rounds): the round's pairs cycled over more epochs, or cut within the first; a control at "
                "equal steps (0: the round trains no step, as a round with no pair). Default: --num_train_epochs over "
                "the round's pairs."})
    on_no_pairs: str = field(default=_DEFAULT["on_no_pairs"], metadata={
        "help": "A round where every prompt's samples tie: stop there, or skip to the next round.",
        "choices": list(NO_PAIR_CHOICES)})
    generation_batch_size: int | None = field(default=_DEFAULT["generation_batch_size"], metadata={
        "help": "Completions per generate() call, as TRL GRPOConfig's: a multiple of --num_generations (each prompt "
                "of a call with all its samples). Default: 8 prompts' worth (8 x --num_generations)."})

    # The options named on the line or in the recipe (set by args.parse_with_rounds): a round's DPO pass takes
    # those of the training options, and DPOMinConfig's defaults for the rest.
    given: frozenset[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self):
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")


# Trainer keeps the checkpoint its evaluations rated best; a round's DPO pass has none (no held-out pairs): Trainer's
# advice, to match --eval_strategy to --save_strategy, is one --rounds refuses.
LOAD_BEST_WITH_ROUNDS = ("--load_best_model_at_end is not supported with --rounds (a round's DPO pass has no held-out "
                         "pairs to rate its checkpoints by; the held-out prompts, --eval_fraction, are scored after "
                         "each round: held_out.jsonl)")


def without_rounds(rounds_args: RoundsArguments, named: set[str]) -> str | None:
    """Why the options are refused when a rounds option is given without --rounds (it would change nothing)."""
    given = sorted(named & {option.name for option in fields(RoundsArguments)} - {"rounds"})
    if rounds_args.rounds is None and given:
        return f"{given[0]} is an option of DPO in rounds: add --rounds N (docs/rounds.md)"
    return None
