import torch

from dpo_min import DPODataCollator

EXAMPLES = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11, 12]},
]


def test_chosen_rows_first_then_rejected_right_padded():
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0], [1, 2, 3, 6, 0], [7, 8, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_labels_mask_prompt_and_padding():
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    m = -100
    assert batch["labels"].tolist() == [[m, m, m, 4, 5], [m, m, 9, m, m], [m, m, m, 6, m], [m, m, 10, 11, 12]]
    assert batch["sequence_index"].tolist() == [[-1, -1, -1, 0, 0], [-1, -1, 1, -1, -1], [-1, -1, -1, 2, -1],
                                                [-1, -1, 3, 3, 3]]


def test_pad_to_multiple_of_and_reference_columns():
    examples = [dict(ex, ref_chosen_logps=-1.5, ref_rejected_logps=-2.5) for ex in EXAMPLES]
    batch = DPODataCollator(pad_token_id=0, pad_to_multiple_of=4)(examples)
    assert batch["input_ids"].shape == (4, 8)
    assert torch.equal(batch["ref_chosen_logps"], torch.tensor([-1.5, -1.5]))
    assert torch.equal(batch["ref_rejected_logps"], torch.tensor([-2.5, -2.5]))
