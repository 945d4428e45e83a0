"""Configuration: :class:`~zero3.core.Zero3Config`, its value checks, the DeepSpeed
JSON mapping and leaf-module targets. The bottom layer of ``zero3.core``.
"""
