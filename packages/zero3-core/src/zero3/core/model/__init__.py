"""One sharded model: its state (the façade hooks and optim call), the training step
that owns the step's state machine, and the rank-consistency checks and merges.
"""
