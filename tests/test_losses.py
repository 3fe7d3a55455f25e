import dataclasses
import inspect
import math

import pytest
import torch
from conftest import tiny_llama

from dpo_min import DPOMinConfig, DPOMinTrainer, dpo_loss
from dpo_min.loss_family import PairTerms
from dpo_min.losses import LOSSES, READS_LABEL_SMOOTHING, Knob, LossEntry, LossSettings
from dpo_min.train.run_dir import OutputDirError, RunFolder
from dpo_min.train.same_run import check_same_run, resume_settings


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_sigmoid_matches_hand_computed_value():
    # D = (-10 - -11) - (-12 - -11) = 2; loss = -log sigmoid(0.1 * 2) = log(1 + e^-0.2)
    losses, chosen_rewards, rejected_rewards = dpo_loss(t(-10.0), t(-12.0), t(-11.0), t(-11.0), beta=0.1)
    assert losses.item() == pytest.approx(0.5981388693815918, abs=1e-7)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-12)
    assert chosen_rewards.item() == pytest.approx(0.1) and rejected_rewards.item() == pytest.approx(-0.1)


@pytest.mark.parametrize(
    "policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, eps, expected",
    [
        # Hand-computed table: D = (pc - rc) - (pr - rr); loss = -(1-eps) log s(bD) - eps log s(-bD).
        (-10.0, -12.0, -11.0, -11.0, 0.1, 0.0, math.log1p(math.exp(-0.2))),
        (-10.0, -12.0, -11.0, -11.0, 0.1, 0.1, 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2))),
        (-5.0, -5.0, -5.0, -5.0, 0.5, 0.3, math.log(2)),
        (-20.0, -10.0, -15.0, -15.0, 0.2, 0.25, 0.75 * math.log1p(math.exp(2.0)) + 0.25 * math.log1p(math.exp(-2.0))),
    ],
)
def test_conservative_dpo_table(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, eps, expected):
    losses, _, _ = dpo_loss(t(policy_chosen), t(policy_rejected), t(ref_chosen), t(ref_rejected), beta=beta,
                            label_smoothing=eps)
    assert losses.item() == pytest.approx(expected, abs=1e-10)


def test_reference_free_ignores_reference():
    losses, chosen_rewards, _ = dpo_loss(t(-10.0), t(-12.0), t(-3.0), t(-100.0), beta=0.1, reference_free=True)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-12)
    assert chosen_rewards.item() == pytest.approx(-1.0)


def test_loss_is_per_pair_and_rewards_are_detached():
    policy_chosen = torch.tensor([-3.0, -4.0, -5.0], requires_grad=True)
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, torch.full((3,), -4.0), torch.full((3,), -4.0),
                                                        torch.full((3,), -4.0))
    assert losses.shape == chosen_rewards.shape == rejected_rewards.shape == (3,)
    assert losses[0] < losses[1] < losses[2]
    assert not chosen_rewards.requires_grad
    losses.sum().backward()
    # d/dx -log s(beta x) = -beta (1 - s(beta x)); at x = 0 that is -beta / 2.
    assert policy_chosen.grad[1].item() == pytest.approx(-0.05)


@pytest.mark.parametrize(
    "policy_chosen, policy_rejected, eps, beta, expected",
    [
        # As the original DPO code: reference_free sets the reference log-ratio to 0, so D = pc - pr.
        (-10.0, -12.0, 0.0, 0.1, math.log1p(math.exp(-0.2))),
        (-10.0, -12.0, 0.1, 0.1, 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2))),
        (-30.0, -20.0, 0.2, 0.5, 0.8 * math.log1p(math.exp(5.0)) + 0.2 * math.log1p(math.exp(-5.0))),
        (-7.0, -7.0, 0.3, 1.0, math.log(2)),
    ],
)
def test_reference_free_table(policy_chosen, policy_rejected, eps, beta, expected):
    # The reference values would change every row if they were used.
    losses, chosen_rewards, rejected_rewards = dpo_loss(t(policy_chosen), t(policy_rejected), t(-3.0), t(-50.0),
                                                        beta=beta, label_smoothing=eps, reference_free=True)
    assert losses.item() == pytest.approx(expected, abs=1e-10)
    assert chosen_rewards.item() == pytest.approx(beta * policy_chosen)
    assert rejected_rewards.item() == pytest.approx(beta * policy_rejected)


def test_combined_losses_are_the_weighted_sum_of_their_means():
    policy_chosen, policy_rejected = t(-10.0, -20.0), t(-12.0, -18.0)
    reference = t(-11.0, -19.0)
    lengths, nll = t(4.0, 6.0), t(10.0, 20.0)
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, reference, reference, beta=0.1,
                            loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], chosen_lengths=lengths,
                            rejected_lengths=lengths, chosen_nll=nll)
    # sigmoid: D = 2 and -2; sft: (10 + 20) / (4 + 6) = 3 per token, the same for both pairs.
    sigmoid_mean = (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.2))) / 2
    assert losses.mean().item() == pytest.approx(sigmoid_mean + 0.5 * 3.0, abs=1e-12)


def test_unknown_loss_type_lists_the_choices():
    with pytest.raises(ValueError, match=r"sigmoid.*discopop"):
        dpo_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="dpo")


@pytest.mark.parametrize("option", [{"ld_alpha": 0.5}, {"use_weighting": True}])
def test_options_that_shape_the_inputs_are_refused_by_the_loss(option):
    # LD-DPO and WPO act on the log-probs and pair weights given to dpo_loss; accepted here they would do nothing.
    with pytest.raises(TypeError, match=next(iter(option))):
        dpo_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), **option)


def test_length_normalised_losses_need_lengths():
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="ipo")


def test_pair_weights_scale_every_term_and_keep_the_graph():
    # TRL 1.16 scales in place and fails on backward for hinge and sft; here the weights are an ordinary product.
    policy_chosen = t(-10.0, -20.0).requires_grad_()
    inputs = (policy_chosen, t(-12.0, -18.0), t(-11.0, -19.0), t(-11.0, -19.0))
    options = {"loss_type": ["hinge", "sft"], "chosen_lengths": t(4.0, 6.0), "rejected_lengths": t(5.0, 5.0)}
    weights = t(0.5, 0.25)
    weighted, _, _ = dpo_loss(*inputs, pair_weights=weights, **options)
    unweighted, _, _ = dpo_loss(*inputs, **options)
    torch.testing.assert_close(weighted, unweighted * weights)
    weighted.mean().backward()
    assert policy_chosen.grad.abs().sum() > 0


def _margin_hinge(terms):  # a loss type with a hyperparameter of its own: max(0, margin - beta D)
    return torch.relu(terms.value("margin") - terms.beta * terms.delta)


@dataclasses.dataclass
class MarginConfig(DPOMinConfig):
    margin: float = 1.0  # the one config field the new loss type needs


def test_a_loss_type_with_a_new_hyperparameter_is_one_entry_and_one_field(monkeypatch, tmp_path, tokenizer, hh_pairs):
    monkeypatch.setitem(LOSSES, "margin_hinge", LossEntry(_margin_hinge, {"margin": Knob(1.0, 0.0, open_low=True)}))
    common = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True, "loss_type": "margin_hinge"}
    with pytest.raises(ValueError, match=r"loss_type 'margin_hinge' needs margin > 0, got -1.0"):
        MarginConfig(**common, margin=-1.0)
    run = {"beta": 0.5, "max_steps": 1, "per_device_train_batch_size": 2, "logging_steps": 1, "save_strategy": "no",
           "disable_tqdm": True}
    args = MarginConfig(**common, **run, margin=3.0)
    # By hand: D = (-10 - -11) - (-12 - -11) = 2, so max(0, 3 - 0.5 * 2) = 2.
    losses, _, _ = dpo_loss(t(-10.0), t(-12.0), t(-11.0), t(-11.0), args.loss_settings)
    assert losses.item() == pytest.approx(2.0, abs=1e-12)
    # Resume knows the new field too: a run recorded with margin 3 is not resumed with margin 2.
    folder = RunFolder(tmp_path / "run")
    folder.begin(resume_settings(args))
    with pytest.raises(OutputDirError, match=r"other settings \(margin 3.0 -> 2.0\)"):
        check_same_run(str(folder.staging / "checkpoint-1"), resume_settings(MarginConfig(**common, **run, margin=2.0)))
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(2)),
                            processing_class=tokenizer)
    trainer.train()
    # The policy starts as its reference (D = 0): the first loss is the margin itself.
    assert trainer.state.log_history[0]["loss"] == pytest.approx(3.0, abs=1e-6)


def test_every_hyperparameter_default_is_the_config_default(tmp_path):
    config = DPOMinConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert LossSettings.of() == config.loss_settings


def test_the_sigmoid_entry_reads_plain_values_three_hops_from_compute_loss():
    # compute_loss -> dpo_loss (the log-ratios and DPO's logits from the four log-probs) -> LOSSES["sigmoid"].
    assert "dpo_loss(" in inspect.getsource(DPOMinTrainer.compute_loss)
    source = inspect.getsource(dpo_loss)
    assert "policy_chosen_logps - ref_chosen_logps" in source and "policy_rejected_logps - ref_rejected_logps" in source
    assert "LOSSES[name].loss(terms)" in source
    assert "-F.logsigmoid(beta * logits)" in inspect.getsource(LOSSES["sigmoid"].loss)
    # Its hyperparameters are plain values of PairTerms, not properties resolved through the settings.
    assert [name for name, value in vars(PairTerms).items() if isinstance(value, property)] == []
    zero = t(0.0, 0.0)
    terms = PairTerms(zero, zero, zero, zero, zero, zero, zero, zero, delta=t(2.0, -1.0), chosen_lengths=None,
                      rejected_lengths=None, chosen_nll=None, beta=0.5, label_smoothing=0.25, hyperparameters={})
    expected = [0.75 * math.log1p(math.exp(-0.5 * d)) + 0.25 * math.log1p(math.exp(0.5 * d)) for d in (2.0, -1.0)]
    torch.testing.assert_close(LOSSES["sigmoid"].loss(terms), t(*expected), rtol=0, atol=1e-12)


def test_reads_reference_says_whether_each_loss_reads_the_reference():
    # Found by running each loss type with two references (not from the table).
    lengths, policy = t(3.0, 5.0), (t(-4.0, -9.0), t(-6.0, -5.0))

    def loss(name, reference):
        return dpo_loss(*policy, *reference, loss_type=name, label_smoothing=0.1, chosen_lengths=lengths,
                        rejected_lengths=lengths)[0]

    for name, entry in LOSSES.items():
        assert isinstance(entry.reads_reference, bool), name
        reads = not torch.equal(loss(name, (t(-5.0, -7.0), t(-5.5, -6.5))), loss(name, (t(-1.0, -2.0), t(-8.0, -3.0))))
        assert entry.reads_reference == reads, name
    assert LOSSES["sigmoid"].reads["label_smoothing"] is READS_LABEL_SMOOTHING["label_smoothing"]


# Each loss setting away from its default, one at a time: every field of LossSettings and every hyperparameter some
# entry reads has a row here (a test below), so a new setting must say whether it leaves DPO's loss alone.
AWAY_FROM_DEFAULT = {"loss_types": {"loss_type": "hinge"}, "loss_types_twice": {"loss_type": ["sigmoid", "sigmoid"]},
                     "loss_weights": {"loss_weights": [2.0]}, "beta": {"beta": 0.3},
                     "reference_free": {"reference_free": True},
                     "f_divergence_type": {"f_divergence_type": "forward_kl"},
                     "f_alpha_divergence_coef": {"f_alpha_divergence_coef": 0.3}, "cpo_alpha": {"cpo_alpha": 0.5},
                     "ld_alpha": {"ld_alpha": 0.5}, "use_weighting": {"use_weighting": True},
                     "label_smoothing": {"label_smoothing": 0.1}, "discopop_tau": {"discopop_tau": 0.2},
                     "simpo_gamma": {"simpo_gamma": 1.0}, "alpha": {"loss_type": "simpo", "alpha": 0.5}}


def test_every_loss_setting_has_a_row_away_from_its_default():
    named = {f.name for f in dataclasses.fields(LossSettings)} - {"hyperparameters"}
    named |= set(LossSettings.of().hyperparameters)
    assert named <= set(AWAY_FROM_DEFAULT)


@pytest.mark.parametrize("name", AWAY_FROM_DEFAULT)
def test_dpo_alone_is_exactly_the_settings_whose_loss_is_dpos_line(name):
    # compute_loss writes -logsigmoid(beta * logits) itself when `dpo_alone`, and asks the table otherwise: the two
    # must agree wherever it writes it, and it must not write it where the table gives anything else.
    settings = LossSettings.of(**AWAY_FROM_DEFAULT[name])
    generator = torch.Generator().manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (-20 * torch.rand(4, generator=generator, dtype=torch.float64)
                                                  for _ in range(4))
    lengths = t(3.0, 5.0, 7.0, 2.0)
    weights = t(0.5, 1.0, 2.0, 0.25) if settings.use_weighting else None  # WPO's, as compute_loss passes them
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, settings,
                                                        chosen_lengths=lengths, rejected_lengths=lengths,
                                                        pair_weights=weights)
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    line = -torch.nn.functional.logsigmoid(settings.beta * (chosen_logratios - rejected_logratios))
    same = (torch.equal(losses, line) and torch.equal(chosen_rewards, settings.beta * chosen_logratios)
            and torch.equal(rejected_rewards, settings.beta * rejected_logratios))
    assert settings.dpo_alone == same
    assert LossSettings.of().dpo_alone  # the default
