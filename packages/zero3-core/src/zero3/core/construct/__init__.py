"""Construct-time sharding: ``empty_init``, weight sources and the materializer that
builds meta parameters straight into this rank's shards.
"""
