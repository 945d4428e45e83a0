"""MPI backend (being written)."""

from __future__ import annotations

from zero3.comm._backend import CommBackend


class MPIBackend(CommBackend):  # replaced by the full implementation
    name = "mpi"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "not implemented yet"
