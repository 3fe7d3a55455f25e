"""docs/rounds.md's library snippet runs as written, on a tiny model and cut to one short round (the page's own
figures are SmolLM2's; here the code path is what is checked)."""

import json
import re
from pathlib import Path

from test_rounds import tiny_policy

import dpo_min

PAGE = Path(__file__).resolve().parent.parent / "docs" / "rounds.md"


def _snippet() -> str:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)[0]


def test_the_pages_library_snippet_runs_and_leaves_a_rounds_folder(tmp_path, monkeypatch, tokenizer, capsys):
    code = _snippet()
    # Cut as a test must be: one round of 2 samples of 4 tokens, each shortening a value the page spells out.
    cuts = {"rounds=3": "rounds=1", "num_generations=4": "num_generations=2", "max_completion_length=32":
            "max_completion_length=4", '"runs/rounds"': repr(str(tmp_path / "rounds"))}
    for written, cut in cuts.items():
        assert code.count(written) == 1, written
        code = code.replace(written, cut)
    monkeypatch.setattr(dpo_min, "load_model_and_tokenizer", lambda *args, **kwargs: (tiny_policy(), tokenizer))
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    result = namespace["result"]
    lines = [json.loads(line) for line in (tmp_path / "rounds" / "rounds.jsonl").read_text().splitlines()]
    assert lines == result.rounds and len(lines) == 1
    assert lines[0]["samples"] == 2 * lines[0]["prompts"] > 0  # every training prompt sampled twice, and scored
    # A random tiny model answers no product right: every prompt ties, and the run stops as the page's default says.
    assert result.stopped is not None and lines[0]["pairs"] == 0
    assert [row["round"] for row in result.held_out] == [0]
    assert str(lines[-1]["pairs"]) in capsys.readouterr().out
