"""The prefix cache: finished requests' caches reused by requests that begin the same way, each
request's output still that of the request alone."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode import Decoder, wrap
from leapdecode.engine import CacheState
from leapdecode.engine.cache import snapshot_cache
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.prefix_cache import PrefixCache, RunningSource, plan_start, shared_prefix, usable
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.engine.tree import compile_tree
from leapdecode.errors import InputError
from leapdecode.models.row_exact import use_row_exact
from tests.helpers import TINY_VOCAB, make_tiny_model, tiny_lm

COST = ForwardCost(tuple(0.01 + 0.003 * n for n in range(1, 129)))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exact_tiny(request):
    """A tiny model made row-exact, as the API loads it (`LoadedModel.row_exact`)."""
    model = make_tiny_model(request.param)
    use_row_exact(model)
    return dataclasses.replace(tiny_lm(model), row_exact=True)


def drain(scheduler: BatchScheduler, before_step=None, steps: int = 5000) -> int:
    """Step `scheduler` until it is idle (failing, not hanging, past `steps` passes); the prompt rows
    its passes prefilled. `before_step(i)` runs before pass i."""
    prefill_rows = 0
    for i in range(steps):
        if scheduler.idle:
            return prefill_rows
        if before_step is not None:
            before_step(i)
        report = scheduler.step()
        prefill_rows += report.prefill_rows if report else 0
    pytest.fail(f"the scheduler was not idle after {steps} passes")


def fake_seq(length: int) -> CacheState:
    return CacheState(cache=None, length=length)


def fake_fork(seq: CacheState, length: int) -> CacheState:
    assert 1 <= length <= seq.length
    return fake_seq(length)


def fake_snapshot(seq: CacheState, length: int) -> CacheState:
    assert 1 <= length <= seq.length
    return fake_seq(length)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_shared_prefix_is_the_brute_force_count(a, b) -> None:
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    assert shared_prefix(tuple(a), tuple(b)) == count == shared_prefix(tuple(b), tuple(a))


def test_a_request_takes_a_copy_of_the_longest_shared_prefix_and_leaves_a_token_to_prefill() -> None:
    cache = PrefixCache(100)
    cache.keep([1, 2, 3, 4, 5, 6], fake_seq(5), fake_snapshot)  # the pending token is not in the cache
    cache.keep([1, 2, 9, 9], fake_seq(4), fake_snapshot)
    assert [e.tokens for e in cache.entries] == [(1, 2, 3, 4, 5), (1, 2, 9, 9)]
    seq, length, holes = cache.take([1, 2, 3, 4, 7], fake_fork)
    assert length == seq.length == 4 and holes == ()
    assert cache.entries[-1].tokens == (1, 2, 3, 4, 5)  # now the most recent
    assert cache.take([1, 2, 3], fake_fork)[1] == 2  # the whole prompt held: its last token is prefilled
    assert cache.take([1], fake_fork) is None and cache.take([8, 1, 2], fake_fork) is None
    assert (cache.hits, cache.hit_tokens) == (2, 6)


def test_kept_sequences_are_refreshed_merged_and_evicted_least_recent_first_within_the_budget() -> None:
    cache = PrefixCache(10)
    cache.keep([1, 2, 3], fake_seq(3), fake_snapshot)
    cache.keep([4, 5, 6], fake_seq(3), fake_snapshot)
    longer = fake_seq(5)
    cache.keep([1, 2, 3, 7, 8], longer, fake_snapshot)  # holds the first entry: it replaces it
    assert [e.tokens for e in cache.entries] == [(4, 5, 6), (1, 2, 3, 7, 8)]
    held = fake_seq(2)
    cache.keep([4, 5], held, fake_snapshot)  # already held: the entry is refreshed, the new cache dropped
    assert [e.tokens for e in cache.entries] == [(1, 2, 3, 7, 8), (4, 5, 6)] and cache.entries[0].seq.length == 5
    cache.keep([9, 9, 9, 9], fake_seq(4), fake_snapshot)  # 12 tokens: the least recent goes
    assert [e.tokens for e in cache.entries] == [(4, 5, 6), (9, 9, 9, 9)] and cache.tokens == 7
    cache.keep(list(range(100, 130)), fake_seq(30), fake_snapshot)  # past the budget: cut to it, alone
    assert [len(e.tokens) for e in cache.entries] == [10] and cache.entries[0].seq.length == 10
    cache.keep([5], fake_seq(0), fake_snapshot)  # an empty cache is not kept
    assert cache.tokens == 10
    with pytest.raises(InputError, match="at least one token"):
        PrefixCache(0)


@st.composite
def holed(draw) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A kept stream and the holes its cache skips: disjoint, in order, none at its start, touching
    or not."""
    tokens = draw(st.lists(st.integers(0, 3), min_size=2, max_size=40))
    holes, at = [], 1
    for gap, count in draw(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 8)), max_size=4)):
        if at + gap + count < len(tokens):  # a token past every hole; holes may touch (gap 0)
            holes.append((at + gap, count))
            at += gap + count
    return tokens, tuple(holes)


@settings(max_examples=300, deadline=None)
@given(holed(), st.integers(0, 45), st.lists(st.integers(4, 6), max_size=5))
def test_a_cache_with_holes_serves_a_prompt_up_to_where_a_hole_cuts_it(kept, shared, tail) -> None:
    """Brute force: the cache's positions hold the stream's tokens outside the holes, in order; a
    prompt sharing `shared` tokens is served the longest prefix that no hole straddles, as a copy
    of exactly the positions those tokens fill, with the holes among them."""
    tokens, holes = kept
    cache = PrefixCache(1000)
    outside = [i for i in range(len(tokens)) if not any(s <= i < s + n for s, n in holes)]
    cache.keep(tokens, fake_seq(len(outside)), fake_snapshot, holes)
    (entry,) = cache.entries
    assert entry.tokens == tuple(tokens) and entry.holes == holes and entry.seq.length == entry.size == len(outside)
    prompt = tokens[: min(shared, len(tokens))] + tail  # tokens 4-6 never match the stream's 0-3
    wanted = min(shared, len(tokens), len(prompt) - 1)
    best = max(
        (n for n in range(wanted + 1) if not any(s < n < s + c for s, c in holes)),
        default=0,
    )
    positions = sum(1 for i in outside if i < best)
    taken = cache.take(prompt, fake_fork)
    if positions == 0:
        assert taken is None
        return
    assert taken is not None and taken.length == best and taken.seq.length == positions
    assert taken.holes == tuple((s, c) for s, c in holes if s + c <= best)
    assert usable(holes, best) == (best, taken.holes)


def test_a_kept_cache_with_holes_is_cut_to_the_budget_in_positions_and_replaces_what_it_serves() -> None:
    cache = PrefixCache(12)
    tokens = list(range(20))
    cache.keep(tokens[:6], fake_seq(6), fake_snapshot)
    cache.keep(tokens[:12], fake_seq(6), fake_snapshot, ((2, 6),))  # holds 0, 1 and 8-11
    # the first entry's tokens 2-5 are not in the second: it is not served whole, both stay
    assert [(len(e.tokens), e.holes) for e in cache.entries] == [(6, ()), (12, ((2, 6),))] and cache.tokens == 12
    cache.keep(tokens, fake_seq(14), fake_snapshot, ((2, 6),))  # 14 positions past a budget of 12: cut to 12
    (entry,) = cache.entries  # it serves the holed entry whole; the budget drops the first
    assert (len(entry.tokens), entry.holes, entry.seq.length, cache.tokens) == (18, ((2, 6),), 12, 12)
    cache.keep(tokens[:10], fake_seq(4), fake_snapshot, ((2, 6),))  # served already: only refreshed
    assert cache.entries == [entry]
    cache.keep(tokens[:5], fake_seq(5), fake_snapshot, ((5, 3),))  # a hole past its positions is dropped
    assert (len(cache.entries[-1].tokens), cache.entries[-1].holes) == (5, ())


def converse(lm, methods, turns, prefix_cache, alone=False, **options):
    """A conversation of `turns` user turns, each request's prompt the last one's prompt, its answer
    and new tokens, on one scheduler (each request alone in the batch; `alone`: in passes of its
    own): [(prompt, output, cached)]."""
    decoders = {m: wrap(lm, m) for m in methods}
    backend = decoders[methods[0]].backend
    scheduler = (
        BatchScheduler.alone(backend, prefix_cache)
        if alone
        else BatchScheduler(backend, COST, max_batch=4, max_rows=24, prefix_cache=prefix_cache)
    )
    rng = random.Random(len(methods))
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(9)]
    history = []
    for turn in range(turns):
        output: list[int] = []
        ends: list[str] = []
        prefill_rows = 0
        run = decoders[methods[turn % len(methods)]].start(prompt, max_new_tokens=12 + 3 * turn, **options)
        submission = scheduler.submit(Submission(run, lambda s, out=output: out.extend(s.tokens), ends.append))
        while not ends:
            report = scheduler.step()
            prefill_rows += report.prefill_rows if report else 0
        assert prefill_rows == len(prompt) - submission.cached_tokens  # only the rest was prefilled
        history.append((prompt, output, submission.cached_tokens))
        prompt = prompt + output + [rng.randrange(2, TINY_VOCAB) for _ in range(5)]
    return history, decoders


@pytest.mark.parametrize("alone", [False, True], ids=["shared", "alone"])
@pytest.mark.parametrize(
    "methods, options",
    [
        (["ar"], {}),
        (["anpd", "anpd-tree", "suffix", "ar"], {}),  # trees' kept paths, then reused by other methods
        (["anpd"], {"temperature": 0.9, "seed": 3}),
    ],
)
def test_each_turn_of_a_chat_reuses_the_last_cache_and_equals_its_prompt_decoded_alone(
    exact_tiny, methods, options, alone
) -> None:
    history, decoders = converse(exact_tiny, methods, 4, PrefixCache(4096), alone, **options)
    for turn, (prompt, output, cached) in enumerate(history):
        if turn:
            last_prompt, last_output, _ = history[turn - 1]
            assert cached == len(last_prompt) + len(last_output) - 1  # all but the pending token
        else:
            assert cached == 0
        alone = decoders[methods[turn % len(methods)]].generate(prompt, max_new_tokens=12 + 3 * turn, **options)
        assert output == alone.token_ids, turn


def test_a_kept_cache_is_an_exact_size_copy_and_a_request_copies_it_to_grow(exact_tiny) -> None:
    backend = wrap(exact_tiny, "ar").backend
    seq, _ = backend.prefill(list(range(2, 40)))
    kept = snapshot_cache(seq, 30)
    for layer, own in zip(kept.cache.layers, seq.cache.layers):
        assert layer.keys.shape[-2] == 30 and layer.keys.untyped_storage().nbytes() == layer.keys.nbytes
        assert torch.equal(layer.keys, own.keys[..., :30, :]) and torch.equal(layer.values, own.values[..., :30, :])
    before = [(layer.keys.clone(), layer.values.clone()) for layer in kept.cache.layers]
    grown = backend.fork(kept, 20)
    backend.forward(grown, [5, 6, 7])  # writes positions 20-22 of its own buffers
    assert kept.length == 30 and all(
        torch.equal(layer.keys, k) and torch.equal(layer.values, v) for layer, (k, v) in zip(kept.cache.layers, before)
    )  # the copy grows alone
    with pytest.raises(ValueError, match="cannot keep"):
        snapshot_cache(seq, 39)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), nodes=st.integers(1, 9))
def test_a_tree_pass_kept_path_is_bitwise_the_cache_a_prefill_of_it_writes(exact_tiny, seed, nodes) -> None:
    """What makes a kept cache reusable: after a tree pass keeps any root-to-node path (entries
    moved into place), the cache is bitwise a fresh prefill of the context and that path."""
    rng = random.Random(seed)
    backend = wrap(exact_tiny, "ar").backend
    context = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 60))]
    parents = tuple(rng.randrange(-1, j) if j else -1 for j in range(nodes - 1))
    tokens = [rng.randrange(TINY_VOCAB) for _ in range(nodes)]  # the pending token, then the tree
    seq, _ = backend.prefill(context)
    backend.forward(seq, tokens, tree=compile_tree(parents) if parents else None)
    path, node = [], rng.randrange(nodes)
    while node > 0:
        path.append(node)
        node = parents[node - 1] + 1
    path = [0, *reversed(path)]
    backend.keep(seq, len(context), path)
    fresh, _ = backend.prefill(context + [tokens[i] for i in path])
    assert seq.length == fresh.length and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(seq.cache.layers, fresh.cache.layers)
    )


def test_requests_with_one_prompt_share_its_kept_prefix_and_one_prefill(exact_tiny) -> None:
    decoder = wrap(exact_tiny, "anpd")
    prefix_cache = PrefixCache(4096)
    scheduler = BatchScheduler(decoder.backend, COST, max_batch=4, max_rows=24, prefix_cache=prefix_cache)
    first = [5, 6, 7, 8, 9, 10, 11, 12]
    answer: list[int] = []
    ends: list[str] = []
    scheduler.submit(Submission(decoder.start(first, max_new_tokens=9), lambda s: answer.extend(s.tokens), ends.append))
    while not scheduler.idle:
        scheduler.step()
    prompt = first + answer + [13, 14, 15]
    options = [{"max_new_tokens": 8}, {"max_new_tokens": 8, "temperature": 0.9, "seed": 4}]
    outputs: list[list[int]] = [[], []]
    subs = [
        scheduler.submit(
            Submission(decoder.start(prompt, **o), lambda s, i=i: outputs[i].extend(s.tokens), ends.append)
        )
        for i, o in enumerate(options)
    ]
    prefill_rows = 0
    while not scheduler.idle:
        report = scheduler.step()
        prefill_rows += report.prefill_rows if report else 0
    cached = len(first) + len(answer) - 1
    assert [s.cached_tokens for s in subs] == [cached, cached] and prefill_rows == len(prompt) - cached
    assert prefix_cache.hits == 1  # one copy, one prefill: the second request follows the first's
    for output, o in zip(outputs, options):
        assert output == decoder.generate(prompt, **o).token_ids


def test_without_a_prefix_cache_every_prompt_is_prefilled_whole(exact_tiny) -> None:
    history, _ = converse(exact_tiny, ["ar"], 3, None)
    assert [cached for _, _, cached in history] == [0, 0, 0]


def test_a_decoder_with_a_prefix_cache_prefills_only_a_chats_new_turn(exact_tiny, tiny_model) -> None:
    decoder = Decoder(exact_tiny, "anpd", prefix_cache_tokens=4096)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    first = decoder.generate(prompt, max_new_tokens=10).token_ids
    second = prompt + first + [12, 13]
    assert (
        decoder.generate(second, max_new_tokens=10).token_ids
        == wrap(exact_tiny, "anpd").generate(second, max_new_tokens=10).token_ids
    )
    assert (decoder.prefix_cache.hits, decoder.prefix_cache.hit_tokens) == (1, len(prompt) + len(first) - 1)
    # a model that is not row-exact: its prefill and decoding rows may differ in their last bits,
    # so nothing is kept or taken
    loose = Decoder(tiny_lm(tiny_model), "anpd", prefix_cache_tokens=4096)
    first = loose.generate(prompt, max_new_tokens=10).token_ids
    loose.generate(prompt + first, max_new_tokens=4)
    assert loose.prefix_cache.hits == 0 and not loose.prefix_cache.entries
    with pytest.raises(InputError, match="prefix_cache_tokens"):
        Decoder(exact_tiny, "ar", prefix_cache_tokens=-1)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    requests=st.integers(2, 7),
    max_batch=st.integers(1, 3),
    budget=st.sampled_from([16, 64, 4096]),
    wait_tokens=st.sampled_from([1, 4, 10**6]),
)
def test_requests_sharing_prefixes_in_a_busy_batch_each_equal_the_request_alone(
    exact_tiny, seed, requests, max_batch, budget, wait_tokens
) -> None:
    """Prompts that extend, cut or repeat earlier ones, joining while others are prefilled, decode
    and leave (one cancelled), starting from kept caches (a budget small enough to evict) and from
    running requests' caches, waiting or not for prefills that will give them more."""
    rng = random.Random(seed)
    decoders = {m: wrap(exact_tiny, m) for m in ("ar", "anpd", "anpd-tree", "suffix")}
    prefix_cache = PrefixCache(budget)
    scheduler = BatchScheduler(
        decoders["ar"].backend,
        COST,
        max_batch=max_batch,
        max_rows=6,
        prefix_cache=prefix_cache,
        wait_tokens=wait_tokens,
    )
    prompts: list[list[int]] = []
    outputs: dict[int, list[int]] = {}
    ends: dict[int, str] = {}
    plans = []
    submissions = []
    for i in range(requests):
        base = list(rng.choice(prompts)) if prompts and rng.random() < 0.8 else []
        base = base[: rng.randint(1, len(base))] if base and rng.random() < 0.3 else base
        prompt = base + [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(0 if base else 1, 12))]
        prompts.append(prompt)
        options = {"max_new_tokens": rng.randint(1, 20)}
        plans.append((rng.choice(list(decoders)), prompt, options))
        outputs[i] = []
        submissions.append(
            scheduler.submit(
                Submission(
                    decoders[plans[i][0]].start(prompt, **options),
                    lambda step, i=i: outputs[i].extend(step.tokens),
                    lambda reason, i=i: ends.__setitem__(i, reason),
                )
            )
        )
        for _ in range(rng.choice([0, 0, 1, 3, 6])):  # often in bursts
            scheduler.step()
        if i == 1:
            submissions[0].cancel()
    while not scheduler.idle:
        scheduler.step()
    assert prefix_cache.tokens <= budget
    for i, (method, prompt, options) in enumerate(plans):
        alone = decoders[method].generate(prompt, **options).token_ids
        assert outputs[i] == (alone[: len(outputs[i])] if ends[i] == "cancelled" else alone), (i, plans[i])


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    kept=st.integers(0, 12),
    running=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=12), st.integers(0, 12)), max_size=4),
    wait_tokens=st.integers(1, 6),
)
def test_a_prompt_starts_from_the_longest_prefix_held_now_or_waits_for_enough_more(
    prompt, kept, running, wait_tokens
) -> None:
    sources = [
        RunningSource(tuple(tokens), min(ready, len(tokens)), fake_seq(min(ready, len(tokens))))
        for tokens, ready in running
    ]
    start = plan_start(prompt, kept, sources, wait_tokens)
    cap = len(prompt) - 1
    shared = [min(shared_prefix(s.tokens, tuple(prompt)), cap) for s in sources]
    now = max([min(kept, cap)] + [min(n, s.ready) for n, s in zip(shared, sources)])
    later = max([n for n, s in zip(shared, sources) if n > s.ready], default=0)
    if later - now >= wait_tokens:
        assert start is not None and start.wait and start.length == later
        assert shared[start.source] == later > sources[start.source].ready
    elif now == 0:
        assert start is None
    else:
        assert start is not None and not start.wait and start.length == now
        if start.source is None:
            assert min(kept, cap) == now
        else:
            assert min(shared[start.source], sources[start.source].ready) == now


@pytest.mark.parametrize("cancel_leader", [False, True])
def test_a_burst_with_one_system_prompt_prefills_it_once(exact_tiny, cancel_leader) -> None:
    """Requests that join together, each a shared system prompt and a question of its own: the
    first prefills the system prompt, the others wait for it and start from copies (the first
    cancelled midway: the next goes on from the chunks it kept); each equals its request alone."""
    decoders = [wrap(exact_tiny, m) for m in ("ar", "anpd", "suffix", "anpd-tree")]
    prefix_cache = PrefixCache(4096)
    scheduler = BatchScheduler(
        decoders[0].backend, COST, max_batch=4, max_rows=8, prefix_cache=prefix_cache, wait_tokens=4
    )
    rng = random.Random(7)
    system = [rng.randrange(2, TINY_VOCAB) for _ in range(20)]
    prompts = [system + [rng.randrange(2, TINY_VOCAB) for _ in range(3 + i)] for i in range(4)]
    options = [{"max_new_tokens": 10}] * 3 + [{"max_new_tokens": 10, "temperature": 0.9, "seed": 5}]  # one sampled
    outputs: list[list[int]] = [[] for _ in prompts]
    ends: list[str] = []
    subs = [
        scheduler.submit(Submission(d.start(p, **options[i]), lambda s, i=i: outputs[i].extend(s.tokens), ends.append))
        for i, (d, p) in enumerate(zip(decoders, prompts))
    ]
    prefill_rows = drain(scheduler, lambda i: subs[0].cancel() if cancel_leader and i == 1 else None)
    followers = subs[1:]
    if cancel_leader:
        assert outputs[0] == [] and ends.count("cancelled") == 1
        # the leader left after a chunk and kept it: the next starts from that chunk and prefills
        # the rest of its prompt, the last two wait for that one's prefill; no prompt row is
        # prefilled twice
        assert 0 < followers[0].cached_tokens < len(system) and prefix_cache.hits == 1
        assert [s.cached_tokens for s in followers[1:]] == [len(system)] * 2
        assert prefill_rows == sum(len(p) for p in prompts[1:]) - 2 * len(system)
    else:
        assert [s.cached_tokens for s in followers] == [len(system)] * 3
        assert prefill_rows == sum(len(p) for p in prompts) - 3 * len(system)
    for i, (d, p) in enumerate(zip(decoders, prompts)):
        if not (cancel_leader and i == 0):
            assert outputs[i] == d.generate(p, **options[i]).token_ids


def test_a_request_joining_a_decoding_one_starts_from_its_cache(exact_tiny) -> None:
    """A prompt that extends what a running request has decoded so far (a chat's next turn sent
    before the last one ended, or a shared prefix) starts from a copy of its cache."""
    decoder = wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler(decoder.backend, COST, max_batch=4, max_rows=24, prefix_cache=PrefixCache(4096))
    first = [5, 6, 7, 8, 9, 10, 11, 12]
    answer: list[int] = []
    ends: list[str] = []
    scheduler.submit(
        Submission(decoder.start(first, max_new_tokens=30), lambda s: answer.extend(s.tokens), ends.append)
    )
    for _ in range(30):
        if len(answer) >= 6:
            break
        scheduler.step()
    assert len(answer) >= 6 and not ends  # the first is still decoding
    prompt = first + answer[:4] + [13, 14]
    second: list[int] = []
    sub = scheduler.submit(
        Submission(decoder.start(prompt, max_new_tokens=8), lambda s: second.extend(s.tokens), ends.append)
    )
    drain(scheduler)
    assert sub.cached_tokens == len(first) + 4 and scheduler.prefix_cache.hits == 0  # from the running request
    assert second == decoder.generate(prompt, max_new_tokens=8).token_ids


def test_requests_with_one_prompt_that_wait_on_a_prefill_then_share_one(exact_tiny) -> None:
    """Siblings with one prompt (`n` > 1) that join while another prompt sharing its start is being
    prefilled: they wait for it, then one prefills the rest and the others follow its prefill."""
    decoder = wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler(
        decoder.backend, COST, max_batch=4, max_rows=4, prefix_cache=PrefixCache(4096), wait_tokens=4
    )
    system = list(range(20, 44))
    prompts = [system + [5, 6], system + [7, 8, 9], system + [7, 8, 9]]
    outputs: list[list[int]] = [[] for _ in prompts]
    ends: list[str] = []
    subs = [
        scheduler.submit(
            Submission(decoder.start(p, max_new_tokens=6), lambda s, i=i: outputs[i].extend(s.tokens), ends.append)
        )
        for i, p in enumerate(prompts)
    ]
    prefill_rows = drain(scheduler)
    assert [s.cached_tokens for s in subs] == [0, len(system), len(system)]
    assert prefill_rows == len(prompts[0]) + 3  # the system prompt once, the siblings' rest once
    for output, p in zip(outputs, prompts):
        assert output == decoder.generate(p, max_new_tokens=6).token_ids


def test_a_scheduler_refuses_a_wait_of_no_tokens(exact_tiny) -> None:
    with pytest.raises(InputError, match="wait_tokens"):
        BatchScheduler(wrap(exact_tiny, "ar").backend, COST, prefix_cache=PrefixCache(64), wait_tokens=0)


def test_the_servers_default_size_is_what_a_gigabyte_of_keys_and_values_holds_at_most(exact_tiny, monkeypatch) -> None:
    from leapdecode.server import batching

    backend = wrap(exact_tiny, "ar").backend
    text = exact_tiny.model.config
    kv_heads = text.num_key_value_heads
    per_token = text.num_hidden_layers * 2 * kv_heads * (text.hidden_size // text.num_attention_heads) * 4
    assert batching.default_prefix_cache_tokens(backend) == min(8192, 2**30 // per_token)
    monkeypatch.setattr(batching, "PREFIX_CACHE_BYTES", 10 * per_token + 1)
    assert batching.default_prefix_cache_tokens(backend) == 10
