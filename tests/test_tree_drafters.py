"""Tree drafters (ANPD tree, trie, REST datastore): greedy output equals plain greedy token for
token on tiny random models and the real model, trees really branch and deep branches are
accepted; the trie's counts, the suffix array and the datastore's lookup against brute force;
datastore files and tokenizer checks; the `datastore build` command."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from leapdecode import InputError, wrap
from leapdecode.cli import app
from leapdecode.drafters import AnpdTreeDrafter, Datastore, NGramModule, RestDrafter, TokenTrie, TrieDrafter
from leapdecode.drafters.rest import KEY, sort_suffixes
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.reference import greedy_reference
from leapdecode.methods import parse_method
from tests.helpers import GREEDY, TINY_VOCAB
from tests.test_lossless_tiny import prompts


def tiny_datastore(seed: int = 0, extra: list[list[int]] = ()) -> Datastore:
    """Documents with shared phrases, so that retrieval finds several continuations; `extra`
    adds documents (such as the model's own continuations, so that deep drafts are right)."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(3, 8))] for _ in range(12)]
    docs = [[t for _ in range(rng.randint(3, 10)) for t in rng.choice(phrases)] for _ in range(40)]
    return Datastore.from_documents(docs + list(extra), separator=1, meta={"model": "tiny", "tokenizer": "none"})


DRAFTERS = {
    "anpd-tree": lambda: AnpdTreeDrafter(n=4, nodes=12, depth=6, width=3),
    "anpd-tree-wide": lambda: AnpdTreeDrafter(n=3, nodes=32, depth=10, width=4),
    "trie": lambda: TrieDrafter(nodes=12, depth=6, window=10, max_match=3),
    "trie-small": lambda: TrieDrafter(nodes=4, depth=2, window=4, max_match=1, prompt_weight=1),
}


def rest_drafter(model, test_prompts) -> RestDrafter:
    """A datastore holding the greedy continuations of every other test prompt (drafts right,
    then wrong where the text ends) among phrase documents the model never follows."""
    answers = [p + greedy_reference(model, p, 40) for p in test_prompts[::2]]
    return RestDrafter(tiny_datastore(extra=answers), nodes=16, depth=6, matches=32, max_suffix=6, min_suffix=1)


def run(model, prompt, drafter, max_new_tokens):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize("name", [*DRAFTERS, "rest"])
def test_tree_drafters_equal_plain_greedy(tiny_model, name) -> None:
    branched = deep = 0
    test_prompts = prompts(10, seed=2)
    if name == "rest":
        test_prompts += [d[:12] for d in _documents(tiny_datastore())][:4]
    for prompt in test_prompts:
        drafter = rest_drafter(tiny_model, test_prompts) if name == "rest" else DRAFTERS[name]()
        got, steps = run(tiny_model, prompt, drafter, 40)
        assert got == greedy_reference(tiny_model, prompt, 40), prompt
        for s in steps:
            if s.parents is not None and len(set(s.parents)) < len(s.parents):
                branched += 1  # some node has two children
            if len(s.path) >= 2:
                deep += 1
    assert branched > 0 and deep > 0  # real trees, and deep branches accepted


def _documents(store: Datastore) -> list[list[int]]:
    docs, current = [], []
    for token in store.tokens.tolist():
        if token == store.separator:
            docs.append(current)
            current = []
        else:
            current.append(token)
    return docs


def test_a_non_first_branch_is_accepted_sometimes(tiny_model) -> None:
    hits = 0
    for prompt in prompts(30, seed=5):  # random models often fall into one loop: many prompts
        _, steps = run(tiny_model, prompt, AnpdTreeDrafter(n=3, nodes=24, depth=6, width=4), 40)
        for s in steps:
            if s.path and s.parents is not None:
                first_children = [i for i, p in enumerate(s.parents) if p == -1]
                hits += s.path[0] != first_children[0]
    assert hits > 0


def test_ngram_candidates_rank_by_count_then_recency_and_fall_back_across_orders() -> None:
    module = NGramModule(3)
    module.initialise([1, 2, 7, 1, 2, 8, 1, 2, 8, 1, 2, 9, 5, 2, 6])
    ranked = module.candidates([1, 2], 3)
    assert [t for t, _ in ranked] == [8, 9, 7]  # 8 twice; 9 more recent than 7
    assert ranked[0][1] == pytest.approx(0.5)
    merged = module.candidates([1, 2], 5)  # order 2 adds what followed 2 alone: 6
    assert [t for t, _ in merged] == [8, 9, 7, 6]
    assert merged[3][1] < merged[2][1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 5))
def test_token_trie_counts_every_ngram(stream, window) -> None:
    trie = TokenTrie(window)
    for token in stream:
        trie.add(token)
    for n in range(1, window + 1):
        for i in range(len(stream) - n + 1):
            gram = stream[i : i + n]
            brute = sum(1 for j in range(len(stream) - n + 1) if stream[j : j + n] == gram)
            assert trie.find(gram).count == brute
    assert trie.find([9]) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_suffix_array_and_lookup_against_brute_force(tokens, pattern) -> None:
    array = np.asarray(tokens, dtype=np.int32)
    order = sort_suffixes(array)
    keys = [tuple(tokens[p : p + KEY]) for p in order.tolist()]
    assert keys == sorted(keys)
    store = Datastore(array, order, {"separator": 99, "tokens": len(tokens), "format": "x"})
    length, starts = store.lookup(pattern, max_suffix=len(pattern), min_suffix=1, matches=10_000)

    def occurs(suffix: list[int]) -> list[int]:
        return [
            i + len(suffix) for i in range(len(tokens) - len(suffix) + 1) if tokens[i : i + len(suffix)] == list(suffix)
        ]

    longest = next((n for n in range(len(pattern), 0, -1) if occurs(pattern[-n:])), 0)
    assert length == longest
    if longest:
        assert sorted(starts.tolist()) == sorted(occurs(pattern[-longest:]))


def test_datastore_files_round_trip_and_corruption_is_reported(tmp_path) -> None:
    store = tiny_datastore()
    store.save(tmp_path / "ds")
    loaded = Datastore.load(tmp_path / "ds")
    assert np.array_equal(loaded.tokens, store.tokens) and np.array_equal(loaded.suffixes, store.suffixes)
    with pytest.raises(InputError, match="no datastore"):
        Datastore.load(tmp_path / "missing")
    (tmp_path / "ds" / "suffixes.npy").write_bytes(b"not numpy")
    with pytest.raises(InputError, match="not a readable datastore"):
        Datastore.load(tmp_path / "ds")
    store.save(tmp_path / "ds2")
    meta = json.loads((tmp_path / "ds2" / "meta.json").read_text())
    meta["tokens"] = 3
    (tmp_path / "ds2" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="not a valid datastore"):
        Datastore.load(tmp_path / "ds2")
    with pytest.raises(InputError, match="empty"):
        Datastore.from_documents([], 1, {})


def test_tree_method_strings() -> None:
    assert str(parse_method("anpd-tree:nodes=24")) == "anpd-tree:n=5,nodes=24,depth=4,width=3"
    for bad in ("anpd-tree:nodes=0", "trie:max_match=12", "rest", "rest:datastore=x,min_suffix=9", "trie:depth=100"):
        with pytest.raises(Exception) as info:
            parse_method(bad)
        assert "MethodError" in type(info.value).__name__


@pytest.mark.real_model
def test_datastore_build_command_and_rest_on_the_real_model(real_lm, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "fib.py").write_text(
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        encoding="utf-8",
    )
    (corpus / "notes.md").write_text(
        "The sky is blue because air scatters blue light more than red light.\n", encoding="utf-8"
    )
    (corpus / "image.bin").write_bytes(bytes(range(256)))
    result = CliRunner().invoke(
        app, ["datastore", "build", str(corpus), str(tmp_path / "ds"), "--model", "smollm2-135m"]
    )
    assert result.exit_code == 0, result.output
    assert "2 documents" in " ".join(result.output.split())  # rich wraps long lines
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    plain = wrap(real_lm, "ar").generate(prompt, max_new_tokens=40)
    out = wrap(real_lm, f"rest:datastore={tmp_path / 'ds'}").generate(prompt, max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens > 0
    bad = CliRunner().invoke(app, ["datastore", "build", str(tmp_path / "nothing"), str(tmp_path / "x")])
    assert bad.exit_code == 2 and "no corpus" in bad.output


@pytest.mark.real_model
def test_rest_refuses_a_datastore_from_another_tokenizer(real_lm, tmp_path) -> None:
    store = tiny_datastore()
    store.save(tmp_path / "ds")
    with pytest.raises(InputError, match="rebuild it with"):
        wrap(real_lm, f"rest:datastore={tmp_path / 'ds'}")
