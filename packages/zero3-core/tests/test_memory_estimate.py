"""estimate_model_states: the arithmetic of ZeRO-3 model states, before building."""

import pytest
import torch
from torch import nn

from zero3.core import Zero3Config, estimate_model_states

SHARD_ALL = Zero3Config(param_persistence_threshold=0)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fp32_adamw_is_sixteen_bytes_per_element_over_n(world):
    psi = 8 * 1024 * 1024
    est = estimate_model_states(psi, world, config=SHARD_ALL)
    assert est.unsharded_bytes == 16 * psi
    assert est.per_rank_bytes == 16 * psi // world
    assert (est.param_bytes, est.grad_bytes, est.master_bytes, est.optimizer_bytes) == (
        4 * psi // world,
        4 * psi // world,
        0,
        8 * psi // world,
    )


def test_bf16_parameters_get_fp32_masters():
    psi = 1 << 20
    est = estimate_model_states(psi, 4, param_dtype=torch.bfloat16, config=SHARD_ALL)
    # 2 (bf16 parameter) + 2 (bf16 gradient) + 4 (fp32 master) + 8 (two fp32 moments)
    assert est.per_rank_bytes == 16 * psi // 4
    assert est.master_bytes == 4 * psi // 4
    est = estimate_model_states(
        psi, 4, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, config=SHARD_ALL
    )
    assert est.grad_bytes == 4 * psi // 4


def test_optimizer_offload_moves_masters_and_state_out_of_memory_by_its_ratio(tmp_path):
    psi = 1 << 20
    plain = estimate_model_states(psi, 4, param_dtype=torch.bfloat16, config=SHARD_ALL)
    moved = plain.master_bytes + plain.optimizer_bytes  # 4 + 8 bytes per element, over N
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    est = estimate_model_states(
        psi, 4, param_dtype=torch.bfloat16,
        config=Zero3Config(param_persistence_threshold=0, offload_optimizer=nvme),
    )  # fmt: skip
    assert est.nvme_bytes == moved == 12 * psi // 4 and est.host_bytes == 0
    assert est.per_rank_bytes == plain.per_rank_bytes - moved  # params and grads stay
    assert est.unsharded_bytes == plain.unsharded_bytes
    half = estimate_model_states(
        psi, 4, param_dtype=torch.bfloat16,
        config=Zero3Config(param_persistence_threshold=0, offload_optimizer={**nvme, "ratio": 0.5}),
    )  # fmt: skip
    assert half.nvme_bytes == moved // 2
    host = Zero3Config(param_persistence_threshold=0, offload_optimizer={"device": "cpu"})
    cpu = estimate_model_states(psi, 4, config=host)
    assert cpu.host_bytes == 8 * psi // 4 and cpu.nvme_bytes == 0
    assert cpu.per_rank_bytes == 16 * psi // 4  # host memory is where a CPU run keeps it all


def test_offload_on_an_accelerator_counts_host_memory_apart_from_the_device():
    psi = 1 << 20
    plain = estimate_model_states(psi, 4, config=SHARD_ALL, device="cuda")
    assert plain.per_rank_bytes == 16 * psi // 4 and plain.host_bytes == 0
    host = Zero3Config(param_persistence_threshold=0, offload_optimizer={"device": "cpu"})
    est = estimate_model_states(psi, 4, config=host, device="cuda")
    # fp32 parameters: the shard stays on the device, a host master of 4 bytes per
    # element appears beside the 8 bytes of AdamW state.
    assert est.host_bytes == 12 * psi // 4 and est.master_bytes == 0
    assert est.per_rank_bytes == 8 * psi // 4  # parameter and gradient shards
    both = Zero3Config(
        param_persistence_threshold=0, param_dtype=torch.bfloat16,
        offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"},
    )  # fmt: skip
    est = estimate_model_states(psi, 4, config=both, device="cuda")
    assert est.host_bytes == (2 + 4 + 8) * psi // 4 and est.param_bytes == 0
    assert est.per_rank_bytes == 2 * psi // 4  # the bf16 gradient shards


def test_a_model_on_meta_counts_padding_persistence_and_frozen_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(10, 30), nn.LayerNorm(30), nn.Linear(30, 7))
    model[0].requires_grad_(False)
    config = Zero3Config(param_persistence_threshold=30)
    est = estimate_model_states(model, 4, optimizer="sgd", config=config)
    sizes = [300, 30, 30, 30, 210, 7]  # weight/bias of each layer
    shards = [-(-n // 4) for n in sizes]
    whole = [n if n <= 30 else 0 for n in sizes]
    assert est.numel == sum(sizes)
    assert est.param_bytes == 4 * (sum(shards) + sum(whole))
    assert est.grad_bytes == 4 * sum(shards[2:])  # layer 0 is frozen (no weight/bias grads)
    assert est.optimizer_bytes == 0
    assert est.largest_module_bytes == 4 * (300 + 30)


def test_optimizer_by_name_or_count_and_bad_input():
    assert estimate_model_states(1000, 2, optimizer=3, config=SHARD_ALL).optimizer_bytes == 6000
    assert estimate_model_states(1000, 2, optimizer="SGD", config=SHARD_ALL).optimizer_bytes == 0
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        estimate_model_states(1000, 2, optimizer="rmsprop")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        estimate_model_states(1000, 0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        estimate_model_states("model", 2)  # type: ignore[arg-type]


def test_parameter_offload_moves_the_shards_out_and_gives_them_separate_masters(tmp_path):
    psi = 1 << 20
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    plain = estimate_model_states(psi, 4, config=SHARD_ALL)  # fp32: 4 + 4 + 8 per element
    shards = Zero3Config(param_persistence_threshold=0, offload_param={**nvme, "max_in_cpu": 0})
    est = estimate_model_states(psi, 4, config=shards)
    # The fp32 shard leaves; its master becomes a copy of its own, in memory.
    assert est.param_bytes == 0 and est.nvme_bytes == 4 * psi // 4
    assert est.master_bytes == 4 * psi // 4
    assert est.per_rank_bytes == plain.per_rank_bytes
    both = Zero3Config(param_persistence_threshold=0, offload_param={**nvme, "max_in_cpu": 0},
                       offload_optimizer=nvme)  # fmt: skip
    est = estimate_model_states(psi, 4, config=both)
    # Only the gradient shard stays: 4 (shard) + 4 (master) + 8 (moments) go to disk.
    assert est.per_rank_bytes == est.grad_bytes == 4 * psi // 4
    assert est.nvme_bytes == 16 * psi // 4
    assert est.unsharded_bytes == plain.unsharded_bytes
    # DeepSpeed's max_in_cpu default (10⁹ elements) keeps a model this small in memory.
    kept = Zero3Config(param_persistence_threshold=0, offload_param=nvme)
    assert estimate_model_states(psi, 4, config=kept).param_bytes == plain.param_bytes


def test_one_device_with_offloaded_parameters_keeps_only_the_window_there(tmp_path):
    """A world of one offloads too: each parameter's "shard" is the whole parameter, off
    the device between uses, and a gather window is counted where in memory nothing was.
    """
    psi = 1 << 20
    plain = estimate_model_states(psi, 1, config=SHARD_ALL, device="cuda")
    assert plain.param_bytes == 4 * psi and plain.window is None
    for param in ({"device": "cpu"}, {"device": "nvme", "nvme_path": str(tmp_path)}):
        config = Zero3Config(
            param_persistence_threshold=0, offload_param={**param, "max_in_cpu": 0}
        )
        est = estimate_model_states(psi, 1, config=config, device="cuda")
        assert est.param_bytes == 0, (param, est)
        moved = est.nvme_bytes if param["device"] == "nvme" else est.host_bytes
        assert moved >= 4 * psi, (param, est)
        assert est.window is not None and est.window_bytes > 0, (param, est)
    # On a CPU run ``cpu`` moves nothing (the parameters are in host memory already).
    config = Zero3Config(param_persistence_threshold=0, offload_param={"device": "cpu"})
    assert estimate_model_states(psi, 1, config=config).param_bytes == plain.param_bytes
