"""What the probes of the draft path share: the cached context every timed pass follows, the 1.5B
target with the 0.5B's backend on its draft path, and the 1.5B's greedy answers to Spec-Bench
prompts that a draft's agreement with the target is counted on.

The scripts under `docs/results/` that time a pass or score a draft share these, so that their
figures are taken on the same context, the same draft path and the same answers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TypedDict

from leapdecode.engine.backend import TorchBackend
from leapdecode.methods import DraftModel
from leapdecode.models import LoadedModel, load_model

CONTEXT = [1000 + (i * 37) % 20000 for i in range(300)]  # the cached tokens every timed pass follows
CATEGORIES = ["multi-turn", "translation", "qa", "math_reasoning", "summarization", "rag"]  # Spec-Bench's


class Answer(TypedDict):
    """One of the target's greedy answers: its Spec-Bench category, the chat prompt's token ids
    and the answer's new token ids."""

    category: str
    prompt: list[int]
    answer: list[int]


def draft_path() -> tuple[LoadedModel, TorchBackend]:
    """The 1.5B as loaded by default, and the 0.5B's backend on its draft path for it (int4 rounded
    for drafting, the draft vocabulary, the lean forward), as `draft:model=qwen2.5-coder-0.5b` builds
    it: what a probe of the draft pass's cost has to time."""
    quiet = lambda message: None  # noqa: E731
    target = load_model("qwen2.5-coder-1.5b", log=quiet)
    method = DraftModel(model="qwen2.5-coder-0.5b")
    return target, method.draft_backend(target, method.load_draft(target, quiet), quiet)


def answers(per_category: int) -> list[Answer]:
    """The 1.5B's (default int4 load) greedy answers, 96 new tokens, to the first `per_category`
    chat prompts of each of `CATEGORIES`: generated once and kept in the system's temporary folder
    (outside the tree), since every draft variant is scored on the same answers."""
    # imported here: the probes that only time a pass load neither the API nor the datasets
    from leapdecode.api import wrap
    from leapdecode.bench.datasets import load_dataset

    path = Path(tempfile.gettempdir()) / f"draft-rounding-answers-{per_category}.json"
    if not path.exists():
        decoder = wrap(load_model("qwen2.5-coder-1.5b", log=lambda message: None), "ar")
        rows: list[Answer] = []
        for category in CATEGORIES:
            for prompt in load_dataset(f"spec-bench:{category}", per_category):
                out = decoder.generate([{"role": "user", "content": prompt.text}], max_new_tokens=96, chat=True)
                rows.append({"category": category, "prompt": list(out.prompt_ids), "answer": list(out.token_ids)})
        path.write_text(json.dumps(rows))
    kept: list[Answer] = json.loads(path.read_text())
    return kept
