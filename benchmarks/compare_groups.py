"""Every pair of a prompt's k answers, in groups, against one best-against-worst pair, at equal samples: a protocol
fixed before its seeds run (issue 51, item 6), every arm scored on the same held-out prompts of the arithmetic pool,
one greedy completion each, right or wrong, prompt by prompt.

    python benchmarks/compare_groups.py --protocol benchmarks/protocols/groups-2026-12-05.json --seed 47 \\
        --out runs/groups-47 --json benchmarks/results/groups-2026-12-05/seed-47.json
    python benchmarks/compare_groups.py --table benchmarks/results/groups-2026-12-05/seed-*.json

Each arm is ONE round of `python -m dpo_min.train --rounds 1` with the protocol's options and the arm's own: pi_0
samples the seed's draw of training prompts (the same draw, seeds and temperature in every arm, so the same
samples: checked), the arm's pair rule pairs them, one DPO pass trains from pi_0. pi_0's held-out outcomes are the
rounds' score before round 1 (the same in every arm: checked). The paired statistics are benchmarks/paired.py's:
exact McNemar over prompts, and over seeds the sign test and the exact sign-flip test, since the prompts of a seed
share one trained model (docs/rounds.md: they vary 1.6-2.8x what independent prompts would). A seed file records the
protocol's digest and each arm's arguments; `--table` reads the protocol and refuses, in one line, a file not run
under it (benchmarks/seed_files.py).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_rounds import POOL_OPTIONS, demo_options, interval, print_comparisons, rounds_arm
from seed_files import SeedFileForm, protocol_digest, read_seeds, recorded_argv, run_or_table


def arm_figures(on: dict, folder: Path) -> dict:
    """What one arm's single round gave: pi_0's and the trained policy's held-out outcomes, pairs, steps, seconds,
    and its samples (to check that every arm trained on the same ones)."""
    held = sorted(on["result"].held_out, key=lambda line: line["round"])
    before, after = ([int(bool(total)) for _, total in line["per_prompt"]] for line in (held[0], held[-1]))
    (round_line,) = on["result"].rounds
    samples = (folder / "round-1" / "generated.jsonl").read_text()  # the round's samples, as drawn
    return {"pi0_outcomes": before, "outcomes": after, "held_rows": [i for i, _ in held[0]["per_prompt"]],
            "pairs": round_line["pairs"], "steps": round_line.get("dpo", {}).get("steps", 0),
            "saturated": round_line.get("saturated"), "seconds": round(on["seconds"]),
            "samples": [[row["prompt_index"], row["completion_ids"]] for row in map(json.loads, samples.splitlines())]}


def seed_argv(protocol: dict, seed: int, out: Path = Path("compare_groups")) -> dict[str, list[str]]:
    """Each arm's arguments for one seed of the protocol (its seed files record them, `--table` checks them)."""
    return {arm: ["--rounds", "1", "--seed", str(seed), *demo_options(), *POOL_OPTIONS, *protocol["options"],
                  *options, "--output_dir", str(out / arm)] for arm, options in protocol["arm_options"].items()}


def seed_fields(protocol: dict) -> dict:
    """The fields of a seed file of `protocol` that `--table` reads (seed_files.field_problem's shape)."""
    trained = protocol["arm_options"]
    return {"seed": int, "protocol": str, "protocol_digest": str, "argv": dict, "held_rows": list,
            "outcomes": dict.fromkeys(["pi_0", *trained], list),
            "arms": {arm: {"pairs": int, "steps": int} for arm in trained}}


SEED_FILES = SeedFileForm({"name": str, "seeds": list, "options": list, "arm_options": dict}, seed_fields, seed_argv)


def run_seed(protocol: dict, seed: int, out: Path) -> dict:
    if seed not in protocol["seeds"]:
        sys.exit(f"seed {seed} is not one of the protocol's {protocol['seeds']}: a protocol's seeds are fixed")
    figures, argvs = {}, seed_argv(protocol, seed, out)
    for arm, argv in argvs.items():
        figures[arm] = arm_figures(rounds_arm(argv), out / arm)
    first, *others = figures.values()
    for arm, of_arm in zip(list(figures)[1:], others):
        for key in ("pi0_outcomes", "held_rows", "samples"):
            if of_arm[key] != first[key]:
                sys.exit(f"seed {seed}: arm {arm}'s {key} differ from the first arm's: every arm trains on pi_0's "
                         "same samples")
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": protocol_digest(protocol),
            "argv": {arm: recorded_argv(argv) for arm, argv in argvs.items()}, "held_rows": first["held_rows"],
            "samples": len(first["samples"]),
            "outcomes": {"pi_0": first["pi0_outcomes"], **{arm: f["outcomes"] for arm, f in figures.items()}},
            "arms": {arm: {k: v for k, v in f.items() if k not in ("outcomes", "pi0_outcomes", "held_rows", "samples")}
                     for arm, f in figures.items()}}


def print_table(paths: list[str], protocol_file: str | None = None) -> None:
    """Per seed: each arm's held-out right, pairs and steps; then every seed pooled (Wilson 95% interval) and the
    paired tests. Every file is checked against the protocol first (`protocol_file`, or the one the files name):
    seed_files.read_seeds."""
    protocol, seeds = read_seeds(paths, protocol_file, SEED_FILES)
    arms = list(seed_fields(protocol)["outcomes"])
    trained = arms[1:]
    print(f"protocol {seeds[0]['protocol']}, {len(seeds)} seed(s)\n")
    print(f"| seed | {' | '.join(arms)} | pairs | steps |\n| ---: |{' ---: |' * len(arms)} --- | --- |")
    for f in seeds:
        print(f"| {f['seed']} | {' | '.join(str(sum(f['outcomes'][arm])) for arm in arms)} | "
              f"{', '.join(str(f['arms'][arm]['pairs']) for arm in trained)} | "
              f"{', '.join(str(f['arms'][arm]['steps']) for arm in trained)} |")
    pooled = {arm: [x for f in seeds for x in f["outcomes"][arm]] for arm in arms}
    print("\n| arm | all seeds (Wilson 95%) |\n| --- | --- |")
    for arm in arms:
        print(f"| {arm} | {interval(sum(pooled[arm]), len(pooled[arm]))} |")
    comparisons = [(trained[-1], other) for other in trained[:-1]] + [(arm, "pi_0") for arm in trained]
    print_comparisons(seeds, pooled, comparisons)


def main() -> None:
    run_or_table(__doc__, "compare_groups", run_seed, print_table)


if __name__ == "__main__":
    main()
