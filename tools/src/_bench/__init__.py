"""Pieces of tools/bench.py (and of tools/memory.py): the workload and one worker per system."""
