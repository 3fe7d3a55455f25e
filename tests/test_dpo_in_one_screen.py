"""docs/dpo_in_one_screen.md: its code runs as written, and its hand check would catch a wrong loss."""

import re
from pathlib import Path

import pytest

import dpo_min

PAGE = Path(__file__).resolve().parent.parent / "docs" / "dpo_in_one_screen.md"


def page_code() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)
    assert len(blocks) == 1, "the page shows one python block"
    return blocks[0]


def test_the_page_is_one_screen_and_calls_the_core():
    assert len(PAGE.read_text().splitlines()) <= 70
    code = page_code()
    for call in ("DPODataCollator(", "sequence_logps(", "dpo_loss(", ".chunk(2)", "assert "):
        assert call in code, call


def test_the_pages_code_runs_and_checks_the_loss_by_hand(capsys):
    exec(compile(page_code(), str(PAGE), "exec"), {"__name__": "dpo_in_one_screen"})
    assert capsys.readouterr().out.startswith("loss ")


def test_the_hand_check_fails_for_a_loss_off_by_one_part_in_a_million(monkeypatch):
    # Not a check that passes whatever dpo_loss returns: the same page with a slightly wrong loss stops.
    real = dpo_min.dpo_loss

    def off(*args, **kwargs):
        losses, chosen, rejected = real(*args, **kwargs)
        return losses * (1 + 1e-6), chosen, rejected

    monkeypatch.setattr(dpo_min, "dpo_loss", off)
    with pytest.raises(AssertionError):
        exec(compile(page_code(), str(PAGE), "exec"), {"__name__": "dpo_in_one_screen"})
