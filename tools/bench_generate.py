"""Generation on a sharded model at world 2: tokens/s against the same model unsharded.

    ./dev run python tools/bench_generate.py                 # the three models, 5 rounds
    ./dev run python tools/bench_generate.py --models gpt2 --rounds 9 --tokens 96

Per model, in the same processes and interleaved round by round: plain PyTorch (an
unsharded copy), ``generate`` inside an open ``zero3.hooks.unsharded`` block (the block's
own cost, one gather in and one sync out, is the last column), the sharded model with no
context (transformers' ``generate``: zero3's own block bounded by the reuse window; the
benchmark GPT has no ``generate``, so its loop runs a forward per token through the
hooks), and, for transformers models, the per-token hook path that generate took before
(every module gathered and released for each token). A rate is the world's: every rank's
tokens over the slowest rank's time. Each round times plain twice, just before and just
after the block, and every ratio of the round is against the mean of those two times, so
a load that changes during the round moves both sides alike; the ratios are medians of
the per-round ratios (this machine is shared: absolute figures move between rounds,
ratios much less). "CPU" is the same ratio for the block in CPU time of the ranks' main
threads (the slowest rank's), which other processes' load does not inflate: where the
time goes, not what the clock showed.
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
from typing import Any

import torch
from _bench.workload import Workload, gpt_config
from _train.launch import free_port, rank_env
from _train.model import GPT, gpt_forward

MODELS = ["bench-gpt", "gpt2", "llama"]


class LogitsGPT(GPT):
    """The benchmark GPT returning next-token logits (generation needs no targets)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return gpt_forward(self, idx, last_position=True)


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding without a cache (the benchmark GPT has none)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(tokens):
            seq = torch.cat([seq, model(seq).argmax(-1, keepdim=True)], dim=1)
    return seq


def _build(name: str) -> torch.nn.Module:
    """The benchmark GPT, or a tiny transformers model (zero3.testing's shapes, with room
    for 128 positions so a generation is long enough to amortise the block's one gather).
    """
    torch.manual_seed(0)
    if name == "bench-gpt":
        return LogitsGPT(gpt_config(Workload()))
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from zero3.testing.hf_models import VOCAB

    if name == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
        model = LlamaForCausalLM(config)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _runners(name: str, model: Any, reference: Any, prompt: torch.Tensor, tokens: int) -> dict:
    if name == "bench-gpt":

        def gen(m: Any) -> Any:
            return _greedy(m, prompt, tokens)
    else:
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

        def gen(m: Any) -> Any:
            return m.generate(prompt, **kwargs)

    runners = {
        "plain": lambda: gen(reference),
        "unsharded": lambda: gen(model),  # timed inside an open block (see worker)
        "no context": lambda: gen(model),
    }
    if name != "bench-gpt":
        base = type(model).__mro__[3]  # the model's own class, under zero3's mixins

        def hooks() -> Any:  # generate as it ran before zero3's own: a gather per module
            return base.generate(model, prompt, synced_gpus=True, **kwargs)

        runners["hook path"] = hooks
    return runners


def _timed(fn: Any) -> tuple[float, float]:
    """Wall and main-thread CPU seconds of the slowest rank for ``fn()`` (every rank
    starts together).
    """
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def _round(model: Any, runners: dict, unsharded: Any) -> tuple[dict, dict, float]:
    """One round: wall and CPU seconds per runner (plain: the mean of its two times,
    before and after the block) and the block's own milliseconds (in and out).
    """
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    before = _timed(runners["plain"])
    opened = time.perf_counter()
    with unsharded(model):
        wall["unsharded"], cpu["unsharded"] = _timed(runners["unsharded"])
    block_ms = (time.perf_counter() - opened - wall["unsharded"]) * 1e3
    after = _timed(runners["plain"])
    wall["plain"], cpu["plain"] = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    for key, fn in runners.items():
        if key not in wall:
            wall[key], cpu[key] = _timed(fn)
    return wall, cpu, block_ms


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from zero3.core import Zero3Config
    from zero3.hooks import shard_module, unsharded

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
        rounds = [_round(model, runners, unsharded) for _ in range(args.rounds)]
        tokens = world * args.batch * args.tokens
        results[name] = {
            "block_ms": statistics.median(b for _, _, b in rounds),
            "cpu_ratio": statistics.median(c["plain"] / c["unsharded"] for _, c, _ in rounds),
        } | {
            key: {
                "tokens_per_s": statistics.median(tokens / w[key] for w, _, _ in rounds),
                "ratio": statistics.median(w["plain"] / w[key] for w, _, _ in rounds),
            }
            for key in runners
        }
    if dist.get_rank() == 0:
        print("BENCH_RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per sequence (< 120)")
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
    print(
        "| model | plain tokens/s | inside unsharded | inside, CPU | no context | hook path "
        "| block ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        block_ms, cpu_ratio = rows.pop("block_ms"), rows.pop("cpu_ratio")
        rate = {k: f"{r['tokens_per_s']:.0f} ({r['ratio']:.2f}x)" for k, r in rows.items()}
        cells = [f"{rows['plain']['tokens_per_s']:.0f}", rate["unsharded"], f"{cpu_ratio:.2f}x"]
        cells += [rate["no context"], rate.get("hook path", "-"), f"{block_ms:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
