"""A transformers Llama never whole on any rank: estimate, load, initialise, train.

Run it on two local ranks::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/big_models.py
"""

import os
import tempfile

import torch
import torch.distributed as dist
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from zero3.comm import create_backend
from zero3.core import Zero3Config, estimate_model_states
from zero3.hooks import empty_init, memory_stats, shard_module
from zero3.optim import PartitionedOptimizer

transformers.logging.set_verbosity_error()
comm = create_backend("gloo", timeout_s=120)
rank, world = comm.rank, comm.world_size
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
zero3_config = Zero3Config(backend="gloo", param_persistence_threshold=0)

# Before anything is built: what will each rank hold? (fp32 AdamW: 16 B/element / N)
with empty_init():
    model = LlamaForCausalLM(config)  # parameters on meta: no memory
estimate = estimate_model_states(model, world, config=zero3_config)
print(
    f"rank {rank}: estimate per rank {estimate.per_rank_bytes:,} bytes of "
    f"{estimate.unsharded_bytes:,} unsharded"
)

# A checkpoint in the transformers layout (several files and an index), as a
# save_pretrained elsewhere would have left it.
where = os.path.join(tempfile.gettempdir(), "zero3-big-models-example")
if rank == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(where, max_shard_size="100KB")
dist.barrier()

# 1. Load it: each rank reads only the elements of its own shards.
with empty_init():
    model = LlamaForCausalLM(config)
shard_module(model, zero3_config, comm=comm, checkpoint=where)
reference = LlamaForCausalLM.from_pretrained(where)  # one whole copy, to compare with
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
with torch.no_grad():
    diff = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max()
print(f"rank {rank}: max |sharded - from_pretrained| = {diff.item():.1e}")

# 2. Or initialise from scratch, one module at a time, with the model's own initialiser.
with empty_init():
    fresh = LlamaForCausalLM(config)
shard_module(
    fresh, zero3_config, comm=create_backend("gloo"), param_init_fn=fresh._init_weights
)

# Train the loaded model one step, and at the next backward see what this rank holds
# (gradient shards live from a backward to the optimizer step, as plain PyTorch's do).
opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
opt.zero_grad()
model(input_ids=ids, labels=ids).loss.backward()
mem = memory_stats(model, opt)
print(
    f"rank {rank}: holds {mem.held_bytes:,} of {mem.unsharded_bytes:,} "
    "model-state bytes "
    f"({mem.held_fraction:.2f}x), estimate {estimate.per_rank_bytes:,}"
)
