"""Rounds that spend their samples where the policy is unsure against one offline pass at equal samples, by the
protocol rounds-pay-2026-12-06, fixed before its seeds run (issue 56 item 5): every arm scored on the same held-out
prompts of the arithmetic pool, one greedy completion each, right or wrong, prompt by prompt.

    python benchmarks/compare_rounds_pay.py --protocol benchmarks/protocols/rounds-pay-2026-12-06.json --seed 509 \\
        --out runs/pay1206-509 --json benchmarks/results/rounds-pay-2026-12-06/seed-509.json
    python benchmarks/compare_rounds_pay.py --table benchmarks/results/rounds-pay-2026-12-06/seed-*.json

The arms of one seed (its held-out split, draws and sampling seeds are the command's for that --seed):
- pi_0: the model as loaded, the rounds' own score before round 1 (the same in every rounds arm: checked);
- rounds_pay, rounds_plain: `python -m dpo_min.train --rounds N` with the protocol's options and the arm's own, as
  the command makes it (compare_rounds.rounds_arm);
- offline_pay (equal sampled completions): pi_0 sampled on rounds_pay's generate() calls as each round's draw records
  them (every call's prompts and seed, set-aside prompts included, the round's temperature), the same pair rule in
  groups, pooled, ONE pass of the same training options; its round 1 is rounds_pay's, token for token (recorded);
- offline_pay_matched: offline_pay's pairs for exactly rounds_pay's total optimizer steps;
- plain_matched: rounds_plain's options with `--round_max_steps` at rounds_pay's steps, round by round.
Each arm writes under --out (the rounds arms' folders are the command's run folders) and its figures to
--out/ARM.json once it finished: a rerun reuses them, and resumes a rounds arm that was stopped. A seed file records
the protocol's digest and the rounds arms' arguments; `--table` reads the protocol and refuses, in one line, a file
not run under it (benchmarks/seed_files.py), or whose controls were not run at rounds_pay's steps and samples.
The paired statistics are benchmarks/paired.py's.
"""

import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_rounds import (
    POOL_OPTIONS,
    demo_options,
    held_out_outcomes,
    interval,
    one_pass,
    pass_args,
    print_comparisons,
    render,
    rounds_arm,
    rounds_figures,
    sample_like_the_rounds,
    scored_groups,
)
from paired import exact_mcnemar, seed_permutation_test, sign_flip_floor
from seed_files import SeedFileForm, protocol_digest, read_seeds, recorded_argv, refuse, run_or_table

ARMS = ("pi_0", "rounds_pay", "rounds_plain", "offline_pay", "offline_pay_matched", "plain_matched")
ROUNDS_ARMS = ("rounds_pay", "rounds_plain", "plain_matched")
# Where a round's samples went (rounds.jsonl's draw, its pairs and steps), as the seed file and the table give it.
SPEND = ("prompts", "all_right", "all_wrong", "mixed", "skipped", "refills", "gen_batches", "pairs", "steps",
         "completions")
ALPHA = 0.05


def seed_argv(protocol: dict, seed: int, out: Path = Path("compare_rounds_pay")) -> dict[str, list[str]]:
    """The rounds arms' arguments for one seed of the protocol (its seed files record them, `--table` checks them)."""
    return {arm: ["--rounds", str(protocol["rounds"]), "--seed", str(seed), *demo_options(), *POOL_OPTIONS,
                  *protocol["options"], *options, "--output_dir", str(out / arm)]
            for arm, options in protocol["arm_options"].items()}


def matched_argv(plain: list[str], steps: list[int], out: Path) -> list[str]:
    """plain_matched's arguments: rounds_plain's, each round's DPO pass at `steps` of that round."""
    return [*plain[:-2], "--round_max_steps", *map(str, steps), "--output_dir", str(out / "plain_matched")]


def finished(path: Path, make: Callable[[], dict]) -> dict:
    """An arm's figures: read back when an earlier call finished the arm, else made, timed and written whole."""
    if path.exists():
        return json.loads(path.read_text())
    from dpo_min.files import write_whole

    start = time.perf_counter()
    figures = make()
    figures["seconds"] = round(time.perf_counter() - start)
    write_whole(path, json.dumps(figures))
    return figures


def spend(line: dict) -> dict:
    """One round's line (rounds.jsonl) as SPEND counts it: where its samples went, its pairs, steps and samples."""
    draw = line["draw"]
    return {"prompts": line["prompts"], **{key: draw[key] for key in SPEND[1:7]}, "pairs": line["pairs"],
            "steps": line.get("dpo", {}).get("steps", 0), "completions": line["samples"]}


def rounds_run(argv: list[str]) -> dict:
    """A rounds arm: the command's run of `argv`, its held-out outcomes (pi_0's too) and its spend round by round."""
    on = rounds_arm(argv)
    figures = rounds_figures(on)
    kept = ("right", "changed", "steps", "outcomes", "pi0_outcomes", "held_rows")
    return {**{key: figures[key] for key in kept}, "rounds": [spend(line) for line in on["result"].rounds]}


def task(plan, config) -> tuple:
    """pi_0 and its tokenizer as the command loads them, the prompts, the rounds' held-out rows and the reward."""
    from dpo_min.rounds import Rewards
    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.rounds.prompts import prompt_rows, split_held_out
    from dpo_min.train import load_model
    from dpo_min.train.rounds import load_prompts

    model, tokenizer, _, _ = load_model(plan)
    rows = prompt_rows(load_prompts(plan))
    held_rows = split_held_out(len(rows), config.held_out_share, config.seed)[1]
    return model, tokenizer, rows, held_rows, Rewards([last_integer_reward])


def pi0_round(model, tokenizer, rows, config, rewards, draw: dict, round_index: int) -> list[dict]:
    """pi_0's scored samples of one round of a rounds run: each of its generate() calls as its draw records it (the
    call's prompts and seed, the round's temperature), made again, one call each."""
    from dpo_min.rounds.sampling import GenerationSettings

    settings = GenerationSettings(config.num_generations, config.max_completion_length, True, draw["temperature"],
                                  config.top_p)
    indices = [i for batch in draw["batches"] for i in batch["prompts"]]
    prompt_ids = render(tokenizer, rows, indices, config)
    groups = [group for batch in draw["batches"]
              for group in sample_like_the_rounds(model, tokenizer, prompt_ids, batch["prompts"],
                                                  replace(settings, seed=batch["seed"]), config.prompts_per_batch)]
    return scored_groups(rows, indices, prompt_ids, groups, rewards, round_index)


def offline_pay(plan, config, pay: Path, folder: Path) -> dict:
    """(c): pi_0 on rounds_pay's calls round by round, paired as the rounds pair, pooled, one pass; its samples and
    pairs kept under `folder` (offline_pay_matched trains on the pairs)."""
    from dpo_min.rounds import make_pairs
    from dpo_min.rounds.pairs import keep_trainable
    from dpo_min.rounds.spend import outcomes
    from dpo_min.rounds.store import read_jsonl, write_jsonl
    from dpo_min.tokenizing import end_token_ids

    model, tokenizer, rows, held_rows, rewards = task(plan, config)
    args, pool, per_round, firsts = pass_args(config, folder / "train"), [], [], []
    for line in read_jsonl(pay / "rounds.jsonl"):
        groups = pi0_round(model, tokenizer, rows, config, rewards, line["draw"], line["round"])
        samples = [{"prompt_index": g["prompt_index"], **sample} for g in groups for sample in g["samples"]]
        (folder / f"round-{line['round']}").mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / f"round-{line['round']}" / "samples.jsonl", samples)
        made = make_pairs(groups, config.min_margin, config.pairs_per_prompt, config.pair_rule, args.listwise)[0]
        made = keep_trainable(made, tokenizer, args, end_token_ids(model, tokenizer))[0]
        pool += made
        per_round.append({"prompts": len(groups), **outcomes(samples), "skipped": None, "refills": None,
                          "gen_batches": len(line["draw"]["batches"]), "pairs": len(made), "steps": None,
                          "completions": len(samples)})
        firsts = firsts or [sample["completion_ids"] for sample in samples]
    write_jsonl(folder / "pairs.jsonl", pool)
    trained, steps = one_pass(plan, config, pool, None, folder / "train")
    pay_first = [row["completion_ids"] for row in read_jsonl(pay / "round-1" / "samples.jsonl")]
    return {"rounds": per_round, "pairs": len(pool), "steps": steps, "round_1_as_rounds_pay": firsts == pay_first,
            "held_rows": held_rows, "outcomes": held_out_outcomes(trained, tokenizer, rows, held_rows, config, rewards)}


def offline_pay_matched(plan, config, pairs: Path, steps: int, folder: Path) -> dict:
    """offline_pay's pairs trained for exactly `steps` optimizer steps (rounds_pay's, all rounds), cycled or cut."""
    from dpo_min.rounds.store import read_jsonl

    _, tokenizer, rows, held_rows, rewards = task(plan, config)
    trained, taken = one_pass(plan, config, read_jsonl(pairs), steps, folder / "train")
    return {"max_steps": steps, "steps": taken, "held_rows": held_rows,
            "outcomes": held_out_outcomes(trained, tokenizer, rows, held_rows, config, rewards)}


def run_seed(protocol: dict, seed: int, out: Path) -> dict:
    if seed not in protocol["seeds"]:
        sys.exit(f"seed {seed} is not one of the protocol's {protocol['seeds']}: a protocol's seeds are fixed")
    from dpo_min.train import resolve
    from dpo_min.train.rounds import rounds_config

    out.mkdir(parents=True, exist_ok=True)
    argvs = seed_argv(protocol, seed, out)
    arms = {arm: finished(out / f"{arm}.json", lambda argv=argv: rounds_run(argv)) for arm, argv in argvs.items()}
    steps = arms["rounds_pay"]["steps"]
    arms["plain_matched"] = finished(out / "plain_matched.json", lambda: {
        **rounds_run(matched_argv(argvs["rounds_plain"], steps, out)), "round_max_steps": steps})
    plan = resolve(argvs["rounds_pay"])
    config = rounds_config(plan, None)
    arms["offline_pay"] = finished(out / "offline_pay.json",
                                   lambda: offline_pay(plan, config, out / "rounds_pay", out / "offline_pay"))
    arms["offline_pay_matched"] = finished(out / "offline_pay_matched.json", lambda: offline_pay_matched(
        plan, config, out / "offline_pay" / "pairs.jsonl", sum(steps), out / "offline_pay_matched"))
    pay = arms["rounds_pay"]
    for arm, figures in arms.items():
        if figures["held_rows"] != pay["held_rows"] or figures.get("pi0_outcomes", pay["pi0_outcomes"]) != \
                pay["pi0_outcomes"]:
            sys.exit(f"seed {seed}: arm {arm}'s held-out prompts or pi_0's outcomes differ from rounds_pay's: every "
                     "arm is scored on the same prompts from the same pi_0")
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": protocol_digest(protocol),
            "argv": {arm: recorded_argv(argv) for arm, argv in argvs.items()}, "held_rows": pay["held_rows"],
            "outcomes": {"pi_0": pay["pi0_outcomes"], **{arm: arms[arm]["outcomes"] for arm in ARMS[1:]}},
            "arms": {arm: {k: v for k, v in arms[arm].items() if k not in ("outcomes", "pi0_outcomes", "held_rows")}
                     for arm in ARMS[1:]}}


def seed_fields(protocol: dict) -> dict:
    """The fields of a seed file of `protocol` that `--table` reads (seed_files.field_problem's shape)."""
    rounds = {"steps": protocol["rounds"], "rounds": list, "seconds": int}
    return {"seed": int, "protocol": str, "protocol_digest": str, "argv": dict, "held_rows": list,
            "outcomes": dict.fromkeys(ARMS, list),
            "arms": {"rounds_pay": rounds, "rounds_plain": rounds,
                     "offline_pay": {"rounds": list, "pairs": int, "steps": int, "seconds": int},
                     "offline_pay_matched": {"max_steps": int, "steps": int, "seconds": int},
                     "plain_matched": {**rounds, "round_max_steps": protocol["rounds"]}}}


SEED_FILES = SeedFileForm({"name": str, "seeds": list, "rounds": int, "options": list, "arm_options": dict},
                          seed_fields, seed_argv)


def control_problem(figures: dict) -> str | None:
    """Whether the seed's controls ran as the protocol says: plain_matched at rounds_pay's steps round by round,
    offline_pay_matched at their sum, offline_pay on rounds_pay's completions round by round."""
    arms = figures["arms"]
    steps = arms["rounds_pay"]["steps"]
    pay, offline = ([r["completions"] for r in arms[arm]["rounds"]] for arm in ("rounds_pay", "offline_pay"))
    if arms["plain_matched"]["round_max_steps"] != steps:
        return f"plain_matched ran at {arms['plain_matched']['round_max_steps']} steps a round, rounds_pay took {steps}"
    if arms["offline_pay_matched"]["max_steps"] != sum(steps):
        return f"offline_pay_matched ran {arms['offline_pay_matched']['max_steps']} steps, rounds_pay took {sum(steps)}"
    if offline != pay:
        return f"offline_pay sampled {offline} completions a round, rounds_pay {pay}"
    return None


def print_table(paths: list[str], protocol_file: str | None = None) -> None:
    """In the protocol's order: per seed, every seed pooled (Wilson 95%), the primary comparison and its verdict, the
    secondary ones, where each arm's samples went round by round, and what a held-out prompt gained cost. Every file
    is checked against the protocol first (`protocol_file`, or the one the files name): seed_files.read_seeds."""
    protocol, seeds = read_seeds(paths, protocol_file, SEED_FILES)
    for figures in seeds:
        if problem := control_problem(figures):
            refuse(f"seed {figures['seed']}: {problem}: not the protocol's control")
    print(f"protocol {seeds[0]['protocol']}, {len(seeds)} seed(s)\n")
    print(f"| seed | {' | '.join(ARMS)} | steps: {', '.join(ARMS[1:])} |\n| ---: |{' ---: |' * len(ARMS)} --- |")
    for f in seeds:
        steps = [sum(f["arms"][arm]["steps"]) if arm in ROUNDS_ARMS else f["arms"][arm]["steps"] for arm in ARMS[1:]]
        print(f"| {f['seed']} | {' | '.join(str(sum(f['outcomes'][arm])) for arm in ARMS)} | "
              f"{', '.join(map(str, steps))} |")
    pooled = {arm: [x for f in seeds for x in f["outcomes"][arm]] for arm in ARMS}
    print("\n| arm | all seeds (Wilson 95%) |\n| --- | --- |")
    for arm in ARMS:
        print(f"| {arm} | {interval(sum(pooled[arm]), len(pooled[arm]))} |")
    print("\nprimary: rounds_pay vs offline_pay, both tests two-sided at 0.05")
    print_comparisons(seeds, pooled, [("rounds_pay", "offline_pay")])
    print(f"\n{verdict(seeds, pooled, len(protocol['seeds']))}\n\nsecondary:")
    print_comparisons(seeds, pooled, [("rounds_pay", "rounds_plain"), ("rounds_pay", "offline_pay_matched"),
                                      ("rounds_pay", "plain_matched"), ("rounds_plain", "offline_pay"),
                                      *((arm, "pi_0") for arm in ARMS[1:])])
    print_spend(seeds)
    print_cost(seeds, pooled)


def verdict(seeds: list[dict], pooled: dict, seeds_in_all: int) -> str:
    """The protocol's rule: a gain only if McNemar over the prompts and the sign-flip test over the seeds both give
    p < 0.05, with rounds_pay right on more of the discordant prompts. Before its last seed, whether the seeds left
    can still give a gain: not once the sign-flip test's floor over all the seeds reaches 0.05."""
    pay, off = pooled["rounds_pay"], pooled["offline_pay"]
    only_pay, only_off = sum(a and not b for a, b in zip(pay, off)), sum(b and not a for a, b in zip(pay, off))
    prompts = exact_mcnemar(only_pay, only_off)
    differences = [sum(f["outcomes"]["rounds_pay"]) - sum(f["outcomes"]["offline_pay"]) for f in seeds]
    flips = seed_permutation_test(differences)
    gain = prompts < ALPHA and flips < ALPHA and only_pay > only_off
    line = (f"primary verdict: {'a gain of rounds_pay' if gain else 'no gain claimed'} (McNemar p {prompts:.3g}, "
            f"sign-flip p {flips:.3g}, discordant prompts {only_pay} for rounds_pay, {only_off} for offline_pay)")
    left = seeds_in_all - len(seeds)
    if left <= 0:
        return line
    floor = sign_flip_floor(differences, seeds_in_all)
    if floor < ALPHA:
        return f"{line}; {len(seeds)} of the protocol's {seeds_in_all} seeds run: the {left} left decide it"
    not_ahead = sum(d <= 0 for d in differences)
    return (f"{line}; {len(seeds)} of the protocol's {seeds_in_all} seeds run, and no outcome of the {left} left "
            f"gives a gain: with {not_ahead} seed(s) not ahead, the sign-flip p over {seeds_in_all} seeds is at least "
            f"{floor * 2 ** seeds_in_all:.0f}/{2 ** seeds_in_all} = {floor:.3g}")  # the floor's own sign choices


def print_spend(seeds: list[dict]) -> None:
    """Where each arm's samples went, round by round, summed over the seeds ('-': not the arm's own: offline_pay
    samples rounds_pay's prompts and trains one pass)."""
    print("\nwhere the samples went, summed over the seeds:\n\n| arm | round | prompts | all right | all wrong | "
          "mixed | skipped | refills | generate() calls | pairs | steps | completions |\n"
          "| --- | ---: |" + " ---: |" * len(SPEND))
    for arm in (*ROUNDS_ARMS, "offline_pay"):
        for k, rounds in enumerate(zip(*(f["arms"][arm]["rounds"] for f in seeds)), start=1):
            cells = [sum(r[key] for r in rounds) if rounds[0][key] is not None else "-" for key in SPEND]
            print(f"| {arm} | {k} | {' | '.join(map(str, cells))} |")
    total = sum(f["arms"]["offline_pay"]["steps"] for f in seeds)
    matched = sum(f["arms"]["offline_pay_matched"]["steps"] for f in seeds)
    same = sum(f["arms"]["offline_pay"].get("round_1_as_rounds_pay") is True for f in seeds)
    print(f"\none pass: offline_pay {total} steps, offline_pay_matched {matched} steps (on offline_pay's pairs); "
          f"offline_pay's round 1 is rounds_pay's, token for token (both pi_0's), in {same} of {len(seeds)} seed(s)")


def completions(figures: dict, arm: str) -> int:
    """What an arm sampled: its rounds' completions (offline_pay_matched trains on offline_pay's samples)."""
    own = "offline_pay" if arm == "offline_pay_matched" else arm
    return sum(r["completions"] for r in figures["arms"][own]["rounds"])


def print_cost(seeds: list[dict], pooled: dict) -> None:
    """Completions sampled per held-out prompt gained over pi_0 (all seeds), and seconds per arm (mean of the
    seeds)."""
    print("\n| arm | completions | held-out prompts gained over pi_0 | completions per prompt gained | seconds "
          "(mean of the seeds) |\n| --- | ---: | ---: | ---: | ---: |")
    for arm in ARMS[1:]:
        spent, gained = sum(completions(f, arm) for f in seeds), sum(pooled[arm]) - sum(pooled["pi_0"])
        per = f"{spent / gained:.1f}" if gained > 0 else "-"
        seconds = sum(f["arms"][arm]["seconds"] for f in seeds) / len(seeds)
        print(f"| {arm} | {spent} | {gained} | {per} | {seconds:.0f} |")


def main() -> None:
    run_or_table(__doc__, "compare_rounds_pay", run_seed, print_table)


if __name__ == "__main__":
    main()
