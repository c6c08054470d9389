"""The OpenAI API's bodies: completion and chat responses, their SSE chunks, usage, log-probabilities,
and streamed text held back while it could still begin a stop string."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from leapdecode.engine import Step, truncate_at_stop
from leapdecode.server.metrics import step_stats
from leapdecode.textstream import TextStream
from leapdecode.verifiers import TokenLogprob

# (text delta, finish reason, log-probabilities of the tokens behind it) -> one response or SSE chunk
Chunk = Callable[[str, "str | None", Sequence[TokenLogprob]], dict[str, Any]]


@dataclass(frozen=True)
class Choice:
    """One finished choice of a response (`n` of them): its text, finish reason and steps."""

    text: str
    finish: str
    steps: Sequence[Step]


SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def finish_reason(reason: str) -> str:
    """The API's finish reason for a generation's: "stop" (end of turn or a stop string), else "length"."""
    return "stop" if reason == "stop" else "length"


def final_text(tokenizer: Any, steps: Sequence[Step], stops: list[str]) -> str:
    """A whole (non-streamed) completion's text, cut at its first stop string."""
    token_ids = [t for s in steps for t in s.tokens]
    return truncate_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stops)


def usage(prompt_tokens: int, steps: Sequence[Step], cached_tokens: int = 0) -> dict[str, Any]:
    """The API's usage: the prompt once, the tokens of every choice (`steps` of all of them), and
    as OpenAI's `prompt_tokens_details.cached_tokens` the prompt tokens the prefix cache held."""
    completion = sum(len(s.tokens) for s in steps)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def leapdecode_stats(method: str, steps: Sequence[Step]) -> dict[str, Any]:
    """The response's extra `leapdecode` field: the method that ran and why it was fast or slow."""
    stats = step_stats(steps)
    return {
        "method": method,
        "forward_passes": stats.forward_passes,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "tau": stats.tau,
        "alpha": stats.alpha,
    }


def step_logprobs(steps: Sequence[Step]) -> list[TokenLogprob]:
    return [r for s in steps for r in s.logprobs or ()]


def token_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False))


def chat_logprobs(tokenizer: Any, records: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat API's `logprobs`: per token its text, UTF-8 bytes, log-probability and alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records],
        "refusal": None,
    }


@dataclass
class CompletionFormat:
    """One legacy completions request's response or SSE chunks (one id for all of them)."""

    model: str
    tokenizer: Any
    logprobs: bool  # the request asked for log-probabilities
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # per choice: characters of text before its next token

    def chunk(
        self, text: str, finish: str | None, records: Sequence[TokenLogprob] = (), index: int = 0
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(text, finish, records, index)],
        }

    def response(
        self, choices: Sequence[Choice], prompt_tokens: int, method: str, cached_tokens: int = 0
    ) -> dict[str, Any]:
        steps = [s for c in choices for s in c.steps]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(c.text, c.finish, step_logprobs(c.steps), i) for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, steps, cached_tokens),
            "leapdecode": leapdecode_stats(method, steps),
        }

    def _choice(self, text: str, finish: str | None, records: Sequence[TokenLogprob], index: int) -> dict[str, Any]:
        logprobs = self._logprobs(records, index) if self.logprobs else None
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, records: Sequence[TokenLogprob], index: int) -> dict[str, Any]:
        """The legacy API's `logprobs`: parallel lists, alternatives as {text: logprob}."""
        tokens, offsets = [], []
        for r in records:
            text = token_text(self.tokenizer, r.token)
            tokens.append(text)
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{token_text(self.tokenizer, t): v for t, v in r.top} for r in records],
            "text_offset": offsets,
        }


@dataclass
class ChatFormat:
    """One chat request's response or SSE chunks (the first chunk names the assistant's role)."""

    model: str
    tokenizer: Any
    logprobs: bool  # the request asked for log-probabilities
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    started: set[int] = field(default_factory=set)  # choices whose first chunk (naming the role) was sent

    def chunk(
        self, text: str, finish: str | None, records: Sequence[TokenLogprob] = (), index: int = 0
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text or finish is None else {}
        if index not in self.started:
            delta["role"] = "assistant"
            self.started.add(index)
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        if self.logprobs:
            choice["logprobs"] = chat_logprobs(self.tokenizer, records)
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def response(
        self, choices: Sequence[Choice], prompt_tokens: int, method: str, cached_tokens: int = 0
    ) -> dict[str, Any]:
        steps = [s for c in choices for s in c.steps]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish,
                    "logprobs": chat_logprobs(self.tokenizer, step_logprobs(c.steps)) if self.logprobs else None,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage(prompt_tokens, steps, cached_tokens),
            "leapdecode": leapdecode_stats(method, steps),
        }


class StopStringHolder:
    """Holds back streamed text that could still turn out to begin a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, delta: str, final: bool) -> str:
        self.text += delta
        cut = truncate_at_stop(self.text, self.stops)
        end = len(cut) if (final or len(cut) < len(self.text)) else max(self.sent, len(self.text) - self.hold)
        out = cut[self.sent : end]
        self.sent = max(self.sent, end)
        return out


class StreamText:
    """A stream's SSE chunks: text detokenised as it arrives and held back while it could begin a
    stop string; log-probabilities not yet sent ride on the next chunk."""

    def __init__(self, tokenizer: Any, stops: list[str], chunk: Chunk) -> None:
        self.detok = TextStream(tokenizer)
        self.holder = StopStringHolder(stops)
        self.chunk = chunk
        self.pending: list[TokenLogprob] = []

    def step(self, step: Step) -> str | None:
        """The chunk for one decoding step, if it freed any text to send."""
        self.pending.extend(step.logprobs or ())
        delta = self.holder.push(self.detok.push(step.tokens), final=False)
        return self._send(delta) if delta else None

    def end(self, finish: str) -> Iterator[str]:
        """The choice's last chunks: the text held back and the finish reason."""
        tail = self.holder.push(self.detok.flush(), final=True)
        if tail:
            yield self._send(tail)
        yield sse(self.chunk("", finish, self.pending))

    def usage_line(self, usage: dict[str, Any]) -> str:
        """The stream's last chunk when the client asked for usage: no choices, the usage."""
        return sse({**self.chunk("", None, ()), "choices": [], "usage": usage})

    def _send(self, text: str) -> str:
        line = sse(self.chunk(text, None, self.pending))
        self.pending = []
        return line
