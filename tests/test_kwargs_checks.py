"""`train.kwargs_checks`: the nested options (lr_scheduler_kwargs, gradient_checkpointing_kwargs,
model_init_kwargs), checked against what they reach before the model loads."""


import pytest
import yaml

from dpo_min.train import main, resolve
from dpo_min.train.args import UsageError
from dpo_min.train.command_line import parse_args


# ---- nested options, checked before the model loads ---------------------------------------------------------------
def test_an_unknown_model_init_kwarg_of_the_default_model_is_refused_before_it_loads(smollm_path, monkeypatch):
    # The default model's config is its cached conversion's: read before any weights load.
    monkeypatch.setattr("dpo_min.train.model_setup.load_model_and_tokenizer",
                        lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UsageError, match=r"model_init_kwargs: unknown key 'bogus'"):
        parse_args(["--dataset", "pairs.jsonl", "--model_init_kwargs", '{"bogus": 1}'])


@pytest.mark.parametrize(("recipe", "message"), [
    ({"lr_scheduler_kwargs": {"nonsense": 1}},
     "lr_scheduler_kwargs (lr_scheduler_type linear): unknown key 'nonsense' (it takes last_epoch)"),
    ({"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {"last_epoch": 3}},  # transformers would drop it
     "lr_scheduler_kwargs (lr_scheduler_type constant): unknown key 'last_epoch' (it takes no keyword)"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": "half"}},
     "lr_scheduler_kwargs (lr_scheduler_type cosine): num_cycles must be float, got 'half'"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "lr_scheduler_kwargs": {"patience": 2.5}},
     "lr_scheduler_kwargs (lr_scheduler_type reduce_lr_on_plateau): patience must be int, got 2.5"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": "False"}},
     "gradient_checkpointing_kwargs: use_reentrant must be bool or null, got 'False'"),
    ({"gradient_checkpointing_kwargs": {"use_reentrnt": False}},
     "gradient_checkpointing_kwargs: unknown key 'use_reentrnt' (did you mean 'use_reentrant'?)"),
    ({"model_init_kwargs": {"bogus": 1}}, "model_init_kwargs: unknown key 'bogus' (not a keyword of from_pretrained"),
    ({"model_init_kwargs": {"local_files_only": "yes"}}, "model_init_kwargs: local_files_only must be bool, got 'yes'"),
    # what the schedule function itself checks, and the keywords its signature requires
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "lr_scheduler_kwargs (lr_scheduler_type cosine_with_min_lr): One "
     "of min_lr or min_lr_rate should be set"),
    ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6, "min_lr_rate": 0.1}},
     "lr_scheduler_kwargs (lr_scheduler_type cosine_with_min_lr): Only one of min_lr or min_lr_rate should be set"),
    ({"lr_scheduler_type": "warmup_stable_decay"},
     "lr_scheduler_kwargs (lr_scheduler_type warmup_stable_decay): needs num_decay_steps"),
    ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 2, "decay_type": "x"}},
     "lr_scheduler_kwargs (lr_scheduler_type warmup_stable_decay): Unknown decay type: x"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"context_fn": None}},
     "gradient_checkpointing_kwargs: context_fn must be Callable, got None"),
], ids=["scheduler-key", "constant-takes-none", "scheduler-type", "plateau-int", "reentrant-string",
        "checkpoint-typo", "init-key", "init-type", "min-lr-neither", "min-lr-both", "wsd-required", "wsd-checks",
        "context-fn-null"])
def test_bad_nested_options_are_one_line_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys,
                                                                recipe, message):
    import dpo_min.train

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset_name": "x.jsonl", **recipe}))
    monkeypatch.setattr(dpo_min.train.model_setup, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main(["--config", str(path), "--output_dir", str(tmp_path / "run")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "run").exists()


def test_nested_options_the_signatures_take_pass(tiny_model_dir):
    _, _, args = parse_args([
        "--model", str(tiny_model_dir), "--lr_scheduler_type", "warmup_stable_decay",
        "--lr_scheduler_kwargs", '{"num_decay_steps": 2, "min_lr_ratio": 0}',
        "--gradient_checkpointing_kwargs", '{"use_reentrant": false, "preserve_rng_state": true}',
        # from_pretrained's own keyword, and an attribute of this model's config (use_cache)
        "--model_init_kwargs", '{"attn_implementation": "sdpa", "use_cache": false, "dtype": "float32"}'])
    assert args.model_init_kwargs["use_cache"] is False and args.lr_scheduler_kwargs["num_decay_steps"] == 2
    # A hub id whose config is not on disk: only the keys and values known are checked, from_pretrained decides the
    # rest (it refuses an unknown one when it builds the model).
    parse_args(["--model", "org/not-cached", "--model_init_kwargs", '{"rope_scaling": null}'])


def test_from_pretrained_keywords_it_drops_are_accepted_and_the_list_holds_every_one_it_pops(tmp_path, tiny_model_dir):
    import inspect
    import re

    from transformers import PreTrainedModel

    from dpo_min.train.kwargs_checks import FROM_PRETRAINED_KWARGS
    from dpo_min.train.model_setup import load_model

    # Every keyword from_pretrained takes from **kwargs, read off transformers' own source; a recipe cannot give
    # objects (a state_dict of tensors, a tqdm class).
    source = inspect.getsource(PreTrainedModel.from_pretrained)
    popped = set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    for names in re.findall(r"for name in \[([^\]]*)\]:\s*_ = kwargs\.pop\(name", source):
        popped |= set(re.findall(r'"(\w+)"', names))
    assert {name for name in popped if not name.startswith("_")} - {"state_dict", "tqdm_class"} <= set(
        FROM_PRETRAINED_KWARGS)
    plan = resolve(["--model", str(tiny_model_dir), "--dataset", "x.jsonl", "--output_dir", str(tmp_path / "run"),
                    "--model_init_kwargs", '{"low_cpu_mem_usage": true, "allow_all_kernels": false}'])
    assert load_model(plan)[0].config.model_type == "llama"  # from_pretrained took and dropped them
