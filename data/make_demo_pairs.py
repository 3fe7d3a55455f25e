"""Write the demo's pairs: the single-turn preference pairs of the embedded HH-RLHF harmless-base test file.

    python data/make_demo_pairs.py

The rule reads the transcripts only (no model output): keep a pair when each of its two transcripts holds exactly
one Human turn, so the prompt is one request and the two answers are the assistant's first reply to it, and both
answers follow the same prompt and hold text (9 upstream pairs do not; the loader drops them). Same order, same
text; the file is written with a fixed gzip header, so the same input gives the same bytes.
"""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "hh-rlhf-harmless-base-test.jsonl.gz"
TARGET = HERE / "hh-rlhf-harmless-single-turn.jsonl.gz"


def is_single_turn(row: dict[str, str]) -> bool:
    return all(row[name].count("\n\nHuman:") == 1 for name in ("chosen", "rejected"))


def is_a_pair(row: dict[str, str]) -> bool:
    """The same prompt before two answers that hold text: the loader drops the upstream pairs that are not."""
    (prompt, chosen), (other_prompt, rejected) = (row[name].rsplit("\n\nAssistant:", 1)
                                                  for name in ("chosen", "rejected"))
    return prompt == other_prompt and bool(chosen.strip()) and bool(rejected.strip())


def main() -> None:
    with gzip.open(SOURCE, "rt", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    kept = [row for row in rows if is_single_turn(row) and is_a_pair(row)]
    with open(TARGET, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as file:
        file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept).encode("utf-8"))
    print(f"{len(kept)} of {len(rows)} pairs -> {TARGET.name}")


if __name__ == "__main__":
    main()
