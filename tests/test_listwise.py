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
