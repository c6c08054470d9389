"""leapdecode's drafters as vLLM proposers (needs the `vllm` extra; set-up: `vllm_setup`).

vLLM (0.32) builds the class named in `speculative_config["model"]` with its `VllmConfig`, and
every step calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)`
with one row per batch slot; it verifies the drafts itself. `LeapdecodeProposer` runs the method
named in `additional_config["leapdecode_method"]` (`vllm_setup.vllm_engine_args` writes both);
`AnpdProposer`, `PromptLookupProposer` and `SuffixProposer` run that method when none is named.
Rows find their own request's drafter through `slots.SlotDrafters`.
"""

from __future__ import annotations

import logging
from typing import Any

from leapdecode.integrations.vllm_setup import CONFIG_KEY, SUPPORTED_VLLM, vllm_method

logger = logging.getLogger("leapdecode")


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
        from leapdecode.engine.sampling import SamplingParams
        from leapdecode.integrations.slots import SlotDrafters

        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.method = vllm_method(extra.get(CONFIG_KEY, self.default_method))
        factory = self.method.drafter_factory(None, draft_model=None, log=logger.info)  # type: ignore[arg-type]  # these methods load nothing
        greedy = SamplingParams()  # chain drafters draft the same whatever vLLM samples
        self.slots = SlotDrafters(
            lambda: factory(greedy, None),
            max_tokens=min(vllm_config.speculative_config.num_speculative_tokens, self.method.draft_length),
            max_len=vllm_config.model_config.max_model_len,
            capacity=max(64, 4 * vllm_config.scheduler_config.max_num_seqs),
        )
        logger.info("leapdecode proposer: %s, at most %d tokens per draft", self.method, self.slots.max_tokens)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafters read the text only."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """Drafts for every slot of the batch (`SlotDrafters.propose`)."""
        return self.slots.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)


class AnpdProposer(LeapdecodeProposer):
    default_method = "anpd"


class PromptLookupProposer(LeapdecodeProposer):
    default_method = "pld"


class SuffixProposer(LeapdecodeProposer):
    default_method = "suffix"
