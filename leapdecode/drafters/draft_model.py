"""Draft-model speculative decoding: a smaller model with the same tokenizer drafts the chain
(Leviathan et al. 2211.17192, Chen et al. 2302.01318; the cascade: 2312.11462).

The draft model keeps its own KV cache, always a prefix of (stream + last draft), the stream
being the prompt and every token the target emitted; after each verdict it is rolled back to
what the stream still agrees with, and the next proposal feeds only what it lacks (usually the
bonus token): one small pass per drafted token, never a re-read of the context. Greedy runs
draft the argmax (q None: one-hot); sampled runs draw from q, shaped as p is, and return q's rows.

Options (what each does for a user: `docs/methods.md`, Draft model):
- `schedule="heuristic"`: K from the last verdict (as Hugging Face's assisted generation); `threshold`:
  stop after a token the draft model doubts; `cascade`: ANPD drafts, the draft model checks them.
- `cost` (`DraftCost`, `drafters.draft_pricing`): each next token only while it pays for a draft
  pass and a verification row, by the draft's own probability calibrated online (`estimate`); the
  tokens the cache lacks are charged to the first, over the steps the request can be counted on
  for (the request's budget, `LengthEstimate`); a probe every `PROBE_EVERY` silent steps (B times as seldom
  in a batch of B) keeps the rates learning. Cut as a shared pass cuts every request's
  (`allocate`), alone too; alone, its passes are timed (`clock`) for live costs. Not with the cascade.
- `retrieval` (a `SuffixDrafter`, with `cost`): where the text repeats, a suffix match drafts at
  no draft-model cost; each step takes the plan that promises more tokens per second, and the
  draft model feeds the tokens it skipped in its next pass, never in a pass of their own. Only
  where no q is needed (greedy or coupled sampling).
- `window` > 0: the draft model reads at most `window` tokens of the context before its first
  pass, its first and its last (`drafters.draft_window`); with `prefix_cache`, a finished
  request's draft cache is kept with the tokens it skipped (its holes), so a chat's next turn, or
  the next request after the same long system prompt, feeds only its own new tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Hashable, Sequence

import torch

from leapdecode.drafters.cost_aware import AcceptanceEstimate, LengthEstimate, RequestEstimate, judged
from leapdecode.drafters.draft_pricing import (
    PROBE_EVERY,
    PROBE_LAG,
    DraftCost,
    catch_up_charge,
    depth_bucket,
    match_buckets,
    match_cut,
    model_rate,
    pays,
    prob_bucket,
)
from leapdecode.drafters.draft_window import DraftWindow
from leapdecode.drafters.ngram import NGramModule
from leapdecode.drafters.suffix import SuffixDrafter
from leapdecode.engine.backend import Backend, CacheState, Scores
from leapdecode.engine.cache import snapshot_cache
from leapdecode.engine.drafting import (
    Draft,
    DraftContext,
    Drafter,
    DraftFeed,
    Needs,
    Offer,
    PassCost,
    PassResult,
    Request,
    Rounds,
)
from leapdecode.engine.noise import PositionNoise, Stream
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.verifiers import Verdict, verify_greedy, verify_speculative

logger = logging.getLogger("leapdecode")


class DraftModelDrafter(Drafter):
    """Drafts up to K tokens with a draft model's own decoding, KV cache kept across steps; its
    settings are checked once, where the method string is parsed (`methods.draft_model`)."""

    def __init__(
        self,
        backend: Backend,
        k: int = 5,
        *,
        sampling: SamplingParams = SamplingParams(),
        noise: PositionNoise | None = None,
        coupled: bool = True,
        schedule: str = "constant",
        threshold: float = 0.0,
        cascade_n: int = 0,
        cost: DraftCost | None = None,
        estimate: AcceptanceEstimate | None = None,
        lengths: LengthEstimate | None = None,
        retrieval: SuffixDrafter | None = None,
        window: int = 0,
        prefix_cache: PrefixCache | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.backend = backend
        self.needs = Needs(draft_backend=backend)  # requests of one method draft in shared passes of it
        self.k = k
        self.k_max = 4 * k
        self.sampling = sampling
        # coupled: the draft model picks its token at output position t with the target's own
        # uniform u_t, so the target keeps it iff it would have sampled it (q stays out of the
        # verdict, and the text is plain sampling's); else its own noise and min(1, p/q)
        self.coupled = coupled
        noise = noise if noise is not None else PositionNoise(0)
        self.noise = noise if coupled else noise.derived(Stream.DRAFT)
        self.prompt_len = 0
        self.view = DraftWindow(window)  # at most `window` stream tokens read before its first pass; its holes
        # finished requests' draft caches (shared by a decoder's requests): a prompt that begins
        # with kept tokens starts from a copy (holes and all); every request leaves its cache
        self.prefix_cache = prefix_cache
        self.max_new_tokens: int | None = None  # the request's budget; None: unknown
        self.schedule = schedule
        self.threshold = threshold
        self.ngram = NGramModule(cascade_n) if cascade_n else None
        self.stream: list[int] = []
        self.seq: CacheState | None = None
        self.last_draft: list[int] = []
        self.k_now, self.draft_passes = k, 0  # draft-model forward passes: for statistics and tests
        self.cost = cost if cascade_n == 0 else None
        self.shared = estimate if estimate is not None else AcceptanceEstimate()  # a decoder's greedy requests share it
        self.rates = RequestEstimate(self.shared)
        self.lengths = lengths if lengths is not None else LengthEstimate()  # a decoder's requests share it
        self.buckets: list[Hashable] = []  # per token of the last draft: its probability's bucket
        self.reach: list[float] = []  # per token of the last draft (with the costs): its chance to be accepted
        self.silent, self.probing = 0, False  # steps in a row without a draft; the last draft a probe (kept whole)
        # a suffix match drafts instead of the draft model where that pays (needs the costs, and no q)
        needs_q = not (sampling.greedy or coupled) or threshold > 0.0
        self.retrieval = retrieval if self.cost is not None and not needs_q else None
        self.retrieved = False  # the last draft came from the suffix match
        # the step's whole suffix match (tokens, parents, buckets): judged, drafted or not
        self.match: tuple[list[int], tuple[int, ...], list[Hashable]] = ([], (), [])
        self.retrieved_steps = 0  # for statistics and tests
        # a request alone times its passes for live costs (`DraftCost.drafted`, `verified`)
        self.alone, self.clock = False, clock
        self.verifying: tuple[int, float] | None = None  # the rows and start of the target pass now verifying

    def start(self, request: Request) -> None:
        self.reset(request.prompt_ids)
        self.max_new_tokens = request.max_new_tokens
        if request.prefill is not None:
            self.hear(request.prefill)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """A new stream: the prompt (its budget unknown until `start` says)."""
        self.stream = list(prompt_ids)
        self.prompt_len = len(self.stream)
        self.view.unstarted(self.prompt_len)
        self.max_new_tokens = None
        self.seq = self._kept_prefix()
        self.last_draft = []
        self.k_now = self.k
        self.draft_passes = 0
        self.rates = RequestEstimate(self.shared)
        self.buckets = []
        self.silent = 0
        self.retrieved, self.retrieved_steps, self.match = False, 0, ([], (), [])
        self.verifying = None
        if self.retrieval is not None:
            self.retrieval.reset(prompt_ids)
        if self.ngram is not None:
            self.ngram.initialise(prompt_ids)

    def _kept_prefix(self) -> CacheState | None:
        """A copy of the longest kept draft cache the prompt begins with, or None (then the first
        pass reads the prompt's window). Past the copy the window applies to the rest: the draft
        model reads at most `window` of it, the copied prefix in place of the attention sinks."""
        packer = self.backend.packer
        if self.prefix_cache is None or packer is None:
            return None
        try:
            taken = self.prefix_cache.take(self.stream, packer.fork)
        except Exception:  # noqa: BLE001 - e.g. out of memory: the draft model reads its window instead
            logger.exception("copying a kept draft-model cache failed")
            return None
        if taken is None:
            return None
        self.view.copied(taken, self.prompt_len)
        return taken.seq

    @property
    def emitted(self) -> int:
        """The tokens the target emitted so far in this request, as this drafter heard them."""
        return len(self.stream) - self.prompt_len

    def _catch_up(self) -> float:
        """Seconds a step's first drafted token is charged for the tokens the draft model's cache
        lacks beyond the one every round feeds (`catch_up_charge`)."""
        assert self.cost is not None
        return catch_up_charge(self.cost, self._lag(), self.emitted, self.max_new_tokens, self.lengths, self.rates.rate)

    def _lag(self) -> int:
        """The stream tokens the draft model's cache lacks (its holes aside)."""
        return len(self.stream) - self._covered()

    def _verify(self, lower: list[int], logits: torch.Tensor, position: int) -> Verdict:
        """The draft model judging the n-gram drafts (none: sampling its next token), with the
        target's rule one level down; row 0 decides output position `position`."""
        if self.sampling.greedy:
            return verify_greedy(lower, logits)
        return verify_speculative(lower, logits, None, self.sampling, self.noise, position=position)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q for the rows of `logits`; greedy runs use the plain softmax (for the threshold)."""
        return logits.float().softmax(-1) if self.sampling.greedy else logits_to_probs(logits, self.sampling)

    def _covered(self) -> int:
        """The stream tokens the draft model's cache accounts for: those it holds, and its holes."""
        return self.view.covered(self.seq.length if self.seq is not None else 0)

    def _unfed(self, drafted: list[int]) -> list[int]:
        """What the draft model's cache lacks of stream + drafted; before its first pass, its
        window of the stream."""
        return self.view.unread(self.stream, self.seq.length if self.seq is not None else None, drafted)

    def _last(self, count: int, drafted: list[int]) -> list[int]:
        """The last `count` tokens of stream + drafted."""
        if len(drafted) >= count:
            return drafted[len(drafted) - count :]
        return self.stream[len(self.stream) - (count - len(drafted)) :] + drafted

    def _pays(self, drafted: int, reach: float, expected: float, batch: int, cost: PassCost | None = None) -> bool:
        """Whether drafting one more token raises the step's expected tokens per second (`pays`),
        the last drafted one reached with probability `reach`; in a batch of `batch` sequences,
        the target's rows priced by the shared passes' `cost` where given. Where nothing has paid
        for `PROBE_EVERY` steps (times the batch), one token is drafted anyway."""
        assert self.cost is not None
        catch_up = self._catch_up() if drafted == 0 else 0.0
        # probe: the rates learn only from drafted tokens; in a batch each request probes `batch`
        # times as seldom (a probe is kept whatever it costs). It feeds no more than a round's
        # silent steps (a long catch-up holds up every request of a shared pass), but while live
        # costs have never timed the draft model (alone): then its price is unchecked
        if drafted == 0 and self.silent >= PROBE_EVERY * batch:
            short = self.seq is not None and self._lag() <= PROBE_LAG
            if short or catch_up == 0.0 or (self.alone and self.cost.unseen):
                self.probing = True
                return True
        guess = reach * self.rates.rate(depth_bucket(drafted + 1))
        target = cost if cost is not None else self.cost.target
        return pays(self.cost, target, drafted, guess, expected, batch, catch_up)

    def _model_rate(self, budget: int) -> float:
        """The draft model's best expected tokens per second this step (`model_rate`), priced as
        for a request alone, as the match's chain is: the two are compared, not the batch."""
        assert self.cost is not None
        return model_rate(self.cost, self.rates.rate, budget, self._catch_up())

    def _retrieve(self, max_tokens: int, budget: int) -> Draft | None:
        """The suffix match's chain or tree, cut to its best part (`cut_alone`: the most probable
        tokens, each token's chance the acceptance of its match evidence so far times its
        parent's), when it promises more tokens per second than the draft model would drafting
        `budget` tokens; None: the draft model drafts (the match is still judged against what the
        target emits, so its rates keep learning)."""
        assert self.retrieval is not None and self.cost is not None
        match = self.retrieval.propose(max_tokens)
        if not match.tokens:
            return None
        self.match = (match.tokens, *match_buckets(match))
        kept, chances, best = match_cut(match, self.rates.rate, self.cost.target)
        if not kept or best <= self._model_rate(budget):
            return None
        self.reach = chances
        return match.subset(kept)

    def offer(self, context: DraftContext) -> Rounds:
        # run beside other requests' rounds (`drive_rounds`); each token's reach (its calibrated
        # chance, times its parents') lets the pass cut every draft by one rule (`allocate`): a
        # pass of its own by the target's curve (the pending token's row there anyway), where a
        # token drafted while its depth's rate promised enough, whose calibrated chance then fell
        # short, costs a verification row and no draft pass, so it is dropped as a shared pass
        # would drop it. Alone, its passes are timed for live costs.
        self.alone = context.cost is None
        try:
            draft = yield from self._rounds(context.max_tokens, context.batch, context.cost)
        finally:
            self.alone = False
        # the target's pass over this chain starts now; it ends where `hear` hears the verdict
        chain = self.cost is not None and draft.parents is None and context.cost is None
        self.verifying = (1 + len(draft), self.clock()) if chain else None
        # a probe offers no reach: kept whole (`allocate`), its tokens are judged and the rates learn
        priced = self.cost is not None and not self.probing
        reach = tuple(self.reach[: len(draft)]) if priced else None
        return Offer(draft, reach, self.cost.target if self.cost is not None else None)

    def _rounds(
        self, max_tokens: int, batch: int = 1, cost: PassCost | None = None
    ) -> Generator[DraftFeed, tuple[CacheState, Scores], Draft]:
        """The draft, as rounds: each yields what the draft model must score next (see `DraftFeed`)."""
        budget = min(self.k_now, max_tokens)
        self.last_draft, self.buckets, self.retrieved, self.match = [], [], False, ([], (), [])
        self.reach, self.probing = [], False
        if budget <= 0:
            return Draft()
        if self.retrieval is not None:
            found = self._retrieve(max_tokens, budget)
            if found is not None:
                self.last_draft, self.retrieved = list(found.tokens), True
                self.retrieved_steps += 1
                return Draft(list(found.tokens), parents=found.parents)
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []  # each [tokens in that round, vocab]
        reach, expected = 1.0, 1.0
        while len(drafted) < budget:
            if self.cost is not None and not self._pays(len(drafted), reach, expected, batch, cost):
                break
            # 1. What the cache lacks (at least the last emitted or drafted token), plus n-gram drafts.
            tail = self._unfed(drafted)
            lower: list[int] = []
            if self.ngram is not None and self.seq is not None:
                lower = self.ngram.predict_chain(self._last(self.ngram.n - 1, drafted), budget - len(drafted) - 1)
            # 2. One draft-model pass; rows predict each lower draft and the token after them.
            start = self.clock()
            self.seq, scores = yield DraftFeed(self.seq, tail + lower)
            if self.alone and self.cost is not None:
                self.cost.drafted(len(tail) + len(lower), self.clock() - start)
            self.view.read()
            self.draft_passes += 1
            logits = scores.logits[-(len(lower) + 1) :]  # [len(lower)+1, vocab]
            # 3. Keep the lower drafts the draft model agrees with, plus its own next token.
            verdict = self._verify(lower, logits, self.emitted + len(drafted))
            num_kept, new = verdict.num_accepted, verdict.tokens
            self.backend.rollback(self.seq, self.seq.length - (len(lower) - num_kept))
            drafted.extend(new)
            if self.cost is not None:  # the draft model's own probability of its token, calibrated
                prob = float(self._probs(logits[-1:])[0, new[-1]])
                self.buckets.append(prob_bucket(len(drafted), prob))
                reach *= self.rates.rate(self.buckets[-1])
                expected += reach
                self.reach.append(reach)
            if (self.sampling.greedy or self.coupled) and self.threshold == 0.0:
                continue  # greedy and coupled verification need no q
            probs = self._probs(logits[: num_kept + 1])  # [num_kept+1, vocab]
            q_rows.append(probs)
            # 4. Stop after a token the draft model itself doubts.
            if self.threshold > 0.0:
                kept = torch.tensor(new, dtype=torch.long, device=probs.device)  # [num_kept+1]
                token_probs = probs.gather(1, kept.view(-1, 1)).squeeze(1)  # [num_kept+1]
                doubtful = (token_probs < self.threshold).nonzero()
                if len(doubtful):
                    cut = len(drafted) - len(new) + int(doubtful[0]) + 1
                    q_rows[-1] = probs[: cut - (len(drafted) - len(new))]
                    drafted = drafted[:cut]
                    self.backend.rollback(self.seq, min(self.seq.length, len(self.stream) + cut - self.view.skip))
                    break
        self.last_draft = drafted
        self.silent = 0 if drafted else self.silent + 1
        q = None if self.sampling.greedy or self.coupled else torch.cat(q_rows)  # [D, vocab]
        return Draft(drafted, q)

    def finish(self) -> None:
        # how long answers run, for the next requests' prefills: the tokens heard (the pass that
        # emitted a stop token may have scored a few past it)
        if self.max_new_tokens is not None:
            self.lengths.observe(self.emitted, self.emitted >= self.max_new_tokens)
        # its cache holds the stream but its holes, in order, up to the stream's end (past it: this
        # pass's drafts): kept for a later prompt that begins the same way
        if self.prefix_cache is not None and self.seq is not None:
            try:
                self.prefix_cache.keep(self.stream, self.seq, snapshot_cache, self.view.holes)
            except Exception:  # noqa: BLE001 - e.g. out of memory: the request ended well, its draft cache is not kept
                logger.exception("keeping a draft-model cache failed")

    def hear(self, result: PassResult) -> None:
        if result.kept is not None:
            # a chain's kept part is a prefix, a tree's keeps parents: the rest was never scored
            # (a match is judged whole in `update`)
            self.last_draft = [self.last_draft[i] for i in result.kept]
            self.buckets = self.buckets[: len(result.kept)]
            if self.verifying is not None:
                self.verifying = (1 + len(result.kept), self.verifying[1])
        self.update(result.tokens, result.accepted)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        """`tokens` were emitted, the first `num_accepted` of them drafted: learn, roll back, extend."""
        if self.verifying is not None and self.cost is not None:
            rows, start = self.verifying
            self.cost.verified(rows, self.clock() - start)
        self.verifying = None
        # each scored token up to the first rejected one: accepted or not, given its parent was
        if not self.retrieved:
            for j, bucket in enumerate(self.buckets[: num_accepted + 1]):
                hit = j < num_accepted
                self.rates.observe(depth_bucket(j + 1), hit)
                self.rates.observe(bucket, hit)
        # the step's suffix match, drafted or left to the draft model, judged whole (`judged`)
        match, parents, buckets = self.match
        for child, hit in judged(match, parents, tokens):
            self.rates.observe(buckets[child], hit)
        self.match = ([], (), [])
        if self.retrieval is not None:
            self.retrieval.update(tokens, num_accepted)
        if self.seq is not None:
            # The cache stays valid over the stream and the accepted drafts; drop the rest.
            self.backend.rollback(self.seq, min(self.seq.length, len(self.stream) + num_accepted - self.view.skip))
        if self.last_draft and self.schedule == "heuristic" and not self.retrieved:
            full = num_accepted == len(self.last_draft)
            self.k_now = min(self.k_now + 2, self.k_max) if full else max(1, self.k_now - 1)
        self.stream.extend(tokens)
        self.view.grown(len(self.stream))  # not read yet: it will read the window of all so far
        if self.ngram is not None:
            self.ngram.extend(tokens)
