"""Gradients: fixed buckets, the reduction strategies and the reducer that turns full
gradients into this rank's gradient shards.
"""
