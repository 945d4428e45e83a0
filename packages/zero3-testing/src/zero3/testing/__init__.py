"""zero3.testing: the pooled multi-rank test harness and shared test models.

A development-only package: installed in the workspace so that spawned workers can
import the harness and the models (pytest's importlib mode makes test modules
unimportable there).
"""

from zero3.testing._harness import CaseError, GroupPool, RankExited, WorkerGroup

__all__ = ["CaseError", "GroupPool", "RankExited", "WorkerGroup"]
