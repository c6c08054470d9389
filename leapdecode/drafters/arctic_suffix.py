"""SuffixDecoding as Snowflake implemented it (`arctic-inference`, Apache-2.0), as a drafter in
our engine: the benchmark's peer for `suffix` and `hybrid`, drafted by their code and verified
by ours, so the comparison is of drafts alone.

Their cache keeps a suffix tree per active request (prompt and response) and, when enabled, a
global tree of earlier responses; `speculate` matches the context's suffix (up to the tree
depth), and drafts up to `factor × match + offset` tokens whose estimated probability (from
the trees' counts) is at least `min_prob`, as a chain or a tree.

The package is optional (`make peers` builds it: PyPI has only its source).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft, Evidence
from leapdecode.errors import MethodError

_request_ids = itertools.count()


def suffix_cache(depth: int, cached_requests: int) -> Any:
    """A new `arctic_inference` SuffixDecodingCache (`cached_requests`: responses kept in the global
    tree; 0 disables it)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise MethodError(
            "arctic-suffix needs Snowflake's arctic-inference: run `make peers` (PyPI has only its "
            "source; the target builds it against this torch, without CUDA)"
        ) from None
    return SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached_requests)


class ArcticSuffixDrafter(StreamDrafter):
    def __init__(
        self,
        cache: Any,
        k: int = 16,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
        tree: bool = True,
    ) -> None:
        self.cache = cache  # per request, or shared by the decoder's requests
        self.k, self.factor, self.offset, self.min_prob, self.tree = k, factor, offset, min_prob, tree
        self.request = f"leapdecode-{next(_request_ids)}"
        self.context: list[int] = []
        self.active = False

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.finish()
        self.context = list(prompt_ids)
        self.request = f"leapdecode-{next(_request_ids)}"
        self.cache.start_request(self.request, self.context)
        self.active = True

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.context.extend(tokens)
        self.cache.add_active_response(self.request, list(tokens))

    def propose(self, max_tokens: int) -> Draft:
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return Draft()
        draft = self.cache.speculate(
            self.request,
            self.context[-self.cache.max_tree_depth :],
            max_spec_tokens=limit,
            max_spec_factor=self.factor,
            max_spec_offset=self.offset,
            min_token_prob=self.min_prob,
            use_tree_spec=self.tree,
        )
        tokens = list(draft.token_ids)
        if not tokens:
            return Draft()
        # evidence for cost-aware cutting: their estimated probability, in tenths
        evidence = tuple(Evidence("arctic", min(int(p * 10), 10)) for p in draft.probs)
        return Draft(tokens, parents=tuple(draft.parents) if self.tree else None, evidence=evidence)

    def finish(self) -> None:
        if self.active:
            self.cache.stop_request(self.request)
            self.active = False
