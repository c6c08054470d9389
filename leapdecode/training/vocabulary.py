"""A tokenizer's tokens ranked by how often answers use them: what a draft vocabulary keeps.

Why: a draft model scores only its draft vocabulary (`leapdecode.heads.vocabulary`), so the
tokens kept should be those the target writes most. Answers, not prompts: the drafter proposes
answer tokens. Counted on ShareGPT's answers (the training split: the benchmark's prompts are
never counted), once per tokenizer, and cached where the draft method looks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leapdecode.heads.vocabulary import count_ranking, ranking_path, save_ranking
from leapdecode.training.data import tokenize_conversation
from leapdecode.training.split import training_conversations


def count_answer_tokens(
    tokenizer: Any, source: str = "sharegpt", conversations: int = 2000, max_tokens: int = 2048
) -> list[int]:
    """Every token of the answers of `conversations` training conversations of `source`, most
    used first."""
    train, _, _ = training_conversations(source, limit=conversations)
    examples = (tokenize_conversation(tokenizer, c, max_tokens) for c in train)
    return count_ranking(
        [t for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m] for e in examples if e is not None
    )


def write_ranking(tokenizer: Any, cache: Path, source: str = "sharegpt", conversations: int = 2000) -> tuple[Path, int]:
    """Count and cache the ranking for `tokenizer`; (where it is, how many distinct tokens it ranks)."""
    ranking = count_answer_tokens(tokenizer, source, conversations)
    path = ranking_path(cache, tokenizer)
    save_ranking(path, ranking, f"{conversations} {source} answers")
    return path, len(ranking)
