"""Zero3Trainer: the transformers Trainer on zero3's ZeRO-3 sharding.

Note:
    Each method overridden here answers one place where the stock Trainer (transformers
    5.24, accelerate 1.15) would go wrong on a sharded model: DDP wrapping, the
    optimizer wrapper's state round trip, clipping, rank-0-only saves, loading before the
    optimizer exists. The list, as read in their sources: :ref:`hf-stock-trainer`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    SaveStrategy,
    _is_peft_model,
    rotate_checkpoints,
)
from transformers.training_args import ParallelMode

from zero3.core import Zero3Config
from zero3.core.engine import (
    ShardedModelState,
    checkpoint_group,
    raise_on_every_rank,
    sharded_state,
    try_sharded_state,
)
from zero3.hf._args import take_deepspeed
from zero3.hf._checkpoint import restore_rng, rng_key, rng_state, scheduler_text, zero3_dir
from zero3.hf._config import (
    Zero3ConfigLike,
    args_dtype,
    check_clipping,
    filled_sections,
    resolve_config,
)
from zero3.hf._deepspeed import check_scheduler_steps
from zero3.hf._optim import Zero3AcceleratedOptimizer, build_partitioned, scale_loss_gradient
from zero3.hooks import load_full_state_dict, shard_module
from zero3.optim import (
    PartitionedOptimizer,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["Zero3Trainer"]

_log = logging.getLogger("zero3.hf")

TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"
#: Where save_model writes its DCP checkpoint before consolidating it.
_CONSOLIDATING = ".zero3-consolidating"


def _refuse_unsupported(args: TrainingArguments) -> None:
    problems = []
    if args.fsdp:
        problems.append("TrainingArguments.fsdp is set: zero3 shards the model itself")
    if args.torch_compile:
        problems.append("torch_compile=True: zero3's hooks do not run under torch.compile")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True: not supported at ZeRO-3 (nor by DeepSpeed's)")
    if getattr(args, "parallelism_config", None) is not None:
        problems.append("parallelism_config is set: zero3 is data parallel only")
    if problems:
        raise ValueError("Zero3Trainer: " + "; ".join(problems))


class Zero3Trainer(Trainer):  # type: ignore[misc]
    """The transformers ``Trainer`` running on zero3: DeepSpeed's ZeRO-3 path, without
    DeepSpeed.

    It takes the Trainer's arguments plus ``zero3_config``, shards the model (or takes
    one already sharded by ``zero3.hooks.shard_module``), builds the optimizer and
    scheduler the Trainer would build (``optim``, ``learning_rate``, ``weight_decay``
    with the Trainer's no-decay groups, ``lr_scheduler_type``, warmup) as a
    :class:`~zero3.optim.PartitionedOptimizer`, clips with ``max_grad_norm`` through
    it, and never wraps the model in DDP: zero3 reduces the gradients itself. A run
    equals the stock Trainer under DDP with the same ``TrainingArguments``.

    ``bf16=True`` / ``fp16=True`` cast the parameters (fp32 masters in the optimizer,
    fp16 loss scaling), as the DeepSpeed integration does, instead of autocast.
    Checkpoints (``save_steps``, ``save_strategy``) are DCP checkpoints in the
    Trainer's ``checkpoint-{step}`` folders that ``resume_from_checkpoint`` loads at any
    world size, beside ``config.json`` and the tokenizer (and, with the DeepSpeed
    config's ``stage3_gather_16bit_weights_on_model_save``, the consolidated weights:
    ``from_pretrained`` then loads the folder); :meth:`save_model` writes consolidated
    safetensors and ``config.json`` without gathering the model on one rank. A
    DeepSpeed config may also come as ``TrainingArguments(deepspeed=...)`` (or
    :class:`~zero3.hf.Zero3TrainingArguments` without DeepSpeed installed).

    Args:
        model: A model (sharded here, after ``torch.distributed`` is set up from
            ``args``), or a module already returned by ``zero3.hooks.shard_module``
            (then ``zero3_config`` must be None: the model's own config is used).
        args: The ``TrainingArguments``.
        *trainer_args: The Trainer's other positional arguments.
        zero3_config: A :class:`~zero3.core.Zero3Config`, or a DeepSpeed JSON config
            (path or dict) whose ``"auto"`` values are filled from ``args`` as
            transformers fills them for DeepSpeed; default: ``args.deepspeed`` if set,
            else ``Zero3Config()``.
        **trainer_kwargs: The Trainer's other keyword arguments (``optimizers`` must be
            a PartitionedOptimizer over the sharded model, if given).

    Raises:
        ValueError: FSDP, torch.compile or tensor parallelism requested; a DeepSpeed
            config given both as ``args.deepspeed`` and ``zero3_config``; a DeepSpeed
            config value that differs from its TrainingArguments value; a precision or
            clipping setting of ``zero3_config`` that contradicts ``args``.
    """

    # Set by transformers.Trainer (untyped to mypy); declared for the methods below.
    optimizer: Any
    lr_scheduler: Any
    _created_lr_scheduler: bool

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        zero3_config: Zero3ConfigLike | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        args, from_args = take_deepspeed(args)  # deepspeed="ds.json": zero3 reads it
        if from_args is not None:
            if zero3_config is not None:
                raise ValueError(
                    "Zero3Trainer: the DeepSpeed config is given twice, as "
                    "TrainingArguments.deepspeed and as zero3_config=; keep one"
                )
            zero3_config = from_args
        _refuse_unsupported(args)
        self._zero3_source = zero3_config
        #: The Zero3Config the model is sharded with.
        self.zero3_config: Zero3Config | None = None
        #: The DeepSpeed config with its "auto" values filled (None without one).
        self.deepspeed_config: dict[str, Any] | None = None
        self._resume_extra: dict[str, Any] = {}
        if args.n_gpu > 1:
            raise ValueError(
                f"Zero3Trainer: this process sees {args.n_gpu} GPUs and the Trainer would use "
                "nn.DataParallel; launch one process per GPU (torchrun --nproc-per-node N)"
            )
        _ = args.device  # sets up torch.distributed from the launcher, before sharding
        # The Trainer sets this in its constructor; the model is sharded before that.
        positional = trainer_args[9] if len(trainer_args) > 9 else None
        self.optimizer_cls_and_kwargs = trainer_kwargs.get("optimizer_cls_and_kwargs", positional)
        if model is not None:
            model = self._zero3_model(model, args)
        if trainer_args:
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        else:  # by keyword: subclasses (zero3_trainer(cls)) order their arguments otherwise
            super().__init__(model=model, args=args, **trainer_kwargs)
        if self.optimizer is not None and not isinstance(self.optimizer, PartitionedOptimizer):
            raise ValueError(
                "Zero3Trainer: optimizers=(optimizer, scheduler) must hold a "
                f"zero3.optim.PartitionedOptimizer over the sharded model, got "
                f"{type(self.optimizer).__name__} (it would step no gradient: they live in "
                "zero3's shards). Leave optimizers unset to get the Trainer's own optimizer"
            )
        if self.optimizer is not None and self.optimizer.module is not self.model:
            raise ValueError("Zero3Trainer: the PartitionedOptimizer steps another model")

    # -- the model ----------------------------------------------------------------------

    def _zero3_model(self, model: nn.Module, args: TrainingArguments) -> nn.Module:
        """Shard ``model`` (or check an already sharded one) for these arguments."""
        if getattr(model, "is_distributed_loading_by_transformers", False):
            raise ValueError(
                "Zero3Trainer: the model was sharded at load time by transformers "
                "(from_pretrained(distributed_config=...)); load it without it (or with "
                "zero3.hf.sharded_from_pretrained) so zero3 shards it"
            )
        state = _inner_state(model)
        if state is not None:
            if self._zero3_source is not None:
                raise ValueError(
                    "Zero3Trainer: the model is already sharded with its own Zero3Config; "
                    "pass zero3_config=None (or pass the unsharded model)"
                )
            check_clipping(state.config.gradient_clipping, args)
            wanted = args_dtype(args)
            if wanted is not None:
                state.convert(dtype=wanted)  # as param_dtype would (parameters only)
            self.zero3_config = state.config
            self.deepspeed_config = filled_sections(
                state.config.extras, args, model, self.optimizer_cls_and_kwargs
            )
            return model
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "Zero3Trainer: the model has parameters on the meta device; shard it first "
                "with zero3.hooks.shard_module(model, config, checkpoint=...) (or "
                "param_init_fn=model._init_weights) and pass the sharded model"
            )
        config, self.deepspeed_config = resolve_config(
            self._zero3_source, args, model, self.optimizer_cls_and_kwargs
        )
        self.zero3_config = config
        # The Trainer would move the model to its device in its constructor; the shards
        # must be made where the comm backend works (a model too large for that is built
        # sharded instead: sharded_from_pretrained).
        return shard_module(model.to(args.device), config)

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """``model.to(device)``, reaching the sharded model inside a wrapper: torch's
        ``Module.to`` on a ``PeftModel`` recurses with ``_apply``, which never calls the
        sharded module's own ``to`` and would read its released parameters.
        """
        for module in _sharded_roots(model) or [model]:
            module.to(device)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init``'s model, sharded."""
        return self._zero3_model(super().call_model_init(trial), self.args)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Accelerate without mixed precision: zero3 casts the parameters itself (the
        DeepSpeed integration's behaviour), so no autocast and no GradScaler.
        """
        accelerator_args: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        return accelerator_args

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        """Never wrapped (no DataParallel, no DDP): zero3 reduces gradients itself."""
        return model

    # -- optimizer, scheduler, the step ------------------------------------------------

    @property
    def partitioned_optimizer(self) -> PartitionedOptimizer | None:
        """The PartitionedOptimizer stepping the model (None before training)."""
        opt = self.optimizer
        if isinstance(opt, Zero3AcceleratedOptimizer):
            return opt.partitioned
        return opt if isinstance(opt, PartitionedOptimizer) else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (``optim``, its arguments, the no-decay groups) as a
        PartitionedOptimizer, wrapped for accelerate.
        """
        if self.optimizer is None:
            model = self.model
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(
                self.args, model
            )
            decay = self.get_decay_parameter_names(model)
            self.optimizer = build_partitioned(model, self.args, decay, cls, dict(kwargs))
        if isinstance(self.optimizer, PartitionedOptimizer):
            self.optimizer = Zero3AcceleratedOptimizer(self.optimizer)
        optimizer: torch.optim.Optimizer = self.optimizer
        return optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The Trainer's scheduler; a DeepSpeed config's step counts are checked first."""
        if self.lr_scheduler is None and self.deepspeed_config is not None:
            check_scheduler_steps(self.deepspeed_config, self.args, num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, Any]:
        """Optimizer and scheduler, then the checkpoint: no DDP, no ``accelerator.prepare``
        of the model (its MULTI_CPU/MULTI_GPU branch wraps it in DDP), and loading
        happens here, once the optimizer exists.
        """
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.optimizer = self.accelerator.prepare_optimizer(self.optimizer)
        self.create_scheduler(num_training_steps=max_steps)
        model = self.model
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._load_zero3_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _require_optimizer(self) -> PartitionedOptimizer:
        opt = self.partitioned_optimizer
        if opt is None:
            raise RuntimeError("Zero3Trainer: no optimizer yet (train() builds it)")
        return opt

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shards (``param.grad`` of
        a sharded model is None, so the Trainer's own clipping would see nothing).
        """
        return self._require_optimizer().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float:
        if grad_norm is None:
            grad_norm = self._require_optimizer().clip_grad_norm_(math.inf)
        return float(grad_norm)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The Trainer's loss; with fp16 parameters its gradient carries the loss scale."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        opt = self.partitioned_optimizer
        if opt is None or not opt.fp16 or not torch.is_grad_enabled() or not model.training:
            return result
        if return_outputs:
            loss, outputs = result
            return scale_loss_gradient(loss, opt.loss_scale), outputs
        return scale_loss_gradient(result, opt.loss_scale)

    # -- checkpoints ----------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, with the model, optimizer, scheduler and RNG states
        in one DCP checkpoint (every rank writes its shards) instead of rank 0's files.
        """
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        if self.args.save_only_model:
            self.save_model(output_dir, _internal_call=True)
        else:
            self._save_zero3_checkpoint(output_dir)
            self._save_pretrained_files(output_dir)
            if _is_peft_model(self.model):
                self._save_adapters(output_dir)  # the stock Trainer's checkpoint holds them
        if (
            self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            and self.state.best_global_step
        ):
            if self.args.parallel_mode == ParallelMode.DISTRIBUTED:
                dist.barrier()
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:
            exportable = [*self.callback_handler.callbacks, self.control]
            for cb in [cb for cb in exportable if isinstance(cb, ExportableState)]:
                name = type(cb).__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _save_zero3_checkpoint(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        rank = self.args.process_index
        extra: dict[str, Any] = {
            "global_step": self.state.global_step,
            "world_size": self.args.world_size,
            rng_key(rank): rng_state(),
        }
        if self.lr_scheduler is not None:
            extra["scheduler"] = scheduler_text(self.lr_scheduler)
        save_checkpoint(zero3_dir(output_dir), self.model, self._require_optimizer(), extra=extra)

    def _save_pretrained_files(self, output_dir: str) -> None:
        """What DeepSpeed's Trainer checkpoints hold beside its own state, so that
        ``from_pretrained(checkpoint-N)`` works as there: ``config.json``, the tokenizer
        and ``training_args.bin``, and with ``stage3_gather_16bit_weights_on_model_save``
        the weights, consolidated by rank 0 from the checkpoint just written (one tensor
        at a time; no rank gathers the model). A collective: it raises on every rank.
        """
        error: BaseException | None = None
        if self.args.process_index == 0:
            try:
                if gathers_weights_on_save(self.zero3_config):
                    consolidate_checkpoint(zero3_dir(output_dir), output_dir)
                else:
                    config = getattr(self.model, "config", None)
                    if callable(getattr(config, "save_pretrained", None)):
                        config.save_pretrained(output_dir)  # type: ignore[union-attr]
                self._save_extras(output_dir)
            except Exception as exc:
                error = exc
        raise_on_every_rank(checkpoint_group(self.model), error)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Called by ``train()`` before the optimizer exists: only check that the folder
        holds a zero3 checkpoint; it is loaded once the optimizer is built.
        """
        if not os.path.isdir(zero3_dir(resume_from_checkpoint)):
            raise ValueError(
                f"Zero3Trainer: no zero3 checkpoint in {resume_from_checkpoint} (expected "
                f"{zero3_dir(resume_from_checkpoint)}, written by Zero3Trainer's checkpoints). "
                "To start from weights, load them into the model before training"
            )

    def _load_zero3_checkpoint(self, checkpoint: str) -> None:
        extra = load_checkpoint(zero3_dir(checkpoint), self.model, self._require_optimizer())
        if self.lr_scheduler is not None and "scheduler" in extra:
            self.lr_scheduler.load_state_dict(json.loads(extra["scheduler"]))
        self._resume_extra = {"checkpoint": checkpoint, **extra}
        if extra.get("world_size") != self.args.world_size:
            _log.info(
                "zero3: resuming at world size %s from a checkpoint saved at %s",
                self.args.world_size,
                extra.get("world_size"),
            )

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """This rank's RNG states from the zero3 checkpoint (a rank the saving world did
        not have keeps its own, as the stock Trainer does without an RNG file).
        """
        if checkpoint is None:
            return
        state = self._resume_extra.get(rng_key(self.args.process_index))
        if self._resume_extra.get("checkpoint") != checkpoint or state is None:
            _log.info(
                "zero3: no RNG state for rank %d in %s (saved by %s ranks); reproducibility "
                "of random ops is not guaranteed",
                self.args.process_index,
                checkpoint,
                self._resume_extra.get("world_size"),
            )
            return
        restore_rng(state)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        assert best is not None
        _log.info("zero3: loading the best model from %s", best)
        if os.path.isdir(zero3_dir(best)):
            load_checkpoint(zero3_dir(best), self.model, None)
        elif _is_peft_model(self.model):  # save_only_model: the adapters' file
            from peft import set_peft_model_state_dict

            path = os.path.join(best, "adapter_model.safetensors")
            set_peft_model_state_dict(self.model, safetensors.torch.load_file(path))
        else:  # save_only_model: consolidated safetensors
            load_full_state_dict(self.model, _read_safetensors(best))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model as ``save_pretrained`` would (``model.safetensors`` or several
        files and an index, ``config.json``), plus the tokenizer and training arguments,
        so ``from_pretrained(output_dir)`` loads it. A collective: every rank writes its
        shards into a DCP checkpoint, then rank 0 consolidates it one tensor at a time;
        no rank ever holds the whole model.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        if _is_peft_model(self.model):
            self._save_adapters(output_dir)
        else:
            self._save_weights(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_weights(self, output_dir: str) -> None:
        staging = os.path.join(output_dir, _CONSOLIDATING)
        save_checkpoint(staging, self.model, None)
        error: BaseException | None = None
        if self.args.process_index == 0:
            try:
                consolidate_checkpoint(staging, output_dir)
                shutil.rmtree(staging)
                self._save_extras(output_dir)
            except Exception as exc:
                error = exc
        raise_on_every_rank(checkpoint_group(self.model), error)

    def _save_adapters(self, output_dir: str) -> None:
        """A ``PeftModel``'s adapters as the stock Trainer writes them
        (``adapter_model.safetensors``, ``adapter_config.json``): every rank calls peft's
        ``save_pretrained`` (the adapters' gathers are collectives; the frozen base is
        never gathered), rank 0 writes.
        """
        # The state dict first, on every rank (its adapter gathers are collectives): peft
        # does rank-0-only work before reading it, and a rank failing there would leave
        # the others waiting in a gather instead of raising below.
        state = self.model.state_dict()
        error: BaseException | None = None
        try:
            self.model.save_pretrained(
                output_dir, state_dict=state, is_main_process=self.args.process_index == 0
            )
            if self.args.process_index == 0:
                self._save_extras(output_dir)
        except Exception as exc:
            error = exc
        raise_on_every_rank(checkpoint_group(self.model), error)

    def _save_extras(self, output_dir: str) -> None:
        """What ``Trainer._save`` writes beside the weights (rank 0)."""
        generation = getattr(self.model, "generation_config", None)
        can_generate = getattr(self.model, "can_generate", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


#: DeepSpeed's names for "save 16-bit weights with the model" (zero_optimization).
_GATHER_ON_SAVE = tuple(
    f"zero_optimization.{key}"
    for key in (
        "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    )
)


def _inner_state(model: nn.Module) -> ShardedModelState | None:
    """The sharded model's state: ``model`` itself, or the one sharded model inside a
    wrapper built after sharding (a ``peft.PeftModel`` around a sharded base).
    """
    return sharded_state(model) if _sharded_roots(model) else None  # raises for several


def _sharded_roots(model: nn.Module) -> list[nn.Module]:
    """The sharded models in ``model``: itself, or those a wrapper holds."""
    return [m for m in model.modules() if try_sharded_state(m) is not None]


def gathers_weights_on_save(config: Zero3Config | None) -> bool:
    """Whether the DeepSpeed config asked for weights in every checkpoint folder."""
    extras = config.extras if config is not None else {}
    return any(extras.get(key) is True for key in _GATHER_ON_SAVE)


def _read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (one file or an index)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(safetensors.torch.load_file(os.path.join(directory, name)))
    return state
