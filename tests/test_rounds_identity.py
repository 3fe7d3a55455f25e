"""A resume of DPO in rounds checks it has the same rewards by what decides them (`dpo_min/rounds/identity.py`), not
by a function's own source alone: a module constant it reads, a helper it calls, a callable object's constructor
arguments and a reward model's weights each change settings.json's reward_identity, and the resume is refused in one
line naming the old and the new digest."""

import functools
import importlib
import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from test_rounds import PROMPTS, tiny_policy
from transformers import LlamaConfig, LlamaForSequenceClassification

from dpo_min.rounds import RoundsConfig, RoundsError, run_rounds
from dpo_min.rounds.rewards import Rewards

CONSTANT = """SIGN = {sign}


def signed(completions, **_):
    return [SIGN * 1.0 for _ in completions]
"""
HELPER = "def sign():\n    return {sign}\n"
CALLS_HELPER = """from rw_helper import sign


def by_helper(completions, **_):
    return [sign() * 1.0 for _ in completions]
"""
SCORER = """class Scorer:
    def __init__(self, sign):
        self.sign = sign

    def __call__(self, completions, **_):
        return [self.sign * 1.0 for _ in completions]
"""
MODULES = ("rw_constant", "rw_helper", "rw_calls", "rw_scorer")


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """The reward modules above in the working folder, importable; write(name, text) rewrites one and reloads it."""
    for name, text in zip(MODULES, (CONSTANT.format(sign=1), HELPER.format(sign=1), CALLS_HELPER, SCORER)):
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def write(name, text):
        (tmp_path / f"{name}.py").write_text(text)
        return importlib.reload(importlib.import_module(name))
    yield write
    for name in MODULES:
        sys.modules.pop(name, None)


def config(tmp_path) -> RoundsConfig:
    # Every reward here gives each sample the same total: no pair, no training; the run stops after round 1.
    return RoundsConfig(str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=2)


def refused(tmp_path, tokenizer, reward, name, key) -> None:
    """The resume is refused in one line naming `key` of `name`'s identity, old (as recorded) -> new."""
    old = json.loads((tmp_path / "run" / "settings.json").read_text())["reward_identity"][name][key]
    new = Rewards(reward).identity()[name][key]
    assert old != new
    with pytest.raises(RoundsError) as error:
        run_rounds(tiny_policy(), tokenizer, PROMPTS, reward, config(tmp_path))
    assert len(str(error.value).splitlines()) == 1
    assert re.search(re.escape(f"other settings (reward_identity[{name}][{key}] {old[:12]} -> {new[:12]})"),
                     str(error.value)), str(error.value)


def test_a_changed_module_constant_is_refused_on_resume(modules, tmp_path, tokenizer):
    module = importlib.import_module("rw_constant")
    run_rounds(tiny_policy(), tokenizer, PROMPTS, module.signed, config(tmp_path))
    run_rounds(tiny_policy(), tokenizer, PROMPTS, module.signed, config(tmp_path))  # the same: it resumes
    source = Rewards(module.signed).identity()["signed"]["source (sha256)"]
    edited = modules("rw_constant", CONSTANT.format(sign=-1))
    # The function's own source is unchanged: what the resume compared before.
    assert Rewards(edited.signed).identity()["signed"]["source (sha256)"] == source
    refused(tmp_path, tokenizer, edited.signed, "signed", "code (sha256)")
    # The file as it was, the constant set at run time: read as the function reads it.
    restored = modules("rw_constant", CONSTANT.format(sign=1))
    run_rounds(tiny_policy(), tokenizer, PROMPTS, restored.signed, config(tmp_path))
    restored.SIGN = -1
    refused(tmp_path, tokenizer, restored.signed, "signed", "code (sha256)")


def test_a_changed_helper_in_another_module_is_refused_on_resume(modules, tmp_path, tokenizer):
    calls = importlib.import_module("rw_calls")
    run_rounds(tiny_policy(), tokenizer, PROMPTS, calls.by_helper, config(tmp_path))
    modules("rw_helper", HELPER.format(sign=-1))
    refused(tmp_path, tokenizer, importlib.reload(calls).by_helper, "by_helper", "code (sha256)")


def test_a_callable_objects_constructor_argument_is_refused_on_resume(modules, tmp_path, tokenizer):
    scorer = importlib.import_module("rw_scorer").Scorer
    run_rounds(tiny_policy(), tokenizer, PROMPTS, scorer(1), config(tmp_path))
    run_rounds(tiny_policy(), tokenizer, PROMPTS, scorer(1), config(tmp_path))  # another object, the same: resumes
    refused(tmp_path, tokenizer, scorer(-1), "Scorer", "code (sha256)")


def test_the_identity_is_the_same_in_another_process(modules, tmp_path):
    # No address or id may enter it: a resume is another process.
    made = "Rewards([signed, by_helper, Scorer(2), functools.partial(signed, weight=[1, {2}])]).identity()"
    script = textwrap.dedent(f"""
        import functools, json, sys
        sys.path.insert(0, sys.argv[1])
        from dpo_min.rounds.rewards import Rewards
        from rw_calls import by_helper
        from rw_constant import signed
        from rw_scorer import Scorer
        print(json.dumps({made}))
    """)
    there = json.loads(subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                                      check=True, cwd=str(tmp_path)).stdout)
    namespace = {"Rewards": Rewards, "functools": functools, **{name: getattr(importlib.import_module(module), name)
                 for module, name in (("rw_calls", "by_helper"), ("rw_constant", "signed"), ("rw_scorer", "Scorer"))}}
    here = eval(made, namespace)
    assert here == there and len({entry["code (sha256)"] for entry in here.values()}) == 4


def save_reward_model(folder, tokenizer, seed) -> None:
    torch.manual_seed(seed)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_new_reward_model_weights_in_the_same_folder_are_refused_on_resume(tmp_path, tokenizer):
    folder = tmp_path / "rm"
    save_reward_model(folder, tokenizer, seed=0)
    small = RoundsConfig(str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=2,
                         training={"per_device_train_batch_size": 2, "disable_tqdm": True, "save_strategy": "no"})
    run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], str(folder), small)
    save_reward_model(folder, tokenizer, seed=0)  # the same weights written again (a new mtime): it resumes
    run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], str(folder), small)
    old = json.loads((tmp_path / "run" / "settings.json").read_text())["reward_identity"]["rm"]["weights (sha256)"]
    save_reward_model(folder, tokenizer, seed=1)  # new weights, the same path
    with pytest.raises(RoundsError) as error:
        run_rounds(tiny_policy(), tokenizer, PROMPTS[:2], str(folder), small)
    new = Rewards(str(folder)).identity()["rm"]["weights (sha256)"]
    assert old != new and len(str(error.value).splitlines()) == 1
    assert f"other settings (reward_identity[rm][weights (sha256)] {old[:12]} -> {new[:12]}): " in str(error.value)


def test_a_run_recorded_before_the_code_digest_resumes_and_is_compared_by_what_it_recorded(modules, tmp_path,
                                                                                           tokenizer):
    module = importlib.import_module("rw_constant")
    run_rounds(tiny_policy(), tokenizer, PROMPTS, module.signed, config(tmp_path))
    path = tmp_path / "run" / "settings.json"
    recorded = json.loads(path.read_text())
    del recorded["reward_identity"]["signed"]["code (sha256)"]
    path.write_text(json.dumps(recorded))
    run_rounds(tiny_policy(), tokenizer, PROMPTS, module.signed, config(tmp_path))
    modules("rw_constant", CONSTANT.format(sign=-1))  # what it did not record is not compared
    run_rounds(tiny_policy(), tokenizer, PROMPTS, importlib.import_module("rw_constant").signed, config(tmp_path))
