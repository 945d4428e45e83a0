"""State dicts of a sharded model: full (gathered) and sharded (torch.distributed.checkpoint
native), and the gloo group checkpoints use.
"""
