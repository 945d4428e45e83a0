"""Models that are never whole on any rank: empty_init + shard_module(checkpoint= / init).

Checkpoints are written by transformers' own save_pretrained (several files and an
index); results are compared with from_pretrained in one process, and training with one
process started from the same weights.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from torch import nn

from zero3.comm import GlooBackend
from zero3.core import Zero3Config, estimate_model_states
from zero3.hooks import empty_init, full_state_dict, memory_stats, shard_module, stats
from zero3.optim import PartitionedOptimizer
from zero3.testing.models import TinyGPT, loss_of, token_batch, train_beside

pytestmark = pytest.mark.multirank

LOCAL = 2
STEPS = 3
HF_CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _param_diff(full: dict[str, torch.Tensor], reference: nn.Module) -> float:
    """Largest elementwise excess over a relative tolerance of 1e-3 (AdamW's first steps
    turn fp32 reduction-order noise in the gradients into noise of about the lr)."""
    return max(
        ((full[k] - v).abs() - 1e-3 * v.abs()).max().item()
        for k, v in reference.state_dict().items()
    )


def _train_both(model: nn.Module, reference: nn.Module, batch: Any, comm: Any) -> dict[str, Any]:
    """STEPS AdamW steps of the sharded model (this rank's rows) and of the reference
    (the whole batch); the loss differences and the final weight difference."""
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    diffs = train_beside(model, opt, reference, ropt, batch, comm, STEPS, LOCAL, batch.loss)
    return {
        "loss_diff": max(diffs),
        "param_diff": _param_diff(full_state_dict(model), reference),
        "gathers": stats(model).gathers,
        "reductions": stats(model).reduce_collectives,
    }


class _TokenBatch:
    """Token batches and a loss for a model returning logits (or an HF output)."""

    def __init__(self, vocab: int, seq: int) -> None:
        self.make = token_batch(vocab, seq)

    def __call__(self, batch: int, seed: int) -> torch.Tensor:
        return self.make(batch, seed)

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return loss_of(getattr(out, "logits", out))


# -- transformers checkpoints ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Llama and GPT-2 (tied embeddings) written by save_pretrained into >= 3 files."""
    pytest.importorskip("transformers")
    from zero3.testing.hf_models import build_hf

    dirs = {}
    for name in HF_CLASSES:
        path = tmp_path_factory.mktemp(name)
        build_hf(name, seed=3).save_pretrained(path, max_shard_size="20KB")
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
        dirs[name] = str(path)
    return dirs


def _hf_from_checkpoint(name: str, path: str) -> dict[str, Any]:
    import transformers

    from zero3.testing.hf_models import SEQ, VOCAB

    transformers.logging.set_verbosity_error()
    comm = GlooBackend(timeout_s=60)
    n, r = comm.world_size, comm.rank
    cls = getattr(transformers, HF_CLASSES[name])
    reference = cls.from_pretrained(path).train()
    with empty_init():
        model = cls(reference.config)
    on_meta = all(p.is_meta for p in model.parameters())
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm, checkpoint=path)
    batch = _TokenBatch(VOCAB, SEQ)
    x = batch(LOCAL * n, 99)[r * LOCAL : (r + 1) * LOCAL]
    with torch.no_grad():
        logits = model(input_ids=x).logits
        ref_logits = reference(input_ids=x).logits
    result = _train_both(model, reference, batch, comm)
    result.update(
        on_meta=on_meta,
        logits_diff=(logits - ref_logits).abs().max().item(),
        tied=name != "gpt2" or model.lm_head.weight is model.transformer.wte.weight,
    )
    return result


@pytest.mark.transformers
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(HF_CLASSES))
def test_hf_checkpoint_equals_from_pretrained(worker_pool, hf_dirs, name, world_size):
    results = worker_pool(world_size).run(_hf_from_checkpoint, name, hf_dirs[name], timeout=300)
    for result in results:
        assert result["on_meta"] and result["tied"], result
        assert result["logits_diff"] == 0.0, result
        assert result["loss_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-4, result
        assert result["gathers"] > 0 and result["reductions"] > 0


def _bf16_file_into_fp32(path: str) -> dict[str, Any]:
    import transformers
    from safetensors.torch import save_file

    transformers.logging.set_verbosity_error()
    comm = GlooBackend(timeout_s=60)
    reference = transformers.LlamaForCausalLM.from_pretrained(path)
    file = f"{path}/bf16-{comm.rank}.safetensors"  # one per rank: no write race
    save_file({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}, file)
    with empty_init():
        model = transformers.LlamaForCausalLM(reference.config)
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm, checkpoint=file)
    full = full_state_dict(model)
    expected = {k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()}
    return {
        "dtypes": {str(v.dtype) for v in full.values()},
        "exact": all(torch.equal(full[k], v) for k, v in expected.items()),
    }


@pytest.mark.transformers
def test_bf16_checkpoint_is_cast_to_the_parameter_dtype(worker_pool, hf_dirs):
    for result in worker_pool(2).run(_bf16_file_into_fp32, hf_dirs["llama"], timeout=300):
        assert result == {"dtypes": {"torch.float32"}, "exact": True}


def _mixtral_refused(path: str) -> str:
    import transformers

    transformers.logging.set_verbosity_error()
    with empty_init():
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig.from_pretrained(path))
    try:
        shard_module(model, Zero3Config(), comm=GlooBackend(timeout_s=60), checkpoint=path)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.transformers
def test_mixtral_checkpoint_layout_is_refused_clearly(worker_pool, tmp_path):
    pytest.importorskip("transformers")
    from zero3.testing.hf_models import build_hf

    build_hf("mixtral").save_pretrained(tmp_path, max_shard_size="20KB")
    # At world 2, whose pool the other transformers tests keep warm (a pool of its own
    # costs a process start and a transformers import): every rank refuses it.
    for message in worker_pool(2).run(_mixtral_refused, str(tmp_path), timeout=300):
        assert "transformers converts 'mixtral' checkpoints" in message
        assert "missing (6)" in message and "block_sparse_moe.experts.0.w1.weight" in message


# -- meta + reset_parameters ----------------------------------------------------------------


class _WithAttention(nn.Module):
    """Untied; nn.MultiheadAttention's _reset_parameters writes its child's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(61, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 61)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * self.scale
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(self.norm(h))


MODELS = {"tied_gpt": TinyGPT, "attention": _WithAttention}


def _meta_reset(model_name: str) -> dict[str, Any]:
    comm = GlooBackend(timeout_s=60)
    cls = MODELS[model_name]
    torch.manual_seed(comm.rank)  # different draws on every rank: rank 0's must win
    with empty_init():
        model = cls()
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    full = full_state_dict(model)
    torch.manual_seed(0)
    eager = cls()
    reference = cls()
    reference.load_state_dict(full)
    result = _train_both(model, reference, _TokenBatch(61, 16), comm)
    result["full"] = full
    result["equals_eager_seed0"] = all(
        torch.equal(full[k], v) for k, v in eager.state_dict().items()
    )
    return result


@pytest.mark.parametrize("model_name", list(MODELS))
def test_meta_reset_parameters_consistent_and_trains_as_one_process(worker_pool, model_name):
    results = worker_pool(2).run(_meta_reset, model_name)
    for result in results:
        assert result["loss_diff"] < 1e-5, result
        assert result["param_diff"] < 1e-4, result
        assert result["gathers"] > 0 and result["reductions"] > 0
    first, second = results[0]["full"], results[1]["full"]
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    if model_name == "attention":
        # Children first, as in eager construction: bitwise rank 0's eager build.
        assert results[0]["equals_eager_seed0"]
        assert torch.equal(first["mha.out_proj.bias"], torch.zeros(16))


def _transformers_param_init_fn() -> dict[str, Any]:
    import transformers

    from zero3.testing.hf_models import HF_MODELS

    transformers.logging.set_verbosity_error()
    comm = GlooBackend(timeout_s=60)
    config = HF_MODELS["gpt2"]().config
    with empty_init():
        model = transformers.GPT2LMHeadModel(config)
    shard_module(
        model,
        Zero3Config(param_persistence_threshold=0),
        comm=comm,
        param_init_fn=model._init_weights,
    )
    full = full_state_dict(model)
    return {
        "c_proj": full["transformer.h.0.attn.c_proj.weight"].std().item(),
        "c_attn": full["transformer.h.0.attn.c_attn.weight"].std().item(),
        "ln": torch.equal(full["transformer.h.0.ln_1.weight"], torch.ones(32)),
        "checksum": sum(v.double().sum().item() for v in full.values()),
    }


@pytest.mark.transformers
def test_transformers_init_weights_runs_parent_initialisers_last(worker_pool):
    results = worker_pool(2).run(_transformers_param_init_fn, timeout=300)
    assert results[0]["checksum"] == results[1]["checksum"]
    # GPT-2's attention block rescales its child's c_proj after the child's own init.
    std = 0.02 / (2 * 2) ** 0.5
    assert results[0]["c_proj"] == pytest.approx(std, rel=0.15)
    assert results[0]["c_attn"] == pytest.approx(0.02, rel=0.15)
    assert results[0]["ln"]


# -- errors, raised on every rank -----------------------------------------------------------


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))  # nothing initialises it


class _MetaBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def _error_of(case: str, path: str) -> str:
    comm = GlooBackend(timeout_s=30)
    config = Zero3Config(param_persistence_threshold=0)
    try:
        if case == "keys":
            with empty_init():
                model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
            shard_module(model, config, comm=comm, checkpoint=path)
        elif case == "uninitialised":
            with empty_init():
                model = _NoInit()
            shard_module(model, config, comm=comm)
        elif case == "meta_buffer":
            with torch.device("meta"):
                model = _MetaBuffer()
            shard_module(model, config, comm=comm)
        elif case == "divergent":
            torch.manual_seed(comm.rank)
            with empty_init():
                model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
            shard_module(
                model,
                Zero3Config(param_persistence_threshold=0, sync_module_states=False),
                comm=comm,
            )
        elif case == "one_rank_bad_path":
            with empty_init():
                model = nn.Linear(4, 8)
            where = path if comm.rank == 0 else path + ".missing"
            shard_module(model, config, comm=comm, checkpoint=where)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture(scope="module")
def mismatched_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Weights for ``Sequential(Linear(4, 8), Linear(8, 2))`` with three kinds of mistake."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("ckpt") / "weights.safetensors"
    save_file(
        {
            "0.weight": torch.zeros(8, 4),
            "0.bias": torch.zeros(7),  # shape mismatch
            "1.weight": torch.zeros(2, 8),  # 1.bias missing
            "2.weight": torch.zeros(2, 2),  # unexpected
        },
        str(path),
    )
    return str(path)


def test_checkpoint_key_problems_reported_together_on_every_rank(worker_pool, mismatched_file):
    for message in worker_pool(2).run(_error_of, "keys", mismatched_file):
        assert message.startswith("ValueError"), message
        assert "missing (1): '1.bias'" in message
        assert "unexpected (1): '2.weight'" in message
        assert "shape mismatch (1): '0.bias': checkpoint (7,), model (8,)" in message


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("uninitialised", "nothing initialises (1): 'gain' (_NoInit)"),
        ("meta_buffer", "buffers on the meta device that nothing provides (1): 'table'"),
        ("divergent", "parameters that differ between ranks (2): '0.weight', '0.bias'"),
    ],
)
def test_initialisation_errors_name_the_tensor_on_every_rank(worker_pool, case, expected):
    for message in worker_pool(2).run(_error_of, case, ""):
        assert message.startswith("ValueError"), message
        assert expected in message, message


def test_a_rank_that_cannot_open_the_checkpoint_fails_every_rank(worker_pool, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}, str(path))
    first, second = worker_pool(2).run(_error_of, "one_rank_bad_path", str(path))
    assert first.startswith("RuntimeError: zero3: rank(s) [1] could not prepare"), first
    assert second.startswith("FileNotFoundError") and ".missing" in second, second


# -- memory in the API ----------------------------------------------------------------------


def _memory_after_a_step() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=60)
    with empty_init():
        model = TinyGPT()
    estimate = estimate_model_states(
        model, comm.world_size, config=Zero3Config(param_persistence_threshold=0)
    )
    shard_module(model, Zero3Config(param_persistence_threshold=0), comm=comm)
    opt = PartitionedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = token_batch(61, 16)(LOCAL, comm.rank)
    loss_of(model(x)).backward()
    opt.step()
    between = memory_stats(model, opt)
    assert between.grad_bytes == 0  # the window is over: its buffer went
    # The second backward: optimizer state and gradient shards both held (the estimate's
    # moment; between windows the gradient buffer is freed).
    loss_of(model(x)).backward()
    measured = memory_stats(model, opt)
    assert between.peak_held_bytes == measured.held_bytes == measured.peak_held_bytes
    return {"measured": measured, "estimate": estimate, "step": stats(model)}


def test_memory_stats_match_the_estimate(worker_pool):
    for result in worker_pool(2).run(_memory_after_a_step):
        measured, estimate = result["measured"], result["estimate"]
        # stats() carries the same figures, finding the optimizer by itself.
        step = result["step"]
        assert step.memory is not None and step.gathers > 0
        assert step.memory.held_bytes == measured.held_bytes
        assert step.memory.optimizer_bytes == measured.optimizer_bytes > 0
        assert measured.param_bytes == estimate.param_bytes
        assert measured.master_bytes == estimate.master_bytes == 0  # fp32: shards are masters
        assert measured.grad_bytes >= estimate.grad_bytes  # bucket alignment may pad
        assert measured.grad_bytes - estimate.grad_bytes < 64 * 4 * len(
            list(TinyGPT().parameters())
        )
        # AdamW: two fp32 moments per local element plus a step counter per tensor.
        assert 0 <= measured.optimizer_bytes - estimate.optimizer_bytes <= 8 * 4 * 40
        psi = measured.numel
        assert estimate.unsharded_bytes == 16 * psi
        assert measured.unsharded_bytes == pytest.approx(16 * psi, rel=0.01)
        assert measured.held_fraction == pytest.approx(0.5, abs=0.02)
        assert measured.peak_gathered_bytes > 0 and measured.peak_rss_bytes > 0


def _pool_in_the_first_forward() -> dict[str, Any]:
    comm = GlooBackend(timeout_s=60)
    # Twelve layers of twelve different shapes (8.7 MB in all): no released storage fits
    # a later gather, so whatever the pool may keep in the first step it keeps.
    widths = [256 + 32 * i for i in range(13)]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    largest = max(p.numel() * 4 for p in model.parameters())
    shard_module(
        model,
        Zero3Config(
            param_persistence_threshold=0,
            max_reuse_distance=0,
            prefetch_bucket_size=8_000,
            max_live_parameters=16_000,
        ),
        comm=comm,
    )
    with torch.no_grad():
        model(torch.randn(2, widths[0]))
    memory = memory_stats(model)
    return {
        "pool": memory.pool_bytes,
        "model": memory.numel * 4,
        "largest": largest,
        "gathers": stats(model).gathers,
    }


def test_the_pool_keeps_what_the_config_allows_gathered_in_the_first_step(worker_pool):
    # Before the first step has measured its working set, the pool's limit comes from what
    # the config lets be gathered at once (here one layer: each is larger than
    # max_live_parameters plus a prefetch bucket), not from the model, whose every
    # released storage it would keep.
    for result in worker_pool(2).run(_pool_in_the_first_forward):
        assert result["gathers"] >= 12
        peak = result["largest"] + 4096  # padding to the world size, at most
        limit = 2 * peak + peak // 2 + 2**20
        assert limit < result["model"]  # the old limit would not be tested
        assert 0 < result["pool"] <= limit, result
