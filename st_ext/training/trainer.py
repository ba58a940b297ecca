"""Trainers with the upstream signatures whose ``gradient_checkpointing=True`` works on any model, one per
upstream archetype the installed release has.

The Hugging Face Trainer switches checkpointing on by calling a method on the model: transformers 4 calls
``gradient_checkpointing_enable``, which a sentence-transformers 4.x ``CrossEncoder`` lacks (``AttributeError``);
transformers 5 prefers ``activation_checkpointing_enable``, which no sentence-transformers release defines (two
deprecation warnings). st_ext's trainers lend st_ext's switches (:class:`st_ext.models.CheckpointingMixin`) to a
plain upstream model for the duration of ``train()``, so the model ends as it began, apart from the
checkpointing state it asked for.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import sentence_transformers
from torch import nn

from st_ext import _compat
from st_ext.gradient_sync import sharded_by_fsdp2
from st_ext.losses.auto_mini_batch import AutoMiniBatch, auto_mini_batch_of
from st_ext.losses.registry import build_loss
from st_ext.models import CheckpointingMixin
from st_ext.scoped_entries import entries_set
from st_ext.training.ddp import keep_cpu_flag, plain_dict_outputs, swap_model_in_loss
from st_ext.training.deepspeed import check_deepspeed_setup
from st_ext.training.engine_forwards import (
    compute_loss_on_engine,
    engine_forwards,
    selected_loss,
    warn_upstream_replaced_losses,
)
from st_ext.training.frozen_encoders import (
    apply_frozen_encoder_mode,
    each_loss,
    named_losses,
    require_resident,
    validate_frozen_encoder_mode,
)
from st_ext.training.fsdp_saving import fsdp_hooks_held_back, full_weights_in_place
from st_ext.training.memory_checkpoints import restore_memories_for_resume, save_memories
from st_ext.training.zero3_encoders import serve_partitioned_encoders

if TYPE_CHECKING:  # the types of upstream 6.x's trainer arguments, for the constructors a type checker reads
    import torch
    from datasets import Dataset, DatasetDict, IterableDataset
    from sentence_transformers.base.evaluation import BaseEvaluator
    from sentence_transformers.multi_vector_encoder.data_collator import MultiVectorEncoderDataCollator
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from sentence_transformers.sparse_encoder.data_collator import SparseEncoderDataCollator
    from transformers import (
        EvalPrediction,
        FeatureExtractionMixin,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainerCallback,
    )
    from transformers.image_processing_utils import BaseImageProcessor

    from st_ext.losses.upstream_forwards import EngineForward
    from st_ext.models import MultiVectorEncoder, SentenceTransformer, SparseEncoder

    TrainerDataset: TypeAlias = Dataset | DatasetDict | IterableDataset | dict[str, Dataset]
    ProcessingClass = PreTrainedTokenizerBase | BaseImageProcessor | FeatureExtractionMixin | ProcessorMixin
    Optimizers = tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]
    OptimizerClassAndKwargs = tuple[type[torch.optim.Optimizer], dict[str, Any]]
    LogitsPreprocessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_LENT_METHODS = (
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
    "activation_checkpointing_enable",
    "activation_checkpointing_disable",
)


def lend_checkpointing_methods(model: nn.Module | None) -> contextlib.AbstractContextManager[None]:
    """Give ``model`` st_ext's checkpointing methods while the block runs, unless it already has them."""
    if model is None or isinstance(model, CheckpointingMixin):
        return contextlib.nullcontext()
    lent = {name: types.MethodType(getattr(CheckpointingMixin, name), model) for name in _LENT_METHODS}
    return entries_set(vars(model), lent)


class CheckpointingTrainerMixin:
    """Checkpointing switches on whatever model the trainer holds, the DDP work-arounds of
    :mod:`st_ext.training.ddp`, the DeepSpeed checks of :mod:`st_ext.training.deepspeed`, sentence-transformers'
    own cached losses forwarded by st_ext's engine (:mod:`st_ext.training.engine_forwards`), and
    ``mini_batch_size="auto"``'s optimizer and log."""

    #: The trainer's losses that st_ext's engine forwards, by ``id`` (set by the constructor).
    engine_forwards: dict[int, EngineForward]

    if not TYPE_CHECKING:  # a type checker reads the trainer's constructor (upstream's, or the one declared below)

        def __init__(self, *args, **kwargs):
            settings = kwargs.get("args", args[1] if len(args) > 1 else None)
            with keep_cpu_flag(settings):
                super().__init__(*args, **kwargs)
            serve_partitioned_encoders(self.loss, self.model)
            self.engine_forwards = engine_forwards(self.loss)
            warn_upstream_replaced_losses(type(self).__name__, self.loss, self.engine_forwards)
            check_deepspeed_setup(self.args, self.loss)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Upstream's ``compute_loss``; one of sentence-transformers' cached losses is forwarded by st_ext's engine."""
        loss = selected_loss(self.loss, inputs)
        forward = self.engine_forwards.get(id(loss))
        if forward is None or forward.loss is not loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return compute_loss_on_engine(self, forward, model, inputs, return_outputs)

    def auto_mini_batch(self, loss) -> AutoMiniBatch | None:
        """The ``mini_batch_size="auto"`` state of one of the trainer's losses, whichever engine forward holds it."""
        forward = self.engine_forwards.get(id(loss))
        return forward.auto if forward is not None and forward.loss is loss else auto_mini_batch_of(loss)

    def create_optimizer(self, *args, **kwargs):
        """Upstream's ``create_optimizer``; a loss with ``mini_batch_size="auto"`` is told the optimizer, so
        that its memory budget holds the whole step, the optimizer's update included."""
        optimizer = super().create_optimizer(*args, **kwargs)
        for loss in each_loss(self.loss):
            auto = self.auto_mini_batch(loss)
            if auto is not None:
                auto.optimizer = optimizer
        return optimizer

    def log(self, logs, *args, **kwargs):
        """Upstream's ``log``; a size ``mini_batch_size="auto"`` chose since the last log joins the logged
        values, once per choice."""
        logged = self.__dict__.setdefault("_logged_auto_choices", {})
        for name, loss in named_losses(self.loss):
            auto = self.auto_mini_batch(loss)
            if auto is not None and auto.choice is not None and logged.get(name) is not auto.choice:
                logs["mini_batch_size" + (f"/{name}" if name else "")] = auto.choice.size
                logged[name] = auto.choice
        return super().log(logs, *args, **kwargs)

    if not TYPE_CHECKING:  # a type checker reads upstream's train(), whose arguments this one passes on

        def train(self, *args, **kwargs):
            with lend_checkpointing_methods(self.model), plain_dict_outputs(self.model):
                return super().train(*args, **kwargs)

    def override_model_in_loss(self, loss, model):
        loss = super().override_model_in_loss(loss, model)
        swap_model_in_loss(loss, model)
        return loss

    def _save(self, output_dir=None, state_dict=None):
        """A model sharded by FSDP2 saves the whole weights the Trainer gathered, from the rank that gathered them
        (:mod:`st_ext.training.fsdp_saving`)."""
        if state_dict is None or not sharded_by_fsdp2(self.model):
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return None
        with fsdp_hooks_held_back(self.model), full_weights_in_place(self.model, state_dict):
            return super()._save(output_dir, state_dict)


def resolve_loss_names(loss, model):
    """Build losses given by registered name (``"cached_mnrl"``, or a dict of names per dataset)."""
    if isinstance(loss, str) or (isinstance(loss, dict) and any(isinstance(v, str) for v in loss.values())):
        if model is None:
            raise ValueError("A loss given by name needs the model at construction; pass model=..., not model_init.")
        if isinstance(loss, str):
            return build_loss(loss, model)
        return {key: build_loss(value, model) if isinstance(value, str) else value for key, value in loss.items()}
    return loss


class SentenceTransformerTrainer(CheckpointingTrainerMixin, sentence_transformers.SentenceTransformerTrainer):
    """Upstream ``SentenceTransformerTrainer``; ``gradient_checkpointing=True`` works on every model,
    ``loss`` may also be a registered loss name (see :func:`st_ext.losses.registry.known_losses`), and
    the queue of a :class:`~st_ext.losses.cross_batch_memory.CrossBatchMemoryLoss` is part of each
    checkpoint (written with the model, before older checkpoints are rotated away) and restored on
    resume. Resuming from a checkpoint without it is an error unless ``resume_empty_memory=True``
    (keyword only), which starts the queue empty.

    ``frozen_encoders`` (keyword only): ``"resident"`` (default), ``"offload"`` or ``"precompute"``
    for every GIST guide and distillation teacher of the loss, switched before upstream moves the loss
    onto the model's device; see :mod:`st_ext.training.frozen_encoders`. With ``"precompute"`` they run
    over ``train_dataset`` and ``eval_dataset`` here, then are released; :attr:`frozen_encoder_reports`
    holds what each release freed.
    """

    #: What each release of ``frozen_encoders="precompute"`` freed (set by the constructor).
    frozen_encoder_reports: list[Any]

    if TYPE_CHECKING:  # what a type checker reads: 6.x's arguments, then st_ext's (tests/test_typing.py)

        def __init__(
            self,
            model: SentenceTransformer | None = None,
            args: sentence_transformers.SentenceTransformerTrainingArguments | None = None,
            train_dataset: TrainerDataset | None = None,
            eval_dataset: TrainerDataset | None = None,
            loss: nn.Module
            | dict[str, nn.Module]
            | Callable[[SentenceTransformer], nn.Module]
            | dict[str, Callable[[SentenceTransformer], nn.Module]]
            | str
            | dict[str, str | nn.Module]
            | None = None,
            evaluator: BaseEvaluator | list[BaseEvaluator] | None = None,
            data_collator: SentenceTransformerDataCollator | None = None,
            processing_class: ProcessingClass | None = None,
            model_init: Callable[[], SentenceTransformer] | None = None,
            compute_metrics: Callable[[EvalPrediction], dict] | None = None,
            callbacks: list[TrainerCallback] | None = None,
            optimizers: Optimizers = ...,
            optimizer_cls_and_kwargs: OptimizerClassAndKwargs | None = None,
            preprocess_logits_for_metrics: LogitsPreprocessor | None = None,
            *,
            frozen_encoders: Literal["resident", "offload", "precompute"] = "resident",
            resume_empty_memory: bool = False,
        ) -> None: ...

    else:

        def __init__(
            self,
            model=None,
            args=None,
            train_dataset=None,
            eval_dataset=None,
            loss=None,
            *rest,
            frozen_encoders: str = "resident",
            resume_empty_memory: bool = False,
            **kwargs,
        ):
            validate_frozen_encoder_mode(frozen_encoders)
            loss = resolve_loss_names(loss, model)
            switch = partial(
                apply_frozen_encoder_mode,
                frozen_encoders,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                prompts=getattr(args, "prompts", None),
                show_progress_bar=not getattr(args, "disable_tqdm", False),
            )
            # Before upstream's prepare_loss moves the loss, guides and teachers included, onto the model's device.
            built = isinstance(loss, (nn.Module, dict))
            if built:
                serve_partitioned_encoders(loss, model)  # before an encoder ZeRO-3 partitioned runs for "precompute"
                reports = switch(loss, device=getattr(model, "device", None))
            super().__init__(model, args, train_dataset, eval_dataset, loss, *rest, **kwargs)
            if not built:  # a loss factory, built by upstream's __init__ just now
                reports = switch(self.loss, device=self.model.device)
            self.resume_empty_memory = resume_empty_memory
            self.frozen_encoders = frozen_encoders
            self.frozen_encoder_reports = reports

    if not TYPE_CHECKING:  # a type checker reads upstream's train(), whose arguments this one passes on

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            """Upstream's ``train``; a cross-batch memory saved with the checkpoint is restored first."""
            restore_memories_for_resume(self, resume_from_checkpoint, allow_empty=self.resume_empty_memory)
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir=None, _internal_call=False):
        """Upstream's ``save_model``; inside a checkpoint, the cross-batch memories are written with the model,
        so the checkpoint holds them before the trainer counts it or rotates older ones away."""
        super().save_model(output_dir, _internal_call)
        if _internal_call and self.args.should_save:
            save_memories(self.loss, output_dir or self.args.output_dir)


class CrossEncoderTrainer(CheckpointingTrainerMixin, sentence_transformers.CrossEncoderTrainer):
    """Upstream ``CrossEncoderTrainer``; ``gradient_checkpointing=True`` works on every supported version."""


class ResidentFrozenEncodersMixin:
    """``frozen_encoders=`` for trainers whose upstream losses hold no frozen encoder: ``"resident"`` only,
    accepted so that one training script can pass the option to any st_ext trainer."""

    if not TYPE_CHECKING:  # a type checker reads the constructor each trainer declares below

        def __init__(self, *args, frozen_encoders: str = "resident", **kwargs):
            require_resident(frozen_encoders, type(self).__name__)
            super().__init__(*args, **kwargs)
            self.frozen_encoders = frozen_encoders
            self.frozen_encoder_reports = []


if _compat.HAS_SPARSE_ENCODER:

    class SparseEncoderTrainer(
        ResidentFrozenEncodersMixin, CheckpointingTrainerMixin, sentence_transformers.SparseEncoderTrainer
    ):
        """Upstream ``SparseEncoderTrainer``; ``gradient_checkpointing=True`` works on every model."""

        if TYPE_CHECKING:  # what a type checker reads: 6.x's arguments, then st_ext's (tests/test_typing.py)

            def __init__(
                self,
                model: SparseEncoder | None = None,
                args: sentence_transformers.SparseEncoderTrainingArguments | None = None,
                train_dataset: TrainerDataset | None = None,
                eval_dataset: TrainerDataset | None = None,
                loss: nn.Module
                | dict[str, nn.Module]
                | Callable[[SparseEncoder], nn.Module]
                | dict[str, Callable[[SparseEncoder], nn.Module]]
                | None = None,
                evaluator: BaseEvaluator | list[BaseEvaluator] | None = None,
                data_collator: SparseEncoderDataCollator | None = None,
                processing_class: ProcessingClass | None = None,
                model_init: Callable[[], SparseEncoder] | None = None,
                compute_metrics: Callable[[EvalPrediction], dict] | None = None,
                callbacks: list[TrainerCallback] | None = None,
                optimizers: Optimizers = ...,
                optimizer_cls_and_kwargs: OptimizerClassAndKwargs | None = None,
                preprocess_logits_for_metrics: LogitsPreprocessor | None = None,
                *,
                frozen_encoders: Literal["resident"] = "resident",
            ) -> None: ...


if _compat.HAS_MULTI_VECTOR_ENCODER:

    class MultiVectorEncoderTrainer(
        ResidentFrozenEncodersMixin, CheckpointingTrainerMixin, sentence_transformers.MultiVectorEncoderTrainer
    ):
        """Upstream ``MultiVectorEncoderTrainer``; ``gradient_checkpointing=True`` works on every model."""

        if TYPE_CHECKING:  # what a type checker reads: 6.x's arguments, then st_ext's (tests/test_typing.py)

            def __init__(
                self,
                model: MultiVectorEncoder | None = None,
                args: sentence_transformers.MultiVectorEncoderTrainingArguments | None = None,
                train_dataset: TrainerDataset | None = None,
                eval_dataset: TrainerDataset | None = None,
                loss: nn.Module
                | dict[str, nn.Module]
                | Callable[[MultiVectorEncoder], nn.Module]
                | dict[str, Callable[[MultiVectorEncoder], nn.Module]]
                | None = None,
                evaluator: BaseEvaluator | list[BaseEvaluator] | None = None,
                data_collator: MultiVectorEncoderDataCollator | None = None,
                processing_class: ProcessingClass | None = None,
                model_init: Callable[[], MultiVectorEncoder] | None = None,
                compute_metrics: Callable[[EvalPrediction], dict] | None = None,
                callbacks: list[TrainerCallback] | None = None,
                optimizers: Optimizers = ...,
                optimizer_cls_and_kwargs: OptimizerClassAndKwargs | None = None,
                preprocess_logits_for_metrics: LogitsPreprocessor | None = None,
                *,
                frozen_encoders: Literal["resident"] = "resident",
            ) -> None: ...


def __getattr__(name: str):
    """Name the sentence-transformers release an archetype's trainer needs when the installed one lacks it."""
    error = _compat.missing_archetype_error(name) if name.endswith("Trainer") else None
    if error is not None:
        raise error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
