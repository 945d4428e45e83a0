"""On-disk formats: the zero3 checkpoint (a torch.distributed.checkpoint directory), its
one-process reader, and tensor boxes shared with weight files.
"""
