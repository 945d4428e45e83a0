"""Diagnostics: the collective guard (headers, timeouts), step counters, trace events
and memory records. Built on the configuration alone.
"""
