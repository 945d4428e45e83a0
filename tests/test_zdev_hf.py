"""The transformers Trainer (``zero3.hf.Zero3Trainer``) on the zdev device, at world 2.

accelerate does not know zdev; ``ACCELERATE_TORCH_DEVICE=zdev:<local rank>`` is its own
way to name a device it does not know, and the Trainer then puts the model and every
batch there. The run on zdev is compared, micro-step by micro-step and in the final
weights, with the same Trainer on the host over gloo (which tests/test_hf_trainer.py
compares with the stock Trainer under DDP).

The Trainer's own bookkeeping collectives (the loss it logs, token counts across ranks,
the FLOP count at the end) go through torch.distributed's default group, which serves
zdev tensors nowhere (on a GPU, NCCL's default group does): the run turns logging and
token averaging off, and a test-only subclass skips the FLOP count. zero3's own
collectives all run through the zdev backend.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.device,
    pytest.mark.multirank,
    pytest.mark.transformers,
    pytest.mark.timeout(300),
]


def _train(out: str, where: str) -> dict[str, Any]:
    from accelerate.state import AcceleratorState

    from zero3.core import Zero3Config
    from zero3.hf import Zero3Trainer
    from zero3.hooks import full_state_dict, stats
    from zero3.testing.hf_models import build_hf, lm_rows, trainer_arguments

    class RecordingTrainer(Zero3Trainer):  # type: ignore[misc]
        """Records each micro-step's loss; skips the FLOP count (see the module note)."""

        losses: list[float]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(float(loss.detach()))
            return loss

        def store_flos(self) -> None:
            pass

    AcceleratorState._reset_state(True)  # accelerate keeps its device per process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")  # accelerate asks
    if where == "zdev":
        os.environ["ACCELERATE_TORCH_DEVICE"] = f"zdev:{os.environ['LOCAL_RANK']}"
    args = trainer_arguments(
        f"{out}/{where}-{os.environ['RANK']}",
        max_steps=3,
        logging_strategy="no",
        average_tokens_across_devices=False,
    )
    config = Zero3Config(
        backend="zdev" if where == "zdev" else "gloo",
        param_persistence_threshold=0,
        overlap_comm=True,
        overlap_chunk_size=2000,
    )
    trainer = RecordingTrainer(
        model=build_hf("llama"), args=args, train_dataset=lm_rows(32, 1), zero3_config=config
    )
    trainer.losses = []
    trainer.train()
    return {
        "losses": trainer.losses,
        "device": str(next(trainer.model.parameters()).device),
        "reductions": stats(trainer.model).reduce_collectives,
        "weights": full_state_dict(trainer.model),
    }


def _both(out: str) -> dict[str, Any]:
    host = _train(out, "cpu")
    zdev = _train(out, "zdev")
    worst = max(float((host["weights"][k] - v).abs().max()) for k, v in zdev["weights"].items())
    return {"host": {k: v for k, v in host.items() if k != "weights"}, "zdev": zdev, "worst": worst}


def test_zero3_trainer_on_zdev_matches_the_host_run(zdev_pool, tmp_path):
    pytest.importorskip("transformers")
    for rank, result in enumerate(zdev_pool(2).run(_both, str(tmp_path), timeout=280)):
        host, zdev = result["host"], result["zdev"]
        assert zdev["device"] == f"zdev:{rank}" and host["device"] == "cpu", result
        assert zdev["reductions"] > 1, result
        assert len(zdev["losses"]) == 6 == len(host["losses"]), result  # 3 steps x 2 micro
        diffs = [abs(a - b) for a, b in zip(zdev["losses"], host["losses"], strict=True)]
        assert max(diffs) < 1e-5, (diffs, result)
        assert result["worst"] < 1e-5, result
        assert isinstance(zdev["weights"]["model.embed_tokens.weight"], torch.Tensor)
