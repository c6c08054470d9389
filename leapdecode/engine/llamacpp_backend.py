"""The llama.cpp backend: the same decode loop, drafters and verifiers on a quantized GGUF model.

Driven through llama-cpp-python's C API (`llama_decode` on a batch we fill, `llama_get_logits`,
`llama_memory_seq_rm` / `_seq_cp`), not its high-level `Llama` generator, so that the loop
decides what is scored and what is kept:
- the prefill asks for logits at its last token only; a draft pass at every drafted token;
- rejected drafts are cut from the KV cache with one `seq_rm` from the first rejected position;
- a token tree is one batch: each leaf gets a sequence id, each node carries the ids of the
  leaves below it, and the cached prefix is shared by every id (a unified KV buffer), so each
  node attends to its own path only. After verification the accepted path's cells move to
  sequence 0 and every other branch is dropped; accepted nodes that do not lead the batch are
  recomputed in place, so that the cache is exactly plain decoding's (see `keep`).

Exactness: llama.cpp picks its kernels by batch size and by the size of the KV cache, and a
batch's logits are then not bit-identical to one-token decoding's. The difference is not in the
last bits: with the default (flash) attention, once the cache passes 256 cells a batch of 2 scores
up to ~1 logit away from the same tokens one at a time (measured on smollm2's Q8_0 GGUF), which
flips greedy tokens on long prompts. So the backend probes, once per model, the largest batch that
scores exactly as single tokens do at a ladder of context lengths (`exact_batch`); a pass is
scored in chunks of that size, and where no batch is exact (`draft_limit` 0) the loop drafts
nothing: plain decoding, at plain decoding's speed, rather than a faster, different output.

One context is one KV cache: a backend serves one sequence at a time (a new prefill ends the
previous sequence; using the old one after that is an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from leapdecode.engine.backend import CacheState, Scores, no_features
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import InputError
from leapdecode.models.llamacpp import MAX_SEQUENCES, LlamaCppModel, import_llama_cpp

# Context lengths at which batch exactness is probed (denser where llama.cpp's attention changes
# kernels, at 256 cached cells), and the largest batch probed.
PROBE_LENGTHS = (8, 64, 128, 192, 240, 256, 320, 512, 1024)
PROBE_BATCH = 8


@dataclass
class _State:
    """What a llama.cpp sequence needs beyond its length."""

    leaf_of: dict[int, int] = field(default_factory=dict)  # last tree pass: node -> a sequence id through it
    tree_tokens: list[int] = field(default_factory=list)  # last tree pass: the token of each node


class LlamaCppBackend:
    """A `Backend` over one llama.cpp context."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.llama_cpp = import_llama_cpp()
        self.model = model
        self.vocab_size: int = model.n_vocab
        self.device = torch.device("cpu")
        self._batch = self.llama_cpp.llama_batch_init(model.n_batch, 0, MAX_SEQUENCES)
        self.model.exact_batches or self._probe()  # probed now, before any sequence it would overwrite

    @property
    def packer(self) -> None:
        return None  # one context, one KV cache: no packed passes, no copies

    @property
    def batchable(self) -> str | None:
        return "the llama.cpp backend decodes one sequence at a time"

    def __del__(self) -> None:
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self.llama_cpp.llama_batch_free(batch)

    # -- batches -------------------------------------------------------------------------

    def _decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[tuple[int, ...]], logits: list[bool]
    ) -> None:
        if len(tokens) > self.model.n_batch:
            raise InputError(f"{len(tokens)} tokens in one pass exceed llama.cpp's batch of {self.model.n_batch}")
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, pos, ids, wanted) in enumerate(zip(tokens, positions, seq_ids, logits)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(ids)
            for j, sid in enumerate(ids):
                batch.seq_id[i][j] = sid
            batch.logits[i] = wanted
        code = self.llama_cpp.llama_decode(self.model.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed with code {code} (context of {self.model.n_ctx} tokens full?)")

    def _score(
        self, tokens: list[int], positions: list[int], seq_ids: list[tuple[int, ...]], cells: int
    ) -> torch.Tensor:
        """Logits for every token [n, vocab], decoded in chunks no longer than the batch that
        scores exactly as one token at a time does with `cells` cached after the pass."""
        step = self.exact_batch(cells)
        rows = []
        for i in range(0, len(tokens), step):
            j = min(i + step, len(tokens))
            self._decode(tokens[i:j], positions[i:j], seq_ids[i:j], [True] * (j - i))
            rows.append(self._logits(j - i))
        return torch.cat(rows)

    def exact_batch(self, cells: int) -> int:
        """The largest batch (≤ `PROBE_BATCH`) that scores bit for bit as single tokens do, for a
        pass that leaves `cells` tokens in the cache: the smallest exact batch probed at any
        context shorter than that (so it never grows with the context)."""
        ladder = self.model.exact_batches or self._probe()
        exact = PROBE_BATCH
        for length, batch in ladder:
            if length >= cells:
                break
            exact = min(exact, batch)
        return exact

    def draft_limit(self, seq: CacheState) -> int | None:
        # With no exact batch here, a draft would cost one pass per token: draft nothing.
        return None if self.exact_batch(seq.length + PROBE_BATCH) > 1 else 0

    def _probe(self) -> tuple[tuple[int, int], ...]:
        """Probe, up the ladder of context lengths, the largest batch whose logits equal one-token
        decoding's; stop at the first length where none does (it only gets worse)."""
        probe = [(1009 * i + 17) % self.vocab_size for i in range(max(PROBE_LENGTHS) + PROBE_BATCH)]
        ladder: list[tuple[int, int]] = []
        seq, _ = self.prefill(probe[:1])
        for length in PROBE_LENGTHS:
            if length + PROBE_BATCH >= self.model.n_ctx:
                break
            self._extend(seq, probe[seq.length : length])
            singles = torch.stack([self.forward_one(seq, token) for token in probe[length : length + PROBE_BATCH]])
            exact = 1
            for n in range(2, PROBE_BATCH + 1):
                self.rollback(seq, length)
                self._decode(probe[length : length + n], list(range(length, length + n)), [(0,)] * n, [True] * n)
                seq.length = length + n
                if not torch.equal(self._logits(n), singles[:n]):
                    break
                exact = n
            self.rollback(seq, length)
            ladder.append((length, exact))
            if exact == 1:
                break
        self.rollback(seq, 0)
        self.model.exact_batches = tuple(ladder)
        return self.model.exact_batches

    def _extend(self, seq: CacheState, tokens: list[int]) -> None:
        """Append `tokens` to the cache as a prefill does (batches, no logits)."""
        step = self.model.n_batch
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            first = seq.length
            self._decode(chunk, list(range(first, first + len(chunk))), [(0,)] * len(chunk), [False] * len(chunk))
            seq.length += len(chunk)

    def forward_one(self, seq: CacheState, token: int) -> torch.Tensor:
        self._decode([token], [seq.length], [(0,)], [True])
        seq.length += 1
        return self._logits(1)[0]

    def _logits(self, rows: int) -> torch.Tensor:
        pointer = self.llama_cpp.llama_get_logits(self.model.ctx)
        array = np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size))
        return torch.from_numpy(array.copy())  # [rows, vocab]: llama.cpp reuses its buffer

    def _check(self, seq: CacheState) -> _State:
        state = seq.cache
        if not isinstance(state, _State) or state is not self.model.holder:
            raise RuntimeError("this llama.cpp sequence was replaced by a newer prefill on the same backend")
        return state

    # -- the Backend protocol ------------------------------------------------------------

    def prefill(self, prompt_ids: list[int], *, features: tuple[int, ...] = ()) -> tuple[CacheState, Scores]:
        no_features(features)
        if len(prompt_ids) >= self.model.n_ctx:
            raise InputError(
                f"the prompt has {len(prompt_ids)} tokens; this llama.cpp context holds {self.model.n_ctx}"
            )
        state = _State()
        self.model.holder = state
        self.llama_cpp.llama_memory_clear(self.model.memory, True)
        step = self.model.n_batch
        for start in range(0, len(prompt_ids), step):
            chunk = prompt_ids[start : start + step]
            last = start + len(chunk) == len(prompt_ids)
            wanted = [last and i == len(chunk) - 1 for i in range(len(chunk))]
            self._decode(chunk, list(range(start, start + len(chunk))), [(0,)] * len(chunk), wanted)
        return CacheState(cache=state, length=len(prompt_ids)), Scores(logits=self._logits(1))

    def forward(
        self,
        seq: CacheState,
        token_ids: list[int],
        *,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        no_features(features)
        state = self._check(seq)
        n = len(token_ids)
        if tree is None or tree.is_chain:
            state.leaf_of = {}
            logits = self._score(token_ids, list(range(seq.length, seq.length + n)), [(0,)] * n, seq.length + n)
        else:
            ids = self._branch_ids(tree, state)
            memory = self.model.memory
            for sid in set().union(*ids) - {0}:
                self.llama_cpp.llama_memory_seq_cp(memory, 0, sid, -1, -1)  # the prefix, shared
            positions = (seq.length + tree.depth).tolist()
            state.tree_tokens = list(token_ids)
            logits = self._score(
                token_ids, positions, ids, seq.length + n
            )  # chunks keep node order: cells stay consecutive
        seq.length += n
        return Scores(logits=logits)  # [n, vocab]

    @staticmethod
    def _branch_ids(tree: TreeLayout, state: _State) -> list[tuple[int, ...]]:
        """Sequence ids per node: one per leaf (1..B), each node carrying those of the leaves below."""
        leaves = [node for node in range(tree.num_nodes) if not tree.children[node]]
        if len(leaves) >= MAX_SEQUENCES:
            raise InputError(
                f"a tree with {len(leaves)} branches exceeds the {MAX_SEQUENCES - 1} this backend verifies at once"
            )
        below: list[list[int]] = [[] for _ in range(tree.num_nodes)]
        for sid, leaf in enumerate(leaves, start=1):
            node = leaf
            while True:
                below[node].append(sid)
                if node == 0:
                    break
                node = tree.parents[node - 1] + 1
        state.leaf_of = {node: ids[0] for node, ids in enumerate(below)}
        return [tuple(ids) for ids in below]

    def rollback(self, seq: CacheState, length: int) -> None:
        self._check(seq)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll a cache of {seq.length} tokens back to {length}")
        self.llama_cpp.llama_memory_seq_rm(self.model.memory, -1, length, -1)
        seq.length = length

    def keep(self, seq: CacheState, start: int, nodes: list[int]) -> None:
        state = self._check(seq)
        if not state.leaf_of:  # a chain: the kept entries are already in place
            if nodes != list(range(len(nodes))):
                raise ValueError(f"a chain pass keeps a prefix of its nodes, not {nodes}")
            self.rollback(seq, start + len(nodes))
            return
        # A tree. Its nodes sit in consecutive cells in node order. The kept nodes that lead that
        # order (root, first child, ...) are where plain decoding would have put them: keep their
        # cells, through the sequence id of a branch that passes them.
        lead = next((i for i, node in enumerate(nodes) if node != i), len(nodes))
        memory, keep_id = self.model.memory, state.leaf_of[nodes[lead - 1]]
        end = start + lead
        self.llama_cpp.llama_memory_seq_rm(memory, keep_id, end, -1)
        for sid in set(state.leaf_of.values()) - {keep_id}:
            self.llama_cpp.llama_memory_seq_rm(memory, sid, -1, -1)
        self.llama_cpp.llama_memory_seq_cp(memory, keep_id, 0, start, end)
        self.llama_cpp.llama_memory_seq_rm(memory, keep_id, -1, -1)
        # Kept nodes further on would sit after holes, and llama.cpp's output depends on cell
        # order (its quantized products round differently), so they are computed again in
        # place: exactly plain decoding's cache, for one extra pass over those tokens.
        redo = [state.tree_tokens[node] for node in nodes[lead:]]
        if redo:
            self._score(redo, list(range(end, end + len(redo))), [(0,)] * len(redo), end + len(redo))
        state.leaf_of, state.tree_tokens = {}, []
        seq.length = start + len(nodes)
