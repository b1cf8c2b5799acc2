"""Math reasoning (Table 3's setting): a synthetic arithmetic-chain world or DeepScaleR-style files,
answers checked with math-verify."""

from .task import SPLITS, MathTask
from .verify import answer_key, is_correct

__all__ = ["SPLITS", "MathTask", "answer_key", "is_correct"]
