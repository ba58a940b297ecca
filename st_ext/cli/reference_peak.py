"""The memory plot's reference: the trained loss without caching, measured on the first step's batch.

What caching saves is the gap between the two losses' forward and backward; the optimizer's update and
state are the same either way, so both figures leave them out (:data:`FORWARD_BACKWARD`). The reference
(``matryoshka_cached_gist`` -> ``matryoshka_gist``, ``xbm_cached_mnrl`` -> ``xbm_mnrl``) keeps the
trained loss's guide arrangement and cross-batch queue. It runs once, just before the first step, from
the level of memory the step starts at; the gradients and the random state are put back afterwards, so
the run trains exactly as it would without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from st_ext.losses.gist import GuidedLoss
from st_ext.losses.registry import BASE_LOSSES, MATRYOSHKA_PREFIX, build_loss, known_losses, loss_spec
from st_ext.memory import measure_peak
from st_ext.training.frozen_encoders import frozen_encoder_losses
from st_ext.training.memory_checkpoints import memory_losses

#: What the trained loss's per-step figure and the reference both count.
FORWARD_BACKWARD = (
    "peak tensor memory above the level at the start of the optimizer step, up to the optimizer's update: the "
    "loss's forward and backward, the parameters' gradients included; the optimizer's update and state excluded"
)
#: Short form of :data:`FORWARD_BACKWARD`, for the plot.
FORWARD_BACKWARD_SHORT = "loss forward+backward, gradients included, optimizer excluded"


@dataclass(frozen=True)
class ReferencePeak:
    loss: str
    trained_loss: str
    batch_size: int
    batch: str  # which batch it ran on
    peak_mib: float | None  # None: out of memory
    meter: str
    counts: str = FORWARD_BACKWARD

    def label(self) -> str:
        measured = "out of memory" if self.peak_mib is None else f"{self.peak_mib:.1f} MiB"
        return f"{self.loss}: {self.trained_loss} without caching, on {self.batch} of {self.batch_size}: {measured}"


def uncached_counterpart(loss_name: str) -> str | None:
    """The registered loss that ``loss_name`` is with caching taken out, or None for a loss that does not
    cache: the registry names a cached loss ``[matryoshka_][xbm_]cached_<base>`` next to its uncached form."""
    if not loss_spec(loss_name).cached:
        return None
    matryoshka = loss_name.startswith(MATRYOSHKA_PREFIX)
    name = loss_name.removeprefix(MATRYOSHKA_PREFIX).replace("cached_", "", 1)
    if matryoshka and not BASE_LOSSES[name].matryoshka:
        # No Matryoshka form of an uncached queue is registered; the queue holds no graph, so the loss
        # inside it is the reference.
        name = name.removeprefix("xbm_")
    counterpart = MATRYOSHKA_PREFIX + name if matryoshka else name
    spec, trained = BASE_LOSSES.get(name), loss_spec(loss_name)
    if (
        spec is None
        or counterpart not in known_losses()
        or spec.cached
        or (spec.columns, spec.guided) != (trained.columns, trained.guided)
    ):
        raise LookupError(f"the loss registry holds no uncached counterpart of {loss_name!r}")
    return counterpart


def build_reference_loss(loss_name: str, trained_loss, model, dims: list[int]):
    """The uncached counterpart of ``trained_loss`` (registered as ``loss_name``), or None, with the trained
    loss's guide as the trainer left it and its cross-batch queue's rows."""
    counterpart = uncached_counterpart(loss_name)
    if counterpart is None:
        return None
    kwargs: dict[str, Any] = {"matryoshka_dims": dims} if counterpart.startswith(MATRYOSHKA_PREFIX) else {}
    if loss_spec(counterpart).guided:
        holder = frozen_encoder_losses(trained_loss)[0]
        assert isinstance(holder, GuidedLoss), "a guided registered loss holds its guide in a GIST loss"
        kwargs.update(
            holder._gist_options(),
            guide=getattr(holder, holder.encoder_attribute),
            guide_embeddings=getattr(holder, holder.table_attribute),
            offload_guide=getattr(holder, holder.offload_attribute),
        )
    reference = build_loss(counterpart, model, **kwargs)
    trained_queues, queues = list(memory_losses(trained_loss).values()), list(memory_losses(reference).values())
    if len(trained_queues) == len(queues) == 1:
        # Banks are replaced, never changed, when rows are queued: sharing one leaves the trained loss's as it was.
        queues[0].memory_size, queues[0].memory = trained_queues[0].memory_size, trained_queues[0].memory
    return reference


def measure_reference_peak(
    loss_name: str,
    trained_loss,
    model,
    features: list[dict[str, Tensor]],
    labels: Tensor | None,
    dims: list[int],
    device: str,
    batch: str = "the first step's batch",
) -> ReferencePeak | None:
    """The uncached counterpart's forward and backward peak on ``features`` (a collated batch's columns on
    ``device``), or None if the loss does not cache."""
    counterpart = uncached_counterpart(loss_name)
    if counterpart is None:
        return None
    reference = build_reference_loss(loss_name, trained_loss, model, dims)
    rows = len(next(iter(features[0].values())))
    labels = torch.zeros(rows, device=device) if labels is None else labels
    parameters = list(model.parameters())
    gradients = [parameter.grad for parameter in parameters]
    was_training = model.training
    cuda_devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    meter, peak_mib = "", None
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            model.train()
            for parameter in parameters:
                parameter.grad = None
            with measure_peak(device) as peak:
                meter = peak.meter
                reference(features, labels).backward()
        peak_mib = round(peak.peak_mib, 2)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
    finally:
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient
        model.train(was_training)
    return ReferencePeak(counterpart, loss_name, rows, batch, peak_mib, meter)


class FirstBatchKept:
    """The trainer's data collator, keeping the first batch it collates: the batch of the first step."""

    def __init__(self, collate: Callable[[list[dict]], dict]):
        self.collate = collate
        self.batch: dict | None = None
        self.taken = False

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        if not self.taken and self.batch is None:
            self.batch = batch
        return batch

    def take(self) -> dict | None:
        """The kept batch, once (None when it was collated elsewhere: a data loader's worker process)."""
        batch, self.batch, self.taken = self.batch, None, True
        return batch

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("collate", "batch", "taken"):
            raise AttributeError(name)
        return getattr(self.collate, name)


class UncachedReference:
    """Measures the trained loss's uncached counterpart on the first step's batch when
    :meth:`before_first_step` is called; ``result`` stays None for a loss that does not cache."""

    def __init__(self, loss_name: str, trainer, dims: list[int], device: str):
        self.loss_name, self.trainer, self.dims, self.device = loss_name, trainer, dims, device
        self.result: ReferencePeak | None = None
        self.kept = None
        if uncached_counterpart(loss_name) is not None:
            self.kept = FirstBatchKept(trainer.data_collator)
            trainer.data_collator = self.kept

    def before_first_step(self) -> None:
        if self.kept is None or self.kept.taken:
            return
        batch, where = self.kept.take(), "the first step's batch"
        if batch is None:
            size = min(self.trainer.args.per_device_train_batch_size, len(self.trainer.train_dataset))
            batch = self.kept.collate([self.trainer.train_dataset[index] for index in range(size)])
            where = "the data's first rows"
        batch = {key: value.to(self.device) if isinstance(value, Tensor) else value for key, value in batch.items()}
        batch.pop("dataset_name", None)
        features, labels = self.trainer.collect_features(batch)
        self.result = measure_reference_peak(
            self.loss_name, self.trainer.loss, self.trainer.model, features, labels, self.dims, self.device, where
        )
