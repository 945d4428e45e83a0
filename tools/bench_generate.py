"""Generation on a sharded model at world 2: tokens/s against the same model unsharded.

    .venv/bin/python tools/bench_generate.py                 # the three models, 5 rounds
    .venv/bin/python tools/bench_generate.py --models gpt2 --rounds 9 --tokens 24

Per model, in the same processes and interleaved round by round: plain PyTorch (an
unsharded copy), ``generate`` inside ``zero3.hooks.unsharded``, the sharded model with no
context (transformers' ``generate``: zero3's own block bounded by the reuse window; the
benchmark GPT has no ``generate``, so its loop runs a forward per token through the
hooks), and, for transformers models, the per-token hook path that generate took before
(every module gathered and released for each token). A rate is the world's: every rank's
tokens over the slowest rank's time. The ratios are medians of per-round ratios (this
machine is shared: absolute figures move between rounds, ratios much less).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench.workload import GPT, Workload
from _train.launch import free_port, rank_env

MODELS = ["bench-gpt", "gpt2", "llama"]


class LogitsGPT(GPT):
    """The benchmark GPT returning next-token logits (generation needs no targets)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, -1:]))[:, -1]


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding without a cache (the benchmark GPT has none)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(tokens):
            seq = torch.cat([seq, model(seq).argmax(-1, keepdim=True)], dim=1)
    return seq


def _build(name: str) -> torch.nn.Module:
    if name == "bench-gpt":
        torch.manual_seed(0)
        return LogitsGPT(Workload())
    from zero3.testing.hf_models import build_hf

    model = build_hf(name)
    model.config.use_cache = True
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _runners(name: str, model: Any, reference: Any, prompt: torch.Tensor, tokens: int) -> dict:
    from zero3.hooks import unsharded

    if name == "bench-gpt":

        def gen(m: Any) -> Any:
            return _greedy(m, prompt, tokens)
    else:
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

        def gen(m: Any) -> Any:
            return m.generate(prompt, **kwargs)

    def inside() -> Any:
        with unsharded(model):
            return gen(model)

    runners = {
        "plain": lambda: gen(reference),
        "unsharded": inside,
        "no context": lambda: gen(model),
    }
    if name != "bench-gpt":
        base = type(model).__mro__[3]  # the model's own class, under zero3's mixins

        def hooks() -> Any:  # generate as it ran before zero3's own: a gather per module
            return base.generate(model, prompt, synced_gpus=True, **kwargs)

        runners["hook path"] = hooks
    return runners


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from zero3.core import Zero3Config
    from zero3.hooks import shard_module

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    for name in args.models.split(","):
        model = _build(name)
        reference = copy.deepcopy(model)
        shard_module(model, Zero3Config(param_persistence_threshold=0, backend="gloo"))
        vocab = 64 if name != "bench-gpt" else Workload().vocab
        g = torch.Generator().manual_seed(dist.get_rank())
        prompt = torch.randint(1, vocab, (args.batch, 8), generator=g)
        runners = _runners(name, model, reference, prompt, args.tokens)
        rates: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(args.rounds):
            for key, fn in runners.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                rates[key].append(world * args.batch * args.tokens / elapsed.item())
        plain = rates["plain"]
        results[name] = {
            key: {
                "tokens_per_s": statistics.median(r),
                "ratio": statistics.median(a / b for a, b in zip(r, plain, strict=True)),
            }
            for key, r in rates.items()
        }
    if dist.get_rank() == 0:
        print("BENCH_RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    # The tiny transformers models hold 32 positions: 8 prompt tokens and at most 24 new.
    p.add_argument("--tokens", type=int, default=20, help="new tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    port = free_port()
    cmd = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    procs = [
        subprocess.Popen(
            cmd, env=rank_env(r, args.world, port, args.threads), stdout=subprocess.PIPE, text=True
        )
        for r in range(args.world)
    ]
    outs = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        sys.exit("a rank failed (its stderr is above)")
    line = next(x for x in outs[0].splitlines() if x.startswith("BENCH_RESULT "))
    results = json.loads(line.removeprefix("BENCH_RESULT "))
    print(
        f"world {args.world}, {args.batch} sequences x {args.tokens} new tokens per rank, "
        f"{args.rounds} rounds, {args.threads} thread(s) per rank, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print("| model | plain tokens/s | inside unsharded | no context | hook path |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        cells = [f"{rows['plain']['tokens_per_s']:.0f}"]
        for key in ("unsharded", "no context", "hook path"):
            row = rows.get(key)
            cells.append("-" if row is None else f"{row['tokens_per_s']:.0f} ({row['ratio']:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
