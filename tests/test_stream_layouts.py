"""A stream trains in the packed layouts (issue 54 item 7): accelerate's dispatcher, its default for a stream, cut
every tensor of a collated batch to the rows of its first, and a packed batch's per-sequence tensors
(`completion_index`, segment bounds) hold more: the first step died. The packed layouts turn dispatching off."""

import pytest
from conftest import tiny_llama
from datasets import Dataset
from test_collator_groups import ranked_pairs
from test_trainer import config

from dpo_min import DPOMinConfig, DPOMinTrainer

LAYOUTS = {"group_by_prompt": {"group_by_prompt": True}, "padding_free": {"padding_free": True},
           "group_by_prompt+padding_free": {"group_by_prompt": True, "padding_free": True}}


def _step_logs(tmp_path, tokenizer, pairs, **layout):
    stream = Dataset.from_list(pairs).to_iterable_dataset()
    trainer = DPOMinTrainer(tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, max_steps=2, **layout)),
                            train_dataset=stream, processing_class=tokenizer, ref_model=tiny_llama(1, 64))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stream_trains_in_a_packed_layout_as_in_the_padded_one(tmp_path, tokenizer, layout):
    pairs = ranked_pairs()  # groups of 6, 3 and 1 pairs, interleaved: batches of 2 hold pairs of one prompt or two
    padded, packed = _step_logs(tmp_path, tokenizer, pairs), _step_logs(tmp_path, tokenizer, pairs, **LAYOUTS[layout])
    assert len(packed) == len(padded) == 2
    for mine, reference in zip(packed, padded):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key


def test_dispatching_a_packed_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^accelerator_config dispatch_batches=True cuts .* padding_free's packed"):
        DPOMinConfig(**config(tmp_path, padding_free=True, accelerator_config={"dispatch_batches": True}))
