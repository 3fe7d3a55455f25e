"""The GPU check: dpo_min's layouts (sdpa and flex attention) against TRL's DPOTrainer on 1-2B shapes, in one run.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (see the script for the wheels)
    python benchmarks/gpu_check.py --device cpu --tiny   # the same code path on a CPU, tiny shapes, in seconds

1. Correctness: on a small random Llama, per-sequence log-probs and their gradients in every packed layout, sdpa and
   flex attention, against the padded layout (on CPU flex runs forward only: torch has no flex backward there).
2. Speed: models randomly initialised from configs shaped like SmolLM2-1.7B and Qwen2.5-1.5B (no hub access), bf16
   weights, full fine-tuning with a frozen reference copy, batch 8 pairs of about 1,024 tokens per sequence
   (prompt ~512 + answer ~512), the same pairs in the same order for every config. Each config reports non-pad
   tokens/s, peak GPU memory, and MFU: (6 policy + 2 reference) x parameters x unique tokens per second, over the
   bf16 matmul rate measured in the same run. Ratios are against TRL.

Pairs are random token ids written as words of a word-level tokenizer ("w17 w4051 ..."), so TRL, which tokenizes
text itself, and dpo_min see exactly the same tokens.
"""

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import ratio

SHAPES = {
    "smollm2-1.7b": ("LlamaForCausalLM", {
        "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
        "rope_theta": 130000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
# name -> (trainer, attention, DPOMinConfig overrides)
CONFIGS = {
    "trl": ("trl", "sdpa", {}),
    "padded": ("dpo_min", "sdpa", {}),
    "padding_free": ("dpo_min", "sdpa", {"padding_free": True}),
    "shared": ("dpo_min", "sdpa", {"padding_free": True, "share_prompt": True}),
    "padding_free/flex": ("dpo_min", "flex_attention", {"padding_free": True}),
    "shared/flex": ("dpo_min", "flex_attention", {"padding_free": True, "share_prompt": True}),
}
LAYOUTS = {"padding_free": (True, False), "shared_packed": (True, True), "shared_padded": (False, True)}


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1", pad_token="w2", unk_token="w0")


def random_pairs(count: int, vocab_size: int, prompt: tuple[int, int], answer: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)

    def text(bounds):
        return " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(rng.randint(*bounds)))

    return [{"prompt": text(prompt), "chosen": " " + text(answer), "rejected": " " + text(answer)}
            for _ in range(count)]


def make_model(class_name: str, shape: dict, attention: str, dtype: torch.dtype, device: str, seed: int = 0):
    import transformers

    model_class = getattr(transformers, class_name)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a CPU init of 1.7B weights takes minutes
        model = model_class(model_class.config_class(**shape, attn_implementation=attention))
    return model.to(dtype)


def matmul_rate(device: str, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of a [size, size] x [size, size] product: mean of 10 after 3 warm-ups."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * size**3 / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 1. correctness -------------------------------------------------------------------------------------------------
def check_layouts(device: str) -> list[str]:
    """Packed layouts (sdpa, flex) against the padded one: log-probs and, where flex has a backward, gradients."""
    from datasets import Dataset

    from dpo_min.logps import sequence_logps
    from dpo_min.scale.attention import use_packed_attention
    from dpo_min.tokenizing import tokenize_dataset
    from dpo_min.trainer_setup import make_collator

    tokenizer = word_tokenizer(TINY["vocab_size"])
    pairs = tokenize_dataset(Dataset.from_list(random_pairs(6, TINY["vocab_size"], (3, 40), (1, 30))), tokenizer,
                             max_length=1024)
    examples = [pairs[i] for i in range(len(pairs))]
    backward = device != "cpu"  # torch 2.13 and earlier: flex attention has no backward on CPU
    lines = []

    def run(attention, layout):
        model = make_model("LlamaForCausalLM", TINY, "sdpa" if attention == "padded" else attention, torch.float32,
                           device).train()
        padding_free, share_prompt = LAYOUTS.get(layout, (False, False))
        if attention != "padded":
            use_packed_attention(model)
        batch = make_collator(2, padding_free, share_prompt, dense_mask=attention != "flex_attention")(examples)
        batch = {key: value.to(device) for key, value in batch.items()}
        with torch.set_grad_enabled(backward or attention != "flex_attention"):
            logps = sequence_logps(model, batch).logps
        grads = None
        if logps.requires_grad:
            logps.sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        return logps.detach(), grads

    reference_logps, reference_grads = run("padded", "padded")
    for attention in ("sdpa", "flex_attention"):
        for layout in LAYOUTS:
            logps, grads = run(attention, layout)
            logp_error = (logps - reference_logps).abs().max().item()
            grad_error = None if grads is None else ((grads - reference_grads).abs().max() /
                                                     reference_grads.abs().max()).item()
            ok = logp_error < 1e-3 and (grad_error is None or grad_error < 1e-3)
            lines.append(f"{'ok  ' if ok else 'FAIL'} {attention:>14} {layout:<14} max |log-prob diff| "
                         f"{logp_error:.2e}  max relative grad diff "
                         f"{'not run (no flex backward on CPU)' if grad_error is None else f'{grad_error:.2e}'}")
    return lines


# ---- 2. speed -------------------------------------------------------------------------------------------------------
def run_config(name: str, model_name: str, args, pairs, tokenizer) -> dict:
    from transformers import TrainerCallback

    from dpo_min import DPOMinConfig, DPOMinTrainer
    from dpo_min.tokenizing import tokenize_dataset

    trainer_kind, attention, overrides = CONFIGS[name]
    class_name, shape = SHAPES[model_name]
    shape = TINY if args.tiny else shape
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = make_model(class_name, shape, attention, dtype, args.device)
    num_params = sum(p.numel() for p in model.parameters())
    settings = {"output_dir": str(Path(args.scratch) / name.replace("/", "_")), "max_steps": args.warmup + args.steps,
                "per_device_train_batch_size": args.batch_size, "learning_rate": 1e-6, "bf16": dtype == torch.bfloat16,
                "gradient_checkpointing": False, "logging_steps": 10_000, "save_strategy": "no", "report_to": "none",
                "disable_tqdm": True, "seed": 42, "dataloader_num_workers": 0, "use_cpu": args.device == "cpu",
                "train_sampling_strategy": "sequential", "max_length": 4096}
    tokenized = tokenize_dataset(pairs, tokenizer, max_length=4096)
    if trainer_kind == "trl":
        from trl import DPOConfig, DPOTrainer

        # TRL would load its reference from the model's hub id; these models have none: a frozen copy, as dpo_min's.
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**settings),
                             train_dataset=pairs, processing_class=tokenizer)
    else:
        trainer = DPOMinTrainer(model, args=DPOMinConfig(**settings, **overrides), train_dataset=tokenized,
                                processing_class=tokenizer)
    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync(args.device)
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync(args.device)
            step_times.append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimer())
    trainer.train()
    batches = [[tokenized[i] for i in range(step * args.batch_size, (step + 1) * args.batch_size)]
               for step in range(args.warmup, args.warmup + args.steps)]
    tokens = [sum(2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in batch)
              for batch in batches]
    unique = [sum(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"]) for ex in batch)
              for batch in batches]
    times = step_times[args.warmup:]
    result = {
        "model": model_name, "config": name, "num_params": num_params, "step_s": statistics.median(times),
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "model_flops": statistics.median(8 * num_params * u / s for u, s in zip(unique, times)),
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None,
        "tokens_per_step": statistics.mean(tokens),
    }
    del trainer, model
    gc.collect()
    return result


def print_table(results: list[dict], matmul: float) -> None:
    print("| model | config | tokens/s | vs TRL | step s | peak GPU GB | vs TRL | MFU (vs measured matmul) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    trl = {r["model"]: r for r in results if r["config"] == "trl"}
    for r in results:
        base = trl.get(r["model"], {})
        peak = "-" if r["peak_gpu_gb"] is None else f"{r['peak_gpu_gb']:.1f}"
        print(f"| {r['model']} | {r['config']} | {r['tokens_per_s']:.0f} | "
              f"{ratio(r['tokens_per_s'], base.get('tokens_per_s'))} | {r['step_s']:.3f} | {peak} | "
              f"{ratio(r['peak_gpu_gb'], base.get('peak_gpu_gb'))} | {r['model_flops'] / matmul:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and sequences: proves the path, in seconds")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (flex attention compiles here)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--scratch", default="/tmp/gpu_check")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from datasets import Dataset

    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""), flush=True)
    print("\n1. layouts against the padded layout (small random Llama, float32):")
    checks = check_layouts(args.device)
    for line in checks:
        print("  " + line, flush=True)

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    matmul = matmul_rate(args.device, dtype, 512 if args.tiny else 8192)
    print(f"\n2. speed: measured {dtype} matmul rate {matmul / 1e12:.2f} TFLOP/s", flush=True)
    configs = [c for c in args.configs if not (args.device == "cpu" and CONFIGS[c][1] == "flex_attention")]
    if "trl" in configs:
        try:
            import trl  # noqa: F401
        except Exception as error:  # a TRL that does not import with this transformers must not cost the whole run
            print(f"   TRL left out, it does not import here: {type(error).__name__}: {error}")
            configs.remove("trl")
    if len(configs) < len(args.configs):
        print("   flex configs skipped on CPU: torch has no flex attention backward there (forward checked in 1.)")
    results = []
    for model_name in args.models:
        vocab = (TINY if args.tiny else SHAPES[model_name][1])["vocab_size"]
        lengths = ((4, 24), (2, 16)) if args.tiny else ((384, 640), (384, 640))
        pairs = Dataset.from_list(random_pairs(args.batch_size * (args.warmup + args.steps), vocab, *lengths))
        tokenizer = word_tokenizer(vocab)
        for name in configs:
            started = time.perf_counter()
            results.append(run_config(name, model_name, args, pairs, tokenizer))
            print(f"   {model_name} {name}: {results[-1]['step_s']:.3f} s/step "
                  f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    print(f"\nbatch {args.batch_size} pairs, {results[0]['tokens_per_step']:.0f} non-pad tokens per step "
          f"({args.steps} timed steps after {args.warmup}); MFU = 8 x parameters x unique tokens / s / matmul rate\n")
    print_table(results, matmul)
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_flops": matmul, "checks": checks, "results": results}, indent=1))
    if any(line.startswith("FAIL") for line in checks):
        sys.exit("a layout check failed (see 1. above)")


if __name__ == "__main__":
    main()
