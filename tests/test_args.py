"""`train.args`, the command's options: the demo's chat template (SmolLM2's own, less its default system message),
and values in messages (no message shows a token)."""

import json

import pytest
from conftest import SECRET, _one_line_error, _recipe

from dpo_min.train.args import SMOLLM2_TEMPLATE_WITHOUT_SYSTEM


def test_the_demo_template_is_smollm2s_own_less_its_default_system_message(tokenizer):
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    own = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    demo = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert own == system + demo
    with_system = [{"role": "system", "content": "Be brief."}, *conversation]  # a system turn of its own: as before
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == tokenizer.apply_chat_template(
        with_system, tokenize=False, chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)
    prompt = conversation[:1]
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == system + \
        tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                      chat_template=SMOLLM2_TEMPLATE_WITHOUT_SYSTEM)


@pytest.mark.parametrize(("argv", "recipe", "message"), [
    (["--hub_tokn", SECRET], None, "unknown argument(s): --hub_tokn <hidden> (did you mean --hub_token?)"),
    ([f"--hub-tokn={SECRET}"], None, "unknown argument(s): --hub-tokn=<hidden>"),
    ([], f"hub_token: [{SECRET}]\n", "hub_token takes a single value, got a list (not shown)"),
    (["--dataset", "x.jsonl", "--model_init_kwargs", json.dumps({"token": [SECRET]})], None,
     "model_init_kwargs: token must be str or bool or null, got a list (not shown)"),
], ids=["typo-flag", "typo-flag-inline", "recipe-list", "model-init-kwargs"])
def test_no_message_shows_a_token(tmp_path, capsys, monkeypatch, argv, recipe, message):
    argv = [*(_recipe(tmp_path, recipe) if recipe else []), *argv]
    line = _one_line_error(argv, tmp_path, capsys, monkeypatch)
    assert message in line and SECRET not in line and SECRET[3:] not in line, line
