"""Zero3Config from a DeepSpeed JSON config (a dict here; a path to the file works too).

No collectives: run it as one process::

    ./dev run python examples/deepspeed_config.py
"""

from zero3.core import Zero3Config

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": 20_000_000,
        "stage3_param_persistence_threshold": "auto",  # "auto": DeepSpeed's default
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 100_000_000,
        "overlap_comm": True,
        "stage3_gather_16bit_weights_on_model_save": True,  # left to the loop (extras)
    },
}

config = Zero3Config.from_deepspeed(ds_config, backend="gloo")  # keyword fields win
print(f"prefetch_bucket_size={config.prefetch_bucket_size:,}")
print(f"param_persistence_threshold={config.param_persistence_threshold:,}")
print(
    f"max_reuse_distance={config.max_reuse_distance}, param_dtype={config.param_dtype}"
)
print(f"gradient_clipping={config.gradient_clipping}, backend={config.backend!r}")
print(f"extras (for the training loop): {sorted(config.extras)}")

for bad in ({"stage": 2}, {"stage3_prefetch_bucket": 1}):
    try:
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, **bad}})
    except ValueError as exc:
        print(f"refused: {str(exc).split(';')[0].split('(a typo?)')[0].strip()}")
