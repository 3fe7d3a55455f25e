"""`--rounds N`: DPO in rounds, the branch of the command that leaves `main` right after the plan, before any offline
phase; `run` (runner.py) takes the plan from there to the last round. Its options are rounds_args.py's."""

from .runner import EMBEDDED_PROMPTS, MODEL_SETTINGS, load_prompts, rounds_config, run

__all__ = ["EMBEDDED_PROMPTS", "MODEL_SETTINGS", "load_prompts", "rounds_config", "run"]
