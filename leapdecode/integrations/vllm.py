"""leapdecode's drafters as vLLM proposers (needs the `vllm` extra; set-up: `vllm_setup`).

vLLM (0.32) builds the class named in `speculative_config["model"]` with its `VllmConfig`, and
every step calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)`
with one row per batch slot; it verifies the drafts itself. `LeapdecodeProposer` runs the method
named in `additional_config["leapdecode_method"]` (`vllm_setup.vllm_engine_args` writes both);
`AnpdProposer`, `PromptLookupProposer` and `SuffixProposer` run that method when none is named.
Rows find their own request's drafter through `slots.SlotDrafters`. A cost-aware method (`anpd`,
`suffix` by default) cuts its drafts by vLLM's own step cost, fitted from the time between calls
(`step_cost.StepCost`), as our engine cuts them by its measured cost curve.
"""

from __future__ import annotations

import logging
from typing import Any

from leapdecode.integrations.vllm_setup import CONFIG_KEY, SUPPORTED_VLLM, vllm_method

logger = logging.getLogger("leapdecode")
LOG_EVERY = 256  # fitted steps between log lines of the step cost


def import_vllm() -> Any:
    """vLLM itself, or a clear error naming the extra (or the version) that is missing."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "leapdecode.integrations.vllm needs vLLM: pip install 'leapdecode[vllm]' "
            f"(vLLM {SUPPORTED_VLLM}x; `make vllm` sets it up in .venv-vllm) [{exc}]"
        ) from exc
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ImportError(
            f"leapdecode's vLLM proposers need vLLM {SUPPORTED_VLLM}x (its proposer interface is experimental "
            f"and changes between releases), found {vllm.__version__}: pip install 'leapdecode[vllm]'"
        )
    return vllm


import_vllm()  # fail at import, with the message above, not deep inside vLLM's engine start


class LeapdecodeProposer:
    """A vLLM proposer running one of leapdecode's chain drafters per request."""

    default_method = "anpd"

    def __init__(self, vllm_config: Any) -> None:
        from leapdecode.engine.noise import PositionNoise
        from leapdecode.engine.sampling import SamplingParams
        from leapdecode.integrations.slots import SlotDrafters
        from leapdecode.integrations.step_cost import StepCost
        from leapdecode.methods.base import cost_aware_factory

        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.method = vllm_method(extra.get(CONFIG_KEY, self.default_method))
        factory = self.method.drafter_factory(None, draft_model=None, log=logger.info)  # type: ignore[arg-type]  # these methods load nothing
        cost = None
        if self.method.capabilities.cost_aware:  # cut by vLLM's own step cost, fitted as it runs
            cost = StepCost()
            factory = cost_aware_factory(factory, cost)
        greedy = SamplingParams()  # chain drafters draft the same whatever vLLM samples
        self.slots = SlotDrafters(
            lambda: factory(greedy, PositionNoise(0)),  # these drafters draw no noise
            max_tokens=min(vllm_config.speculative_config.num_speculative_tokens, self.method.draft_length),
            max_len=vllm_config.model_config.max_model_len,
            capacity=max(64, 4 * vllm_config.scheduler_config.max_num_seqs),
            cost=cost,
        )
        logger.info("leapdecode proposer: %s, at most %d tokens per draft", self.method, self.slots.max_tokens)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafters read the text only."""

    def propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any, slot_mappings: Any = None
    ) -> list[list[int]]:
        """Drafts for every slot of the batch (`SlotDrafters.propose`)."""
        drafts = self.slots.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        cost = self.slots.cost
        if cost is not None and cost.steps and cost.steps % LOG_EVERY == 0:
            logger.info(
                "leapdecode proposer: vLLM's step fitted as %.1f ms + %.1f ms per scored token (%d steps)",
                1000 * cost.a,
                1000 * cost.b,
                cost.steps,
            )
        return drafts


class AnpdProposer(LeapdecodeProposer):
    default_method = "anpd"


class PromptLookupProposer(LeapdecodeProposer):
    default_method = "pld"


class SuffixProposer(LeapdecodeProposer):
    default_method = "suffix"
