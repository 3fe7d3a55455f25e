"""A round in one line, as the run prints it after the round (rounds.jsonl keeps the figures): its samples (what it
spent), its pairs, where the samples went, its reward, its DPO pass."""

from typing import Any

from .spend import describe


def no_pair_message(line: dict[str, Any]) -> str:
    # on_no_pairs is a setting a resume must share: the way on is another folder, not the same one with 'skip'.
    reasons = ", ".join(f"{count} {reason}" for reason, count in line["dropped"].items() if count)
    return (f"round {line['round']}: no prompt gave a pair ({reasons}); the run stopped there (on_no_pairs='stop') "
            "and stops there again when resumed: to go on, start another output_dir with settings that give pairs "
            "(more num_generations, a higher temperature, another reward, or on_no_pairs='skip')")


def summary(line: dict[str, Any]) -> str:
    dropped = ", ".join(f"{count} {reason}" for reason, count in line["dropped"].items() if count) or "none"
    # Where the samples went (spend.py): the round's prompts by outcome, those skipped and drawn to refill.
    text = f"round {line['round']}: {_count(line['samples'], 'sample')}, {_count(line['pairs'], 'pair')} " \
           f"(dropped: {dropped}); {describe(line)}"
    if line["reward_mean"] is not None:
        text += f", reward mean {line['reward_mean']:.3f} (best {line['reward_best']:.3f}, worst " \
                f"{line['reward_worst']:.3f})"
    if line["status"] == "no pair: stop":
        return f"{text}; {no_pair_message(line)}"
    if line["status"] == "no step: round_max_steps 0":
        return f"{text}; no step (round_max_steps 0), round skipped"
    if line["status"] != "trained":
        return f"{text}; no pair, round skipped (on_no_pairs='skip')"
    dpo = line["dpo"]
    shown = (("loss", "loss", ".4f"), ("reward accuracy", "rewards/accuracies", ".2f"),
             ("margin", "rewards/margins", "+.4f"))
    figures = [f"{name} {dpo[key]:{form}}" for name, key, form in shown if key in dpo]
    return f"{text}; DPO: {_count(dpo['steps'], 'step')}{', mean ' + ', '.join(figures) if figures else ''}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
