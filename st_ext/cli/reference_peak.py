"""The uncached loss's peak memory at the run's batch size, measured once: the memory plot's reference.

What st_ext saves is the gap between this line and the cached steps' peaks. The reference is one
forward and backward of the plain in-batch-negative loss the cached one stands in for
(``matryoshka_cached_gist`` -> ``matryoshka_mnrl``: a GIST guide runs without a graph and adds little,
and a cross-batch queue holds no graph either) on the first training batch, measured as the steps
are (peak above the level at its start). The model's gradients and the random state are put back
afterwards, so the run trains exactly as it would without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from st_ext._compat import preprocess
from st_ext.losses.registry import MATRYOSHKA_PREFIX, build_loss, loss_spec
from st_ext.memory import measure_peak


@dataclass(frozen=True)
class ReferencePeak:
    loss: str
    batch_size: int
    peak_mib: float | None  # None: out of memory
    meter: str

    def label(self) -> str:
        measured = "out of memory" if self.peak_mib is None else f"{self.peak_mib:.1f} MiB"
        return f"uncached {self.loss}, batch {self.batch_size}, forward+backward: {measured}"


def uncached_counterpart(loss_name: str) -> str | None:
    """The plain loss whose memory a cached loss bounds, or None for a loss that does not cache."""
    if not loss_spec(loss_name).cached:
        return None
    base = "mnsrl" if "mnsrl" in loss_name else "mnrl"
    return MATRYOSHKA_PREFIX + base if loss_name.startswith(MATRYOSHKA_PREFIX) else base


def measure_reference_peak(loss_name: str, model, batch: list[dict[str, str]], dims: list[int], device: str) -> ReferencePeak | None:
    """The uncached counterpart's peak on ``batch`` (rows of text columns), or None if the loss does not cache."""
    counterpart = uncached_counterpart(loss_name)
    if counterpart is None:
        return None
    matryoshka = {"matryoshka_dims": dims} if counterpart.startswith(MATRYOSHKA_PREFIX) else {}
    loss = build_loss(counterpart, model, **matryoshka)
    features = [preprocess(model, [row[column] for row in batch], device) for column in batch[0]]
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
                loss(features, torch.zeros(len(batch), device=device)).backward()
        peak_mib = round(peak.peak_mib, 2)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
    finally:
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient
        model.train(was_training)
    return ReferencePeak(counterpart, len(batch), peak_mib, meter)
