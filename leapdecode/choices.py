"""The value lists of method parameters, in one torch-free place: the method strings are checked
against them when parsed (`methods`), and the drafters and backends that take the values trust
them (`drafters`, `early_exit`)."""

from __future__ import annotations

DRAFT_SCHEDULES = ("constant", "heuristic")  # draft:schedule
JACOBI_MODES = ("sliding", "block")  # jacobi:mode
JACOBI_INITS = ("repeat", "random", "ngram")  # jacobi:init
CALM_MEASURES = ("softmax", "state")  # calm:measure
