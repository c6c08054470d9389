"""Training heads: on a tiny target whose next token is a function of the current one (learnable),
a short run's loss falls and its held-out acceptance rises, and the trained head stays lossless;
the draft vocabulary; the whole command on the real small model (data split, checkpoints,
resume, export, and the method loading what was trained)."""

from __future__ import annotations

import json

import pytest
import torch

from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.reference import greedy_reference
from leapdecode.errors import InputError
from leapdecode.heads.vocabulary import DraftVocabulary
from leapdecode.training.settings import Progress, TrainSettings, lr_at
from leapdecode.training.trainers import Eagle3Trainer, MedusaTrainer
from tests.helpers import GREEDY, TINY_VOCAB, make_tiny_model, prompts, tiny_lm

pytestmark = pytest.mark.slow  # training runs: short, but hundreds of optimiser steps each


def bigram_model():
    """A tiny Llama whose layers add nothing: the next token depends on the current one only."""
    model = make_tiny_model(layers=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(3)
    return model


def tau(model, trainer, held: list[list[int]]) -> float:
    tokens = passes = 0
    for prompt in held:
        steps = list(decode(TorchBackend(model), prompt, trainer.drafter(), StopCriteria(frozenset(), 40), *GREEDY))
        assert [t for s in steps for t in s.tokens] == greedy_reference(model, prompt, 40)
        tokens += sum(len(s.tokens) for s in steps[1:])
        passes += len(steps) - 1
    return tokens / passes


@pytest.mark.parametrize(
    "cls, draft_vocab",
    [(Eagle3Trainer, 0), (MedusaTrainer, 0), (MedusaTrainer, 80)],
    ids=["eagle3", "medusa", "medusa-shared-lm-head"],
)
def test_short_training_run_lowers_loss_and_raises_held_out_acceptance(cls, draft_vocab, tmp_path) -> None:
    model = bigram_model()
    lm = tiny_lm(model)
    method = "eagle3" if cls is Eagle3Trainer else "medusa"
    settings = TrainSettings(
        method=method,
        steps=200,
        lr=3e-3,
        warmup=10,
        ttt_steps=3,
        max_tokens=64,
        medusa_heads=3,
        draft_vocab=draft_vocab,
    )
    sequences = [p + greedy_reference(model, p, 40) for p in prompts(60, seed=11, repetitive_every=1000)]
    vocab = (
        DraftVocabulary.most_frequent(sequences, draft_vocab, TINY_VOCAB)
        if draft_vocab
        else DraftVocabulary(tuple(range(TINY_VOCAB)), TINY_VOCAB)
    )
    trainer = cls(lm, settings, vocab)
    held = prompts(6, seed=99, repetitive_every=1000)
    before = tau(model, trainer, held)
    losses = []
    for step in range(settings.steps):
        seq = sequences[step % len(sequences)]
        example = trainer.features(seq, [False] * 8 + [True] * (len(seq) - 8))
        losses.append(trainer.step(example, lr_at(step, settings))[0])
    after = tau(model, trainer, held)
    assert sum(losses[-20:]) < 0.7 * sum(losses[:20]), (losses[:5], losses[-5:])
    assert before < 1.3 and after > before + 1.0, (before, after)
    if draft_vocab:  # the target's LM head shared over the draft vocabulary: vLLM's format, read back the same
        from leapdecode.heads.medusa_format import load_medusa

        heads = trainer.heads
        assert heads.lm_heads is None and heads.token_map.tolist() == list(vocab.ids)
        assert all(p.requires_grad for p in heads.parameters()) and not heads.shared_lm_head.requires_grad
        trainer.export(tmp_path, settings, Progress(step=200), "tiny")
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["original_lm_head"] and config["truncated_vocab_size"] == draft_vocab
        loaded = load_medusa(tmp_path, model)
        states = torch.randn(5, model.config.hidden_size)
        assert torch.equal(loaded(states), heads(states))


def test_draft_vocabulary_maps_both_ways() -> None:
    vocab = DraftVocabulary.most_frequent([[5, 5, 5, 7, 7, 9], [9, 9, 9, 9]], 3, 20, always=[2])
    assert vocab.ids == (2, 5, 9)  # the end-of-turn token, then the most frequent, sorted by id
    d2t = vocab.d2t()
    assert torch.equal(torch.arange(3) + d2t, torch.tensor([2, 5, 9]))
    assert vocab.t2d().nonzero().flatten().tolist() == [2, 5, 9]
    assert vocab.to_draft()[[2, 5, 9, 7]].tolist() == [0, 1, 2, -1]
    small = DraftVocabulary.most_frequent([[1]], 4, 10)
    assert len(small.ids) == 4 and 1 in small.ids


def test_settings_are_checked() -> None:
    for bad in (dict(method="lookahead"), dict(steps=0), dict(max_tokens=4), dict(ttt_steps=0)):
        with pytest.raises(InputError):
            TrainSettings(**bad)


@pytest.mark.real_model
def test_train_drafter_command_end_to_end(real_lm, tmp_path) -> None:
    """A few steps on a small JSONL through the command's function: held-out tau measured, a
    checkpoint, resume to more steps, the export in EAGLE-3's format with a card, and the
    `eagle3:head=...` method drafting losslessly with it."""
    from leapdecode import wrap
    from leapdecode.training.train import train_drafter

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Name {i + 2} colours of the rainbow, one per line."},
                {
                    "role": "assistant",
                    "content": "\n".join(["Red", "Orange", "Yellow", "Green", "Blue", "Indigo", "Violet"][: i + 2]),
                },
            ]
        }
        for i in range(6)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = TrainSettings(
        data=str(data),
        steps=4,
        eval_every=4,
        checkpoint_every=2,
        max_tokens=96,
        held_out=2,
        eval_tokens=12,
        draft_vocab=512,
    )
    out = tmp_path / "run"
    head = train_drafter(real_lm, settings, out, progress=False)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["step"] == 4 and progress["evals"] and progress["evals"][0]["tau"] >= 1.0
    with pytest.raises(InputError, match="--resume"):
        train_drafter(real_lm, settings, out, progress=False)
    with pytest.raises(InputError, match=r"other settings \(lr\)"):
        train_drafter(real_lm, TrainSettings(**{**settings.__dict__, "lr": 1e-3}), out, resume=True, progress=False)
    longer = TrainSettings(**{**settings.__dict__, "steps": 6})
    assert train_drafter(real_lm, longer, out, resume=True, progress=False) == head
    assert json.loads((out / "progress.json").read_text())["step"] == 6
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    assert "held-out tau" in (head / "README.md").read_text()
    decoder = wrap(real_lm, f"eagle3:head={head},depth=3")
    plain = wrap(real_lm, "ar").generate("Name three colours.", max_new_tokens=24, chat=True)
    assert decoder.generate("Name three colours.", max_new_tokens=24, chat=True).token_ids == plain.token_ids
