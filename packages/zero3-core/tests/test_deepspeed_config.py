"""Zero3Config.from_deepspeed: every DeepSpeed key mapped, honoured, left or refused."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from zero3.core import (
    AioConfig,
    ModulePath,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    Zero3Config,
)
from zero3.core.config._deepspeed_keys import known_keys

DATA = Path(__file__).parent / "data"
# The ZeRO-3 config of transformers' DeepSpeed docs and tests (every "auto" placeholder,
# CPU offload), with the docs' "bf16": {"enabled": "auto"} section added.
TRANSFORMERS_ZERO3 = DATA / "transformers_zero3.json"

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


def _zero(**keys):
    return {"zero_optimization": {"stage": 3, **keys}, "gradient_clipping": 0}


def test_maps_zero_keys_and_keeps_the_rest_for_the_loop(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    for source in (DS, str(path), path):
        c = Zero3Config.from_deepspeed(source)
        assert c.prefetch_bucket_size == 1000
        assert c.max_live_parameters is None  # "auto": sized from the model (GatherWindow)
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
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
        }
    with pytest.raises(TypeError):
        c.extras["x"] = 1  # type: ignore[index]


def test_the_transformers_zero3_config_loads_unchanged(caplog):
    with caplog.at_level(logging.INFO, logger="zero3.core"):
        c = Zero3Config.from_deepspeed(TRANSFORMERS_ZERO3)
    # "auto" as the HF Trainer fills it without TrainingArguments.
    assert c.param_dtype is None  # bf16/fp16 "auto": precision off
    assert c.gradient_clipping == 1.0  # max_grad_norm's default
    assert c.reduce_bucket_size == 500_000_000 and c.prefetch_bucket_size is None  # window: auto
    assert c.param_persistence_threshold == 100_000
    assert c.sub_group_size == 1_000_000_000 and c.max_live_parameters == 1_000_000_000
    # Batch sizes, optimizer and scheduler are the loop's, still "auto".
    assert c.extras["train_batch_size"] == "auto"
    assert c.extras["train_micro_batch_size_per_gpu"] == "auto"
    assert c.extras["gradient_accumulation_steps"] == "auto"
    assert c.extras["optimizer"]["params"]["lr"] == "auto"
    # Offload is honoured: typed sections, not extras.
    assert c.offload_optimizer.device == "cpu" and c.offload_optimizer.pin_memory
    assert c.offload_param.device == "cpu"
    assert not any("offload" in key for key in c.extras)
    assert c.extras["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is True
    assert "wall_clock_breakdown" not in c.extras  # false asks for nothing
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2  # once: the resolutions, and the keys left to the loop
    chosen, unused = infos
    assert 'gradient_clipping: "auto" -> 1.0' in chosen
    assert 'bf16.enabled: "auto" -> False' in chosen and 'fp16.enabled: "auto" -> False' in chosen
    assert 'zero_optimization.reduce_bucket_size: "auto" -> 500,000,000' in chosen
    assert "zero_optimization.offload_optimizer: offloaded to cpu" in chosen
    # Parameter offload is honoured too (cpu: on a CPU run the shards stay where they
    # are, said at shard time); nothing is a warning.
    assert "zero_optimization.offload_param: offloaded to cpu" in chosen
    assert not [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for key in (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save: save full weights",
        "optimizer: build it in the loop",
        "train_batch_size: left to the training loop",
        "steps_per_print:",
    ):
        assert key in unused


def test_keyword_arguments_override_the_file():
    assert Zero3Config.from_deepspeed(DS, overlap_comm=True).overlap_comm
    both = {**_zero(), "bf16": {"enabled": True}, "fp16": {"enabled": True}}
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled are both true"):
        Zero3Config.from_deepspeed(both)
    assert Zero3Config.from_deepspeed(both, param_dtype="bf16").param_dtype is torch.bfloat16
    auto = {**_zero(), "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    assert Zero3Config.from_deepspeed(auto).param_dtype is None
    assert Zero3Config.from_deepspeed(auto, param_dtype="fp16").param_dtype is torch.float16
    c = Zero3Config.from_deepspeed({**DS, "gradient_clipping": "auto"}, gradient_clipping=0.5)
    assert c.gradient_clipping == 0.5
    c = Zero3Config.from_deepspeed(DS, leaf_modules=(ModulePath("x"),), extras={"mine": 1})
    assert c.leaf_modules == (ModulePath("x"),) and dict(c.extras) == {"mine": 1}


def test_fp16_scaling():
    ds = {
        **_zero(),
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
    }
    c = Zero3Config.from_deepspeed(ds)
    assert c.param_dtype is torch.float16
    assert c.loss_scale == 0 and c.initial_scale_power == 8 and c.hysteresis == 1
    assert c.gradient_clipping is None


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_are_refused(stage):
    with pytest.raises(ValueError, match=r"stage is .*implements ZeRO stage 3 only"):
        Zero3Config.from_deepspeed({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero_optimization": {}}, "zero_optimization.stage is missing"),
        ({"zero_optimization": True}, "old true/false form"),
        ({"train_batch_size": 8}, "no zero_optimization section"),
        (_zero(stage3_prefetch_bucket_sise=5), "zero_optimization.stage3_prefetch_bucket_sise "
         "is not a DeepSpeed setting.*did you mean 'stage3_prefetch_bucket_size'"),
        ({**_zero(), "gradient_cliping": 1.0}, "gradient_cliping is not a DeepSpeed setting"),
        ({**_zero(), "fp16": {"enable": True}}, "fp16.enable is not a DeepSpeed setting"),
        (_zero(leaf_module={"class": ["A"]}), "zero_optimization.leaf_module.class is not"),
        (_zero(offload_param={"device": "cpu", "pin": True}), "offload_param.pin is not"),
    ],
)  # fmt: skip
def test_unknown_or_missing_keys_are_named(config, match):
    with pytest.raises(ValueError, match=match):
        Zero3Config.from_deepspeed(config)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**_zero(), "bf16": {"enabled": "false"}}, "bf16.enabled must be true or false"),
        ({**_zero(), "fp16": {"enabled": 1}}, "fp16.enabled must be true or false"),
        ({**_zero(), "tensorboard": {"enabled": "yes"}}, "tensorboard.enabled must be true"),
        (_zero(overlap_comm="true"), "zero_optimization.overlap_comm must be true or false"),
        (_zero(stage3_max_live_parameters="big"), "stage3_max_live_parameters must be an int"),
        (_zero(reduce_bucket_size=1.5), "reduce_bucket_size must be a whole number"),
        (_zero(sub_group_size=-1), "zero_optimization.sub_group_size must be >= 0"),
        (_zero(stage="3"), "zero_optimization.stage must be an integer"),
        (_zero(leaf_module={"classes": 5}), "leaf_module.classes must be a string or a list"),
        (_zero(leaf_module={"names": [""]}), "leaf_module.names must be a string or a list"),
        (_zero(offload_param={"device": "gpu"}), "offload_param.device must be 'none', 'cpu'"),
        ({**_zero(), "train_batch_size": "8"}, "train_batch_size must be an integer"),
        ({**_zero(), "gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({**_zero(), "optimizer": "adamw"}, "optimizer must be a JSON object"),
        ({**_zero(), "communication_data_type": "fp8"}, "communication_data_type must be one of"),
        ({**_zero(), "gradient_clipping": "1.0"}, "gradient_clipping must be a number"),
        ({**_zero(), "fp16": {"loss_scale": "dynamic"}}, "fp16.loss_scale must be a number"),
        ({**_zero(), "gradient_predivide_factor": 0}, "gradient_predivide_factor must be > 0"),
    ],
)  # fmt: skip
def test_wrong_types_and_values_name_the_key(config, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Zero3Config.from_deepspeed(config)


@pytest.mark.parametrize("section", ["zero_optimization", "fp16", "bf16", "optimizer", "amp"])
def test_a_null_section_is_an_error_naming_it(section):
    config = {**_zero(), section: None}
    with pytest.raises(TypeError, match=f"^{section} must be a JSON object .*got null"):
        Zero3Config.from_deepspeed(config)


def test_null_where_deepspeed_means_off_is_accepted():
    c = Zero3Config.from_deepspeed(
        _zero(offload_param=None, offload_optimizer=None, leaf_module=None, zeropp_loco_param=None)
    )
    assert c.leaf_modules == () and dict(c.extras) == {}


@pytest.mark.parametrize(
    ("clip", "match"),
    [
        (-1, "must be >= 0"),
        (math.nan, "must be a finite number"),
        (math.inf, "must be a finite number"),
    ],
)
def test_gradient_clipping_negative_nan_or_infinite_is_an_error(clip, match):
    # The same rule as Zero3Config(gradient_clipping=...): 0 is off, the rest an error.
    with pytest.raises(ValueError, match=f"^gradient_clipping {match}"):
        Zero3Config.from_deepspeed({**_zero(), "gradient_clipping": clip})
    with pytest.raises(ValueError, match=f"^Zero3Config.gradient_clipping {match}"):
        Zero3Config(gradient_clipping=clip)


def test_gradient_clipping_zero_is_off_and_absent_warns(caplog):
    assert Zero3Config.from_deepspeed({**_zero(), "gradient_clipping": 0}).gradient_clipping is None
    with caplog.at_level(logging.WARNING, logger="zero3.core"):
        c = Zero3Config.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert c.gradient_clipping is None
    assert "DeepSpeed >= 0.19 would clip at 1.0" in caplog.text


@pytest.mark.parametrize(
    ("fp16", "match"),
    [
        ({"loss_scale": math.nan}, "fp16.loss_scale must be a finite number"),
        ({"loss_scale": -2}, "fp16.loss_scale must be >= 0"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale must be > 0"),
        ({"initial_scale_power": math.inf}, "fp16.initial_scale_power must be a finite"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window must be >= 1"),
    ],
)
def test_bad_scales_are_errors(fp16, match):
    with pytest.raises(ValueError, match=match):
        Zero3Config.from_deepspeed({**_zero(), "fp16": {"enabled": True, **fp16}})


def test_nan_sizes_from_json_are_errors(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "reduce_bucket_size": NaN}}')
    with pytest.raises(ValueError, match=r"zero_optimization\.reduce_bucket_size must be a finite"):
        Zero3Config.from_deepspeed(path)


def test_unreadable_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3},}')
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON"):
        Zero3Config.from_deepspeed(bad)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 1, '
                     '"gradient_clipping": 0}')  # fmt: skip
    with pytest.raises(ValueError, match="key 'gradient_clipping' appears twice"):
        Zero3Config.from_deepspeed(twice)
    with pytest.raises(ValueError, match="cannot read it"):
        Zero3Config.from_deepspeed(tmp_path / "missing.json")


def test_leaf_module_forms():
    c = Zero3Config.from_deepspeed(
        _zero(
            leaf_module={
                "classes": ["MoEBlock", "pkg.mod.Other", "MoEBlock"],
                "names": "layers.0.moe",
                "name_suffixes": ["experts"],
            }
        )
    )
    assert c.leaf_modules == (
        "MoEBlock",
        "pkg.mod.Other",
        ModulePath("layers.0.moe"),
        ModulePath("experts", suffix=True),
    )


def test_sizes_deepspeed_allows_at_zero_become_one(caplog):
    with caplog.at_level(logging.INFO, logger="zero3.core"):
        c = Zero3Config.from_deepspeed(_zero(sub_group_size=0, reduce_bucket_size=0))
    assert c.sub_group_size == 1 and c.reduce_bucket_size == 1
    assert "zero_optimization.sub_group_size: 0 -> 1" in caplog.text


def test_memory_and_compression_features_run_without_them_and_say_so(caplog):
    keys = {
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
        "zero_hpz_partition_size": 8,
        "mics_shard_size": 4,
        "stage3_model_persistence_threshold": 1000,
        "zenflow": {"topk_ratio": 0.1},
    }
    with caplog.at_level(logging.INFO, logger="zero3.core"):
        c = Zero3Config.from_deepspeed(_zero(**keys))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for key, value in keys.items():
        assert c.extras[f"zero_optimization.{key}"] == value
        assert f"zero_optimization.{key} (changes " in warnings  # memory or numerics
    assert c.param_persistence_threshold == 100_000  # the total cap changes nothing here


def test_dropped_memory_and_numerics_settings_warn_on_rank_0_only(caplog, monkeypatch):
    config = _zero(zero_hpz_partition_size=8)
    config["fp16"] = {"enabled": True, "auto_cast": True}
    for rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zero3.core"):
            Zero3Config.from_deepspeed(config)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == expected, (rank, warnings)
    assert "zero_optimization.zero_hpz_partition_size (changes memory)" in warnings[0]
    assert "fp16.auto_cast (changes numerics)" in warnings[0]


def test_offload_sections_map_onto_typed_fields(caplog, tmp_path):
    config = _zero(
        offload_optimizer={
            "device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
            "buffer_count": 3, "ratio": 0.5, "pipeline_read": True, "pipeline_write": True,
            "fast_init": False, "super_offload": True,
        },
        offload_param={"device": "cpu", "buffer_count": 2, "buffer_size": 1e6, "max_in_cpu": 0},
    )  # fmt: skip
    config["aio"] = {
        "block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2,
        "single_submit": True, "overlap_events": True, "use_gds": False,
    }  # fmt: skip
    with caplog.at_level(logging.INFO, logger="zero3.core"):
        c = Zero3Config.from_deepspeed(config)
    assert c.offload_optimizer == OffloadOptimizerConfig(
        device="nvme", nvme_path=str(tmp_path), pin_memory=True, buffer_count=3, ratio=0.5
    )
    assert c.offload_param == OffloadParamConfig(
        device="cpu", buffer_count=2, buffer_size=1_000_000, max_in_cpu=0
    )
    assert c.aio == AioConfig(block_size=262144, queue_depth=4, thread_count=2)
    # No sub_group_size given: the offload default, small enough to pipeline.
    assert c.sub_group_size == 2_097_152
    assert set(c.extras) == {
        "zero_optimization.offload_optimizer.super_offload",
        "aio.single_submit",
    }
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "aio.single_submit (changes speed): not applicable" in warnings
    assert "offload_optimizer.super_offload (changes speed): not applicable" in warnings
    assert "pipeline_read" not in caplog.text  # zero3 always pipelines: honoured
    explicit = Zero3Config.from_deepspeed(
        _zero(sub_group_size=1e9, offload_optimizer={"device": "cpu"})
    )
    assert explicit.sub_group_size == 1_000_000_000  # given: kept


@pytest.mark.parametrize(
    ("offload", "match"),
    [
        ({"device": "nvme"}, "offload_optimizer: .*nvme_path is not set"),
        ({"device": "disk"}, "offload_optimizer.device must be 'none', 'cpu' or 'nvme'"),
        ({"device": "cpu", "ratio": 1.5}, "offload_optimizer.ratio is a fraction"),
        ({"device": "cpu", "buffer_count": 1}, "offload_optimizer.buffer_count must be >= 2"),
        ({"device": "cpu", "nvme_path": 5}, "offload_optimizer.nvme_path must be a string"),
    ],
)
def test_bad_offload_values_name_the_key(offload, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Zero3Config.from_deepspeed(_zero(offload_optimizer=offload))


def test_offload_fields_take_mappings_and_check_them():
    c = Zero3Config(offload_optimizer={"device": "cpu"}, aio={"thread_count": 2})
    assert c.offload_optimizer.enabled and c.aio.thread_count == 2
    with pytest.raises(ValueError, match=r"Zero3Config\.offload_optimizer: unknown key.*'devise'"):
        Zero3Config(offload_optimizer={"devise": "cpu"})
    with pytest.raises(
        ValueError, match=r"Zero3Config\.aio\.block_size must be a multiple of 4096"
    ):
        Zero3Config(aio={"block_size": 1000})
    assert Zero3Config(offload_optimizer={"device": "cpu", "ratio": 0}).sub_group_size == 10**9


def test_switched_off_features_and_stage_1_2_settings_are_honoured_silently(caplog):
    with caplog.at_level(logging.INFO, logger="zero3.core"):
        c = Zero3Config.from_deepspeed(
            _zero(
                offload_param={"device": "none"},
                zero_hpz_partition_size=1,
                zero_quantized_weights=False,
                allgather_partitions=True,
                allgather_bucket_size=5e8,
                round_robin_gradients=True,
            )
        )
    assert dict(c.extras) == {} and "does not act on" not in caplog.text


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op: must be 'mean'"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: zero3 is data parallel"),
        ({"expert_parallel": {"enabled": True}}, "expert_parallel: zero3 is data parallel"),
        ({"sequence_parallel_size": 2}, "sequence_parallel_size: zero3 is data parallel"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "both bf16 and bfloat16"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype 'bf16' conflicts"),
        (
            {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "bf16"}},
            "reduces and accumulates gradients in one dtype",
        ),
    ],
)
def test_what_zero3_cannot_run_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        Zero3Config.from_deepspeed({**_zero(), **config})


def test_precision_and_reduction_dtypes():
    c = Zero3Config.from_deepspeed({**_zero(), "communication_data_type": "FP32"})
    assert c.reduce_dtype is torch.float32
    c = Zero3Config.from_deepspeed({**_zero(), "data_types": {"grad_accum_dtype": "fp32"}})
    assert c.reduce_dtype is torch.float32
    c = Zero3Config.from_deepspeed(
        {**_zero(), "bfloat16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}
    )
    assert c.param_dtype is torch.bfloat16


def test_auto_resolves_to_deepspeeds_defaults_everywhere():
    c = Zero3Config.from_deepspeed(
        _zero(overlap_comm="auto", contiguous_gradients="auto", leaf_module="auto")
    )
    assert c.overlap_comm and c.contiguous_gradients and c.leaf_modules == ()


def test_the_docs_table_lists_every_key():
    docs = Path(__file__).resolve().parents[3] / "docs" / "configuration.rst"
    if not docs.exists():
        pytest.skip("not run from a source checkout")
    text = docs.read_text()
    table = text[text.index(".. _deepspeed-config:") : text.index("Flags of the training job")]
    missing = [
        key if section in ("", "zero_optimization") else f"{section}.{key}"
        for section, keys in known_keys().items()
        for key in keys
    ]
    assert [key for key in missing if f"``{key}``" not in table] == []
