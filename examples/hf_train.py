"""Fine-tune a small GPT-2 on the bundled Shakespeare corpus with zero3's Trainer.

A script to copy: the transformers Trainer you know, on zero3's ZeRO-3 sharding instead
of DeepSpeed. No network: the model is built from a config and the tokenizer is the
corpus's characters. Run it under torchrun::

    ./dev run torchrun --standalone --nproc-per-node 2 examples/hf_train.py --steps 50

Add ``--deepspeed-config ds.json`` to use a DeepSpeed ZeRO-3 JSON as you would with
``TrainingArguments(deepspeed=...)`` ("auto" values are filled from the arguments).
It ends with ``trainer.save_model`` (consolidated safetensors), reloads the result with
``from_pretrained`` on rank 0 and prints a sample. ``--init-from DIR`` starts from such
weights, sharded as they are read (no rank holds the whole model).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero3.core import Zero3Config
from zero3.hf import Zero3Trainer, sharded_from_pretrained

#: The main job's corpus (tools/data/: Shakespeare's tragedies, public domain).
CORPUS = Path(__file__).resolve().parents[1] / "tools" / "data" / "shakespeare.txt"


class CharWindows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of character ids (GPT-2 shifts the labels itself)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.windows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sample")
    p.add_argument(
        "--batch", type=int, default=8, help="samples per rank per micro-step"
    )
    p.add_argument("--accumulation", type=int, default=2, help="micro-steps per step")
    p.add_argument(
        "--eval-samples", type=int, default=256, help="held-out windows to evaluate"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--output", default="hf_train_out", help="output directory")
    p.add_argument(
        "--deepspeed-config",
        default=None,
        help="a DeepSpeed ZeRO-3 JSON to read instead of zero3's defaults",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 masters")
    p.add_argument(
        "--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)"
    )
    p.add_argument(
        "--resume", default=None, help="a checkpoint-N folder to resume from"
    )
    p.add_argument(
        "--init-from", default=None, help="start from a save_model directory"
    )
    return p.parse_args()


def main() -> None:
    a = parse()
    text = CORPUS.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}  # the tokenizer: one id per character
    ids = torch.tensor([index[c] for c in text])
    split = int(ids.numel() * 0.95)
    train, held_out = (
        CharWindows(ids[:split], a.seq_len),
        CharWindows(ids[split:], a.seq_len),
    )
    held_out = torch.utils.data.Subset(
        held_out, range(min(len(held_out), a.eval_samples))
    )

    args = TrainingArguments(
        output_dir=a.output,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation,
        learning_rate=a.lr,
        weight_decay=0.1,
        warmup_steps=max(1, a.steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        bf16=a.bf16,
        logging_steps=max(1, a.steps // 10),
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    zero3_config = a.deepspeed_config or Zero3Config()
    if a.init_from:  # from_pretrained, sharded: each rank reads only its own slices
        model = sharded_from_pretrained(
            a.init_from, GPT2LMHeadModel, zero3_config=zero3_config, args=args
        )
        zero3_config = None  # the model is sharded already, with its own config
    else:
        # Every rank builds the same model (zero3 syncs rank 0's too).
        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(chars),
                n_positions=a.seq_len,
                n_embd=a.d_model,
                n_layer=a.layers,
                n_head=a.heads,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    trainer = Zero3Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        zero3_config=zero3_config,
    )
    trainer.train(resume_from_checkpoint=a.resume)
    loss = trainer.evaluate()["eval_loss"]
    final = Path(a.output) / "final"
    # Every rank takes part; no rank holds the whole model.
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        print(
            f"held-out loss {loss:.3f} (perplexity {math.exp(loss):.2f}); saved {final}"
        )
        reloaded = GPT2LMHeadModel.from_pretrained(final)
        # Id 0, the model's eos_token_id, is "\n": without this, generate would stop at
        # the end of the first line. A sample of several lines runs to its length.
        reloaded.generation_config.eos_token_id = None
        prompt = torch.tensor([[index[c] for c in "ROMEO:\n"]])
        room = min(200, a.seq_len - prompt.shape[1])  # positions the model has
        torch.manual_seed(0)
        out = reloaded.generate(
            prompt,
            max_new_tokens=room,
            do_sample=True,
            temperature=0.8,
            top_k=0,
            pad_token_id=0,
        )
        sample = "".join(chars[i] for i in out[0].tolist())
        print(
            f"--- sample ({len(sample)} characters) ---\n{sample}\n"
            "--- end of sample ---"
        )
    # accelerate made the default process group (zero3 destroys only the groups it
    # made): destroy it while Python is whole, as accelerate asks every script to.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
