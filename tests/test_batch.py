"""Several sequences in one pass (`engine.batch`) and continuous batching (`engine.scheduler`):
each sequence's logits, states and cache bitwise what its own pass gives, whatever else is in
the pass; every request's output equal to the request alone under random arrival, departure and
cancellation schedules; the allocation of draft rows across requests."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode import wrap
from leapdecode.drafters import Draft, Offer
from leapdecode.engine import TorchBackend, compile_tree
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import ForwardCost, allocate, efficient_rows, share_rows
from leapdecode.engine.cost_measure import measure_batch_cost
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.errors import InputError
from leapdecode.models.row_exact import use_row_exact
from tests.helpers import TINY_VOCAB, make_tiny_model, tiny_lm


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exact_tiny(request):
    """A tiny model made row-exact, as the API loads it (`LoadedModel.row_exact`)."""
    model = make_tiny_model(request.param)
    use_row_exact(model)
    return dataclasses.replace(tiny_lm(model), row_exact=True)


def random_tree(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(-1, j) if j else -1 for j in range(n))


def caches_equal(a, b) -> bool:
    return all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.cache.layers, b.cache.layers)
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), sequences=st.integers(1, 5), with_prompt=st.booleans())
def test_each_sequence_of_a_packed_pass_scores_bitwise_as_its_own_pass(
    exact_tiny, seed, sequences, with_prompt
) -> None:
    rng = random.Random(seed)
    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    contexts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 80))] for _ in range(sequences)]
    alone = [backend.prefill(c)[0] for c in contexts]
    packed = [backend.prefill(c)[0] for c in contexts]
    plans = []
    for _ in range(sequences):
        n = rng.randint(1, 8)
        tokens = [rng.randrange(TINY_VOCAB) for _ in range(n)]
        tree = compile_tree(random_tree(rng, n - 1)) if n > 2 and rng.random() < 0.5 else None
        plans.append((tokens, tree))
    items = [BatchItem(seq, tokens, tree) for seq, (tokens, tree) in zip(packed, plans)]
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 40))]
    fresh = backend.new_sequence()
    if with_prompt:
        items.insert(rng.randint(0, len(items)), BatchItem(fresh, prompt, last_only=True))
    scores = forward_batch(backend, items, features=(1, 2))
    by_seq = {id(item.seq): s for item, s in zip(items, scores)}
    for seq_alone, seq_packed, (tokens, tree) in zip(alone, packed, plans):
        want = backend.forward(seq_alone, tokens, tree=tree, features=(1, 2))
        got = by_seq[id(seq_packed)]
        assert torch.equal(got.logits, want.logits) and torch.equal(got.features, want.features)
        assert seq_packed.length == seq_alone.length and caches_equal(seq_alone, seq_packed)
        backend.keep(seq_alone, len(seq_alone.cache.layers[0].keys[0, 0]) - len(tokens), [0])
        backend.keep(seq_packed, seq_packed.length - len(tokens), [0])
        assert caches_equal(seq_alone, seq_packed)
    if with_prompt:
        seq, want = backend.prefill(prompt, features=(1, 2))
        got = by_seq[id(fresh)]
        assert (
            got.logits.shape[0] == 1
            and torch.equal(got.logits, want.logits)
            and torch.equal(got.features, want.features)
        )
        assert caches_equal(seq, fresh)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, 90), min_size=1, max_size=4))
def test_a_prompt_prefilled_in_chunks_beside_other_sequences_is_bitwise_its_whole_prefill(
    exact_tiny, seed, cuts
) -> None:
    rng = random.Random(seed)
    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(2, 100))]
    whole_seq, whole = backend.prefill(prompt, features=(1, 2))
    others = [backend.prefill([rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))])[0] for _ in range(2)]
    seq, done, features = backend.new_sequence(), 0, []
    for cut in [*sorted(set(cuts)), len(prompt)]:
        if cut <= done or done >= len(prompt):
            continue
        chunk = prompt[done : min(cut, len(prompt))]
        items = [BatchItem(seq, chunk, last_only=True)] + [BatchItem(o, [rng.randrange(TINY_VOCAB)]) for o in others]
        rng.shuffle(items)
        scores = forward_batch(backend, items, features=(1, 2))
        got = scores[next(i for i, item in enumerate(items) if item.seq is seq)]
        features.append(got.features)
        done += len(chunk)
    assert torch.equal(got.logits, whole.logits) and torch.equal(torch.cat(features), whole.features)
    assert seq.length == whole_seq.length and caches_equal(seq, whole_seq)


def test_the_backend_prefills_long_prompts_in_chunks_that_give_the_bits_of_any_other_cut(
    exact_tiny, monkeypatch
) -> None:
    from leapdecode.models import row_exact

    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    prompt = [(7 * i) % TINY_VOCAB for i in range(90)]
    monkeypatch.setattr(row_exact, "PASS_ROWS", 32)
    assert backend.prefill_chunk == 32
    seq32, by32 = backend.prefill(prompt, features=(1,))
    monkeypatch.setattr(row_exact, "PASS_ROWS", 50)
    seq50, by50 = backend.prefill(prompt, features=(1,))
    assert (
        by32.features.shape[0] == 90
        and torch.equal(by32.features, by50.features)
        and torch.equal(by32.logits, by50.logits)
    )
    assert caches_equal(seq32, seq50)
    forked = backend.fork(seq32)
    assert forked.length == 90 and caches_equal(forked, seq32)
    backend.forward(forked, [1, 2, 3])
    assert seq32.length == 90 and seq32.cache.layers[0].keys.shape[-2] == 90  # the copy grows alone


def test_requests_with_the_same_prompt_share_one_prefill_and_each_equals_itself_alone(exact_tiny) -> None:
    plain, anpd = wrap(exact_tiny, "ar"), wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler(plain.backend, ForwardCost(tuple(0.01 for _ in range(64))), max_batch=4, max_rows=16)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 9, 5, 6, 7, 8, 5, 6, 7]  # two chunks of 16 rows at most
    options = [
        {"max_new_tokens": 20},
        {"max_new_tokens": 20, "temperature": 0.9, "seed": 1},
        {"max_new_tokens": 20, "temperature": 0.9, "seed": 2},
        {"max_new_tokens": 7},
    ]
    outputs: list[list[int]] = [[] for _ in options]
    ends: list[str] = ["" for _ in options]
    subs = [
        scheduler.submit(
            Submission(
                (anpd if i % 2 else plain).start(prompt, **o),
                lambda s, i=i: outputs[i].extend(s.tokens),
                lambda r, i=i: ends.__setitem__(i, r),
            )
        )
        for i, o in enumerate(options)
    ]
    prefilled = scheduler.step().prefill_rows  # the first chunk of the first request's prefill
    assert (
        prefilled == 16
        and list(scheduler.prefilling) == [subs[0]]
        and scheduler.prefilling[subs[0]].followers == subs[1:]
    )
    subs[0].cancel()  # it leaves mid-prefill: the next takes the prefill over
    while not scheduler.idle:
        report = scheduler.step()
        prefilled += report.prefill_rows if report else 0
    assert prefilled == len(prompt)  # one prefill for the three that stayed
    assert ends == ["cancelled", "length", "length", "length"] and outputs[0] == []
    for i in range(1, 4):
        assert outputs[i] == plain.generate(prompt, **options[i]).token_ids, i
    assert outputs[1] != outputs[2]  # siblings sample apart


def test_a_packed_pass_refuses_what_it_cannot_score_exactly(exact_tiny, tiny_model) -> None:
    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    seq, _ = backend.prefill([3, 4, 5])
    with pytest.raises(InputError, match="at most once"):
        forward_batch(backend, [BatchItem(seq, [1]), BatchItem(seq, [2])])
    with pytest.raises(InputError, match="at least one token"):
        forward_batch(backend, [BatchItem(seq, [])])
    assert seq.length == 3
    plain = TorchBackend(tiny_model)  # not row-exact: its rows depend on the others in a pass
    assert plain.batchable is not None
    with pytest.raises(InputError, match="row-exact"):
        BatchScheduler(plain, ForwardCost((0.01,)))


def test_draft_subset_keeps_chains_prefixes_and_renumbers_tree_parents() -> None:
    chain = Draft([5, 6, 7], evidence=(1, 2, 3))
    assert chain.subset([0, 1]) == Draft([5, 6], evidence=(1, 2))
    assert chain.subset([]) == Draft()
    tree = Draft([5, 6, 7, 8], parents=(-1, -1, 1, 2))
    assert tree.subset([1, 2, 3]) == Draft([6, 7, 8], parents=(-1, 0, 1))
    with pytest.raises(ValueError, match="parent was dropped"):
        tree.subset([0, 2])


def test_allocation_drafts_while_rows_are_cheap_and_falls_back_to_plain_rows_when_dear() -> None:
    sure = Offer(Draft([1, 2, 3]), (0.9, 0.8, 0.7))
    doubtful = Offer(Draft([4, 5]), (0.4, 0.05))
    flat = ForwardCost(tuple(0.05 for _ in range(64)))  # a row costs nothing: everything is kept
    assert allocate([sure, doubtful], [3, 2], 2, 2, flat, 64) == [[0, 1, 2], [0, 1]]
    linear = ForwardCost(tuple(0.01 * n for n in range(1, 65)))  # a row costs as much as a pass of its own
    assert allocate([sure, doubtful], [3, 2], 2, 2, linear, 64) == [[], []]
    # 8 pending tokens in a pass of 0.16 s: a row (0.01 s) pays when its token is likelier than
    # about the pass's tokens per row-second, 10.4 / 0.19 x 0.01 = 0.55 once the sure ones are in
    curve = ForwardCost(tuple(0.08 + 0.01 * n for n in range(1, 65)))
    assert allocate([sure, doubtful] + [None] * 6, [3, 2] + [0] * 6, 8, 8, curve, 64) == [[0, 1, 2], []] + [[]] * 6
    alone = curve  # the same curve with one request pending: the 0.4 one pays (above 3.4 / 0.12 x 0.01 = 0.28)
    assert allocate([sure, doubtful], [3, 2], 1, 1, alone, 64) == [[0, 1, 2], [0]]
    # caps and the row budget hold; an offer without reach is taken whole (up to its cap) first
    assert allocate([sure, Offer(Draft([9, 9]))], [1, 5], 2, 2, flat, 64) == [[0], [0, 1]]
    assert allocate([sure, doubtful], [3, 2], 2, 2, flat, 4) == [[0, 1], []]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), offers=st.integers(1, 5), budget=st.integers(1, 40))
def test_allocation_keeps_parents_before_children_within_caps_and_budget(seed, offers, budget) -> None:
    rng = random.Random(seed)
    made, caps = [], []
    for _ in range(offers):
        n = rng.randint(0, 8)
        parents = random_tree(rng, n)
        reach: list[float] = []
        for p in parents:
            reach.append(rng.random() * (reach[p] if p >= 0 else 1.0))
        made.append(Offer(Draft(list(range(n)), parents=parents), tuple(reach)))
        caps.append(rng.randint(0, n))
    cost = ForwardCost(tuple(0.02 + rng.random() * 0.002 * n for n in range(1, 80)))
    kept = allocate(made, caps, offers, offers, cost, offers + budget)
    assert sum(map(len, kept)) <= budget
    for offer, cap, chosen in zip(made, caps, kept):
        assert len(chosen) <= cap and chosen == sorted(chosen)
        assert all(offer.draft.parents[t] < 0 or offer.draft.parents[t] in chosen for t in chosen)
        offer.draft.subset(chosen)  # a valid tree


METHODS = ["ar", "anpd", "pld", "anpd-tree", "suffix", "lookahead", "anpd:cost_aware=false", "recycle"]


def run_schedule(lm, rng: random.Random, requests: int, max_batch: int, max_rows: int, cancel: bool):
    """Submit `requests` random requests at random passes; cancel one mid-way if asked. Returns
    the requests, their outputs and end reasons, and the scheduler."""
    decoders = {m: wrap(lm, m) for m in METHODS}
    cost = ForwardCost(tuple(0.01 + 0.003 * n for n in range(1, 129)))
    scheduler = BatchScheduler(decoders["ar"].backend, cost, max_batch=max_batch, max_rows=max_rows)
    plans = []
    for _ in range(requests):
        motif = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(2, 8))]
        options = {"max_new_tokens": rng.randint(1, 40)}
        if rng.random() < 0.3:
            options.update(temperature=0.8, seed=rng.randrange(1000))
        prompt = (motif * 10)[: rng.randint(2, 70)]
        if plans and rng.random() < 0.3:  # the same prompt again (as `n` > 1 siblings): it may share a prefill
            prompt = list(rng.choice(plans)[1])
        plans.append((rng.choice(METHODS), prompt, options))
    outputs: dict[int, list[int]] = {i: [] for i in range(requests)}
    ends: dict[int, str] = {}
    submissions: dict[int, Submission] = {}
    to_cancel = rng.randrange(requests) if cancel else -1
    waiting = list(range(requests))
    while waiting or not scheduler.idle:
        while waiting and rng.random() < 0.5:
            i = waiting.pop(0)
            method, prompt, options = plans[i]
            run = decoders[method].start(prompt, **options)
            submissions[i] = scheduler.submit(
                Submission(
                    run,
                    lambda step, i=i: outputs[i].extend(step.tokens),
                    lambda reason, i=i: ends.__setitem__(i, reason),
                )
            )
        if to_cancel in submissions and outputs[to_cancel] and rng.random() < 0.5:
            submissions[to_cancel].cancel()
        report = scheduler.step()
        assert report is None or report.rows <= max_rows  # a long prompt comes in chunks
    return plans, outputs, ends, submissions, scheduler, decoders["ar"], to_cancel


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    requests=st.integers(1, 6),
    max_batch=st.integers(1, 4),
    max_rows=st.sampled_from([8, 24, 48]),
    cancel=st.booleans(),
)
def test_every_request_in_a_batch_equals_the_request_alone(
    exact_tiny, seed, requests, max_batch, max_rows, cancel
) -> None:
    rng = random.Random(seed)
    plans, outputs, ends, submissions, scheduler, plain, cancelled = run_schedule(
        exact_tiny, rng, requests, max_batch, max_rows, cancel
    )
    assert not scheduler.running and not scheduler.waiting
    for i, (_, prompt, options) in enumerate(plans):
        alone = plain.generate(prompt, **options).token_ids
        if ends[i] == "cancelled":
            assert i == cancelled and outputs[i] == alone[: len(outputs[i])]
        else:
            assert ends[i] in ("stop", "length") and outputs[i] == alone, (i, plans[i])
        assert submissions[i].run.seq is None  # the cache is freed when the request leaves


def test_a_request_past_its_time_limit_leaves_and_a_failing_pass_ends_only_its_requests(exact_tiny) -> None:
    clock = [0.0]
    decoder = wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler(
        decoder.backend, ForwardCost((0.01, 0.02)), max_batch=4, max_rows=32, clock=lambda: clock[0]
    )
    ends: dict[str, str] = {}
    slow = scheduler.submit(
        Submission(
            decoder.start([5, 6, 7], max_new_tokens=50),
            lambda s: None,
            lambda r: ends.__setitem__("slow", r),
            timeout_s=1.0,
        )
    )
    scheduler.step()
    clock[0] = 2.0
    scheduler.step()
    assert ends == {"slow": "timeout"} and slow.run.seq is None and not scheduler.running

    broken = decoder.start([5, 6, 7], max_new_tokens=20)
    broken.drafter.offer = lambda max_tokens: (_ for _ in ()).throw(RuntimeError("drafter failed"))  # type: ignore[method-assign]
    failed = scheduler.submit(Submission(broken, lambda s: None, lambda r: ends.__setitem__("broken", r)))
    scheduler.step()  # its prefill
    out: list[int] = []
    scheduler.submit(
        Submission(
            decoder.start([9, 8, 7, 9, 8, 7], max_new_tokens=12),
            lambda s: out.extend(s.tokens),
            lambda r: ends.__setitem__("healthy", r),
        )
    )
    while not scheduler.idle:
        scheduler.step()  # the broken drafter fails: that request ends with its error, the pass goes on without it
    assert ends["broken"] == "error" and "drafter failed" in str(failed.error) and broken.seq is None
    assert ends["healthy"] == "length" and out == decoder.generate([9, 8, 7, 9, 8, 7], max_new_tokens=12).token_ids


@pytest.mark.parametrize("max_batch", [1, 3])
def test_requests_that_cannot_share_run_in_passes_of_their_own_beside_the_shared_pass(exact_tiny, max_batch) -> None:
    """A method on a backend of its own (the target's layers run one by one) holds a slot and runs
    its own passes, taking turns with the shared pass; every output is the request's alone."""
    layered, plain = wrap(exact_tiny, "layerskip:exit=1,k=3"), wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler(
        plain.backend, ForwardCost(tuple(0.01 + 0.003 * n for n in range(1, 65))), max_batch=max_batch, max_rows=32
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 9, 8], [4, 4, 3, 4, 4, 3, 4]]
    decoders = [layered, plain, layered]
    outputs: list[list[int]] = [[] for _ in prompts]
    ends: dict[int, str] = {}
    submitted = [
        scheduler.submit(
            Submission(
                d.start(p, max_new_tokens=16),
                lambda s, i=i: outputs[i].extend(s.tokens),
                lambda r, i=i: ends.__setitem__(i, r),
                backend=d.backend,
            )
        )
        for i, (d, p) in enumerate(zip(decoders, prompts))
    ]
    assert [s.alone for s in submitted] == [True, False, True]
    reports = []
    while not scheduler.idle:
        report = scheduler.step()
        if report is not None:
            reports.append(report)
        assert len(scheduler.running) <= max_batch
    assert ends == {0: "length", 1: "length", 2: "length"}
    for d, p, out in zip(decoders, prompts, outputs):
        assert out == d.generate(p, max_new_tokens=16).token_ids
    if max_batch > 1:  # both kinds of pass were taken in turn while both were running
        assert any(r.sequences > 1 or r.prefill_rows for r in reports) and any(r.sequences == 1 for r in reports)


def test_a_batch_of_one_is_the_decode_loop_and_raises_what_failed(exact_tiny) -> None:
    from leapdecode.engine.alone import decode_run

    decoder = wrap(exact_tiny, "anpd")
    scheduler = BatchScheduler.alone(decoder.backend)
    assert scheduler.packing is None
    run = decoder.start([5, 6, 7, 5, 6, 7], max_new_tokens=12)
    assert [t for step in decode_run(decoder.backend, run) for t in step.tokens] == decoder.generate(
        [5, 6, 7, 5, 6, 7], max_new_tokens=12
    ).token_ids
    broken = decoder.start([5, 6, 7], max_new_tokens=12)
    broken.drafter.offer = lambda context: (_ for _ in ()).throw(RuntimeError("drafter failed"))  # type: ignore[method-assign]
    steps = decode_run(decoder.backend, broken)
    assert len(next(steps).tokens) == 1  # the prefill's token came before the failure
    with pytest.raises(RuntimeError, match="drafter failed"):
        next(steps)
    with pytest.raises(InputError, match="needs the row-exact kernels|cannot|decodes one sequence"):
        BatchScheduler(wrap(exact_tiny, "layerskip:exit=1").backend, ForwardCost((0.01,)), max_batch=2, max_rows=8)


def test_measured_batch_cost_covers_every_row_count_and_never_falls(exact_tiny) -> None:
    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    cost = measure_batch_cost(backend, 20, 4, context=16, repeats=1)
    assert len(cost.seconds) == 20 and list(cost.seconds) == sorted(cost.seconds)


def test_the_default_batch_grows_while_doubling_the_rows_of_a_pass_still_pays() -> None:
    from leapdecode.server.batching import default_max_batch

    assert (
        default_max_batch(ForwardCost(tuple(0.01 * n for n in range(1, 129)))) == 1
    )  # a row costs a pass: never share
    assert default_max_batch(ForwardCost(tuple(0.05 for _ in range(128)))) == 16  # rows are free: the largest
    # rows per second 25, 40, 57, 73, 84 at 1, 2, 4, 8, 16: the last doubling gains less than 1.2x
    assert default_max_batch(ForwardCost(tuple(0.03 + 0.01 * n for n in range(1, 129)))) == 8


@pytest.mark.parametrize(
    "methods", [["lookahead", "jacobi"], ["recycle:cost_aware=false", "anpd-tree"], ["hybrid", "lookahead"]]
)
def test_drafts_cut_to_the_pass_budget_still_equal_plain_decoding(exact_tiny, methods) -> None:
    """Drafters that learn from the rows they were scored on hear which rows the pass kept."""
    plain = wrap(exact_tiny, "ar")
    decoders = [wrap(exact_tiny, m) for m in methods]
    flat = ForwardCost(tuple(0.01 for _ in range(64)))  # every drafted token pays: only the budget cuts
    scheduler = BatchScheduler(plain.backend, flat, max_batch=4, max_rows=10)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9, 3, 9], [4, 4, 2, 4, 4, 2], [7, 1, 7, 1, 7]]
    outputs: list[list[int]] = [[] for _ in prompts]
    ends: list[str] = ["" for _ in prompts]
    for i, prompt in enumerate(prompts):
        run = decoders[i % len(decoders)].start(prompt, max_new_tokens=40)
        scheduler.submit(
            Submission(run, lambda s, i=i: outputs[i].extend(s.tokens), lambda r, i=i: ends.__setitem__(i, r))
        )
    while not scheduler.idle:
        report = scheduler.step()
        assert report is None or report.rows <= 10
    for i, prompt in enumerate(prompts):
        assert ends[i] == "length" and outputs[i] == plain.generate(prompt, max_new_tokens=40).token_ids, (methods, i)


def test_models_whose_rotary_follows_the_longest_position_are_not_batched(exact_tiny) -> None:
    backend = TorchBackend(exact_tiny.model, exact_tokens=exact_tiny.exact_tokens)
    assert backend.batchable is None
    config = exact_tiny.model.config
    saved = getattr(config, "rope_parameters", None)
    try:
        config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        assert "dynamic" in backend.batchable
    finally:
        config.rope_parameters = saved


@pytest.mark.parametrize("max_batch, curve", [(1, True), (1, False), (2, True), (4, True)])
def test_a_short_prompt_behind_a_long_one_starts_within_two_passes_and_each_equals_itself_alone(
    exact_tiny, max_batch, curve
) -> None:
    """Prompt rows are shared fairly: a short request that joins while a long prompt is being
    prefilled gets its first token within two passes (oldest-first chunks held it for the long
    prompt's whole prefill: eleven passes here), and both outputs are the requests' own. With no
    slot free (`max_batch` 1), the long prefill steps aside, keeping its chunks, and goes on after;
    so too with no shared curve (the server's one request at a time)."""
    decoder = wrap(exact_tiny, "ar")
    cost = ForwardCost(tuple(0.01 for _ in range(64))) if curve else None
    scheduler = BatchScheduler(decoder.backend, cost, max_batch=max_batch, max_rows=32)
    long_prompt = [random.Random(3).randrange(2, TINY_VOCAB) for _ in range(360)]
    outputs: dict[str, list[int]] = {"long": [], "short": []}
    first: dict[str, int] = {}
    passes = [0]

    def on_step(name: str):
        def record(step) -> None:
            first.setdefault(name, passes[0])
            outputs[name].extend(step.tokens)

        return record

    scheduler.submit(Submission(decoder.start(long_prompt, max_new_tokens=6), on_step("long"), lambda r: None))
    scheduler.step()
    passes[0] += 1
    scheduler.submit(Submission(decoder.start([5, 6, 7, 8], max_new_tokens=6), on_step("short"), lambda r: None))
    joined = passes[0]
    while not scheduler.idle:
        scheduler.step()
        passes[0] += 1
    assert first["short"] - joined < 2
    assert first["long"] >= 360 // 32
    assert not scheduler.stepped_aside and not scheduler.prefilling
    assert outputs["long"] == decoder.generate(long_prompt, max_new_tokens=6).token_ids
    assert outputs["short"] == decoder.generate([5, 6, 7, 8], max_new_tokens=6).token_ids


def test_a_prefill_that_stepped_aside_can_be_cancelled_while_it_waits(exact_tiny) -> None:
    """A long prompt steps aside for a short one (`max_batch` 1); cancelled while it waits for its
    slot, it ends as cancelled, its part-prefilled cache goes, and the short request is its own."""
    decoder = wrap(exact_tiny, "ar")
    scheduler = BatchScheduler(decoder.backend, ForwardCost(tuple(0.01 for _ in range(64))), max_batch=1, max_rows=32)
    ends: dict[str, str] = {}
    short: list[int] = []
    long_prompt = [random.Random(4).randrange(2, TINY_VOCAB) for _ in range(200)]
    long = scheduler.submit(
        Submission(decoder.start(long_prompt, max_new_tokens=4), lambda s: None, lambda r: ends.setdefault("long", r))
    )
    scheduler.step()
    scheduler.submit(
        Submission(
            decoder.start([5, 6, 7], max_new_tokens=5),
            lambda step: short.extend(step.tokens),
            lambda r: ends.setdefault("short", r),
        )
    )
    scheduler.step()
    assert long in scheduler.stepped_aside and list(scheduler.waiting) == [long] and short
    long.cancel()
    while not scheduler.idle:
        scheduler.step()
    assert ends == {"long": "cancelled", "short": "length"}
    assert not scheduler.stepped_aside and not scheduler.prefilling
    assert short == decoder.generate([5, 6, 7], max_new_tokens=5).token_ids


def test_the_time_limit_counts_decoding_and_the_prefill_has_its_own(exact_tiny) -> None:
    """A request whose prefill waits on another prompt's chunks is not timed out for it: its
    limit counts from its first token; a prefill that alone outlasts the limit ends with a timeout."""
    clock = [0.0]
    decoder = wrap(exact_tiny, "ar")
    scheduler = BatchScheduler(
        decoder.backend, ForwardCost(tuple(0.01 for _ in range(64))), max_batch=4, max_rows=16, clock=lambda: clock[0]
    )
    ends: dict[str, str] = {}
    long_prompt = [random.Random(4).randrange(2, TINY_VOCAB) for _ in range(200)]  # 13+ passes of prefill
    scheduler.submit(
        Submission(
            decoder.start(long_prompt, max_new_tokens=4),
            lambda s: None,
            lambda r: ends.__setitem__("long", r),
            timeout_s=5.0,
        )
    )
    for _ in range(3):
        scheduler.step()
        clock[0] += 1.0
    scheduler.submit(
        Submission(
            decoder.start([5, 6, 7], max_new_tokens=5),
            lambda s: None,
            lambda r: ends.__setitem__("short", r),
            timeout_s=5.0,
        )
    )
    while not scheduler.idle:
        scheduler.step()
        clock[0] += 1.0
    assert ends == {"short": "length", "long": "timeout"}


@given(st.lists(st.integers(0, 300), max_size=6), st.integers(1, 256))
def test_prompt_rows_are_shared_max_min_fairly(needs, rows) -> None:
    given_rows = share_rows(needs, rows)
    assert sum(given_rows) == min(rows, sum(needs))
    assert all(0 <= g <= n for g, n in zip(given_rows, needs))
    short = [
        g for g, n in zip(given_rows, needs) if g < n
    ]  # prompts left wanting got at least as much as anyone else, less one
    assert all(s >= max(given_rows) - 1 for s in short)


def test_prompt_chunks_beside_decoding_rows_stop_where_rows_stop_getting_cheaper(exact_tiny) -> None:
    """While requests decode, a pass holds no more rows than the fewest that cost about as little
    per row as any pass can (past them prompt rows cost as much each, and the decoding requests
    would only wait longer per token); a prompt prefilled alone takes the whole pass."""
    knee = ForwardCost((0.030, 0.031, 0.032, 0.034, 0.036, 0.040, 0.045, 0.050))  # then 5 ms a row
    assert efficient_rows(knee, 32) == 12 and efficient_rows(ForwardCost((0.01,) * 64), 8) == 8
    decoder = wrap(exact_tiny, "ar")
    scheduler = BatchScheduler(decoder.backend, knee, max_batch=4, max_rows=32)
    assert scheduler.busy_rows == 12
    out: list[int] = []
    scheduler.submit(
        Submission(decoder.start([5, 6, 7], max_new_tokens=30), lambda s: out.extend(s.tokens), lambda r: None)
    )
    scheduler.step()  # its prefill: it decodes from now on
    long_prompt = [random.Random(5).randrange(2, TINY_VOCAB) for _ in range(100)]
    scheduler.submit(Submission(decoder.start(long_prompt, max_new_tokens=2), lambda s: None, lambda r: None))
    reports = []
    while not scheduler.idle:
        report = scheduler.step()
        if report is not None:
            reports.append(report)
    chunked = [r for r in reports if r.prefill_rows]
    assert chunked and all(r.rows <= 12 for r in chunked)
    assert out == decoder.generate([5, 6, 7], max_new_tokens=30).token_ids
