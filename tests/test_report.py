"""Completions during training, as TRL's LogCompletionsCallback: samples.jsonl and a TensorBoard table."""

import json

from conftest import write_hh_rows
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpo_min.train import main


def test_each_evaluation_logs_scalars_and_completions_to_tensorboard(tmp_path, tiny_model_dir):
    data_file = write_hh_rows(tmp_path / "pairs.jsonl", 12)
    output_dir = tmp_path / "run"
    code = main(["--model", str(tiny_model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir),
                 "--eval_fraction", "0.25", "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--eval_strategy", "steps", "--eval_steps", "1", "--learning_rate", "5e-3", "--num_samples", "2",
                 "--max_new_tokens", "3", "--logging_steps", "1", "--report_to", "tensorboard",
                 "--disable_tqdm", "true"])
    assert code == 0
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    # Evaluations at steps 0 (eval_on_start), 1 and 2 (eval_strategy); the one at the last step is the "after" figure,
    # not followed by a second evaluation of the same weights.
    assert [s["step"] for s in samples] == [0, 0, 1, 1, 2, 2]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert [s["prompt"] for s in samples[-2:]] == [s["prompt"] for s in samples[:2]] and metrics["after"]

    [logs] = (output_dir / "runs").iterdir()  # transformers' default folder, inside the output folder
    events = EventAccumulator(str(logs), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    accuracy = events.Scalars("eval/rewards/accuracies")
    assert sorted({e.step for e in accuracy}) == [0, 1, 2]
    assert accuracy[-1].value == metrics["after"]["eval_rewards/accuracies"]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/completions/text_summary")}
    assert sorted(tables) == [0, 1, 2]
    for sample in samples[-2:]:  # the last table holds the final completions
        assert f"| {sample['policy']} |" in tables[2] or sample["policy"] == ""
