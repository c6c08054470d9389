"""The real `smollm2-135m` (packaged GGUF): losslessness against plain greedy and Hugging Face
`generate`, stop handling, the chat template, and bad input. Runs in CI; never skipped."""

from __future__ import annotations

import pytest
import torch

from leapdecode import InputError, wrap

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten.",
    "Explain in two sentences why the sky is blue.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Summarize: The meeting was moved from Monday to Wednesday because the projector in room 4 was broken, "
    "and the meeting on Wednesday will be in room 4 if the projector in room 4 is repaired.",
]
CODE_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    'import json\n\ndef load_config(path):\n    """Load a JSON config file and return it as a dict."""\n',
    "def bubble_sort(items):\n    items = list(items)\n    for i in range(len(items)):\n",
]
MAX_NEW = 48


def hf_generate(lm, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    out = lm.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(lm.eos_token_ids),
        pad_token_id=lm.tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def plain_outputs(real_lm):
    plain = wrap(real_lm, "ar")
    results = {}
    for prompt in CHAT_PROMPTS:
        results[prompt] = plain.generate(prompt, max_new_tokens=MAX_NEW, chat=True)
    for prompt in CODE_PROMPTS:
        results[prompt] = plain.generate(prompt, max_new_tokens=MAX_NEW)
    return results


def test_plain_decoding_equals_hugging_face_generate(real_lm, plain_outputs) -> None:
    for result in plain_outputs.values():
        assert result.token_ids == hf_generate(real_lm, result.prompt_ids, MAX_NEW)


@pytest.mark.parametrize(
    "method",
    ["anpd", "anpd:n=3,k=4", "pld", "anpd-tree", "trie", "anpd-tree:nodes=40,depth=10,width=4", "jacobi", "lookahead"],
)
def test_methods_equal_plain_greedy_token_for_token(real_lm, plain_outputs, method) -> None:
    decoder = wrap(real_lm, method)
    accepted = 0
    for prompt, plain in plain_outputs.items():
        result = decoder.generate(prompt, max_new_tokens=MAX_NEW, chat=prompt in CHAT_PROMPTS)
        assert result.prompt_ids == plain.prompt_ids
        assert result.token_ids == plain.token_ids, f"{method} differs on {prompt[:40]!r}"
        assert result.text == plain.text
        assert result.stats.forward_passes <= plain.stats.forward_passes
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # drafts were really accepted on real text


def test_chat_stops_on_end_of_turn(real_lm) -> None:
    im_end = real_lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in real_lm.eos_token_ids
    result = wrap(real_lm, "anpd").generate("Say hello.", max_new_tokens=64, chat=True)
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] == im_end
    assert "<|im_end|>" not in result.text


def test_stop_strings_end_generation_and_are_cut_from_the_text(real_lm) -> None:
    prompt = CODE_PROMPTS[0]
    full = wrap(real_lm, "ar").generate(prompt, max_new_tokens=MAX_NEW)
    assert "return" in full.text
    for method in ("ar", "anpd"):
        result = wrap(real_lm, method).generate(prompt, max_new_tokens=MAX_NEW, stop=["return"])
        assert result.finish_reason == "stop"
        assert result.text == full.text[: full.text.index("return")]
        assert result.token_ids == full.token_ids[: len(result.token_ids)]
        assert len(result.token_ids) < len(full.token_ids)


@pytest.mark.parametrize("method", ["anpd", "suffix"])
def test_a_chat_with_a_prefix_cache_equals_each_turn_decoded_afresh(real_lm, method) -> None:
    from leapdecode import Decoder

    decoder = Decoder(real_lm, method, prefix_cache_tokens=2048)
    messages: list[dict[str, str]] = []
    saved = 0
    for turn, (text, stop) in enumerate([(CHAT_PROMPTS[2], [","]), (CHAT_PROMPTS[3], []), (CHAT_PROMPTS[0], [])]):
        messages.append({"role": "user", "content": text})
        result = decoder.generate(messages, max_new_tokens=24, stop=stop)
        fresh = wrap(real_lm, method).generate(messages, max_new_tokens=24, stop=stop)
        assert result.token_ids == fresh.token_ids and result.text == fresh.text, turn
        messages.append({"role": "assistant", "content": result.text})
        assert decoder.prefix_cache.hit_tokens > saved or turn == 0  # each later turn starts from the last
        saved = decoder.prefix_cache.hit_tokens
    assert decoder.prefix_cache.hits == 2


def test_a_burst_sharing_a_system_prompt_prefills_it_once_and_equals_each_request_alone(real_lm) -> None:
    """Requests that join together with one system prompt, in shared passes with a prefix cache:
    the first prefills it, the others start from copies of its cache; each equals its own decode."""
    from leapdecode.engine.cost import ForwardCost
    from leapdecode.engine.prefix_cache import PrefixCache
    from leapdecode.engine.scheduler import BatchScheduler
    from leapdecode.engine.submission import Submission

    system = "You answer questions about rivers, towns and the sea. Keep every answer short and plain. " * 4
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": p}] for p in CHAT_PROMPTS[:3]]
    decoders = [wrap(real_lm, m) for m in ("anpd", "suffix", "ar")]
    cost = ForwardCost(tuple(0.01 + 0.003 * n for n in range(1, 129)))
    scheduler = BatchScheduler(decoders[0].backend, cost, max_batch=3, max_rows=32, prefix_cache=PrefixCache(4096))
    outputs: list[list[int]] = [[], [], []]
    ends: list[str] = []
    subs = [
        scheduler.submit(
            Submission(d.start(c, max_new_tokens=24), lambda s, i=i: outputs[i].extend(s.tokens), ends.append)
        )
        for i, (d, c) in enumerate(zip(decoders, chats))
    ]
    while not scheduler.idle:
        scheduler.step()
    shared = len(real_lm.tokenizer.apply_chat_template(chats[0][:1], tokenize=True, return_dict=False)) - 4
    assert subs[0].cached_tokens == 0 and all(s.cached_tokens >= shared for s in subs[1:])
    for d, c, output in zip(decoders, chats, outputs):
        assert output == d.generate(c, max_new_tokens=24).token_ids


def test_chat_messages_list_and_token_ids_are_accepted(real_lm) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    by_messages = wrap(real_lm, "anpd").generate(messages, max_new_tokens=16)
    by_string = wrap(real_lm, "anpd").generate(CHAT_PROMPTS[0], max_new_tokens=16, chat=True)
    by_ids = wrap(real_lm, "anpd").generate(by_string.prompt_ids, max_new_tokens=16)
    assert by_messages.token_ids == by_string.token_ids == by_ids.token_ids


def test_statistics_are_consistent(real_lm) -> None:
    result = wrap(real_lm, "anpd:n=5,k=7").generate(CODE_PROMPTS[2], max_new_tokens=MAX_NEW)
    stats = result.stats
    assert stats.new_tokens == len(result.token_ids)
    assert stats.forward_passes == len(result.steps)
    assert stats.new_tokens == stats.forward_passes + stats.accepted_tokens
    assert sum(stats.accepted_lengths) == stats.new_tokens - 1
    assert 0 <= stats.alpha <= 1 and stats.tau >= 1
    assert stats.tokens_per_s > 0


@pytest.mark.parametrize(
    "prompt, kwargs, fragment",
    [
        ("", {}, "prompt is empty"),
        ("   \n", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ([{"role": "user", "content": ""}], {}, "empty"),
        ([{"role": "user"}], {}, "'role' and 'content'"),
        ("hello", {"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ("hello", {"max_new_tokens": -5}, "max_new_tokens must be a positive integer"),
        ("hello", {"max_new_tokens": 10**6}, "exceeds the context"),
        ([5] * 9000, {}, "takes at most 8191"),
        ([10**7], {}, "out of the vocabulary"),
        (3.5, {}, "a prompt is a string"),
    ],
)
def test_bad_input_is_a_clear_error(real_lm, prompt, kwargs, fragment) -> None:
    decoder = wrap(real_lm, "anpd")
    with pytest.raises(InputError, match=fragment):
        decoder.generate(prompt, **kwargs)
    # ... and changes nothing: the next request works as before
    assert decoder.generate("Hello", max_new_tokens=3).stats.new_tokens == 3


def test_peer_methods_cannot_be_wrapped(real_lm) -> None:
    with pytest.raises(InputError, match="peer"):
        wrap(real_lm, "hf")
