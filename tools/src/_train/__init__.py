"""Pieces of tools/train.py (the main job): data, launch, report, settings, and the GPT
(``model``) that the benchmarks, the GPU check and the tests use too."""
