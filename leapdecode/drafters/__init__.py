"""Drafters: one module each. A drafter proposes tokens and is told what was accepted."""

from leapdecode.drafters.anpd_tree import AnpdTreeDrafter
from leapdecode.drafters.base import Draft, Drafter, NoDrafter
from leapdecode.drafters.draft_model import DraftModelDrafter
from leapdecode.drafters.jacobi import JacobiDrafter
from leapdecode.drafters.lookahead import LookaheadDrafter
from leapdecode.drafters.ngram import AnpdDrafter, NGramModule, Prediction
from leapdecode.drafters.prompt_lookup import PromptLookupDrafter
from leapdecode.drafters.rest import Datastore, RestDrafter, build_datastore
from leapdecode.drafters.trie import TokenTrie, TrieDrafter

__all__ = [
    "AnpdDrafter", "AnpdTreeDrafter", "Datastore", "Draft", "DraftModelDrafter", "Drafter", "JacobiDrafter", "LookaheadDrafter",
    "NGramModule", "NoDrafter",
    "Prediction", "PromptLookupDrafter", "RestDrafter", "TokenTrie", "TrieDrafter", "build_datastore",
]
