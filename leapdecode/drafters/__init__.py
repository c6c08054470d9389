"""Drafters: one module each. A drafter proposes tokens and is told what was accepted."""

from leapdecode.drafters.base import Draft, Drafter, NoDrafter
from leapdecode.drafters.ngram import AnpdDrafter, NGramModule, Prediction
from leapdecode.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["AnpdDrafter", "Draft", "Drafter", "NGramModule", "NoDrafter", "Prediction", "PromptLookupDrafter"]
