"""Every logged figure is a mean over pairs (over groups for plackett_luce's loss), whatever the batches (issue 54
item 1): the held-out metrics of 10 pairs are the same at evaluation batch 1, 2 and 3, and a logging window of
unequal training batches logs the mean over its pairs. predict() reads plackett_luce's groups whole (item 7)."""

import math

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from test_collator_groups import ranked_pairs
from test_trainer import config

from dpo_min import DPOMinConfig, DPOMinTrainer

SPEED = ("runtime", "per_second")  # wall-clock figures: not metrics of the pairs
PAIRS = {"pairs": {}, "groups": {"group_by_prompt": True, "loss_type": "plackett_luce"}}


def _trainer(tmp_path, pairs, tokenizer, **options):
    # Another reference than the policy: rewards and margins are not 0 from the start.
    return DPOMinTrainer(tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, **options)),
                         train_dataset=Dataset.from_list(pairs), eval_dataset=Dataset.from_list(pairs),
                         processing_class=tokenizer, ref_model=tiny_llama(1, 64))


def _figures(metrics):
    return {key: value for key, value in metrics.items() if not any(word in key for word in SPEED)}


@pytest.mark.parametrize("kind", PAIRS)
def test_held_out_metrics_do_not_depend_on_the_evaluation_batch(tmp_path, tokenizer, kind):
    # 10 pairs of 3 prompts (6 + 3 + 1); for groups 4 prompts (3 + 6 + 1 + 3 pairs): batches of 3 leave a short one.
    pairs = ranked_pairs((4, 3, 2)) if kind == "pairs" else ranked_pairs((3, 4, 2, 3))
    runs = {}
    for batch in (1, 2, 3):
        trainer = _trainer(tmp_path, pairs, tokenizer, per_device_eval_batch_size=batch, **PAIRS[kind])
        runs[batch] = _figures(trainer.evaluate()), trainer
    (metrics, trainer), *others = runs.values()
    for other, _ in others:
        assert other.keys() == metrics.keys()
        for key, value in metrics.items():
            assert other[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    margins = trainer.eval_margins
    assert len(margins) == len(pairs) and min(abs(margin) for margin in margins) > 1e-4
    assert metrics["eval_rewards/accuracies"] == sum(margin > 0 for margin in margins) / len(pairs)
    assert metrics["eval_rewards/margins"] == pytest.approx(sum(margins) / len(pairs), rel=1e-9)
    assert 0 < metrics["eval_rewards/accuracies"] < 1
    if kind == "pairs":  # DPO's loss of each pair is -log sigmoid(its margin): the mean over the 10
        by_hand = sum(-math.log(1 / (1 + math.exp(-margin))) for margin in margins) / len(pairs)
        assert metrics["eval_loss"] == pytest.approx(by_hand, rel=1e-6)
    else:  # the four groups' losses in one batch, then their mean
        batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(len(pairs))])
        assert len(batch["group_sizes"]) == 4
        with torch.no_grad():
            assert metrics["eval_loss"] == pytest.approx(trainer.compute_loss(trainer.model, batch).item(), rel=1e-6)


def test_a_logging_window_of_unequal_batches_logs_the_mean_over_its_pairs(tmp_path, tokenizer):
    """5 pairs in batches of 2, 2 and 1 within one logging window; learning_rate 0 keeps the policy as it was, so the
    same pairs evaluated in one batch give the figures the window must log."""
    pairs = ranked_pairs((3, 3))[:5]
    trainer = _trainer(tmp_path, pairs, tokenizer, max_steps=3, logging_steps=3, learning_rate=0.0,
                       train_sampling_strategy="sequential", per_device_eval_batch_size=5)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
    assert len(logged) == 1
    held_out = trainer.evaluate()
    for key, value in logged[0].items():
        if f"eval_{key}" in held_out and key not in ("loss", "num_tokens"):
            assert value == pytest.approx(held_out[f"eval_{key}"], rel=1e-6, abs=1e-7), key
    assert logged[0]["rewards/accuracies"] == sum(margin > 0 for margin in trainer.eval_margins) / 5


def test_predict_reads_whole_groups_and_keeps_its_pairs_out_of_the_next_evaluation(tmp_path, tokenizer):
    pairs = ranked_pairs((3, 4, 2, 3))
    trainer = _trainer(tmp_path, pairs, tokenizer, per_device_eval_batch_size=3, **PAIRS["groups"])
    expected = _figures(trainer.evaluate())
    others = ranked_pairs((3, 2), seed=1)
    predicted = trainer.predict(Dataset.from_list(pairs)).metrics
    assert predicted["test_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)
    assert predicted["test_rewards/margins"] == pytest.approx(expected["eval_rewards/margins"], rel=1e-6)
    trainer.predict(Dataset.from_list(others))  # its pairs are not the held-out ones: the next evaluation omits them
    again = _figures(trainer.evaluate())
    for key, value in expected.items():
        assert again[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key

