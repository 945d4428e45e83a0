"""zero3's main job: train a small GPT on Shakespeare with every state sharded.

    ./dev train                                          # one rank per core (2 here)
    ./dev train --steps 200 --dtype bf16 --trace trace.json --plot loss.png
    ./dev train --init empty --layers 12 --d-model 1024  # never whole on any rank
    ./dev train --from weights/                          # safetensors weights, sliced
    ./dev run torchrun --standalone --nproc-per-node 2 tools/train.py
    ./dev run mpiexec -n 2 python tools/train.py         # the mpi backend

Run with --help for every flag. The corpus (Shakespeare's tragedies, public domain)
ships in tools/data/.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn.functional as F
from _train import launch, report
from _train.data import CharCorpus
from _train.model import GPT, GPTConfig, sample
from _train.progress import Progress
from _train.settings import Settings, launcher_settings, lr_lambda, parser, rank_settings

from zero3.comm import CommBackend, ReduceOp, create_backend, launched_by_mpi, launched_by_torch
from zero3.core import CheckpointError, estimate_model_states, gathered_parameters
from zero3.core.engine import CheckpointReader, Tracer, sharded_state
from zero3.hooks import empty_init, shard_module, stats
from zero3.optim import OffloadStats, PartitionedOptimizer, load_checkpoint, save_checkpoint


def main(argv: list[str] | None = None) -> int:
    """Parse flags, then launch ranks or act as one."""
    args = parser().parse_args(argv)
    if not (launched_by_torch() or launched_by_mpi()):
        nproc = args.nproc or min(4, launch.usable_cores())
        if nproc < 1:
            parser().error(f"--nproc must be >= 1, got {nproc}")
        try:  # fail once, here, rather than once per rank
            _preflight(args, nproc)
        except (ValueError, TypeError, LookupError, RuntimeError, CheckpointError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"zero3: launching {nproc} local ranks (torchrun-style env, gloo rendezvous)")
        return launch.self_launch(nproc, [str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
    if launched_by_mpi() and not launched_by_torch() and args.backend not in ("auto", "mpi"):
        launch.bootstrap_torch_env_from_mpi()
    try:
        code = train(args)
    except (ValueError, TypeError, LookupError, RuntimeError, CheckpointError) as exc:
        rank = os.environ.get("RANK", os.environ.get("PMI_RANK", "?"))
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        code = 2
    return code


def _preflight(args: object, nproc: int) -> None:
    """Check flags, config, model shape and backend before starting any rank."""
    from zero3.comm import backend_class

    launcher_settings(args, nproc)  # type: ignore[arg-type]  # the config's notes, once
    if args.resume is not None:  # type: ignore[attr-defined]
        CheckpointReader(args.resume)  # type: ignore[attr-defined]  # exists, finished, zero3's
    GPTConfig(CharCorpus().vocab_size, args.layers, args.d_model, args.heads, args.seq_len)  # type: ignore[attr-defined]
    weights = args.from_weights  # type: ignore[attr-defined]
    if weights is not None and not weights.exists():
        raise ValueError(f"--from {weights}: no such file or directory")
    if args.backend != "auto":  # "auto" is resolved by each rank on its own device
        backend_class(args.backend)


def _mean_and_max(comm: CommBackend, value: float, seconds: float) -> tuple[float, float]:
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, op=ReduceOp.SUM).wait()
    s = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(s, op=ReduceOp.MAX).wait()
    return float(t) / comm.world_size, float(s)


def train(args: object) -> int:
    """One rank's whole run."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    comm = create_backend(args.backend, timeout_s=300)
    settings = rank_settings(args, comm.world_size)  # type: ignore[arg-type]
    comm.timeout_s = settings.config.timeout_s  # the config's timeout bounds every wait
    rank, world = comm.rank, comm.world_size
    corpus = CharCorpus()
    shape = GPTConfig(corpus.vocab_size, args.layers, args.d_model, args.heads, args.seq_len)  # type: ignore[attr-defined]
    comm.barrier().wait()
    baseline = report.rss_baseline()  # before the model: interpreter, torch, backend
    model, estimate = _build(args, settings, comm, shape)
    opt = PartitionedOptimizer(model, settings.optimizer, **settings.optimizer_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(settings, args.warmup))  # type: ignore[attr-defined]
    if rank == 0:
        _print_setup(comm, settings, model)
    start = _resume(args, comm, settings, model, opt, scheduler)
    losses, times, swaps = _loop(args, comm, settings, corpus, model, opt, scheduler, start)
    tracer, sharded_state(model).tracer = sharded_state(model).tracer, None  # not the samples
    metrics = report.rank_metrics(model, opt, stats(model), times, baseline, swaps)
    rows = report.gather_rows(comm, metrics)
    tokens = settings.batch * settings.accumulation * world * shape.seq_len
    if rank == 0:
        print(report.format_summary(rows, model, settings.config, tokens, estimate))
    _samples(args, comm, corpus, model, shape)
    _outputs(args, comm, tracer, losses, times)
    for future in _SAVES:
        future.result()  # an async save's failure surfaces here
    comm.barrier().wait()
    # Free the model (its gradient group with it), then the default group, while the
    # interpreter is whole: gloo groups finalized at exit can abort a finished run.
    del model, opt, scheduler
    gc.collect()
    comm.close()
    return 0


def _build(
    args: object, settings: Settings, comm: CommBackend, shape: GPTConfig
) -> tuple[torch.nn.Module, int]:
    """The sharded model, built as ``--init`` / ``--from`` say, and the model-state bytes
    per rank ``estimate_model_states`` predicts for it (asked before it is built)."""
    torch.manual_seed(settings.seed)
    weights = args.from_weights  # type: ignore[attr-defined]
    if weights is None and args.init == "eager":  # type: ignore[attr-defined]
        model = GPT(shape)
    else:
        with empty_init():
            model = GPT(shape)
    estimate = estimate_model_states(
        model, comm.world_size, optimizer=_optimizer_name(settings), config=settings.config
    )
    if weights is not None:
        shard_module(model, settings.config, comm=comm, checkpoint=weights)
    elif args.init == "empty":  # type: ignore[attr-defined]
        shard_module(model, settings.config, comm=comm, param_init_fn=GPT.init_weights)
    else:
        shard_module(model, settings.config, comm=comm)
    return model, estimate.per_rank_bytes


def _optimizer_name(settings: Settings) -> str:
    name = settings.optimizer.__name__.lower()
    if name == "sgd":
        return "sgd-momentum" if settings.optimizer_kwargs.get("momentum") else "sgd"
    return name


def _print_setup(comm: CommBackend, settings: Settings, model: torch.nn.Module) -> None:
    psi = sum(p.numel() for p in model.parameters())
    print(
        f"zero3: {comm.name} backend, world {comm.world_size}, GPT {psi / 1e6:.2f}M params, "
        f"{settings.dtype}, batch {settings.batch} x accumulation {settings.accumulation} per "
        f"rank, {settings.optimizer.__name__}({settings.optimizer_kwargs}), {settings.steps} steps"
    )


_SAVES: list[Future[Path]] = []


def _resume(
    args: object,
    comm: CommBackend,
    settings: Settings,
    model: torch.nn.Module,
    opt: PartitionedOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Load --resume (any world size); the step to continue from."""
    if args.resume is None:  # type: ignore[attr-defined]
        return 0
    extra = load_checkpoint(args.resume, model, opt)  # type: ignore[attr-defined]
    scheduler.load_state_dict(extra["scheduler"])
    step = int(extra["step"])
    if step >= settings.steps:
        raise ValueError(
            f"--resume {args.resume}: it is at step {step}, --steps is {settings.steps}"
        )  # type: ignore[attr-defined]
    if comm.rank == 0:
        print(f"resumed from {args.resume} at step {step}", flush=True)  # type: ignore[attr-defined]
    return step


def _checkpoint(
    args: object,
    comm: CommBackend,
    done: int,
    total: int,
    model: torch.nn.Module,
    opt: PartitionedOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Save after step ``done`` if --save asks for it (at the end, every --save-every)."""
    every = args.save_every  # type: ignore[attr-defined]
    if args.save is None or not (done == total or (every and done % every == 0)):  # type: ignore[attr-defined]
        return
    path = str(args.save).replace("{step}", str(done))  # type: ignore[attr-defined]
    extra = {"step": done, "scheduler": scheduler.state_dict()}
    future = save_checkpoint(path, model, opt, extra=extra, async_save=args.save_async)  # type: ignore[attr-defined]
    if future is not None:
        _SAVES.append(future)
    if comm.rank == 0:
        how = "saving in the background" if future is not None else "saved"
        print(f"checkpoint: {how} {path} (step {done})", flush=True)


def _loop(
    args: object,
    comm: CommBackend,
    settings: Settings,
    corpus: CharCorpus,
    model: torch.nn.Module,
    opt: PartitionedOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    start: int = 0,
) -> tuple[list[float], list[float], list[OffloadStats]]:
    rank, world = comm.rank, comm.world_size
    seq = model.cfg.seq_len  # type: ignore[union-attr]
    no_bar = bool(args.no_progress)  # type: ignore[attr-defined]
    progress = Progress(settings.steps, start, bar=not no_bar) if rank == 0 else None
    trace_from = settings.steps - args.trace_steps if args.trace else settings.steps + 1  # type: ignore[attr-defined]
    tokens = settings.batch * settings.accumulation * world * seq
    losses, times, swaps = [], [], []
    for step in range(start, settings.steps):
        if step == trace_from:
            sharded_state(model).tracer = Tracer(rank)
        start = time.perf_counter()
        total = 0.0
        for micro in range(settings.accumulation):
            x, y = corpus.batch(
                step * settings.accumulation + micro,
                rank,
                world,
                settings.batch,
                seq,
                settings.seed,
            )
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            opt.scale_loss(loss / settings.accumulation).backward()
            total += float(loss.detach()) / settings.accumulation
        opt.step()
        if opt.offload is not None:
            swaps.append(opt.offload.stats)
        opt.zero_grad()
        scheduler.step()
        mean, slowest = _mean_and_max(comm, total, time.perf_counter() - start)
        losses.append(mean)
        times.append(slowest)
        if progress is not None:
            progress.step(step + 1, mean, tokens / slowest, slowest)
        _checkpoint(args, comm, step + 1, settings.steps, model, opt, scheduler)
    if progress is not None:
        progress.close()
    return losses, times, swaps


def _samples(
    args: object, comm: CommBackend, corpus: CharCorpus, model: torch.nn.Module, shape: GPTConfig
) -> None:
    if args.samples <= 0:  # type: ignore[attr-defined]
        return
    model.eval()
    # One gather for the whole generation: every token's forward then finds the
    # parameters whole instead of gathering the model again.
    with gathered_parameters(list(model.parameters())):
        for i in range(args.samples):  # type: ignore[attr-defined]
            prompt = corpus.encode(["ROMEO:\n", "HAMLET:\n", "KING LEAR:\n"][i % 3])
            ids = sample(model, prompt, args.sample_length, shape.seq_len, seed=i)  # type: ignore[attr-defined]
            if comm.rank == 0:
                print(f"\n--- sample {i + 1} ---\n{corpus.decode(prompt)}{corpus.decode(ids)}")
    model.train()


def _outputs(
    args: object, comm: CommBackend, tracer: Tracer | None, losses: list[float], times: list[float]
) -> None:
    if args.trace is not None:  # type: ignore[attr-defined]
        import json

        mine = json.dumps(tracer.chrome_events() if tracer is not None else []).encode()
        blobs = report.gather_bytes(comm, mine)
        if comm.rank == 0:
            report.write_trace(args.trace, blobs)  # type: ignore[attr-defined]
            print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")  # type: ignore[attr-defined]
    if args.plot is not None and comm.rank == 0:  # type: ignore[attr-defined]
        report.write_plot(args.plot, losses, times)  # type: ignore[attr-defined]
        print(f"plot: {args.plot}")  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
