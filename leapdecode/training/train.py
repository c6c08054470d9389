"""Train a draft head on CPU: `leapdecode train-drafter`.

    conversations (never a benchmark prompt) -> token ids -> the target's states and
    distributions (cached on disk) -> the head's loss -> AdamW -> every so often: held-out
    acceptance, a checkpoint -> at the end: the head in EAGLE-3's (or Medusa's) published format

A run is resumable (`resume=True` picks up the folder's checkpoint: head, optimizer, step, data
order) and reproducible from its seed: the data order, the head's initial weights and the
held-out split all follow from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leapdecode.errors import InputError
from leapdecode.training.settings import Progress, TrainSettings, lr_at

if TYPE_CHECKING:
    from leapdecode.heads.vocabulary import DraftVocabulary
    from leapdecode.models.loading import LoadedModel
    from leapdecode.training.trainers import Trainer

logger = logging.getLogger("leapdecode")
CHECKPOINT = "checkpoint.pt"
# settings a resumed run may change: how long it goes on and how often it reports, not what it learns
RESUMABLE = frozenset({"steps", "eval_every", "eval_tokens", "checkpoint_every", "cache_gb", "mixed_precision"})


def train_drafter(
    target: LoadedModel,
    settings: TrainSettings,
    out: Path,
    *,
    resume: bool = False,
    log: Callable[[str], None] = logger.info,
    progress: bool = True,
) -> Path:
    """Train a head for `target` as `settings` say, in `out`; returns the exported head's folder."""
    from leapdecode.training.data import tokenize_conversation
    from leapdecode.training.features import FeatureCache
    from leapdecode.training.split import training_conversations

    if target.backend != "torch":
        raise InputError(
            "train-drafter: the target must run on the torch backend (it reads the target's hidden states)"
        )
    out.mkdir(parents=True, exist_ok=True)
    saved = _load_checkpoint(out) if resume else None
    if saved is not None:
        changed = sorted(k for k, v in asdict(settings).items() if k not in RESUMABLE and saved["settings"].get(k) != v)
        if changed:
            raise InputError(
                f"train-drafter: {out} holds a run with other settings ({', '.join(changed)}); resume with the same "
                f"ones or use a new --out"
            )
    if not resume and (out / CHECKPOINT).exists():
        raise InputError(f"train-drafter: {out} already holds a run: pass --resume to continue it, or use a new --out")
    train, held, report = training_conversations(
        settings.data, limit=settings.limit or None, seed=settings.seed, held_out_count=settings.held_out
    )
    log(f"data: {report}")
    examples = [
        e for e in (tokenize_conversation(target.tokenizer, c, settings.max_tokens) for c in train) if e is not None
    ]
    if not examples:
        raise InputError(f"train-drafter: no usable conversation in {settings.data!r}")
    vocab = _vocabulary(target, settings, examples, saved)
    trainer = _make_trainer(target, settings, vocab, saved)
    key = {
        "model": target.fingerprint,
        "layers": list(trainer.layers),
        "vocab": hashlib.sha256(str(vocab.ids).encode()).hexdigest(),
    }
    cache = FeatureCache(out / "features", key, int(settings.cache_gb * 2**30))
    state = Progress(**saved["progress"]) if saved is not None else Progress()
    order = _order(len(examples), settings.seed, state.step)
    log(
        f"training {settings.method} on {len(examples)} sequences ({sum(len(e.input_ids) for e in examples)} tokens), "
        f"step {state.step} of {settings.steps}"
    )
    bar = _bar(settings.steps, state.step, progress)
    while state.step < settings.steps:
        began = time.perf_counter()
        tokens = examples[next(order)]
        example = cache.get(tokens.input_ids)
        if example is None:
            example = trainer.features(tokens.input_ids, tokens.loss_mask)
            cache.put(example)
        loss, stats = trainer.step(example, lr_at(state.step, settings))
        state.step += 1
        state.seconds += time.perf_counter() - began
        state.losses.append(round(loss, 4))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{h / max(1, n):.2f}" for h, n in stats[:4]))
        if state.step % settings.eval_every == 0 or state.step == settings.steps:
            state.evals.append(
                {"step": state.step, "seconds": round(state.seconds, 1), **trainer.evaluate(held, settings)}
            )
            log(f"step {state.step}: held-out {state.evals[-1]}")
        if state.step % settings.checkpoint_every == 0 or state.step == settings.steps:
            _save_checkpoint(out, trainer, settings, vocab, state)
    bar.close()
    return trainer.export(out / "head", settings, state, report)


def _order(n: int, seed: int, start: int) -> Iterator[int]:
    """The data order: a fresh shuffle per epoch from the seed, resumed at step `start`."""

    def walk() -> Iterator[int]:
        epoch = 0
        while True:
            perm = list(range(n))
            random.Random(seed * 1_000_003 + epoch).shuffle(perm)
            yield from perm
            epoch += 1

    it = walk()
    for _ in range(start):
        next(it)
    return it


def _bar(total: int, done: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, desc="train-drafter", unit="step", dynamic_ncols=True)


def _vocabulary(
    target: LoadedModel, settings: TrainSettings, examples: list[Any], saved: dict[str, Any] | None
) -> DraftVocabulary:
    from leapdecode.heads.vocabulary import DraftVocabulary

    size = target.vocab_size
    if saved is not None:
        return DraftVocabulary(tuple(saved["vocabulary"]), size)
    if settings.method == "medusa" and not settings.draft_vocab:  # each head its own full LM head
        return DraftVocabulary(tuple(range(size)), size)
    wanted = settings.draft_vocab or min(32000, size)
    answers = ([t for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m] for e in examples)
    return DraftVocabulary.most_frequent(answers, wanted, size, always=sorted(target.eos_token_ids))


def _make_trainer(
    target: LoadedModel, settings: TrainSettings, vocab: DraftVocabulary, saved: dict[str, Any] | None
) -> Trainer:
    from leapdecode.training.trainers import Eagle3Trainer, MedusaTrainer

    cls = Eagle3Trainer if settings.method == "eagle3" else MedusaTrainer
    trainer = cls(target, settings, vocab)
    if saved is not None:
        trainer.load_state(saved["trainer"])
    return trainer


def _save_checkpoint(
    out: Path, trainer: Trainer, settings: TrainSettings, vocab: DraftVocabulary, state: Progress
) -> None:
    payload = {
        "settings": asdict(settings),
        "vocabulary": list(vocab.ids),
        "progress": asdict(state),
        "trainer": trainer.state(),
    }
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(out / CHECKPOINT)
    (out / "progress.json").write_text(
        json.dumps({"step": state.step, "seconds": state.seconds, "evals": state.evals}, indent=2)
    )


def _load_checkpoint(out: Path) -> dict[str, Any] | None:
    path = out / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
