"""The command's decisions, made once by `plan.resolve`, and the run folder as a context manager."""

import copy
import dataclasses
import json
import re

import pytest
from conftest import _one_line_error, write_hh_rows

import dpo_min.train
from dpo_min.train.args import DEMO_DEFAULTS, EVAL_FRACTION, UsageError
from dpo_min.train.plan import EMBEDDED_MODEL_NAME, decide, resolve
from dpo_min.train.run_dir import MANIFEST, OutputDirError, RunFolder


def test_the_demo_is_decided_once_with_its_held_out_share_and_adapter(tmp_path):
    plan = resolve(["--output_dir", str(tmp_path / "demo")])
    assert plan.demo and plan.mixture is None and plan.model_name == EMBEDDED_MODEL_NAME
    assert plan.eval_fraction == DEMO_DEFAULTS["eval_fraction"] and plan.saved_as == "adapter"
    # 64 steps of 4 pairs: only the pairs the run reaches are tokenized
    assert plan.reach == DEMO_DEFAULTS["max_steps"] * DEMO_DEFAULTS["per_device_train_batch_size"] == 256
    assert plan.args.global_batch_size == 4 and plan.seed == plan.args.seed == 42
    assert plan.ties_at_start  # no step-0 evaluation: its figures are known
    # The plan takes over three fields: the staging folder, the push and the step-0 evaluation of a resumed run.
    assert plan.args.output_dir == str(tmp_path / "demo.partial") and plan.folder.named == tmp_path / "demo"


@pytest.mark.parametrize(("argv", "mixture", "eval_fraction", "saved_as"), [
    (["--dataset", "p.jsonl"], None, EVAL_FRACTION, "adapter"),  # the demo's model keeps its adapter, with any data
    (["--dataset", "p.jsonl", "--eval_fraction", "0.2"], None, 0.2, "adapter"),
    (["--datasets", json.dumps([{"path": "p.jsonl"}])], "datasets", 0.0, "adapter"),
    (["--dataset_mixture", json.dumps({"datasets": [{"id": "p.jsonl"}]})], "dataset_mixture", 0.0, "adapter"),
    (["--dataset_mixer", json.dumps({"p.jsonl": 1.0})], "dataset_mixer", 0.0, "adapter"),
    (["--model", "m", "--dataset", "p.jsonl"], None, EVAL_FRACTION, "full"),  # a model of one's own: TRL's default
    (["--model", "m", "--use_peft", "--merge_adapter"], None, EVAL_FRACTION, "merged"),
])
def test_each_form_of_data_gets_its_held_out_share_and_each_model_its_weights(tmp_path, argv, mixture,
                                                                              eval_fraction, saved_as):
    plan = resolve([*argv, "--output_dir", str(tmp_path / "run"), "--num_train_epochs", "1"])
    assert (plan.demo, plan.mixture, plan.eval_fraction, plan.saved_as) == (False, mixture, eval_fraction, saved_as)
    assert plan.reach is None  # epochs, not max_steps: every pair is reached


def test_the_plan_owns_the_push_the_repository_and_the_resume(tmp_path, capsys):
    plan = resolve(["--dataset", "p.jsonl", "--datasets", json.dumps([{"path": "q.jsonl"}]), "--push_to_hub",
                    "--output_dir", str(tmp_path / "my-run"), "--resume_from_checkpoint", "latest"])
    assert plan.push and not plan.args.push_to_hub  # the command pushes the published folder, not Trainer
    assert plan.repo_id == "my-run" and plan.resuming and not plan.args.eval_on_start and not plan.ties_at_start
    assert plan.data.dataset is None and plan.resume_settings["dataset"] is None  # TRL's rule: the mixture is trained
    assert "the mixture is trained, dataset ignored" in capsys.readouterr().err
    named = resolve(["--dataset", "p.jsonl", "--hub_model_id", "me/x", "--output_dir", str(tmp_path / "o")])
    assert (named.repo_id, named.push) == ("me/x", False)
    with pytest.raises(UsageError, match=r"^one mixture per run: datasets and dataset_mixer are both given$"):
        resolve(["--datasets", json.dumps([{"path": "p.jsonl"}]), "--dataset_mixer", json.dumps({"q.jsonl": 1.0}),
                 "--output_dir", str(tmp_path / "o")])


def test_decide_leaves_the_callers_options_as_given_and_warns_on_the_main_process_only(tmp_path, capsys,
                                                                                       monkeypatch):
    from dpo_min.train.command_line import parse_args

    given = parse_args(["--dataset", "p.jsonl", "--datasets", json.dumps([{"path": "q.jsonl"}]), "--push_to_hub",
                        "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "latest"])
    before = copy.deepcopy(given)
    plan = decide(*given)
    assert plan.data.dataset is None and plan.args.output_dir.endswith("run.partial") and not plan.args.push_to_hub
    model_args, data_args, args = given  # ... in the plan's copies; the caller's objects are as parsed
    assert (dataclasses.asdict(model_args), dataclasses.asdict(data_args), args.to_dict()) == (
        dataclasses.asdict(before[0]), dataclasses.asdict(before[1]), before[2].to_dict())
    assert capsys.readouterr().err.count("the mixture is trained, dataset ignored") == 1
    monkeypatch.setattr(type(args), "process_index", property(lambda self: 1))  # another process of the run
    decide(model_args, data_args, args)
    assert "dataset ignored" not in capsys.readouterr().err


@pytest.mark.parametrize(("checkpoint", "resuming", "resumes_here"), [
    (None, False, False),
    ("latest", True, True),  # this folder's interrupted run
    ("{run}.partial/checkpoint-2", True, True),  # a checkpoint of it, named
    ("{elsewhere}/checkpoint-2", True, False),  # another run's checkpoint: a new run here, its training continued
])
def test_the_plan_says_once_what_resuming_means(tmp_path, checkpoint, resuming, resumes_here):
    argv = ["--dataset", "p.jsonl", "--output_dir", str(tmp_path / "run")]
    if checkpoint is not None:
        argv += ["--resume_from_checkpoint", checkpoint.format(run=tmp_path / "run", elsewhere=tmp_path / "other")]
    plan = resolve(argv)
    assert (plan.resuming, plan.resumes_here) == (resuming, resumes_here)
    # A resumed run has its first run's step 0; a new one states its ties (sigmoid reads the reference).
    assert not plan.args.eval_on_start and plan.ties_at_start is not resuming


def test_zero3_full_fine_tuning_loads_the_reference_again(tmp_path, monkeypatch):
    from dpo_min.train import plan as plan_module
    from dpo_min.train.command_line import parse_args

    model_args, data_args, args = parse_args(["--model", "m", "--dataset", "p.jsonl",
                                              "--output_dir", str(tmp_path / "o")])
    monkeypatch.setattr(plan_module.zero, "zero_stage", lambda args: 3)
    assert decide(model_args, data_args, args).reload_reference
    args.precompute_ref_log_probs = True  # the reference is scored once, before the weights are partitioned
    assert not decide(model_args, data_args, args).reload_reference


@pytest.mark.parametrize(("argv", "mode", "fits"), [
    (["--model", "m"], "ref_model", "policy_at_start"),  # full fine-tuning: one model loaded, no ref_model
    (["--model", "m"], "adapter_at_start", "policy_at_start"),
    (["--model", "m", "--use_peft"], "adapter_at_start", "adapter_off"),  # the command wraps a bare model in LoRA
    ([], "ref_model", "adapter_off"),  # the demo's model, with LoRA
    (["--model", "m", "zero3"], "policy_at_start", "ref_model"),  # ZeRO-3 full fine-tuning: the model loaded again
])
def test_a_reference_mode_the_command_does_not_give_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch,
                                                                                      argv, mode, fits):
    # It was the library's ValueError once the model had loaded ("reference_mode='ref_model' needs a ref_model").
    from dpo_min.train import plan as plan_module

    if "zero3" in argv:
        argv = argv[:-1]
        monkeypatch.setattr(plan_module.zero, "zero_stage", lambda args: 3)
    argv = [*argv, "--dataset", "p.jsonl"]
    line = _one_line_error([*argv, "--reference_mode", mode], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"python -m dpo_min.train: error: --reference_mode {mode}: this run trains "), line
    assert line.endswith(f"({fits}); leave --reference_mode out, or give {fits}"), line
    for given in ([fits], [mode, "--loss_type", "simpo"]):  # the one it gives; any, for a loss without a reference
        plan = resolve([*argv, "--reference_mode", *given, "--output_dir", str(tmp_path / "o")])
        assert plan.args.reference_mode == given[0]


def test_the_run_folder_discards_a_failed_run_it_began_and_always_releases_its_lock(tmp_path):
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(RuntimeError), folder.claimed(is_main=True, resumes_here=False):
        assert folder.lock_path.exists()
        raise RuntimeError("before begin: nothing of the run's to discard")
    assert not folder.lock_path.exists()
    with pytest.raises(RuntimeError), folder.claimed(is_main=True, resumes_here=False):
        folder.begin({})
        (folder.staging / "half-written").write_text("x")
        raise RuntimeError("after begin")
    assert not folder.staging.exists() and not folder.lock_path.exists()
    with folder.claimed(is_main=True, resumes_here=False):
        folder.begin({})
        folder.publish()
    assert (folder.output_dir / MANIFEST).exists() and not folder.lock_path.exists()
    # Another process of the run neither locks nor checks: the main one may have made the folder meanwhile.
    with folder.claimed(is_main=False, resumes_here=False):
        assert not folder.lock_path.exists()
    (folder.output_dir / "mine.txt").write_text("the user's")
    with pytest.raises(OutputDirError, match="not a dpo_min run's"), folder.claimed(True, False):
        pass
    assert not folder.lock_path.exists()


def _snapshot(plan):
    """The plan field by field, in comparable form: the option sets as dicts, the folder by its paths."""
    fields = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)}
    fields.update(model=dataclasses.asdict(plan.model), data=dataclasses.asdict(plan.data), args=plan.args.to_dict(),
                  folder=(plan.folder.named, plan.folder.output_dir, plan.folder.staging))
    return fields


def _run_recording_the_plan(monkeypatch, argv):
    """main(argv), with the plan resolve returned and a deep copy of it taken before any phase ran."""
    resolved = []

    def recording_resolve(argv):
        plan = resolve(argv)
        resolved.append((plan, copy.deepcopy(_snapshot(plan))))
        return plan

    monkeypatch.setattr(dpo_min.train, "resolve", recording_resolve)
    assert dpo_min.train.main(argv) == 0
    (plan, before), = resolved
    after = _snapshot(plan)
    changed = {f"{name}.{key}": (before[name][key], value[key]) for name, value in after.items()
               for key in (value if isinstance(value, dict) else []) if value[key] != before[name].get(key)}
    changed |= {name: (before[name], value) for name, value in after.items()
                if not isinstance(value, dict) and value != before[name]}
    return changed  # field -> (as resolved, after the run)


@pytest.mark.parametrize("extra", [
    ["--eval_fraction", "0.25", "--model_init_kwargs", '{"attn_implementation": "eager"}'],  # used up by the load
    ["--eval_fraction", "0"],  # no held-out pairs: no step-0 evaluation to run
    ["--datasets", '[{"path": "DATA"}]', "--test_split_size", "3", "--dtype", "float32"],  # a mixture
])
def test_running_the_phases_leaves_the_plan_as_resolved(tmp_path, tiny_model_dir, isolated_cache, monkeypatch,
                                                        extra):
    # The phases read the plan and never write it: what resolve returned is what the run did, to the last field.
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    extra = [value.replace("DATA", str(data_file)) for value in extra]
    data = [] if "--datasets" in extra else ["--dataset", str(data_file)]
    argv = ["--model", str(tiny_model_dir), *data, "--output_dir", str(tmp_path / "run"),
            "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--num_samples", "1", "--max_new_tokens", "2", "--save_strategy", "no", "--disable_tqdm", "true",
            "--use_peft", "--eval_on_start", "true", *extra]
    assert _run_recording_the_plan(monkeypatch, argv) == {}


def test_a_resumed_run_leaves_its_plan_as_resolved(tmp_path, tiny_model_dir, isolated_cache, monkeypatch):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    argv = ["--model", str(tiny_model_dir), "--dataset", str(data_file), "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--num_samples", "0", "--save_strategy", "steps",
            "--save_steps", "1", "--disable_tqdm", "true", "--use_peft"]
    assert dpo_min.train.main([*argv, "--output_dir", str(tmp_path / "first")]) == 0
    checkpoint = tmp_path / "first" / "checkpoint-1"
    assert checkpoint.is_dir()
    changed = _run_recording_the_plan(monkeypatch, [*argv, "--output_dir", str(tmp_path / "second"),
                                                    "--resume_from_checkpoint", str(checkpoint)])
    assert changed == {}


def test_the_plan_decides_how_the_model_loads_and_the_load_passes_it_as_decided(tmp_path, monkeypatch):
    from dpo_min.train import model_setup
    from dpo_min.train.command_line import parse_args

    plan = resolve(["--model", "m", "--dataset", "p.jsonl", "--model_revision", "v2", "--dtype", "bfloat16",
                    "--model_init_kwargs", '{"attn_implementation": "eager", "low_cpu_mem_usage": true}',
                    "--output_dir", str(tmp_path / "o")])
    assert (plan.load.dtype, plan.load.bits) == ("bfloat16", None)
    assert plan.load.kwargs == {"revision": "v2", "trust_remote_code": False, "attn_implementation": "eager",
                                "low_cpu_mem_usage": True}
    assert (plan.resume_settings["dtype"], plan.resume_settings["model_revision"]) == ("bfloat16", "v2")
    # A library caller's model_init_kwargs dtype and revision win over the named options, and the resume records
    # what loads: one owner of the decision.
    model_args, data_args, args = parse_args(["--model", "m", "--dataset", "p.jsonl", "--use_peft",
                                              "--output_dir", str(tmp_path / "o")])
    args.model_init_kwargs = {"torch_dtype": "float16", "revision": "v3"}
    plan = decide(model_args, data_args, args)
    assert (plan.load.dtype, plan.load.kwargs["revision"]) == ("float16", "v3")
    assert (plan.resume_settings["dtype"], plan.resume_settings["model_revision"]) == ("float16", "v3")
    loaded = []
    monkeypatch.setattr(model_setup, "load_model_and_tokenizer",
                        lambda name, dtype, **kwargs: loaded.append((name, dtype, kwargs)) or (object(), object()))
    model_setup.load_model(plan)
    assert loaded == [("m", "float16", plan.load.kwargs)] and plan.load.kwargs["revision"] == "v3"
    quantized = resolve(["--model", "m", "--dataset", "p.jsonl", "--use_peft", "--load_in_4bit",
                         "--output_dir", str(tmp_path / "o")])
    assert (quantized.load.bits, quantized.load.compute_dtype, quantized.load.kwargs["device_map"]) == (
        4, "float32", {"": 0})  # dtype auto: the quantized layers compute in float32


@pytest.mark.parametrize("pairs", [1, 2, 7, 10, 20, 33, 658])
@pytest.mark.parametrize("eval_fraction", [0.01, 0.04, 0.05, 0.1, 0.3, 1 / 3, 0.5, 0.9])
def test_the_plans_held_out_count_is_what_datasets_holds_out_of_that_fraction(tmp_path, pairs, eval_fraction):
    from datasets import Dataset

    plan = resolve(["--dataset", "p.jsonl", "--eval_fraction", str(eval_fraction), "--output_dir", str(tmp_path)])
    rows = Dataset.from_dict({"row": list(range(pairs))})
    try:  # the independent reference: datasets' own rounding of the fraction
        theirs = rows.train_test_split(test_size=plan.eval_fraction, seed=plan.seed)
    except ValueError:  # datasets refuses a split that leaves one side empty
        count = plan.held_out_count(pairs)
        assert count < 1 or pairs - count < 1
        return
    assert plan.held_out_count(pairs) == len(theirs["test"])
    ours = rows.train_test_split(test_size=plan.held_out_count(pairs), seed=plan.seed)
    assert (ours["train"]["row"], ours["test"]["row"]) == (theirs["train"]["row"], theirs["test"]["row"])


def test_a_share_that_rounds_to_below_one_pair_holds_out_one_as_datasets_rounds_it(tmp_path):
    # 10 pairs at 0.04 is 0.4 of a pair: datasets holds out 1 (it rounds up); the check before it rounded to 0 and
    # refused the run as holding out no pair.
    from test_data import load_pairs_of

    train, held_out = load_pairs_of(tmp_path, dataset=str(write_hh_rows(tmp_path / "pairs.jsonl", 10)),
                                    eval_fraction=0.04)
    assert (len(train), len(held_out)) == (9, 1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--dataset", "p.jsonl", "--streaming"], "--streaming needs --max_steps"),
    (["--dataset", "p.jsonl", "--streaming", "--max_steps", "2", "--precompute_ref_log_probs", "true"],
     "--streaming computes the reference on the fly"),
    (["--dataset", "p.jsonl", "--streaming", "--max_steps", "2", "--eval_fraction", "0.5"],
     "--eval_fraction 0.5: a stream has no length to hold out a fraction of"),
    (["--dataset", "p.jsonl", "--test_split_size", "2"], "test_split_size belongs to a mixture"),
    (["--dataset", "FILE", "--eval_split", "test"], "a file has one split, use --eval_fraction"),
    (["--eval_split", "test"], "a file has one split, use --eval_fraction"),  # the embedded pairs are a file
    (["--datasets", '[{"path": "p.jsonl"}]', "--strict_pairs"], "--strict_pairs applies to one dataset"),
    (["--datasets", '[{"path": "p.jsonl"}]', "--eval_split", "test"], "--eval_split picks a split of one dataset"),
    (["--dataset_mixture", '{"datasets": [{"id": "p.jsonl"}]}', "--streaming", "--max_steps", "2"],
     "--streaming: dataset_mixture is read whole"),
    (["--dataset_mixer", '{"p.jsonl": 1.0}', "--test_split_size", "2"], "dataset_mixer holds out its test splits"),
])
def test_data_options_that_cannot_go_together_are_refused_by_the_plan_before_any_file_is_read(tmp_path, argv,
                                                                                            message):
    # p.jsonl exists nowhere: the refusal needs no row (and comes before the folder is locked or made).
    file = tmp_path / "pairs.jsonl"
    file.write_text("")
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve([*[value.replace("FILE", str(file)) for value in argv], "--output_dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.lock").exists()
