"""DPO in rounds, above the core: the policy samples, reward functions (TRL GRPOTrainer's contract) judge, the best
and worst of each prompt make a pair, and each round trains one DPO pass of DPOMinTrainer on its pairs. See
docs/rounds.md."""

from .config import RoundsConfig, RoundsError
from .loop import RoundsResult, run_rounds
from .pairs import make_pairs
from .rewards import RewardModel, Rewards
from .sampling import GenerationSettings

__all__ = ["GenerationSettings", "RewardModel", "Rewards", "RoundsConfig", "RoundsError", "RoundsResult",
           "make_pairs", "run_rounds"]
