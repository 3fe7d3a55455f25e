"""DPO's listwise loss (loss_type plackett_luce, DPO paper appendix A.3): with two answers it is DPO's sigmoid loss,
and for three and four answers it is the Plackett-Luce likelihood computed by hand; a group's ranking comes from its
pairs only where they give one strict order."""

import math

import pytest
import torch

from dpo_min.grouping import strict_order
from dpo_min.listwise import plackett_luce
from dpo_min.losses import dpo_loss


def test_two_answers_give_dpos_sigmoid_loss():
    torch.manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (torch.randn(5, dtype=torch.float64) * 10 for _ in range(4))
    sigmoid, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.3)
    rewards = 0.3 * torch.cat([chosen - ref_chosen, rejected - ref_rejected])
    # each pair a group of two: chosen i (index i) above rejected i (index 5 + i)
    ranking = torch.tensor([index for pair in range(5) for index in (pair, 5 + pair)])
    listwise = plackett_luce(rewards, ranking, torch.full((5,), 2))
    torch.testing.assert_close(listwise, sigmoid, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards, torch.cat([chosen_rewards, rejected_rewards]))


def _by_hand(rewards_best_first: list[float]) -> float:
    """-log prod_k exp(r_k) / sum_{j>=k} exp(r_j), term by term."""
    loss = 0.0
    for k, reward in enumerate(rewards_best_first):
        loss -= reward - math.log(sum(math.exp(r) for r in rewards_best_first[k:]))
    return loss


def test_three_and_four_answers_by_hand():
    # rewards of the 2B sequences; group 1 ranks sequences 2 > 0 > 5, group 2 ranks 1 > 6 > 3 > 4 (B = 4 pairs)
    rewards = torch.tensor([0.4, 1.5, -0.2, -1.0, 0.3, -0.7, 2.0, 0.0], dtype=torch.float64)
    ranking, sizes = torch.tensor([2, 0, 5, 1, 6, 3, 4]), torch.tensor([3, 4])
    three = -(-0.2 - math.log(math.exp(-0.2) + math.exp(0.4) + math.exp(-0.7))) \
        - (0.4 - math.log(math.exp(0.4) + math.exp(-0.7)))
    assert three == pytest.approx(_by_hand([-0.2, 0.4, -0.7]), rel=1e-12)
    e = math.exp
    four = -(1.5 - math.log(e(1.5) + e(2.0) + e(-1.0) + e(0.3))) - (2.0 - math.log(e(2.0) + e(-1.0) + e(0.3))) \
        - (-1.0 - math.log(e(-1.0) + e(0.3)))  # the last answer's term: 0.3 - log(e(0.3)) = 0
    assert four == pytest.approx(_by_hand([1.5, 2.0, -1.0, 0.3]), rel=1e-12)
    torch.testing.assert_close(plackett_luce(rewards, ranking, sizes), torch.tensor([three, four], dtype=torch.float64))


def test_the_gradient_raises_the_better_answers_reward():
    rewards = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    plackett_luce(rewards, torch.tensor([0, 1, 2]), torch.tensor([3])).sum().backward()
    # d/dr of -(r0 - lse(r0, r1, r2)) - (r1 - lse(r1, r2)) at 0: -(1 - 1/3), -(1 - 1/3 - 1/2), 1/3 + 1/2
    torch.testing.assert_close(rewards.grad, torch.tensor([-2 / 3, -1 / 6, 5 / 6]))


@pytest.mark.parametrize(("pairs", "order"), [
    ([("a", "b"), ("a", "c"), ("b", "c")], ["a", "b", "c"]),
    ([("b", "c"), ("a", "b")], ["a", "b", "c"]),  # a chain: its transitive closure orders all three
    ([("c", "d"), ("a", "b"), ("b", "c")], ["a", "b", "c", "d"]),
])
def test_pairs_that_give_one_strict_order(pairs, order):
    assert strict_order(pairs) == order


@pytest.mark.parametrize(("pairs", "reason"), [
    ([("a", "b"), ("a", "c")], "do not order 2 of its completions"),  # b and c: a tie
    ([("r1", "w1"), ("r1", "w2"), ("r2", "w1"), ("r2", "w2")], "do not order 2"),  # right against wrong
    ([("a", "b"), ("b", "c"), ("c", "a")], "cycle"),
    ([("a", "a")], "against itself"),
])
def test_pairs_that_give_no_single_order_say_why(pairs, reason):
    assert reason in strict_order(pairs)


# ---- in the trainer: whole groups, one loss each -------------------------------------------------------------------
def _groups_data(answers_per_prompt=(3, 2, 4), seed=0):
    from test_collator_groups import ranked_pairs

    return ranked_pairs(answers_per_prompt, seed)


def _trainer(tmp_path, tokenizer, pairs, **options):
    from conftest import tiny_llama
    from datasets import Dataset
    from test_trainer import config

    from dpo_min import DPOMinConfig, DPOMinTrainer

    settings = config(tmp_path, group_by_prompt=True, **{"loss_type": "plackett_luce", **options})
    return DPOMinTrainer(tiny_llama(vocab_size=64), args=DPOMinConfig(**settings),
                         train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
                         ref_model=tiny_llama(1, 64))


def test_the_trainers_listwise_loss_is_plackett_luce_by_hand_on_the_padded_log_probs(tmp_path, tokenizer):
    from test_logps import naive_logps

    pairs = _groups_data((3,))  # answers a > b > c: pairs (a, b), (a, c), (b, c)
    trainer = _trainer(tmp_path, tokenizer, pairs, beta=0.5)
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(pairs)).item()
    with torch.no_grad():  # one sequence at a time, the unshared computation
        policy, reference = naive_logps(trainer.model, pairs), naive_logps(trainer.reference.model, pairs)
    rewards = (0.5 * (policy - reference)).tolist()  # chosen of the 3 pairs, then their rejected
    a, b, c = rewards[0], rewards[3], rewards[5]  # a: chosen of (a, b); b: rejected of (a, b); c: rejected of (a, c)
    e = math.exp
    by_hand = -(a - math.log(e(a) + e(b) + e(c))) - (b - math.log(e(b) + e(c)))
    assert loss == pytest.approx(by_hand, rel=1e-5)
    assert abs(by_hand - math.log(6)) > 1e-3  # not the tie's log 3 + log 2: the policy is not its reference


def test_two_answer_groups_train_as_the_sigmoid_loss_step_by_step(tmp_path, tokenizer):
    from test_trainer import METRICS, step_logs

    pairs = _groups_data((2,) * 8)  # eight prompts, one pair each: a group of two answers each
    runs = {}
    for loss_type in ("plackett_luce", "sigmoid"):
        trainer = _trainer(tmp_path, tokenizer, pairs, loss_type=loss_type, max_steps=3, optim="sgd",
                           learning_rate=1.0)
        trainer.train()
        runs[loss_type] = step_logs(trainer)
    for mine, reference in zip(*runs.values(), strict=True):
        for key in (*METRICS, "grad_norm"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key


def test_a_batch_holds_whole_groups_and_accumulation_is_exact(tmp_path, tokenizer):
    pairs = _groups_data((3, 4, 2, 3))
    trainer = _trainer(tmp_path, tokenizer, pairs, per_device_train_batch_size=2)
    sizes = [len(batch["group_sizes"]) for batch in trainer.get_train_dataloader()]
    assert sizes == [2, 2]  # 2 groups a batch: 3 + 6 + 1 + 3 pairs in 2 batches, never cut
    weights = []
    for batch_size, accumulation in ((2, 1), (1, 2)):
        trainer = _trainer(tmp_path, tokenizer, pairs, per_device_train_batch_size=batch_size,
                           gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=1.0)
        trainer.train()
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    for one, other in zip(*weights):
        torch.testing.assert_close(one, other, rtol=1e-5, atol=1e-7)


def test_a_group_without_one_order_is_refused_naming_its_row(tmp_path, tokenizer):
    pairs = _groups_data((3, 2))
    right_wrong = [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [9]},
                   {"prompt_ids": [5, 6], "chosen_ids": [8], "rejected_ids": [9]}]  # 7 and 8 never compared
    with pytest.raises(ValueError, match=r"^row 4: the group of its prompt \(2 pairs\) gives no single ranking for "
                                         r"loss_type plackett_luce: its pairs do not order 2"):
        _trainer(tmp_path, tokenizer, pairs + right_wrong)


@pytest.mark.parametrize(("options", "message"), [
    ({"group_by_prompt": False}, "needs group_by_prompt"),
    ({"loss_type": ["plackett_luce", "sft"]}, "takes no other loss type"),
    ({"use_weighting": True}, "takes no other loss type, ld_alpha, use_weighting"),
])
def test_the_listwise_loss_is_refused_where_it_cannot_run(tmp_path, options, message):
    from test_trainer import config

    from dpo_min import DPOMinConfig

    with pytest.raises(ValueError, match=message):
        DPOMinConfig(**config(tmp_path, **{"group_by_prompt": True, "loss_type": "plackett_luce", **options}))


def test_evaluation_reads_whole_groups(tmp_path, tokenizer):
    from datasets import Dataset

    pairs = _groups_data((3, 4, 2))
    trainer = _trainer(tmp_path, tokenizer, pairs, per_device_eval_batch_size=3)
    trainer.eval_dataset = Dataset.from_list(pairs)
    batches = list(trainer.get_eval_dataloader())
    assert [batch["group_sizes"].tolist() for batch in batches] == [[3, 4, 2]]  # first appearance order, whole
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batches[0]).item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
