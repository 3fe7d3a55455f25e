"""One round of run_rounds on a saved tiny model, as one process of `accelerate launch` or alone
(tests/test_rounds_distributed.py). Each process writes what it sampled and scored to calls-<rank>.json.

    python tests/rounds_worker.py MODEL_DIR OUTPUT_DIR PER_DEVICE_TRAIN_BATCH_SIZE
"""

import json
import sys
from pathlib import Path

from accelerate import PartialState
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpo_min.rounds import RoundsConfig, run_rounds
from dpo_min.rounds.sampling import hf_generate
from dpo_min.tokenizing import render_prompts

# 10 prompts: 2 held out (held_out_share 0.2), 8 sampled in 4 batches of 2, dealt to 2 processes in turn.
PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} times 3?"}], "row": i} for i in range(10)]


def run(model_dir: str, output_dir: str, batch_size: int) -> dict:
    """The round's result; every generate call (its prompts' rows, its seed) and every reward call (its rows) of
    this process, in order, to output_dir/calls-<rank>.json."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    row_of = {tuple(render_prompts(tokenizer, [row["prompt"]], {})[0]): row["row"] for row in PROMPTS}
    calls = {"sampled": [], "scored": []}

    def generate_fn(model, prompt_ids, settings):  # the default generate, recording which prompts it was given
        calls["sampled"].append({"rows": [row_of[tuple(ids)] for ids in prompt_ids], "seed": settings.seed,
                                 "do_sample": settings.do_sample})
        return hf_generate(model, prompt_ids, settings, tokenizer.pad_token_id)

    def id_sum(completion_ids, row, **_):
        """Ties are as good as impossible: every prompt gives a pair, so the DPO pass has a known number of steps."""
        calls["scored"].append(list(row))
        return [float(sum(ids)) for ids in completion_ids]

    config = RoundsConfig(output_dir=output_dir, rounds=1, num_generations=3, max_completion_length=6,
                          held_out_share=0.2, generation_batch_size=6, seed=11,  # 2 prompts
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"),
                          training={"per_device_train_batch_size": batch_size, "learning_rate": 5e-3,
                                    "save_strategy": "no", "disable_tqdm": True})
    result = run_rounds(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, PROMPTS, id_sum, config,
                        generate_fn=generate_fn)
    # Asked after the run: the run sets this process's place up (a PartialState made first would leave it alone).
    Path(output_dir, f"calls-{PartialState().process_index}.json").write_text(json.dumps(calls))
    return {"rounds": result.rounds, "held_out": result.held_out}


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
