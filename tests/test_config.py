import pytest
from transformers import HfArgumentParser

from dpo_min import DPOMinConfig


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
