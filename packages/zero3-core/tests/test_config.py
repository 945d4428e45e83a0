import math

import pytest
import torch
from torch import nn

from zero3.core import ModulePath, Zero3Config


def test_defaults_are_deepspeeds_except_the_gather_window():
    c = Zero3Config()
    # The window is auto (None): sized from the model when it is sharded (GatherWindow).
    assert c.prefetch_bucket_size is None
    assert c.max_live_parameters is None
    assert c.max_reuse_distance is None
    assert c.overlap_chunk_size is None
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
        ({"overlap_comm": 1}, "overlap_comm must be true or false"),
        ({"grad_reduce_op": "allreduce"}, "'reduce_scatter' or 'all_reduce'"),
        ({"frozen_params": "shard"}, "frozen_params must be 'regather'"),
        ({"param_dtype": torch.int32}, "param_dtype must be a floating dtype"),
        ({"reduce_dtype": "half-ish"}, "reduce_dtype must be None"),
        ({"gradient_clipping": -1}, "gradient_clipping must be >= 0"),
        ({"gradient_clipping": math.nan}, "gradient_clipping must be a finite number"),
        ({"gradient_clipping": math.inf}, "gradient_clipping must be a finite number"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping must be a number"),
        ({"gradient_clipping": True}, "gradient_clipping must be a number"),
        ({"loss_scale": math.nan}, "loss_scale must be a finite number"),
        ({"loss_scale": -1}, "loss_scale must be >= 0"),
        ({"loss_scale": math.inf}, "loss_scale must be a finite number"),
        ({"min_loss_scale": 0}, "min_loss_scale must be > 0"),
        ({"min_loss_scale": math.nan}, "min_loss_scale must be a finite number"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"timeout_s": -5}, "timeout_s must be > 0"),
        ({"timeout_s": math.nan}, "timeout_s must be a finite number"),
        ({"timeout_s": math.inf}, "timeout_s must be a finite number"),
        ({"timeout_s": 1e300}, "timeout_s must be at most"),
        ({"prefetch_bucket_size": math.nan}, "prefetch_bucket_size must be a finite integer"),
        ({"reduce_bucket_size": math.inf}, "reduce_bucket_size must be a finite integer"),
        ({"sub_group_size": -math.inf}, "sub_group_size must be a finite integer"),
        ({"max_reuse_distance": -1}, "max_reuse_distance must be >= 0"),
        ({"initial_scale_power": -1}, "initial_scale_power must be >= 0"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"sync_module_states": "false"}, "sync_module_states must be true or false"),
        ({"leaf_modules": (int,)}, "leaf_modules entries must be nn.Module subclasses"),
        ({"leaf_modules": ("",)}, "leaf_modules entries must be nn.Module subclasses"),
        ({"leaf_modules": 3}, "leaf_modules must be a tuple"),
        ({"extras": [1]}, "extras must be a mapping"),
        ({"trim_host_heap": "yes"}, "trim_host_heap must be true or false"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match) as caught:
        Zero3Config(**kwargs)
    assert f"Zero3Config.{next(iter(kwargs))}" in str(caught.value)


def test_the_host_heap_is_trimmed_by_default_only_when_offloading_to_disk():
    nvme = {"device": "nvme", "nvme_path": "/tmp/swap"}
    assert not Zero3Config().trims_host_heap
    assert not Zero3Config(offload_optimizer={"device": "cpu"}).trims_host_heap
    assert Zero3Config(offload_optimizer=nvme).trims_host_heap
    assert Zero3Config(offload_param=nvme).trims_host_heap
    assert not Zero3Config(offload_optimizer={**nvme, "ratio": 0.0}).trims_host_heap
    assert not Zero3Config(offload_optimizer=nvme, trim_host_heap=False).trims_host_heap
    assert Zero3Config(trim_host_heap=True).trims_host_heap
    assert Zero3Config().trim_host_heap is None  # auto stays auto under replace()


def test_normalizes_values():
    c = Zero3Config(
        param_dtype="bf16", reduce_dtype="fp32", prefetch_bucket_size=5e7, leaf_modules=nn.Linear
    )
    assert c.param_dtype is torch.bfloat16 and c.reduce_dtype is torch.float32
    assert c.prefetch_bucket_size == 50_000_000 and isinstance(c.prefetch_bucket_size, int)
    assert c.leaf_modules == (nn.Linear,)


def test_clipping_zero_and_none_mean_off():
    assert Zero3Config(gradient_clipping=0).gradient_clipping is None
    assert Zero3Config(gradient_clipping=0.0).gradient_clipping is None
    assert Zero3Config(gradient_clipping=None).gradient_clipping is None
    assert Zero3Config(gradient_clipping=2).gradient_clipping == 2.0


def test_leaf_modules_hold_classes_names_and_module_paths():
    targets = (nn.Linear, "MoEBlock", ModulePath("layers.0.mlp"), ModulePath("mlp", suffix=True))
    assert Zero3Config(leaf_modules=targets).leaf_modules == targets
    assert Zero3Config(leaf_modules=ModulePath("a")).leaf_modules == (ModulePath("a"),)
    with pytest.raises(TypeError, match=r"ModulePath\.path must be a non-empty module name"):
        ModulePath("")
    with pytest.raises(TypeError, match=r"ModulePath\.suffix must be a bool"):
        ModulePath("a", suffix="yes")  # type: ignore[arg-type]


def test_a_config_pickles_and_deep_copies_with_its_extras():
    import copy
    import pickle

    config = Zero3Config.from_deepspeed(
        {
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
            "gradient_clipping": 0,
            "train_batch_size": 8,
        },
        leaf_modules=("Linear",),
    )
    for twin in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), copy.copy(config)):
        assert twin == config
        assert dict(twin.extras) == {"zero_optimization.zero_hpz_partition_size": 8,
                                     "train_batch_size": 8}  # fmt: skip
        with pytest.raises(TypeError):
            twin.extras["x"] = 1  # type: ignore[index]  # still read-only
