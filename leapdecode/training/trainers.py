"""The two heads' training steps: what `train_drafter` asks of a head, once per method.

A trainer builds its head (random, from the seed), computes an example's target features,
takes one optimizer step, measures held-out acceptance through the real decode loop, saves and
restores its state, and exports the head in its published format with a short model card.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leapdecode.errors import InputError

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter
    from leapdecode.heads.vocabulary import DraftVocabulary
    from leapdecode.models.loading import LoadedModel
    from leapdecode.training.data import Conversation
    from leapdecode.training.features import Example
    from leapdecode.training.settings import Progress, TrainSettings


class Trainer(ABC):
    """What both heads share: the optimizer step, held-out acceptance, state and the card."""

    module: torch.nn.Module
    layers: tuple[int, ...]
    method: str

    def __init__(self, target: LoadedModel, settings: TrainSettings, vocab: DraftVocabulary) -> None:
        from leapdecode.models.hardware import hardware_of

        self.target, self.settings, self.vocab = target, settings, vocab
        self.to_draft = vocab.to_draft()
        # mixed precision where the hardware multiplies bfloat16 natively (float32 weights and
        # optimizer state, bfloat16 products): a head step about 1.6x faster on an AVX512-BF16 CPU
        self.mixed = settings.mixed_precision and hardware_of(target.device).native_bf16

    def _optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=self.settings.lr, betas=(0.9, 0.95), weight_decay=0.0
        )

    def features(self, input_ids: list[int], loss_mask: list[bool]) -> Example:
        from leapdecode.training.features import target_example

        return target_example(self.target.model, input_ids, loss_mask, self.layers, self.to_draft)

    @abstractmethod
    def loss(self, example: Example) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The head's loss on one example, and per step or head (hits, rows)."""

    def step(self, example: Example, lr: float) -> tuple[float, list[tuple[int, int]]]:
        """One AdamW step on one sequence; (loss, per step or head (hits, rows))."""
        self.module.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=self.mixed):
            loss, stats = self.loss(example)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 0.5)
        self.optimizer.step()
        self.module.eval()
        return float(loss.detach()), stats

    @abstractmethod
    def drafter(self) -> Drafter:
        """A drafter over the head as it is now, for held-out acceptance."""

    @abstractmethod
    def export(self, folder: Path, settings: TrainSettings, progress: Progress, report: Any) -> Path:
        """The head in its published format, with a model card."""

    def evaluate(self, held: list[Conversation], settings: TrainSettings) -> dict[str, float]:
        """Greedy decoding of each held-out conversation's first user turn with the head drafting:
        tau, tokens per target pass (the first token, from the prefill, not counted)."""
        from leapdecode.engine.alone import decode
        from leapdecode.engine.backend import TorchBackend
        from leapdecode.engine.stopping import StopCriteria
        from leapdecode.verifiers import verify_greedy, verify_tree_greedy

        backend = TorchBackend(self.target.model, exact_tokens=self.target.exact_tokens)
        tokens = passes = 0
        for conversation in held:
            prompt = _first_turn_ids(self.target.tokenizer, conversation)
            if prompt is None:
                continue
            stop = StopCriteria(self.target.eos_token_ids, settings.eval_tokens)
            steps = decode(
                backend,
                prompt,
                self.drafter(),
                stop,
                lambda d, lg, q, position: verify_greedy(d, lg),
                lambda d, t, lg, position: verify_tree_greedy(d, t, lg),
            )
            for i, step in enumerate(steps):
                if i:
                    tokens += len(step.tokens)
                    passes += 1
        return {"tau": round(tokens / max(1, passes), 3), "passes": passes}

    def state(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])

    def card(self, settings: TrainSettings, progress: Progress, report: Any) -> str:
        """A short model card: what the head drafts for, from what, how long, how well."""
        last = progress.evals[-1] if progress.evals else {}
        tokens = "" if not progress.losses else f", final loss {progress.losses[-1]:.3f}"
        return "\n".join(
            [
                f"# {self.method} head for {self.target.name}",
                "",
                f"- target: `{self.target.name}` ({self.target.describe}), fingerprint `{self.target.fingerprint}`",
                f"- data: {settings.data} ({report}); benchmark prompts (Spec-Bench, MT-Bench, HumanEval) excluded",
                f"- steps: {progress.step} of one sequence (at most {settings.max_tokens} tokens) each, "
                f"{progress.seconds / 60:.1f} CPU minutes{tokens}",
                f"- held-out tau (greedy, {settings.eval_tokens} new tokens per held-out prompt): "
                f"{last.get('tau', 'not measured')}",
                f"- seed {settings.seed}; reproduce: `{reproduce(self.target.name, settings)}`",
                "",
                "Settings:",
                "",
                "```json",
                json.dumps(asdict(settings), indent=2),
                "```",
                "",
            ]
        )


# TrainSettings fields -> train-drafter options, where they differ
OPTIONS = {
    "method": "--method",
    "data": "--data",
    "steps": "--steps",
    "lr": "--lr",
    "max_tokens": "--max-tokens",
    "ttt_steps": "--ttt-steps",
    "draft_vocab": "--draft-vocab",
    "intermediate_size": "--intermediate-size",
    "medusa_heads": "--heads",
    "limit": "--limit",
    "eval_every": "--eval-every",
    "checkpoint_every": "--checkpoint-every",
    "seed": "--seed",
}


def reproduce(model: str, settings: TrainSettings) -> str:
    """The command that trains this head again: every option whose value is not the default
    (the method, data, steps and seed always)."""
    from leapdecode.training.settings import TrainSettings

    default = TrainSettings()
    shown = [
        f"{flag} {getattr(settings, field)}"
        for field, flag in OPTIONS.items()
        if field in ("method", "data", "steps", "seed") or getattr(settings, field) != getattr(default, field)
    ]
    return f"leapdecode train-drafter --model {model} " + " ".join(shown)


def _first_turn_ids(tokenizer: Any, conversation: Conversation) -> list[int] | None:
    """The conversation's system and first user turn, ready for an answer."""
    messages = []
    for role, text in conversation.messages:
        messages.append({"role": role, "content": text})
        if role == "user":
            break
    if not messages or messages[-1]["role"] != "user":
        return None
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tokenizer("".join(f"{m['role'].title()}: {m['content']}\n" for m in messages) + "Assistant:")["input_ids"]
    return list(ids)[-1024:]


class Eagle3Trainer(Trainer):
    """EAGLE-3's head, trained by its training-time test."""

    method = "eagle3"

    def __init__(self, target: LoadedModel, settings: TrainSettings, vocab: DraftVocabulary) -> None:
        from leapdecode.heads.eagle3 import Eagle3Config, default_aux_layers, random_head

        super().__init__(target, settings, vocab)
        text = target.model.config.get_text_config()
        heads = int(text.num_attention_heads)
        config = Eagle3Config(
            hidden_size=int(text.hidden_size),
            intermediate_size=settings.intermediate_size or int(text.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            vocab_size=int(text.vocab_size),
            draft_vocab_size=len(vocab.ids),
            aux_layers=default_aux_layers(int(text.num_hidden_layers)),
            head_dim=int(getattr(text, "head_dim", None) or 0),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=float(
                (getattr(text, "rope_parameters", None) or {}).get("rope_theta") or getattr(text, "rope_theta", 10000.0)
            ),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
        )
        torch.manual_seed(settings.seed)
        self.head = random_head(config, target.model.get_input_embeddings(), seed=settings.seed, scale=0.02).to(
            target.device
        )
        with torch.no_grad():
            self.head.d2t.copy_(vocab.d2t())
            self.head.t2d.copy_(vocab.t2d())
        self.module, self.layers = self.head, config.aux_layers
        self._optimizer()

    def loss(self, example: Example) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        from leapdecode.training.losses import eagle3_loss

        return eagle3_loss(self.head, example, self.settings.ttt_steps)

    def drafter(self) -> Drafter:
        from leapdecode.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(self.head, depth=max(4, self.settings.ttt_steps))

    def export(self, folder: Path, settings: TrainSettings, progress: Progress, report: Any) -> Path:
        from leapdecode.heads.eagle3_format import save_eagle3

        save_eagle3(self.head, folder, fmt="eagle", target_name=self.target.name)
        (folder / "README.md").write_text(self.card(settings, progress, report))
        return folder


class MedusaTrainer(Trainer):
    """Medusa-1's heads on the target's last states, each against the target's distribution.

    With the full vocabulary each head has its own LM head, started as the target's (Medusa's
    recipe). With a draft vocabulary (`--draft-vocab`) the heads share the target's own LM head,
    frozen, restricted to those tokens (vLLM's `original_lm_head` with a `token_map`): only the
    residual blocks train, started at zero so that every head first predicts what the target
    does, and a draft step scores a few thousand tokens, not the whole vocabulary, per head."""

    method = "medusa"

    def __init__(self, target: LoadedModel, settings: TrainSettings, vocab: DraftVocabulary) -> None:
        from leapdecode.heads.medusa import MedusaConfig, random_medusa, target_output_weight

        super().__init__(target, settings, vocab)
        text = target.model.config.get_text_config()
        config = MedusaConfig(
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            num_heads=settings.medusa_heads,
            num_layers=settings.medusa_layers,
        )
        torch.manual_seed(settings.seed)
        self.num_layers = int(text.num_hidden_layers)
        own = target_output_weight(target.model)  # [vocab, H] float, or None
        if len(vocab.ids) < config.vocab_size:
            if own is None:
                raise InputError(
                    "train-drafter: a Medusa draft vocabulary shares the target's LM head, and this target's could not "
                    "be read"
                )
            token_map = torch.tensor(vocab.ids, dtype=torch.long)  # [rows]: target ids, draft order
            self.heads = random_medusa(
                config, seed=settings.seed, shared_lm_head=own[token_map].float().contiguous(), token_map=token_map
            )
            with torch.no_grad():
                for parameter in self.heads.parameters():
                    parameter.zero_()  # x + SiLU(0) = x: each head starts as the target's own next-token head
            self.heads = self.heads.to(target.device)
        else:
            self.heads = random_medusa(config, seed=settings.seed).to(target.device)
            with torch.no_grad():  # each head's LM head starts as the target's own (Medusa's recipe)
                if own is not None and self.heads.lm_heads is not None:
                    for lm in self.heads.lm_heads:
                        lm.weight.copy_(own.float())
        self.module, self.layers = self.heads, (self.num_layers,)
        self._optimizer()

    def loss(self, example: Example) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        from leapdecode.training.losses import medusa_loss

        # scores over the draft vocabulary, in draft order: the labels' ids (all tokens: the same)
        return medusa_loss(self.heads.scores(example.states.to(self.heads.dtype).clone()), example)

    def drafter(self) -> Drafter:
        from leapdecode.drafters.medusa import MedusaDrafter

        return MedusaDrafter(self.heads, self.num_layers)

    def export(self, folder: Path, settings: TrainSettings, progress: Progress, report: Any) -> Path:
        from leapdecode.heads.medusa_format import save_medusa

        # Medusa's own format has no token map: heads over a draft vocabulary are written in vLLM's
        save_medusa(
            self.heads, folder, format="medusa" if self.heads.token_map is None else "vllm", base_model=self.target.name
        )
        (folder / "README.md").write_text(self.card(settings, progress, report))
        return folder
