"""Partitioned parameters: the side table, release and refill of storages, the buffer
pool, fingerprinted gathers, the recorded module order and the coordinator that
gathers, prefetches and releases.
"""
