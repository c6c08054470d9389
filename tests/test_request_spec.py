"""A generation's options and limits, checked once (`leapdecode.request.RequestSpec`): each refusal
names the option, and the library, the command line and the server share the rule."""

from __future__ import annotations

import pytest

from leapdecode import wrap
from leapdecode.errors import InputError, RequestError
from leapdecode.request import RequestSpec
from tests.helpers import make_tiny_model, tiny_lm


@pytest.mark.parametrize(
    "options, param",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": "7"}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_every_bad_option_is_refused_by_name(options, param) -> None:
    with pytest.raises(RequestError) as refused:
        RequestSpec.of(**options)
    assert refused.value.param == param and param in str(refused.value)


def test_the_context_is_fitted_once_for_prompt_and_budget() -> None:
    lm = tiny_lm(make_tiny_model())  # a context of 512 tokens
    RequestSpec.of(max_new_tokens=12).fit(lm, [5] * 500)
    with pytest.raises(RequestError, match="exceeds the context") as over:
        RequestSpec.of(max_new_tokens=13).fit(lm, [5] * 500)
    assert over.value.param == "max_new_tokens" and over.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="too long") as long:
        RequestSpec.of().fit(lm, [5] * 512)
    assert long.value.param == "prompt"


def test_the_library_refuses_as_the_spec_does_and_changes_nothing() -> None:
    decoder = wrap(tiny_lm(make_tiny_model()), "anpd")
    with pytest.raises(InputError, match="top_p must be"):
        decoder.generate([5, 6, 7], max_new_tokens=4, temperature=0.5, top_p=1.5)
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        decoder.generate([5, 6, 7], max_new_tokens=0)
    assert len(decoder.generate([5, 6, 7], max_new_tokens=4).token_ids) == 4
