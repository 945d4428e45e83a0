"""zero3."""
