"""Groups of k answers to a prompt: TRL's DPOTrainer, dpo_min padded, share_prompt per pair and group_by_prompt on the
same pairs: pairs per second and peak memory, as ratios to TRL measured in one run.

    python benchmarks/bench_groups.py                       # k = 4 and 8, LoRA and full fine-tuning
    python benchmarks/bench_groups.py --smoke               # a tiny random model, one step each: does it run

The data (the same pairs, in the same order, for every config): each group is one HH-RLHF prompt (its user turn cut
to --prompt-tokens tokens) with k answers (HH answers cut to --answer-tokens tokens): k = 4 gives every pair of the
4 (6 pairs, answer i better than answer j for i < j), k = 8 pits 4 better answers against 4 worse (16 pairs). A step
trains --groups-per-step whole groups (6 or 16 pairs each); the printed header states the mean prompt and answer
lengths in tokens as the chat template renders them. Every config runs in its own process (so peak memory is its
own) on SmolLM2-135M-Instruct (the embedded model), float32, sequential order, no gradient checkpointing; the first
--warmup steps are not timed, figures are medians over the timed steps (peak memory: the process's RSS on a CPU,
torch's peak allocation on a GPU). The layouts and the step timer are bench_vs_trl.py's.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_trl import HH_PATH, ratio, resolve_model  # noqa: E402 (after the path it needs)

# name -> (trainer, DPOMinConfig overrides)
METHODS = {
    "trl": ("trl", {}),
    "padded": ("dpo_min", {}),
    "shared": ("dpo_min", {"padding_free": True, "share_prompt": True}),
    "groups": ("dpo_min", {"padding_free": True, "group_by_prompt": True}),
}
CONFIGS = [f"{mode}/k{k}/{method}" for mode in ("lora", "full") for k in (4, 8) for method in METHODS]


def group_pairs(k: int) -> list[tuple[int, int]]:
    """(better, worse) answer positions of a group: every pair of 4, or 4 better against 4 worse."""
    if k == 4:
        return [(a, b) for a in range(4) for b in range(a + 1, 4)]
    return [(a, b) for a in range(k // 2) for b in range(k // 2, k)]


def make_groups(tokenizer, k: int, count: int, prompt_tokens: int, answer_tokens: int) -> list[dict]:
    """`count` groups of HH prompts and answers cut to the given token counts, as conversational pairs."""
    from dpo_min import load_preference_dataset

    def cut(text: str, tokens: int) -> str:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])

    hh = load_preference_dataset(str(HH_PATH))
    answers = [cut(row[side][-1]["content"], answer_tokens) for row in hh for side in ("chosen", "rejected")]
    pairs = []
    for group in range(count):
        prompt = [{"role": "user", "content": cut(hh[group]["prompt"][-1]["content"], prompt_tokens)}]
        mine = answers[group * k:(group + 1) * k]
        pairs += [{"prompt": prompt, "chosen": [{"role": "assistant", "content": mine[a]}],
                   "rejected": [{"role": "assistant", "content": mine[b]}]} for a, b in group_pairs(k)]
    return pairs


def run_config(config: str, model_path: str, options: argparse.Namespace, output_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from dpo_min import DPOMinConfig, DPOMinTrainer, load_model_and_tokenizer
    from dpo_min.tokenizing import tokenize_dataset

    mode, k, method = config.split("/")
    k = int(k[1:])
    trainer_kind, overrides = METHODS[method]
    model, tokenizer = load_model_and_tokenizer(model_path)
    steps = options.warmup + options.steps
    per_step = options.groups_per_step * len(group_pairs(k))
    pairs = Dataset.from_list(make_groups(tokenizer, k, options.groups_per_step * steps, options.prompt_tokens,
                                          options.answer_tokens))
    tokenized = tokenize_dataset(pairs, tokenizer, max_length=1024)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_config = lora if mode == "lora" else None
    settings = {"output_dir": output_dir, "per_device_train_batch_size": per_step, "max_steps": steps,
                "learning_rate": 1e-5, "bf16": False, "gradient_checkpointing": False, "logging_steps": 10_000,
                "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 42,
                "dataloader_num_workers": 0, "train_sampling_strategy": "sequential",
                "use_cpu": not torch.cuda.is_available(), "max_length": 1024}
    if trainer_kind == "trl":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, args=DPOConfig(**settings), train_dataset=pairs, processing_class=tokenizer,
                             peft_config=peft_config)
    else:
        trainer = DPOMinTrainer(model, args=DPOMinConfig(**settings, **overrides), train_dataset=tokenized,
                                processing_class=tokenizer, peft_config=peft_config)
    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimer())
    trainer.train()
    completions = [len(ex[side]) for ex in tokenized for side in ("chosen_ids", "rejected_ids")]
    return {
        "config": config,
        "pairs_per_s": statistics.median(per_step / s for s in step_times[options.warmup:]),
        "peak_mb": (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available()
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "pairs_per_step": per_step,
        "prompt_tokens": statistics.mean(len(ex["prompt_ids"]) for ex in tokenized),
        "answer_tokens": statistics.mean(completions),
    }


def print_table(results: list[dict]) -> None:
    print("| config | pairs/s | vs TRL | vs padded | vs share_prompt | peak MB | vs TRL | vs padded "
          "| vs share_prompt |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_name = {r["config"]: r for r in results}
    for r in results:
        group = r["config"].rsplit("/", 1)[0]
        peers = [by_name.get(f"{group}/{peer}") for peer in ("trl", "padded", "shared")]
        cells = [r["config"], f"{r['pairs_per_s']:.2f}",
                 *(ratio(r["pairs_per_s"], peer and peer["pairs_per_s"]) for peer in peers), f"{r['peak_mb']:.0f}",
                 *(ratio(r["peak_mb"], peer and peer["peak_mb"]) for peer in peers)]
        print("| " + " | ".join(cells) + " |")


def tiny_model(folder: Path) -> str:
    """--smoke: a two-layer random Llama with the embedded model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dpo_min.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--groups-per-step", type=int, default=1, help="whole groups a step trains")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="most tokens of a prompt's user turn")
    parser.add_argument("--answer-tokens", type=int, default=128, help="most tokens of an answer")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, metavar="MODE/kK/METHOD",
                        help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--model", default=None, help="hub id, folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, 1 step, k = 4: it runs")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.smoke:
        options.steps, options.warmup, options.prompt_tokens, options.answer_tokens = 1, 0, 16, 8
        options.configs = [config for config in options.configs if "/k4/" in config]
    return options


def main() -> None:
    options = parse()
    with tempfile.TemporaryDirectory(prefix="bench_groups-") as scratch:
        if options.worker:
            print("RESULT " + json.dumps(run_config(options.worker, options.model, options, scratch)))
            return
        if options.smoke:
            model_path, model_name = tiny_model(Path(scratch) / "tiny"), "a tiny random Llama (--smoke)"
        else:
            model_path, model_name = resolve_model(options.model, Path(scratch))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   DPO_MIN_CACHE=str(Path(scratch) / "cache"))
        results = []
        for name in options.configs:
            command = [sys.executable, __file__, "--worker", name, "--model", model_path, "--steps",
                       str(options.steps), "--warmup", str(options.warmup), "--groups-per-step",
                       str(options.groups_per_step), "--prompt-tokens", str(options.prompt_tokens),
                       "--answer-tokens", str(options.answer_tokens)]
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"{name}: {results[-1]['pairs_per_s']:.2f} pairs/s", file=sys.stderr, flush=True)
    first = results[0]
    print(f"model: {model_name}; {options.groups_per_step} group(s) a step; prompts {first['prompt_tokens']:.0f} "
          f"tokens, answers {first['answer_tokens']:.0f} tokens on average (cut at {options.prompt_tokens} and "
          f"{options.answer_tokens}); {options.steps} timed steps after {options.warmup}\n")
    print_table(results)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
