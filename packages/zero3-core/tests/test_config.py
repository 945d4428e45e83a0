import json
import logging

import pytest
import torch
from torch import nn

from zero3.core import Zero3Config


def test_defaults_are_deepspeeds():
    c = Zero3Config()
    assert c.prefetch_bucket_size == 50_000_000
    assert c.max_live_parameters == 1_000_000_000
    assert c.max_reuse_distance == 1_000_000_000
    assert c.param_persistence_threshold == 100_000
    assert c.reduce_bucket_size == 500_000_000
    assert c.contiguous_gradients and c.overlap_comm
    assert c.sub_group_size == 1_000_000_000
    assert c.gradient_clipping is None
    assert c.loss_scale == 0 and c.initial_scale_power == 16
    assert c.loss_scale_window == 1000 and c.hysteresis == 2 and c.min_loss_scale == 1


def test_frozen():
    c = Zero3Config()
    with pytest.raises(AttributeError):
        c.overlap_comm = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefetch_bucket_size": -1}, "prefetch_bucket_size must be >= 0"),
        ({"reduce_bucket_size": 0}, "reduce_bucket_size must be >= 1"),
        ({"sub_group_size": 1.5}, "sub_group_size must be a whole number"),
        ({"max_live_parameters": "big"}, "max_live_parameters must be an integer"),
        ({"overlap_comm": 1}, "overlap_comm must be a bool"),
        ({"grad_reduce_op": "allreduce"}, "'reduce_scatter' or 'all_reduce'"),
        ({"param_dtype": torch.int32}, "param_dtype must be a floating dtype"),
        ({"reduce_dtype": "half-ish"}, "reduce_dtype must be None"),
        ({"gradient_clipping": 0}, "gradient_clipping must be > 0"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"leaf_modules": (int,)}, "leaf_modules entries must be nn.Module subclasses"),
        ({"extras": [1]}, "extras must be a mapping"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Zero3Config(**kwargs)


def test_normalizes_values():
    c = Zero3Config(
        param_dtype="bf16", reduce_dtype="fp32", prefetch_bucket_size=5e7, leaf_modules=nn.Linear
    )
    assert c.param_dtype is torch.bfloat16 and c.reduce_dtype is torch.float32
    assert c.prefetch_bucket_size == 50_000_000 and isinstance(c.prefetch_bucket_size, int)
    assert c.leaf_modules == (nn.Linear,)


DS = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "scheduler": {"type": "WarmupLR"},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": 1000,
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 10,
        "reduce_bucket_size": 2000,
        "contiguous_gradients": False,
        "overlap_comm": False,
        "sub_group_size": 300,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_from_deepspeed_maps_zero_keys_and_keeps_the_rest(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    for source in (DS, str(path), path):
        c = Zero3Config.from_deepspeed(source)
        assert c.prefetch_bucket_size == 1000
        assert c.max_live_parameters == 1_000_000_000  # "auto" keeps the default
        assert c.max_reuse_distance == 0
        assert c.param_persistence_threshold == 10
        assert c.reduce_bucket_size == 2000
        assert not c.contiguous_gradients and not c.overlap_comm
        assert c.sub_group_size == 300
        assert c.param_dtype is torch.bfloat16
        assert c.gradient_clipping == 1.0
        assert dict(c.extras) == {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "scheduler": {"type": "WarmupLR"},
        }
    with pytest.raises(TypeError):
        c.extras["x"] = 1  # type: ignore[index]


def test_from_deepspeed_overrides_win():
    assert Zero3Config.from_deepspeed(DS, overlap_comm=True).overlap_comm


def test_from_deepspeed_fp16_scaling():
    ds = {
        "zero_optimization": {"stage": 3},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
        "gradient_clipping": 0.0,
    }
    c = Zero3Config.from_deepspeed(ds)
    assert c.param_dtype is torch.float16
    assert c.loss_scale == 0 and c.initial_scale_power == 8 and c.hysteresis == 1
    assert c.gradient_clipping is None


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_from_deepspeed_other_stages_are_refused(stage):
    with pytest.raises(ValueError, match=r"stage is .*implements ZeRO stage 3 only"):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": stage}})


def test_from_deepspeed_unknown_key_is_named():
    with pytest.raises(ValueError, match="stage3_prefetch_bucket_sise"):
        Zero3Config.from_deepspeed(
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5}}
        )


@pytest.mark.parametrize(
    ("key", "value", "feature"),
    [
        ("offload_optimizer", {"device": "cpu"}, "optimizer offload"),
        ("offload_param", {"device": "nvme"}, "parameter offload"),
        ("zero_quantized_weights", True, "ZeRO\\+\\+"),
        ("zero_hpz_partition_size", 8, "hierarchical partitioning"),
    ],
)
def test_from_deepspeed_missing_features_are_errors(key, value, feature):
    with pytest.raises(ValueError, match=feature):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3, key: value}})


def test_from_deepspeed_switched_off_features_are_fine():
    c = Zero3Config.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "none"},
                "zero_hpz_partition_size": 1,
            }
        }
    )
    assert c.prefetch_bucket_size == 50_000_000


def test_from_deepspeed_without_clipping_notes_deepspeeds_default(caplog):
    with caplog.at_level(logging.WARNING, logger="zero3.core"):
        c = Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert c.gradient_clipping is None
    assert "DeepSpeed >= 0.19 would clip at 1.0" in caplog.text


def test_from_deepspeed_needs_the_zero_section():
    with pytest.raises(ValueError, match="no zero_optimization section"):
        Zero3Config.from_deepspeed({"train_batch_size": 8})
