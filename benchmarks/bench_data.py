"""Dataset preparation: dpo_min's load + tokenize against TRL DPOTrainer's own, on the same rows in the same run.

    python benchmarks/bench_data.py                    # 100k rows, num_proc 1 and 2
    python benchmarks/bench_data.py --rows 20000 --num_proc 1

The rows are shaped like trl-lib/ultrafeedback_binarized (chosen and rejected message lists that repeat the user
turn, plus score columns; TRL reads this layout too), their texts drawn from the embedded HH-RLHF pairs. Each
measurement runs in its own process, with its own empty datasets cache (so the first run is cold and peak RSS is its
own), and the SmolLM2 tokenizer with its chat template:
- dpo_min: `load_preference_dataset` + `tokenize_dataset` (max_length None: TRL's preparation does not truncate);
- dpo_min, cached: the same again in a new process on the same cache (the second identical run);
- TRL: `load_dataset("json")` + `DPOTrainer._prepare_dataset` (prompt extraction, tokenization).
Peak RSS growth: the process's peak resident memory minus its resident memory before loading (with num_proc > 1,
the largest worker's peak is also given).
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HH_PATH = ROOT / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    from dpo_min import load_preference_dataset

    pairs = load_preference_dataset(str(HH_PATH))
    users = [m["content"] for row in pairs for m in row["prompt"] if m["role"] == "user"]
    replies = [m["content"] for row in pairs for m in row["chosen"] + row["rejected"] if m["content"].strip()]
    rng = random.Random(seed)
    with open(path, "w") as file:
        for _ in range(count):
            question, good, bad = rng.choice(users), rng.choice(replies), rng.choice(replies)
            while bad == good:
                bad = rng.choice(replies)
            turn = {"role": "user", "content": question}
            file.write(json.dumps({"chosen": [turn, {"role": "assistant", "content": good}],
                                   "rejected": [turn, {"role": "assistant", "content": bad}],
                                   "score_chosen": 8.0, "score_rejected": 3.0}) + "\n")


def child(kind: str, rows_file: str, num_proc: int) -> dict:
    """One measurement in this process; HF_DATASETS_CACHE is set by the parent."""
    import datasets
    from transformers import AutoTokenizer

    from dpo_min.models import convert_gguf, default_gguf_path

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(default_gguf_path())))
    baseline = rss_mb()
    started = time.perf_counter()
    if kind == "trl":
        from types import SimpleNamespace

        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(output_dir=tempfile.mkdtemp(), dataset_num_proc=num_proc, report_to="none", use_cpu=True,
                         bf16=False)
        raw = datasets.load_dataset("json", data_files=rows_file, split="train")
        trainer_like = SimpleNamespace(_tokenizer=tokenizer)
        tokenized = DPOTrainer._prepare_dataset(trainer_like, raw, tokenizer, args, "train")
    else:
        from dpo_min.data.loading import load_preference_dataset
        from dpo_min.tokenizing import tokenize_dataset

        pairs = load_preference_dataset(rows_file, num_proc=num_proc)
        tokenized = tokenize_dataset(pairs, tokenizer, max_length=None, num_proc=num_proc)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for name in ("prompt_ids", "chosen_ids", "rejected_ids")
                 for ids in tokenized.with_format("arrow")[:1000][name].to_pylist())
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rows": len(tokenized), "seconds": seconds, "rss_growth_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline, "worker_peak_mb": children, "tokens_first_1000": tokens}


def run_child(kind: str, rows_file: Path, num_proc: int, cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__, "--child", kind, "--rows_file", str(rows_file), "--num_proc",
                             str(num_proc)], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} num_proc={num_proc} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--rows_file", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, options.rows_file, options.num_proc[0])))
        return
    with tempfile.TemporaryDirectory() as scratch:
        rows_file = Path(scratch) / "ultrafeedback_like.jsonl"
        write_rows(rows_file, options.rows)
        figures = {}
        for num_proc in options.num_proc:
            cache = Path(scratch) / f"cache_ours_{num_proc}"
            figures[f"dpo_min/np{num_proc}"] = run_child("ours", rows_file, num_proc, cache)
            figures[f"dpo_min/np{num_proc}/cached"] = run_child("ours", rows_file, num_proc, cache)
            trl_cache = Path(scratch) / f"cache_trl_{num_proc}"
            figures[f"trl/np{num_proc}"] = run_child("trl", rows_file, num_proc, trl_cache)
            ours, trl = figures[f"dpo_min/np{num_proc}"], figures[f"trl/np{num_proc}"]
            if ours["tokens_first_1000"] != trl["tokens_first_1000"]:
                raise RuntimeError("dpo_min and TRL tokenized the rows differently")
    if options.json:
        print(json.dumps(figures))
        return
    print(f"{options.rows} rows shaped like trl-lib/ultrafeedback_binarized, SmolLM2 tokenizer + chat template")
    print(f"{'run':<22}{'seconds':>9}{'rows/s':>9}{'RSS growth MB':>15}{'worker peak MB':>16}")
    for name, figure in figures.items():
        print(f"{name:<22}{figure['seconds']:>9.1f}{figure['rows'] / figure['seconds']:>9.0f}"
              f"{figure['rss_growth_mb']:>15.0f}{figure['worker_peak_mb']:>16.0f}")
    for num_proc in options.num_proc:
        ours, cached, trl = (figures[f"{prefix}/np{num_proc}{suffix}"] for prefix, suffix in
                             (("dpo_min", ""), ("dpo_min", "/cached"), ("trl", "")))
        print(f"num_proc {num_proc}: dpo_min / TRL throughput {trl['seconds'] / ours['seconds']:.2f}x, "
              f"cached run {ours['seconds'] / cached['seconds']:.0f}x faster than the first")


if __name__ == "__main__":
    main()
