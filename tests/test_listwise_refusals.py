"""plackett_luce's refusals name the option to blame, not the data (issue 54 item 8): a --max_eval_samples that cuts a
held-out group, and max_length truncation that cuts two answers of a group to the same ids."""

import json
import re

import pytest
from conftest import _one_line_error, tiny_llama
from datasets import Dataset
from test_trainer import config

from dpo_min import DPOMinConfig, DPOMinTrainer


def _ranked_rows(prompts: int, answers: int) -> list[dict[str, str]]:
    """Every better answer against every worse one (answer 0 best), each prompt's pairs together."""
    return [{"prompt": f"Question {q}?", "chosen": f" answer {a} of {q}", "rejected": f" answer {b} of {q}"}
            for q in range(prompts) for a in range(answers) for b in range(a + 1, answers)]


def test_a_held_out_cap_that_cuts_a_group_names_the_option(tmp_path, capsys, monkeypatch):
    data = tmp_path / "ranked.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _ranked_rows(4, 3)))
    # Half of the 4 prompts held out: 2 groups of 3 pairs. The first 5 keep 2 of the second group's 3 pairs, (a, b)
    # and (a, c), which order b and c no longer: the ranking check would blame a tie on the data.
    argv = ["--dataset", str(data), "--group_by_prompt", "--loss_type", "plackett_luce", "--eval_fraction", "0.5",
            "--max_eval_samples", "5", "--disable_tqdm", "true"]  # no bar of the split's tokenizing beside the line
    line = _one_line_error(argv, tmp_path, capsys, monkeypatch)
    match = re.search(r"--max_eval_samples 5 cuts the held-out group of row (\d+) \(2 of its prompt's 3 pairs kept\), "
                      r"and loss_type plackett_luce ranks whole groups: give --max_eval_samples 3 or 6$", line)
    assert match, line
    row = int(match.group(1))
    assert row % 3 == 0  # the group's first pair: each prompt's 3 pairs are rows 3q, 3q + 1, 3q + 2


def test_answers_cut_to_the_same_ids_name_max_length(tmp_path, tokenizer):
    opening = " the same long opening words of the answer" * 4
    best, middle, worst = opening + " best", " a short one", opening + " worst"
    rows = [{"prompt": "Q?", "chosen": best, "rejected": middle}, {"prompt": "Q?", "chosen": best, "rejected": worst},
            {"prompt": "Q?", "chosen": middle, "rejected": worst}]
    prompt_tokens = len(tokenizer("Q?")["input_ids"])
    options = {"group_by_prompt": True, "loss_type": "plackett_luce"}

    def build(**limits):
        return DPOMinTrainer(tiny_llama(vocab_size=tokenizer.vocab_size), args=DPOMinConfig(**config(
            tmp_path, **options, **limits)), train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
            ref_model=tiny_llama(1, vocab_size=tokenizer.vocab_size))

    build()  # whole, the answers rank best > middle > worst
    # Cut inside the shared opening, best and worst are the same ids: (best, worst) is dropped as chosen = rejected,
    # and (best, middle), (middle, worst) read middle above and below the one answer left, a cycle.
    limit = prompt_tokens + 12
    with pytest.raises(ValueError, match=rf"^row 0: the group of its prompt \(2 pairs\) gives no single ranking for "
                                         rf"loss_type plackett_luce: its pairs contradict each other \(a cycle\); "
                                         rf"max_length={limit} cut some of its answers, and answers cut to the same "
                                         rf"ids count as one: raise max_length$"):
        build(max_length=limit)
