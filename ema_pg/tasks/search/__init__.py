"""Search-agent QA (Table 2's setting): synthetic world, retrievers, the Search-R1 environment."""

from .task import SPLITS, SearchQATask, exact_match, normalize_answer

__all__ = ["SPLITS", "SearchQATask", "exact_match", "normalize_answer"]
