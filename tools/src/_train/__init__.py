"""Pieces of tools/train.py (the main job): data, model, launch, report."""
