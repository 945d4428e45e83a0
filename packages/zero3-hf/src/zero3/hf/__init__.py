"""zero3.hf: the transformers Trainer on zero3 — DeepSpeed's ZeRO-3 path, without DeepSpeed.

::

    from zero3.hf import Zero3Trainer

    trainer = Zero3Trainer(
        model=model,
        args=TrainingArguments(output_dir="out", bf16=True, gradient_accumulation_steps=2),
        train_dataset=dataset,
        zero3_config="ds_config.json",  # a DeepSpeed ZeRO-3 JSON ("auto" filled), or a Zero3Config
    )
    trainer.train()
    trainer.save_model("out/final")  # consolidated safetensors: from_pretrained("out/final")

Run it under a launcher, e.g. ``./dev run torchrun --nproc-per-node N script.py`` in this
repository (``./dev run`` runs a command inside its environment).
"""

from zero3.hf._args import Zero3TrainingArguments
from zero3.hf._config import Zero3ConfigLike
from zero3.hf._pretrained import sharded_from_pretrained
from zero3.hf._trainer import Zero3Trainer
from zero3.hf._trl import zero3_trainer

__all__ = [
    "Zero3ConfigLike",
    "Zero3Trainer",
    "Zero3TrainingArguments",
    "sharded_from_pretrained",
    "zero3_trainer",
]
