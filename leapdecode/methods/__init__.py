"""Methods and their parameters, named by one string everywhere: `anpd:n=5,k=7`.

One module per family (plain, n-gram, suffix, trees, parallel, draft model, trained heads, layers, peers), each
method's frozen parameters next to the code that builds its drafter; `registry` lists them all
and parses method strings. A new method goes into its family's module and into
`registry.METHODS` (docs/ARCHITECTURE.md). No module here imports torch at import time, so
these imports stay eager.
"""

from leapdecode.methods.base import DRAFT_SHAPES, Capabilities, DrafterFactory, DraftShape, Method, backend_for
from leapdecode.methods.draft_model import DraftModel, check_same_vocabulary
from leapdecode.methods.heads import Eagle3, Medusa
from leapdecode.methods.layers import Calm, LayerSkip, SelfSpec
from leapdecode.methods.ngram import Anpd, PromptLookup
from leapdecode.methods.parallel import Jacobi, Lookahead
from leapdecode.methods.peers import (
    HfAssisted,
    HfGenerate,
    HfPromptLookup,
    LlamaCppPlain,
    LlamaCppPromptLookup,
    LlamaCppServer,
    LlamaCppSpeculative,
)
from leapdecode.methods.plain import Autoregressive
from leapdecode.methods.registry import METHODS, method_class, method_names, parse_method
from leapdecode.methods.suffix import ArcticSuffix, Suffix
from leapdecode.methods.trees import AnpdTree, Hybrid, Recycle, Rest, Trie

__all__ = [
    "DRAFT_SHAPES",
    "METHODS",
    "Anpd",
    "AnpdTree",
    "ArcticSuffix",
    "Autoregressive",
    "Calm",
    "Capabilities",
    "DraftModel",
    "DraftShape",
    "Eagle3",
    "Medusa",
    "DrafterFactory",
    "HfAssisted",
    "HfGenerate",
    "HfPromptLookup",
    "Hybrid",
    "Jacobi",
    "LayerSkip",
    "LlamaCppPlain",
    "LlamaCppPromptLookup",
    "LlamaCppServer",
    "LlamaCppSpeculative",
    "Lookahead",
    "Method",
    "PromptLookup",
    "Recycle",
    "Rest",
    "SelfSpec",
    "Suffix",
    "Trie",
    "backend_for",
    "check_same_vocabulary",
    "method_class",
    "method_names",
    "parse_method",
]
