"""precompute_ref_log_probs caches on disk: a second run skips the reference pass; model, data or truncation
changes recompute."""

import logging

import datasets
import pytest
import torch
from conftest import stopping_reference, tiny_llama
from peft import LoraConfig

import dpo_min.trainer_setup
from dpo_min import DPOMinConfig, DPOMinTrainer


@pytest.fixture
def precompute(tmp_path, monkeypatch, tokenizer, hh_pairs):
    """precompute(**changes) -> (reference passes it made, ref_chosen_logps), in a fresh cache under tmp_path."""
    monkeypatch.setenv("DPO_MIN_CACHE", str(tmp_path / "cache"))
    calls = []
    reference_logps = DPOMinTrainer.reference_logps

    def counted(self, inputs):
        calls.append(1)
        return reference_logps(self, inputs)

    monkeypatch.setattr(DPOMinTrainer, "reference_logps", counted)

    def run(ref_seed=1, rows=range(4), max_length=1024, seed=7, lora=False):
        args = DPOMinConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, seed=seed,
                            precompute_ref_log_probs=True, max_length=max_length, per_device_eval_batch_size=2)
        peft_config = LoraConfig(r=4, target_modules=["q_proj"]) if lora else None
        trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(rows),
                                processing_class=tokenizer,
                                ref_model=None if lora else tiny_llama(seed=ref_seed), peft_config=peft_config)
        calls.clear()
        trainer.get_train_dataloader()
        return len(calls), trainer.train_dataset["ref_chosen_logps"]

    return run


def test_second_run_skips_the_reference_pass(precompute, tmp_path):
    passes, first = precompute()
    assert passes == 2  # 4 pairs, batches of 2
    passes, second = precompute()
    assert passes == 0
    assert second == first
    assert len(list((tmp_path / "cache" / "ref_logps").glob("*.pt"))) == 1


@pytest.mark.parametrize("content, reason", [
    ({"chosen_logps": torch.zeros(4), "rejected_logps": torch.zeros(4)},
     "holds ['chosen_logps', 'rejected_logps'], not the keys ['chosen', 'rejected']"),
    ({"chosen": torch.zeros(3), "rejected": torch.zeros(3)}, "'chosen' is (3,), not a float tensor of shape (4,)"),
    ([1, 2], "holds list, not the keys"),
], ids=["wrong-keys", "wrong-length", "not-a-dict"])
def test_a_cache_entry_with_the_wrong_content_is_named_moved_aside_and_recomputed(precompute, tmp_path, caplog,
                                                                                  content, reason):
    _, first = precompute()
    (entry,) = (tmp_path / "cache" / "ref_logps").glob("*.pt")
    torch.save(content, entry)
    with caplog.at_level(logging.WARNING, logger="dpo_min.ref_cache"):
        passes, second = precompute()
    assert passes == 2 and second == first
    assert f"reference log-prob cache {entry} {reason}" in caplog.text and "recomputing" in caplog.text
    assert torch.load(entry.with_name(entry.name + ".bad"), weights_only=True) is not None  # kept for a look
    assert set(torch.load(entry, weights_only=True)) == {"chosen", "rejected"}  # and a good entry written again


@pytest.mark.parametrize("change", [{"ref_seed": 2}, {"rows": range(1, 5)}, {"max_length": 128}],
                         ids=["model", "data", "max_length"])
def test_a_change_of_model_data_or_truncation_recomputes(precompute, change):
    _, first = precompute()
    passes, changed = precompute(**change)
    assert passes == 2
    assert changed != first


def test_adapter_reference_key_ignores_the_trained_adapter(precompute):
    # The reference is the base model with the adapter off: a different adapter init (seed) still hits the cache.
    assert precompute(lora=True, seed=1)[0] == 2
    assert precompute(lora=True, seed=2)[0] == 0


def test_pairs_fingerprint_follows_the_selected_rows():
    from datasets import Dataset

    from dpo_min.ref_cache import fingerprint_pairs

    rows = [{"prompt_ids": [i, i + 1], "chosen_ids": [i + 2], "rejected_ids": [i + 3, 2]} for i in range(4)]
    tokenized = Dataset.from_list(rows)
    # Non-contiguous selections keep the whole table underneath, with an index mapping on top.
    assert fingerprint_pairs(tokenized.select([0, 2])) == fingerprint_pairs(Dataset.from_list([rows[0], rows[2]]))
    assert fingerprint_pairs(tokenized.select([0, 2])) != fingerprint_pairs(tokenized.select([0, 3]))


@pytest.mark.parametrize("disable_tqdm", [False, True], ids=["bar", "no-bar"])
def test_tokenizing_and_the_reference_pass_show_a_progress_bar_unless_disabled(tmp_path, tokenizer, hh_pairs,
                                                                                capsys, disable_tqdm, monkeypatch):
    # Tokenizing is a datasets.map, whose bar datasets switches on and off (tqdm itself reads conftest's
    # TQDM_DISABLE once, at import): record the switch as the trainer tokenizes.
    seen = []
    tokenize = dpo_min.trainer_setup.tokenize_dataset

    def recording_tokenize(*args, **kwargs):
        seen.append(datasets.is_progress_bar_enabled())
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(dpo_min.trainer_setup, "tokenize_dataset", recording_tokenize)
    args = DPOMinConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, disable_tqdm=disable_tqdm,
                        precompute_ref_log_probs=True, per_device_eval_batch_size=2)
    capsys.readouterr()
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(4)),
                            processing_class=tokenizer, ref_model=tiny_llama(seed=1))
    assert seen == [not disable_tqdm]
    trainer.get_train_dataloader()
    shown = capsys.readouterr().err
    assert ("reference log-probs" in shown and "/2 " in shown) != disable_tqdm, shown  # a bar over 2 batches


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "failure"])
def test_a_stopped_reference_pass_keeps_its_finished_batches_and_the_rerun_computes_only_the_rest(
        precompute, tmp_path, monkeypatch, stop):
    _, uninterrupted = precompute(rows=range(8))  # 4 batches of 2
    for entry in (tmp_path / "cache" / "ref_logps").glob("*.pt"):
        entry.unlink()
    with monkeypatch.context() as patch:
        patch.setattr(DPOMinTrainer, "reference_logps", stopping_reference(3, stop)[0])
        with pytest.raises(stop):
            precompute(rows=range(8))
    (partial,) = (tmp_path / "cache" / "ref_logps").glob("*.partial.pt")
    assert len(torch.load(partial, weights_only=True)["chosen"]) == 2
    passes, resumed = precompute(rows=range(8))
    assert passes == 2  # the third and fourth batches only
    assert resumed == uninterrupted  # bit for bit
    assert not partial.exists()  # the whole entry replaced it
    assert precompute(rows=range(8))[0] == 0


def test_a_partial_entry_of_other_data_is_not_read(precompute, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(DPOMinTrainer, "reference_logps", stopping_reference(2)[0])
        with pytest.raises(KeyboardInterrupt):
            precompute(rows=range(4))
    passes, _ = precompute(rows=range(1, 5))  # other pairs: another key, the whole pass
    assert passes == 2
