"""Scripts that tools/exit_check.py runs under torchrun: user code that ends without cleanup."""
