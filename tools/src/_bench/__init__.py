"""Pieces of tools/bench.py: the workload and one worker per system."""
