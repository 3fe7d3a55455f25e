from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from dpo_min import DPODataCollator
from dpo_min.logps import sequence_logps

EXAMPLES = [
    {"prompt_ids": [5, 6, 7, 8], "chosen_ids": [9, 10, 2], "rejected_ids": [11, 2]},
    {"prompt_ids": [12, 13], "chosen_ids": [14, 2], "rejected_ids": [15, 16, 17, 2]},
]


def naive_logps(model, examples):
    """One sequence at a time, full logits, float64 log_softmax: the unshared computation."""
    sequences = [(ex["prompt_ids"], ex["chosen_ids"]) for ex in examples]
    sequences += [(ex["prompt_ids"], ex["rejected_ids"]) for ex in examples]
    out = []
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        out.append(sum(logprobs[len(prompt) + i - 1, token] for i, token in enumerate(completion)))
    return torch.stack(out)


def test_sequence_logps_equal_one_sequence_at_a_time_with_gradients():
    model = tiny_llama(vocab_size=64)
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    lean = sequence_logps(model, batch)
    lean.logps.sum().backward()
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    naive = naive_logps(model, EXAMPLES)
    naive.sum().backward()
    torch.testing.assert_close(lean.logps.double(), naive, atol=1e-4, rtol=1e-5)
    assert lean.lengths.tolist() == [3, 2, 2, 4]
    for lean_grad, param in zip(lean_grads, model.parameters()):
        torch.testing.assert_close(lean_grad, param.grad, atol=1e-5, rtol=1e-4)


class LogitTable(torch.nn.Module):
    """A 'model' whose logits are a fixed [2B, T, V] table, whatever the input ids: sequence_logps sees exactly them."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask, logits_to_keep, use_cache):
        return SimpleNamespace(logits=self.logits[logits_to_keep][None])


def completion_rows(table: LogitTable, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, V] logits of the positions that predict a completion token, and those tokens."""
    labels = batch["labels"][:, 1:]
    predicts = F.pad(labels != -100, (0, 1), value=False)
    return table.logits[predicts], labels[labels != -100]


def table_for(batch, vocab: int, dtype=torch.float32, scale: float = 1.0) -> LogitTable:
    rows, length = batch["input_ids"].shape
    return LogitTable((torch.randn(rows, length, vocab) * scale).to(dtype))


def test_label_log_probs_and_their_gradient_equal_log_softmax():
    torch.manual_seed(0)
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    table = table_for(batch, 101)
    lean = sequence_logps(table, batch)
    weights = torch.randn(lean.token_logps.shape)
    (lean.token_logps * weights).sum().backward()
    ours_grad = table.logits.grad.clone()
    table.logits.grad = None
    logits, labels = completion_rows(table, batch)
    reference = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    (reference * weights).sum().backward()
    torch.testing.assert_close(lean.token_logps, reference)
    torch.testing.assert_close(ours_grad, table.logits.grad)
    mean_logits = logits.detach().mean(-1)
    torch.testing.assert_close(lean.logits_sums, torch.zeros(4).index_add(0, lean.token_sequence, mean_logits))


def test_bf16_logits_are_reduced_in_float32():
    torch.manual_seed(0)
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    table = table_for(batch, 5000, dtype=torch.bfloat16, scale=4.0)
    with torch.no_grad():
        ours = sequence_logps(table, batch).token_logps
    assert ours.dtype == torch.float32
    logits, labels = completion_rows(table, batch)
    reference = torch.log_softmax(logits.double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    # A bf16 log_softmax would be off by ~1e-2 here; float32 reduction keeps the bf16 inputs' exact result.
    assert (ours.double() - reference).abs().max() < 1e-5


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunking_does_not_change_the_result(monkeypatch, chunk):
    import dpo_min.logps as logps_module

    monkeypatch.setattr(logps_module, "CHUNK_TOKENS", chunk)
    torch.manual_seed(1)
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    table = table_for(batch, 50)
    with torch.no_grad():
        ours = sequence_logps(table, batch).token_logps
    logits, labels = completion_rows(table, batch)
    torch.testing.assert_close(ours, torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1))


def test_token_positions_and_sum_sq_probs_per_token():
    model = tiny_llama(vocab_size=64)
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    with torch.no_grad():
        lean = sequence_logps(model, batch, with_sum_sq_probs=True)
        # Unshared: full logits, float64, one row at a time.
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    expected_positions, expected_sum_sq = [], []
    for row in range(batch["input_ids"].size(0)):
        completion = (batch["labels"][row] != -100).nonzero().squeeze(-1)
        expected_positions += list(range(len(completion)))
        probs = torch.softmax(logits[row, completion - 1], dim=-1)
        expected_sum_sq.append(torch.log((probs ** 2).sum(-1)))
    assert lean.token_positions.tolist() == expected_positions
    torch.testing.assert_close(lean.token_log_sum_sq_probs.double(), torch.cat(expected_sum_sq), atol=1e-5, rtol=0)


def test_ld_alpha_weights_the_tokens_beyond_the_shorter_completion():
    batch = DPODataCollator(pad_token_id=0)(EXAMPLES)
    with torch.no_grad():
        lean = sequence_logps(tiny_llama(vocab_size=64), batch)
    # Completion lengths: chosen 3, 2; rejected 2, 4 -> shared 2 and 2.
    per_token = lean.token_logps.split(lean.lengths.long().tolist())
    chosen0, chosen1, rejected0, rejected1 = per_token
    expected = torch.stack([chosen0[:2].sum() + 0.25 * chosen0[2:].sum(), chosen1.sum(), rejected0.sum(),
                            rejected1[:2].sum() + 0.25 * rejected1[2:].sum()])
    torch.testing.assert_close(lean.summed_logps(0.25), expected)
    torch.testing.assert_close(lean.summed_logps(None), lean.logps)
