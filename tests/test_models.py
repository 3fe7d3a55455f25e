"""convert_gguf when two processes convert the same file at once (two runs, or two test workers, on a fresh
machine): both get the one finished checkpoint, and no staging folder is left."""

import os

from conftest import tiny_llama

from dpo_min import models


def test_a_conversion_that_loses_the_race_returns_the_winners_checkpoint(tmp_path, monkeypatch, tokenizer):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: loading is replaced below")
    monkeypatch.setenv("DPO_MIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny_llama())
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    real_replace, raced = os.replace, []

    def replace_after_the_other_process(source, target):
        if not raced:  # the other process finishes its whole conversion while this one is about to rename
            raced.append(None)
            raced[0] = models.convert_gguf(gguf)
        real_replace(source, target)

    monkeypatch.setattr(models.os, "replace", replace_after_the_other_process)
    target = models.convert_gguf(gguf)
    assert raced == [target]
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert [path.name for path in target.parent.iterdir()] == [target.name]  # no .converting-* folder left
