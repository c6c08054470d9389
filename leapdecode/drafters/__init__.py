"""Drafters: one module each, each the engine's four-call contract (`engine.drafting`).

The names below are imported on first use: the drafters import torch (and some the early-exit
backends), and `leapdecode.methods` names these modules without wanting either loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leapdecode.drafters.anpd_tree import AnpdTreeDrafter
    from leapdecode.drafters.arctic_suffix import ArcticSuffixDrafter
    from leapdecode.drafters.base import Composite, NoDrafter, StreamDrafter
    from leapdecode.drafters.cost_aware import CostAwareDrafter
    from leapdecode.drafters.draft_model import DraftModelDrafter
    from leapdecode.drafters.eagle3 import Eagle3Drafter
    from leapdecode.drafters.head_suffix import HeadWithSuffix
    from leapdecode.drafters.hybrid import HybridDrafter
    from leapdecode.drafters.jacobi import JacobiDrafter
    from leapdecode.drafters.lookahead import LookaheadDrafter
    from leapdecode.drafters.medusa import MedusaDrafter
    from leapdecode.drafters.ngram import AnpdDrafter, NGramModule, Prediction
    from leapdecode.drafters.prompt_lookup import PromptLookupDrafter
    from leapdecode.drafters.recycle import RecycleDrafter
    from leapdecode.drafters.rest import Datastore, RestDrafter, build_datastore
    from leapdecode.drafters.self_draft import SelfDrafter
    from leapdecode.drafters.suffix import SuffixDrafter
    from leapdecode.drafters.trie import TokenTrie, TrieDrafter
    from leapdecode.engine.drafting import Draft, Drafter, Offer

_LAZY = {
    "AnpdTreeDrafter": "anpd_tree",
    "ArcticSuffixDrafter": "arctic_suffix",
    "Composite": "base",
    "NoDrafter": "base",
    "StreamDrafter": "base",
    "CostAwareDrafter": "cost_aware",
    "DraftModelDrafter": "draft_model",
    "HybridDrafter": "hybrid",
    "Eagle3Drafter": "eagle3",
    "HeadWithSuffix": "head_suffix",
    "MedusaDrafter": "medusa",
    "JacobiDrafter": "jacobi",
    "LookaheadDrafter": "lookahead",
    "AnpdDrafter": "ngram",
    "NGramModule": "ngram",
    "Prediction": "ngram",
    "PromptLookupDrafter": "prompt_lookup",
    "RecycleDrafter": "recycle",
    "Datastore": "rest",
    "RestDrafter": "rest",
    "build_datastore": "rest",
    "SelfDrafter": "self_draft",
    "SuffixDrafter": "suffix",
    "TokenTrie": "trie",
    "TrieDrafter": "trie",
}

_CONTRACT = ("Draft", "Drafter", "Offer")

__all__ = [
    "AnpdDrafter",
    "AnpdTreeDrafter",
    "ArcticSuffixDrafter",
    "Composite",
    "CostAwareDrafter",
    "Datastore",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "Eagle3Drafter",
    "HeadWithSuffix",
    "HybridDrafter",
    "JacobiDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "NGramModule",
    "NoDrafter",
    "Offer",
    "Prediction",
    "PromptLookupDrafter",
    "RecycleDrafter",
    "RestDrafter",
    "SelfDrafter",
    "StreamDrafter",
    "SuffixDrafter",
    "TokenTrie",
    "TrieDrafter",
    "build_datastore",
]


def __getattr__(name: str) -> Any:
    """Import the drafter modules on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _CONTRACT:  # the engine's own types, named here for drafters' users
        return getattr(importlib.import_module("leapdecode.engine.drafting"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
