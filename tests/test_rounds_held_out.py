"""The rounds' held-out prompts (dpo_min/rounds/held_out.py): prompts held out that are also training prompts are
counted and said, as the offline split says of its held-out pairs."""

import json

from test_rounds import PROMPTS, constant, settings, tiny_policy

from dpo_min.rounds import run_rounds
from dpo_min.rounds.prompts import split_held_out


def test_held_out_prompts_that_are_also_training_prompts_are_counted_and_said(tmp_path, tokenizer, capsys):
    rows = PROMPTS + PROMPTS[:3]  # duplicate rows: the split by row may put a prompt on both sides
    config = settings(tmp_path, rounds=1, on_no_pairs="stop")  # every sample ties: no pair, no training
    train_rows, held_rows = split_held_out(len(rows), config.held_out_share, config.seed)
    training = {json.dumps(rows[i]["prompt"]) for i in train_rows}
    shared = sum(json.dumps(rows[i]["prompt"]) in training for i in held_rows)
    assert 0 < shared < len(held_rows)  # some held-out prompts are training prompts, some not
    run_rounds(tiny_policy(), tokenizer, rows, constant, config)
    said = (f"prompts: {shared} of the {len(held_rows)} held-out prompts are also training prompts (the same prompt: "
            "duplicate rows); their held-out scores measure recall")
    assert said in capsys.readouterr().out.splitlines()
    run_rounds(tiny_policy(), tokenizer, PROMPTS, constant, settings(tmp_path, "unique", rounds=1))
    assert "held-out prompts are also training prompts" not in capsys.readouterr().out
