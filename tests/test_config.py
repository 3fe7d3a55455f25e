import dataclasses
import logging
import re

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

from dpo_min import DPOMinConfig, DPOMinTrainer, dpo_loss
from dpo_min.compat import TRL_AUTO_PAD, TRL_FIELDS, TRL_NEGATIONS
from dpo_min.losses import LOSS_TYPES
from dpo_min.trl_surface import TRLSurface


def make(tmp_path, **overrides):
    return DPOMinConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **overrides)


@pytest.mark.parametrize("argv", [["--loss_type", "sigmoid,sft"], ["--loss_type", "sigmoid", "sft"]],
                         ids=["comma", "spaces"])
def test_cli_parses_several_loss_types(tmp_path, argv):
    (args,) = HfArgumentParser(DPOMinConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--loss_weights", "1", "0.5", *argv])
    assert args.loss_type == ["sigmoid", "sft"]
    assert args.loss_weights == [1.0, 0.5]


def test_python_string_loss_type_becomes_a_list(tmp_path):
    assert make(tmp_path, loss_type="ipo").loss_type == ["ipo"]
    assert make(tmp_path).loss_type == ["sigmoid"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss_type": "dpo"}, "valid choices: sigmoid, robust, hinge, ipo"),
        ({"loss_type": "sigmoid,hinge_loss"}, r"unknown loss_type \['hinge_loss'\]"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, r"'robust' needs label_smoothing in \[0, 0.5\)"),
        ({"loss_type": "exo_pair"}, "'exo_pair' needs label_smoothing in"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "one weight per loss_type"),
        ({"label_smoothing": 1.0}, "label_smoothing must be in"),
        ({"ld_alpha": 1.5}, "ld_alpha must be in"),
        ({"loss_type": "aot", "use_weighting": True}, "cannot weight aot"),
        ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "cannot be combined"),
        ({"sync_ref_model": True, "ref_model_mixup_alpha": 0.0}, "ref_model_mixup_alpha"),
        ({"reference_free": True, "precompute_ref_log_probs": True}, "reference_free needs no"),
        ({"ref_adapter_name": "a", "model_adapter_name": "a"}, "another adapter"),
    ],
)
def test_bad_settings_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **overrides)


def test_label_smoothing_help_names_every_loss_that_reads_it():
    # Which losses read it, found by running each with two values (not from the table the help is written from).
    def loss(name, smoothing):
        lengths = torch.tensor([3.0, 5.0], dtype=torch.float64)
        logps = [torch.tensor(values, dtype=torch.float64) for values in ([-4.0, -9.0], [-6.0, -5.0], [-5.0, -7.0],
                                                                          [-5.5, -6.5])]
        return dpo_loss(*logps, loss_type=name, label_smoothing=smoothing, chosen_lengths=lengths,
                        rejected_lengths=lengths)[0]

    readers = {name for name in LOSS_TYPES if not torch.equal(loss(name, 0.1), loss(name, 0.2))}
    help_text = next(f for f in dataclasses.fields(DPOMinConfig) if f.name == "label_smoothing").metadata["help"]
    assert {name for name in LOSS_TYPES if re.search(rf"\b{name}\b", help_text)} == readers
    assert readers >= {"aot_unpaired", "cpo", "simpo"}


def test_trl_only_fields_and_attributes_are_written_in_the_class_bodies():
    # A reader finds them in DPOMinConfig's body and in TRLSurface's (trl_surface.py, a base DPOMinTrainer names),
    # not in classes generated at import.
    assert DPOMinConfig.__bases__ == (TrainingArguments,)
    assert DPOMinTrainer.__bases__ == (TRLSurface, Trainer)
    own_fields = DPOMinConfig.__annotations__
    assert set(TRL_FIELDS) | {f"no_{name}" for name in TRL_NEGATIONS} <= set(own_fields)
    attributes = ("beta", "loss_types", "loss_weights", "label_smoothing", "ld_alpha", "use_weighting",
                  "f_divergence_type", "f_alpha_divergence_coef", "precompute_ref_logps", "padding_free")
    assert all(isinstance(vars(TRLSurface).get(name), property) for name in attributes)


@pytest.mark.parametrize("value, expected", [("auto", None), ("AUTO", None), ("none", None), ("null", None),
                                             (None, None), (8, 8)])
def test_trls_pad_to_multiple_of_values_read_as_compat_names_them(tmp_path, value, expected):
    # TRL's default "auto" (None off AWS Neuron): the one table of such values is compat's.
    assert make(tmp_path, pad_to_multiple_of=value).pad_to_multiple_of == expected
    assert TRL_AUTO_PAD == ("auto", "none", "null")


def test_a_copy_in_memory_keeps_the_hub_token_and_a_pickle_holds_none(tmp_path):
    # The plan works on a deep copy of the config and pushes with it; training_args.bin is a pickle, written to disk.
    import copy
    import pickle

    token = "hf_dpoMinSecret0123456789abcdef"
    config = make(tmp_path, hub_token=token, loss_type=["sigmoid", "sft"])
    copied = copy.deepcopy(config)
    assert copied.hub_token == token and copied.loss_type == ["sigmoid", "sft"]
    assert copied.loss_type is not config.loss_type  # deep: the copy's lists are its own
    assert copy.copy(config).hub_token == token
    assert pickle.loads(pickle.dumps(config)).hub_token is None
    assert token.encode() not in pickle.dumps(copied)


def test_use_liger_kernel_is_accepted_with_one_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dpo_min.config"):
        args = DPOMinConfig(output_dir=str(tmp_path), use_liger_kernel=True)
    [record] = caplog.records
    assert "already hold no [2B, T, V] logits" in record.getMessage()
    assert args.use_liger_kernel is False  # so that Trainer does not patch Liger's kernels into the model


def test_a_loss_field_set_after_the_config_was_built_is_what_the_trainer_reads(tmp_path, tokenizer, hh_pairs):
    """TRL scripts set `args.beta` (or the loss type) on a config before building the trainer: the trainer reads
    the fields as they are then, where it is built (the reference chosen by them) and where it is given args."""
    from conftest import tiny_llama

    from dpo_min import DPOMinTrainer

    args = DPOMinConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=64)
    args.beta, args.loss_type = 0.25, ["simpo"]
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(2)),
                            processing_class=tokenizer)
    assert trainer.loss_settings.beta == 0.25 and trainer.loss_settings.loss_types == ("simpo",)
    assert not trainer.reads_reference and trainer.reference.kind is None  # simpo reads no reference
    replaced = DPOMinConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, beta=0.5)
    trainer.args = replaced
    assert trainer.loss_settings.beta == 0.5 and trainer.dpo_alone
