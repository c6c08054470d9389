"""The guard at the extension point: every registered method, run on tiny random models.

Parametrised over the registry itself, so a new method cannot land untested: a lossless one must
decode greedily as the slow reference does and, seeded, sample the tokens plain sampling samples
(methods whose sampled drafts are coupled to the target's per-position noise); a lossy one reports
its agreement with plain decoding. A method that needs files (a draft model, a datastore, a trained
head) gets them from `FIXTURES`; one missing there fails here. Peers run other libraries'
`generate` and are covered by the benchmark's tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from leapdecode.api import Decoder
from leapdecode.engine.reference import greedy_reference
from leapdecode.methods import METHODS, Method, parse_method
from leapdecode.models import LoadedModel
from tests.helpers import TINY_VOCAB, CheckedDrafter, make_tiny_model, prompts, tiny_lm

Fixture = Callable[[Path, LoadedModel], tuple[str, "LoadedModel | None"]]


def _draft(tmp: Path, target: LoadedModel) -> tuple[str, LoadedModel | None]:
    return "draft:k=3", tiny_lm(make_tiny_model(seed=1), "tiny-draft")


def _rest(tmp: Path, target: LoadedModel) -> tuple[str, LoadedModel | None]:
    from leapdecode.drafters.rest import Datastore, tokenizer_fingerprint

    documents = [prompt * 3 for prompt in prompts(6, seed=3)]
    meta = {"tokenizer": tokenizer_fingerprint(target.tokenizer), "model": target.name}
    Datastore.from_documents(documents, separator=0, meta=meta).save(tmp / "ds")
    return f"rest:datastore={tmp / 'ds'}", None


def _eagle3(tmp: Path, target: LoadedModel) -> tuple[str, LoadedModel | None]:
    from leapdecode.heads.eagle3 import Eagle3Config, default_aux_layers, random_head
    from leapdecode.heads.eagle3_format import save_eagle3

    text = target.model.config.get_text_config()
    config = Eagle3Config(
        hidden_size=text.hidden_size,
        intermediate_size=128,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        vocab_size=TINY_VOCAB,
        draft_vocab_size=TINY_VOCAB,
        aux_layers=default_aux_layers(text.num_hidden_layers),
        rope_theta=10000.0,
    )
    save_eagle3(random_head(config, target.model.get_input_embeddings(), seed=1, scale=0.05), tmp / "eagle3")
    return f"eagle3:head={tmp / 'eagle3'},depth=3,cost_aware=false", None


def _medusa(tmp: Path, target: LoadedModel) -> tuple[str, LoadedModel | None]:
    from leapdecode.heads.medusa import MedusaConfig, random_medusa
    from leapdecode.heads.medusa_format import save_medusa

    text = target.model.config.get_text_config()
    save_medusa(
        random_medusa(MedusaConfig(text.hidden_size, TINY_VOCAB, num_heads=3), seed=2, scale=0.05), tmp / "medusa"
    )
    return f"medusa:head={tmp / 'medusa'},depth=3,cost_aware=false", None


# Methods that load files, and how to make them on a tiny model.
FIXTURES: dict[str, Fixture] = {"draft": _draft, "rest": _rest, "eagle3": _eagle3, "medusa": _medusa}
# Methods that need a parameter to run on a two-layer model.
EXAMPLES = {"layerskip": "layerskip:exit=1", "self-spec": "self-spec:skip=1"}
ENGINE = [m for m in METHODS if not m.kind.peer]


def example(cls: type[Method], tmp: Path, target: LoadedModel) -> tuple[Method, LoadedModel | None]:
    if cls.kind.loads_files:
        assert cls.name in FIXTURES, f"{cls.name} loads files: give it a fixture in FIXTURES so it is tested"
        spec, draft = FIXTURES[cls.name](tmp, target)
        return parse_method(spec), draft
    return parse_method(EXAMPLES.get(cls.name, cls.name)), None


def marks(cls: type[Method]) -> list[pytest.MarkDecorator]:
    return [pytest.mark.peers] if cls.name == "arctic-suffix" else []


@pytest.mark.parametrize("cls", [pytest.param(m, marks=marks(m), id=m.name) for m in ENGINE])
def test_every_method_decodes_as_plain_decoding_or_reports_its_agreement(cls, tiny_model, tmp_path) -> None:
    target = tiny_lm(tiny_model)
    method, draft = example(cls, tmp_path, target)
    decoder = Decoder(target, method, draft_model=draft)
    checked: list[CheckedDrafter] = []
    factory = decoder._new_drafter  # every drafter it builds is checked for the legal call order

    def build(sampling, noise):
        checked.append(CheckedDrafter(factory(sampling, noise)))
        return checked[-1]

    decoder._new_drafter = build
    plain = Decoder(target, "ar")
    agreement = []
    for prompt in prompts(3, seed=11):
        expected = greedy_reference(tiny_model, prompt, 24)
        out = decoder.generate(prompt, max_new_tokens=24)
        assert len(out.token_ids) == 24 and out.stats.forward_passes >= 1
        if method.capabilities.lossless:
            assert out.token_ids == expected, f"{method}: greedy output differs from plain decoding's"
        else:
            agreement.append(sum(a == b for a, b in zip(out.token_ids, expected)) / len(expected))
        if method.capabilities.lossless and method.capabilities.coupled:
            for seed in (3, 4):
                sampled = decoder.generate(prompt, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=seed)
                want = plain.generate(prompt, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=seed)
                assert sampled.token_ids == want.token_ids, f"{method}: seeded sampling differs from plain sampling's"
    assert checked and all(d.state == "done" for d in checked)  # every request ended with `finish`
    if not method.capabilities.lossless:
        assert all(0.0 <= a <= 1.0 for a in agreement)
        print(f"{method}: agreement with plain greedy decoding {sum(agreement) / len(agreement):.2f}")


def test_every_method_that_loads_files_has_a_fixture_and_no_fixture_is_stale() -> None:
    loading = {m.name for m in ENGINE if m.kind.loads_files}
    assert loading == set(FIXTURES), "FIXTURES must name exactly the methods that load files"
    assert set(EXAMPLES) <= {m.name for m in ENGINE}


@pytest.mark.parametrize("cls", [m for m in ENGINE if not m.kind.lossless], ids=lambda m: m.name)
def test_a_lossy_method_at_its_exact_setting_is_plain_decoding(cls, tiny_model) -> None:
    """The lossy methods have a setting that gives up nothing (CALM: threshold 1 never exits)."""
    exact = {"calm": "calm:threshold=1"}
    assert cls.name in exact, f"{cls.name} is lossy: name its exact setting here"
    target = tiny_lm(tiny_model)
    decoder = Decoder(target, exact[cls.name])
    for prompt in prompts(2, seed=12):
        with torch.inference_mode():
            assert decoder.generate(prompt, max_new_tokens=16).token_ids == greedy_reference(tiny_model, prompt, 16)


@pytest.mark.parametrize("cls", [pytest.param(m, marks=marks(m), id=m.name) for m in ENGINE])
def test_every_method_keeps_the_call_order_and_its_output_in_shared_passes(cls, tmp_path) -> None:
    """Several requests of each method in the scheduler's shared passes (offer, take, cuts across
    requests), on a row-exact tiny model: each output is the request's alone, and every drafter
    hears its calls in the legal order."""
    import dataclasses

    from leapdecode.engine.cost import ForwardCost
    from leapdecode.engine.scheduler import BatchScheduler
    from leapdecode.engine.submission import Submission
    from leapdecode.models.row_exact import use_row_exact

    model = make_tiny_model()
    use_row_exact(model)
    target = dataclasses.replace(tiny_lm(model), row_exact=True)
    method, draft = example(cls, tmp_path, target)
    decoder = Decoder(target, method, draft_model=draft)
    scheduler = BatchScheduler(
        Decoder(target, "ar").backend,
        ForwardCost(tuple(0.01 + 0.001 * n for n in range(1, 65))),
        max_batch=3,
        max_rows=32,
    )
    outputs: list[list[int]] = [[] for _ in range(3)]
    runs = []
    for i, prompt in enumerate(prompts(3, seed=13)):
        run = decoder.start(prompt, max_new_tokens=20)
        run.drafter = CheckedDrafter(run.drafter)
        runs.append(run)
        scheduler.submit(
            Submission(
                run, lambda step, i=i: outputs[i].extend(step.tokens), lambda reason: None, backend=decoder.backend
            )
        )
    while not scheduler.idle:
        scheduler.step()
    for run, out, prompt in zip(runs, outputs, prompts(3, seed=13)):
        assert run.drafter.state == "done"
        if method.capabilities.lossless:
            assert out == greedy_reference(model, prompt, 20), f"{method} in shared passes"


def test_the_call_order_check_refuses_what_the_loop_never_does() -> None:
    from leapdecode.drafters import NoDrafter
    from leapdecode.engine.drafting import DraftContext, PassResult, Request

    drafter = CheckedDrafter(NoDrafter())
    with pytest.raises(AssertionError, match="offer in state new"):
        next(drafter.offer(DraftContext(4)), None)
    drafter.start(Request([1, 2], prefill=PassResult([3], 0)))
    with pytest.raises(AssertionError, match="hear in state started"):
        drafter.hear(PassResult([3], 0, ()))  # a pass it never offered for
    with pytest.raises(StopIteration):
        next(drafter.offer(DraftContext(4)))  # no draft model: the offer is made at once
    with pytest.raises(AssertionError, match="offer in state offered"):
        next(drafter.offer(DraftContext(4)), None)
    drafter.hear(PassResult([5], 0, ()))
    drafter.finish()
    with pytest.raises(AssertionError, match="hear in state done"):
        drafter.hear(PassResult([5], 0, ()))
