"""The script ``tests/test_distributed.py`` launches with torchrun: 2 ranks, gloo, CPU.

``losses`` mode: for each loss case, one manual DDP training step (two for the cross-batch memory)
on this rank's share of a fixed global batch, and the same steps with the model sharded by FSDP2
(``fully_shard``, resharding after forward or not) instead; each rank saves its loss values, the
gradients after the ranks' reduction and the updated parameters, for the test to compare with a
single process (:func:`single_process_run`, run by the test itself from the same definitions). Then
two DDP settings that fail: ``find_unused_parameters=False`` with BERT's unused pooler, and
re-entrant checkpointing with ``find_unused_parameters=True``.

``deepspeed`` mode: the loss cases' steps under a DeepSpeed engine at each ZeRO stage;
``deepspeed-train`` and ``deepspeed-guide``: training scripts given the Trainer's ``deepspeed`` argument
(see :func:`run_deepspeed_training` and :func:`run_guide_loaded_last`); ``fsdp2-train``: the training
script under the Trainer's FSDP2 path (:func:`run_fsdp2_training`).

``engine-parity`` mode: a cached step under DDP by st_ext's engine, by upstream's own cached loss and by
the uncached loss, counting DDP's all-reductions; under ``static_graph=True``; and with a final mini-batch
that no backward runs through (:func:`run_engine_parity`, for ``tests/test_engine_parity.py``).

``train`` mode: ordinary st_ext training scripts (:func:`train_sentence_transformer`,
:func:`train_cross_encoder`), with no distributed code in them, run unchanged; each rank reports what
its trainer did.

What a DDP step equals, and so which single process it is compared with:

* DDP averages the ranks' gradients. A loss whose in-batch negatives stay on the rank therefore
  trains on the *mean of the per-rank losses*: the reference is the mean of single-process
  gradients over each rank's half, not the gradient over the concatenated batch.
* With ``gather_across_devices=True`` every rank ranks its anchors against all ranks' candidates,
  and the all-gather's backward returns each rank its candidates' gradients from every rank's loss.
  The mean of the ranks' losses is then the loss over the concatenated batch, so the DDP-averaged
  gradient is the single-process gradient over the concatenated batch.
* The cross-batch memory gathers every rank's documents into the queue, so after a step every rank
  holds the queue a single process would hold after seeing rank 0's half and then rank 1's; its
  in-batch negatives stay on the rank (the first point). So do its query bank and document ids.
* Same-document masking (``document_ids``) names each row's document by the first word of its
  positive (:func:`first_word_of_positive`): rows of the two ranks share documents, so a gathered step
  equals the concatenated batch's only if candidates gathered from the other rank are masked too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from tiny_models import WORDS, cross_encoder_from, sentence_transformer_from
from torch import nn

WORLD_SIZE = 2
ROWS_PER_RANK = 8
MINI_BATCH_SIZE = 4  # two mini-batches per column on each rank: DDP's no_sync, then the synchronising one
PARTIAL_KEPT_GRAPHS = 2  # the partial cases keep the first two mini-batches' graphs
MATRYOSHKA_DIMS = [32, 16, 8]
LEARNING_RATE = 0.5
COLUMNS = ("anchor", "positive", "negative")


# ---------------------------------------------------------------------------------------------
# Data


def random_texts(count: int, seed: int) -> list[str]:
    """Distinct sentences over the tiny vocabulary: a duplicate would be a masked in-batch negative
    in one place and not in another, which is not what these checks are about."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    while len(texts) < count:
        texts[" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))] = None
    return list(texts)


def global_batch(step: int) -> list[list[str]]:
    """The (anchor, positive, negative) columns of the whole step, over all ranks, rank 0's rows first."""
    rows = ROWS_PER_RANK * WORLD_SIZE
    texts = random_texts(rows * len(COLUMNS), seed=1000 + step)
    return [texts[index * rows : (index + 1) * rows] for index in range(len(COLUMNS))]


def rank_share(columns: list[list[str]], rank: int) -> list[list[str]]:
    """Rank ``rank``'s rows: rank 0 takes the first ``ROWS_PER_RANK`` rows of every column."""
    begin = rank * ROWS_PER_RANK
    return [column[begin : begin + ROWS_PER_RANK] for column in columns]


# ---------------------------------------------------------------------------------------------
# Loss cases


def gather_supported() -> bool:
    """Upstream's gather_across_devices (CachedMultipleNegativesRankingLoss, all_gather_with_grad)
    arrived in sentence-transformers 5; 4.x has neither."""
    import inspect

    from st_ext._compat import all_gather_with_grad, st_losses

    signature = inspect.signature(st_losses().CachedMultipleNegativesRankingLoss.__init__)
    return all_gather_with_grad() is not None and "gather_across_devices" in signature.parameters


def cached_mnrl(model: nn.Module, gathered: bool, kept_graphs: int | None = None) -> nn.Module:
    from st_ext import losses

    kwargs = {"gather_across_devices": True} if gathered else {}
    return losses.CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=MINI_BATCH_SIZE, kept_graphs=kept_graphs, **kwargs
    )


def matryoshka_cmnrl(gathered: bool, kept_graphs: int | None = None) -> Callable[[nn.Module, nn.Module], nn.Module]:
    def build(model: nn.Module, guide: nn.Module) -> nn.Module:
        from st_ext import losses

        return losses.MatryoshkaLoss(model, cached_mnrl(model, gathered, kept_graphs), MATRYOSHKA_DIMS)

    return build


def matryoshka_2d_cmnrl(gathered: bool) -> Callable[[nn.Module, nn.Module], nn.Module]:
    """Every layer and dimension, so that no rank draws differently from the reference."""

    def build(model: nn.Module, guide: nn.Module) -> nn.Module:
        from st_ext import losses

        inner = cached_mnrl(model, gathered)
        return losses.Matryoshka2dLoss(model, inner, MATRYOSHKA_DIMS, n_layers_per_step=-1, n_dims_per_step=-1)

    return build


def cached_gist(gathered: bool, **options) -> Callable[[nn.Module, nn.Module], nn.Module]:
    def build(model: nn.Module, guide: nn.Module) -> nn.Module:
        from st_ext import losses

        # contrast_anchors=False: with gathering, upstream (and st_ext) contrast an anchor only with
        # its own rank's anchors, which no single-process batch reproduces.
        return losses.CachedGISTEmbedLoss(
            model,
            guide,
            temperature=0.05,
            mini_batch_size=MINI_BATCH_SIZE,
            contrast_anchors=False,
            gather_across_devices=gathered,
            **options,
        )

    return build


def self_guided_gist(gathered: bool) -> Callable[[nn.Module, nn.Module], nn.Module]:
    """The model as its own guide; gathered, its guide is every rank's candidates, detached."""
    guided = cached_gist(gathered, margin=-0.05)

    def build(model: nn.Module, guide: nn.Module) -> nn.Module:
        return guided(model, model)

    return build


def cross_batch_memory(model: nn.Module, guide: nn.Module) -> nn.Module:
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    return CrossBatchMemoryLoss(model, cached_mnrl(model, gathered=False), memory_size=64)


def first_word_of_positive(sentence_features: list[dict], labels: torch.Tensor | None) -> torch.Tensor:
    """A document id per row: its positive's first token (after [CLS]); the tiny vocabulary repeats them."""
    return sentence_features[1]["input_ids"][:, 1]


def matryoshka_same_document(gathered: bool) -> Callable[[nn.Module, nn.Module], nn.Module]:
    def build(model: nn.Module, guide: nn.Module) -> nn.Module:
        from st_ext import losses

        kwargs = {"gather_across_devices": True} if gathered else {}
        inner = losses.CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=MINI_BATCH_SIZE, document_ids=first_word_of_positive, **kwargs
        )
        return losses.MatryoshkaLoss(model, inner, MATRYOSHKA_DIMS)

    return build


def memory_same_document(model: nn.Module, guide: nn.Module) -> nn.Module:
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    inner = cached_mnrl(model, gathered=False)
    return CrossBatchMemoryLoss(model, inner, memory_size=64, document_ids=first_word_of_positive)


def memory_query_bank(model: nn.Module, guide: nn.Module) -> nn.Module:
    from st_ext import losses
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    directions = ("query_to_doc", "query_to_query", "doc_to_query")
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, directions=directions)
    return CrossBatchMemoryLoss(model, inner, memory_size=64, query_bank=True)


def directions_supported() -> bool:
    """MultipleNegativesRankingLoss's ``directions`` (a query bank needs them); 4.x has none."""
    import inspect

    from st_ext._compat import st_losses

    return "directions" in inspect.signature(st_losses().CachedMultipleNegativesRankingLoss.__init__).parameters


@dataclass(frozen=True)
class LossCase:
    """One loss configuration checked under DDP against its single-process reference."""

    build: Callable[[nn.Module, nn.Module], nn.Module]
    gathered: bool = False
    steps: int = 1
    checkpointing: bool = False
    needs_directions: bool = False
    #: Train the tiny Qwen3 decoder embedder's LoRA adapter (:func:`lora_decoder`) instead of the tiny BERT.
    lora_decoder: bool = False

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """Why the installed sentence-transformers cannot run this case, or None."""
        from st_ext._compat import ST_VERSION

        if self.gathered and not gather_supported():
            return f"sentence-transformers {ST_VERSION} has no gather_across_devices (added in 5.x, PR #3442)"
        if self.lora_decoder and importlib.util.find_spec("peft") is None:
            return "peft is not installed (LoRA adapters need it)"
        if self.needs_directions and not directions_supported():
            return (
                f"sentence-transformers {ST_VERSION}'s MultipleNegativesRankingLoss has no directions: no query bank"
            )
        return None


CASES: dict[str, LossCase] = {
    "matryoshka_cmnrl": LossCase(matryoshka_cmnrl(gathered=False)),
    "matryoshka_cmnrl_gathered": LossCase(matryoshka_cmnrl(gathered=True), gathered=True),
    "matryoshka_cmnrl_checkpointed": LossCase(matryoshka_cmnrl(gathered=False), checkpointing=True),
    # Partial caching: of the rank's 4 mini-batches, the first 2 keep their graphs and the others are replayed.
    "matryoshka_cmnrl_partial": LossCase(matryoshka_cmnrl(gathered=False, kept_graphs=PARTIAL_KEPT_GRAPHS)),
    "matryoshka_2d_cmnrl": LossCase(matryoshka_2d_cmnrl(gathered=False)),
    "matryoshka_2d_cmnrl_gathered": LossCase(matryoshka_2d_cmnrl(gathered=True), gathered=True),
    "cached_gist": LossCase(cached_gist(gathered=False)),
    "cached_gist_gathered": LossCase(cached_gist(gathered=True), gathered=True),
    "self_guided_gist": LossCase(self_guided_gist(gathered=False)),
    "self_guided_gist_gathered": LossCase(self_guided_gist(gathered=True), gathered=True),
    "cross_batch_memory": LossCase(cross_batch_memory, steps=2),
    "matryoshka_same_document": LossCase(matryoshka_same_document(gathered=False)),
    "matryoshka_same_document_gathered": LossCase(matryoshka_same_document(gathered=True), gathered=True),
    "cross_batch_memory_same_document": LossCase(memory_same_document, steps=2),
    "cached_gist_same_document": LossCase(cached_gist(gathered=False, document_ids=first_word_of_positive)),
    "cached_gist_same_document_gathered": LossCase(
        cached_gist(gathered=True, document_ids=first_word_of_positive), gathered=True
    ),
    "cross_batch_memory_query_bank": LossCase(memory_query_bank, steps=2, needs_directions=True),
    # Only a LoRA adapter trains, on a decoder embedder (last-token pooling, left padding, frozen embeddings).
    "lora_decoder_matryoshka_cmnrl": LossCase(matryoshka_cmnrl(gathered=False), lora_decoder=True),
    "lora_decoder_matryoshka_cmnrl_gathered": LossCase(
        matryoshka_cmnrl(gathered=True), gathered=True, lora_decoder=True
    ),
    "lora_decoder_matryoshka_cmnrl_checkpointed": LossCase(
        matryoshka_cmnrl(gathered=False), checkpointing=True, lora_decoder=True
    ),
}


# ---------------------------------------------------------------------------------------------
# One training step, shared by the DDP ranks and the single-process reference


def load_model(model_dir: Path, checkpointing: bool = False, checkpoint_kwargs: dict | None = None) -> nn.Module:
    """The model being trained (dropout 0 in its config), identical in every process.

    Checkpointing uses st_ext's default (``use_reentrant=False``) unless ``checkpoint_kwargs`` say otherwise.
    """
    model = sentence_transformer_from(model_dir)
    if checkpointing:
        model.gradient_checkpointing_enable(checkpoint_kwargs)
    return model.train()


def lora_decoder(checkpointing: bool = False) -> nn.Module:
    """A tiny Qwen3 decoder embedder (tests/tiny_decoders.py) whose only trainable weights are a LoRA adapter,
    attached as st_ext.adapters does on this stack; built from fixed seeds, identical in every process."""
    import tempfile

    from tiny_decoders import decoder_embedder, lora_config, save_tiny_decoder

    from st_ext.adapters import add_lora_adapter

    with tempfile.TemporaryDirectory() as folder:
        model = decoder_embedder(save_tiny_decoder(Path(folder), "qwen3"))
    torch.manual_seed(3)
    add_lora_adapter(model, lora_config())
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def case_model(case: LossCase, model_dir: Path) -> nn.Module:
    """The model ``case`` trains: the tiny BERT in ``model_dir``, or the LoRA decoder."""
    return lora_decoder(case.checkpointing) if case.lora_decoder else load_model(model_dir, case.checkpointing)


def load_guide(guide_dir: Path) -> nn.Module:
    return sentence_transformer_from(guide_dir).eval().requires_grad_(False)


def memory_of(loss: nn.Module):
    """The loss's cross-batch memory, if it keeps one (its queue is part of what a step produces)."""
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    return loss if isinstance(loss, CrossBatchMemoryLoss) else None


def queued(loss: nn.Module) -> torch.Tensor | None:
    """A copy of the loss's queued embeddings, or None (no cross-batch memory, or an empty one)."""
    memory = memory_of(loss)
    return None if memory is None or memory.memory_embeddings is None else memory.memory_embeddings.clone()


def queued_anchors(loss: nn.Module) -> torch.Tensor | None:
    """A copy of the loss's query bank, or None (no cross-batch memory, or no query bank)."""
    memory = memory_of(loss)
    return None if memory is None or not memory.query_memory.rows else memory.query_memory.embeddings.clone()


def features_of(model: nn.Module, columns: list[list[str]]) -> list[dict]:
    from st_ext._compat import preprocess

    return [preprocess(model, column) for column in columns]


def forward_backward(model: nn.Module, loss: nn.Module, columns: list[list[str]]) -> float:
    value = loss(features_of(model, columns), None)
    value.backward()
    return value.item()


def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, loss: nn.Module, record: dict) -> None:
    """Step the optimizer; record the gradients it used, the parameters it produced and the queue, if any."""
    record["grads"] = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    record["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    record["memory"] = queued(loss)
    record["query_memory"] = queued_anchors(loss)


def single_process_run(case_name: str, model_dir: Path, guide_dir: Path) -> list[dict]:
    """What one process computes for the same steps (see the module docstring for which one)."""
    case = CASES[case_name]
    model = case_model(case, model_dir)
    loss = case.build(model, load_guide(guide_dir))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    records = []
    for step in range(case.steps):
        columns = global_batch(step)
        if case.gathered:
            record = {"loss": forward_backward(model, loss, columns)}
        else:
            record = mean_of_rank_steps(model, loss, [rank_share(columns, rank) for rank in range(WORLD_SIZE)])
        apply_update(model, optimizer, loss, record)
        records.append(record)
    return records


def mean_of_rank_steps(model: nn.Module, loss: nn.Module, shares: list[list[list[str]]]) -> dict:
    """Each rank's loss and the mean of their gradients, each computed from the same starting queue;
    then the queue every rank holds afterwards: each share's documents, in rank order."""
    memory = memory_of(loss)
    start = memory.memory_state() if memory is not None else None
    values, grad_sum = [], {}
    for share in shares:
        if memory is not None:
            memory.load_memory_state(start)
        values.append(forward_backward(model, loss, share))
        for name, p in model.named_parameters():
            if p.grad is not None:
                grad_sum[name] = grad_sum.get(name, 0) + p.grad.detach().clone()
        model.zero_grad(set_to_none=True)
    if memory is not None:
        memory.load_memory_state(start)
        with torch.enable_grad():  # the queue is written on training passes only; no backward needed
            for share in shares:
                loss(features_of(model, share), None)
    for name, p in model.named_parameters():
        if name in grad_sum:
            p.grad = grad_sum[name] / len(shares)
    return {"rank_losses": values}


# ---------------------------------------------------------------------------------------------
# The DDP side


def use_wrapped_model(loss: nn.Module, wrapped: nn.Module) -> None:
    """Put the DDP model into the loss where it stores the plain one, with the trainer's own method
    (which reads nothing from the trainer, so an uninitialised one serves)."""
    from st_ext import SentenceTransformerTrainer

    SentenceTransformerTrainer.__new__(SentenceTransformerTrainer).override_model_in_loss(loss, wrapped)


def wrap_in_ddp(model: nn.Module, *, find_unused_parameters: bool) -> nn.Module:
    """DDP as sentence-transformers' training arguments configure it: ``ddp_broadcast_buffers=False``.

    With buffer broadcasting, each forward overwrites BERT's ``position_ids`` buffer in place while
    the previous forward's embedding still holds a slice of it for backward, so a loss that embeds
    two columns before one backward can fail with "modified by an inplace operation" (seen with
    torch 2.11 and transformers 5.17).
    """
    return nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=find_unused_parameters, broadcast_buffers=False
    )


def ddp_run(case_name: str, model_dir: Path, guide_dir: Path) -> list[dict]:
    """The case's steps under plain DDP, with find_unused_parameters=True as the trainer sets it for
    a SentenceTransformer (a BERT pooler is not part of the loss)."""
    case = CASES[case_name]
    rank = dist.get_rank()
    model = case_model(case, model_dir)
    loss = case.build(model, load_guide(guide_dir))
    use_wrapped_model(loss, wrap_in_ddp(model, find_unused_parameters=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    records = []
    for step in range(case.steps):
        record = {"loss": forward_backward(model, loss, rank_share(global_batch(step), rank))}
        apply_update(model, optimizer, loss, record)
        records.append(record)
    return records


# The FSDP2 side


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def shard_with_fsdp2(model: nn.Module, reshard_after_forward: bool | None = None) -> nn.Module:
    """``fully_shard`` as one shards a transformer: each layer (of the model's first layer list: BERT's encoder,
    a decoder's stack), then the whole model; with ``reshard_after_forward`` None, FSDP2's default (each layer
    reshards after forward, the root not)."""
    from torch.distributed.fsdp import fully_shard

    settings = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    layers = next(module for module in model[0].auto_model.modules() if isinstance(module, nn.ModuleList))
    for layer in layers:
        fully_shard(layer, **settings)
    return fully_shard(model, **settings)


#: How the FSDP2 runs shard: FSDP2's default, and every module kept gathered after forward (SHARD_GRAD_OP).
FSDP2_RESHARDING = {"default": None, "kept_gathered": False}

#: ``torch.distributed``'s single-tensor collectives FSDP2 calls, under each torch release's names.
COLLECTIVE_NAMES = {
    "all_gathers": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatters": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


@contextmanager
def collectives_counted(counts: dict[str, int]) -> Iterator[None]:
    """Inside the block, every all-gather and reduce-scatter this process enters adds one to
    ``counts["all_gathers"]`` or ``counts["reduce_scatters"]``."""
    originals = {}
    for kind, names in COLLECTIVE_NAMES.items():
        counts.setdefault(kind, 0)
        for name in names:
            if hasattr(dist, name):
                originals[name] = (kind, getattr(dist, name))

    def counted(kind, original):
        def collective(*args, **kwargs):
            counts[kind] += 1
            return original(*args, **kwargs)

        return collective

    for name, (kind, original) in originals.items():
        setattr(dist, name, counted(kind, original))
    try:
        yield
    finally:
        for name, (_, original) in originals.items():
            setattr(dist, name, original)


def is_shard(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is one rank's shard of a tensor split by FSDP2 (a DTensor)."""
    return hasattr(tensor, "full_tensor")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter or gradient (a DTensor) gathered whole."""
    return tensor.full_tensor() if is_shard(tensor) else tensor


def trained_sharded_modules(model: nn.Module) -> int:
    """How many of the modules FSDP2 shards own a trainable parameter (one not inside a nested sharded module):
    only those reduce-scatter gradients (a LoRA decoder's root holds frozen embeddings and norm only)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    owners = {
        max((name for name in sharded if not name or param_name.startswith(name + ".")), key=len)
        for param_name, param in model.named_parameters()
        if param.requires_grad
    }
    return len(owners)


def fsdp2_run(case_name: str, model_dir: Path, guide_dir: Path, resharding: str) -> list[dict]:
    """The case's steps with the model sharded by FSDP2 across the ranks (no DDP), resharding as
    ``FSDP2_RESHARDING[resharding]`` says; each rank records the gathered gradients and parameters,
    which FSDP2 averages across ranks as DDP does, whether the sharded gradients existed already when
    each forward pass of the step began (they do once a mini-batch's backward has reduced), and how many
    all-gathers and reduce-scatters the step ran against how many modules FSDP2 shards."""
    from torch.distributed.fsdp import FSDPModule

    case = CASES[case_name]
    rank = dist.get_rank()
    model = case_model(case, model_dir)
    loss = case.build(model, load_guide(guide_dir))
    shard_with_fsdp2(model, reshard_after_forward=FSDP2_RESHARDING[resharding])
    sharded_modules = sum(isinstance(module, FSDPModule) for module in model.modules())
    reducing_modules = trained_sharded_modules(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    reduced_before_pass: list[bool] = []
    # Ahead of FSDP2's own pre-forward, which swaps in the unsharded parameters. A reduced gradient is a
    # shard (a DTensor); one accumulated locally on parameters kept gathered is a plain tensor.
    model.register_forward_pre_hook(
        lambda *_: reduced_before_pass.append(any(is_shard(p.grad) for p in model.parameters())), prepend=True
    )
    records = []
    for step in range(case.steps):
        reduced_before_pass.clear()
        collectives = {}
        with collectives_counted(collectives):
            record = {"loss": forward_backward(model, loss, rank_share(global_batch(step), rank))}
        record["reduced_before_pass"] = list(reduced_before_pass)
        record.update(collectives, sharded_modules=sharded_modules, reducing_modules=reducing_modules)
        record["grads"] = {name: full(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["params"] = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
        record["memory"] = queued(loss)
        record["query_memory"] = queued_anchors(loss)
        records.append(record)
    return records


# The DeepSpeed side

ZERO_STAGES = (1, 2, 3)


def deepspeed_config(stage: int) -> dict:
    """ZeRO at ``stage`` in fp32 with the test's own SGD (the Trainer passes its optimizer the same way),
    without DeepSpeed's default clipping at norm 1.0, which the reference step does not do. Its buckets
    are small: the default reduction bucket (5e8 elements, 1.9 GiB in fp32) is allocated at the first
    backward, which an auto mini-batch budget would rightly count."""
    return {
        "train_micro_batch_size_per_gpu": ROWS_PER_RANK,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**16, "allgather_bucket_size": 2**16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def deepspeed_engine(model: nn.Module, loss: nn.Module, stage: int):
    """``model`` under a DeepSpeed engine at ZeRO ``stage`` with SGD, the engine in the loss as the Trainer
    puts it there."""
    import deepspeed

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(stage))
    use_wrapped_model(loss, engine)
    return engine


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of ``model`` gathered whole from the engine's partitions (ZeRO 2 and 3 shard them)."""
    from deepspeed.utils import safe_get_full_grad

    grads = {name: safe_get_full_grad(p) for name, p in model.named_parameters()}
    return {name: grad.clone() for name, grad in grads.items() if grad is not None}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole: a trained one as the engine's fp32 copy, a frozen one (a LoRA
    adapter's base weights, which the optimizer holds no copy of) gathered from its ZeRO-3 partitions."""
    from deepspeed import zero
    from deepspeed.utils import safe_get_full_fp32_param

    with zero.GatheredParameters([p for p in model.parameters() if not p.requires_grad]):
        return {
            name: (safe_get_full_fp32_param(p) if p.requires_grad else p.detach()).clone()
            for name, p in model.named_parameters()
        }


def deepspeed_run(case_name: str, stage: int, model_dir: Path, guide_dir: Path) -> list[dict]:
    """The case's steps under a DeepSpeed engine at ZeRO ``stage``; each rank records the full (gathered)
    gradients and fp32 parameters."""
    case = CASES[case_name]
    rank = dist.get_rank()
    model = case_model(case, model_dir)
    loss = case.build(model, load_guide(guide_dir))
    engine = deepspeed_engine(model, loss, stage)
    records = []
    for step in range(case.steps):
        value = loss(features_of(model, rank_share(global_batch(step), rank)), None)
        engine.backward(value)
        record = {"loss": value.item(), "grads": full_grads(model)}
        engine.step()
        record["params"] = full_params(model)
        record["memory"] = queued(loss)
        record["query_memory"] = queued_anchors(loss)
        records.append(record)
    engine.destroy()
    return records


def deepspeed_auto_run(stage: int, model_dir: Path) -> dict:
    """One step of MatryoshkaLoss(CachedMNRL) with ``mini_batch_size="auto"`` and a budget under ZeRO
    ``stage``: the record of the step, or the error it raised."""
    from st_ext import losses

    model = load_model(model_dir)
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=0.5)
    loss = losses.MatryoshkaLoss(model, inner, MATRYOSHKA_DIMS)
    engine = deepspeed_engine(model, loss, stage)
    try:
        value = loss(features_of(model, rank_share(global_batch(0), dist.get_rank())), None)
    except ValueError as error:
        engine.destroy()
        return {"error": str(error)}
    engine.backward(value)
    record = {
        "error": None,
        "loss": value.item(),
        "size": inner.auto_mini_batch.choice.size,
        "grads": full_grads(model),
    }
    engine.destroy()
    return record


def run_deepspeed_checks(model_dir: Path, guide_dir: Path, out_dir: Path, case_names: list[str]) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for name in case_names:
        for stage in ZERO_STAGES:
            torch.save(deepspeed_run(name, stage, model_dir, guide_dir), out_dir / f"{name}-zero{stage}-rank{rank}.pt")
    for stage in ZERO_STAGES:
        torch.save(deepspeed_auto_run(stage, model_dir), out_dir / f"auto-zero{stage}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def without_unused_parameter_detection(model_dir: Path) -> dict:
    """Two steps under DDP with find_unused_parameters=False, on a model whose BERT pooler the loss
    never uses: the gradient of one used weight after the first step, and the error of the second.

    DDP then waits for the pooler's gradient, never all-reduces, and only notices at the next forward.
    """
    from st_ext import losses

    model = load_model(model_dir)
    ddp = wrap_in_ddp(model, find_unused_parameters=False)
    loss = losses.MultipleNegativesRankingLoss(model)
    use_wrapped_model(loss, ddp)
    share = rank_share(global_batch(0), dist.get_rank())
    forward_backward(model, loss, share)
    first_step_grad = next(p for p in model.parameters() if p.grad is not None).grad.clone()
    model.zero_grad(set_to_none=True)
    try:
        forward_backward(model, loss, share)
    except RuntimeError as error:
        return {"first_step_grad": first_step_grad, "second_step_error": str(error)}
    return {"first_step_grad": first_step_grad, "second_step_error": None}


def reentrant_checkpointing_error(model_dir: Path) -> str | None:
    """The error re-entrant checkpointing raises under DDP with find_unused_parameters=True, or None.

    A re-entrant checkpoint hides the layers' parameters from the outer graph, so DDP marks them
    unused (ready) at the start of backward, and again when the recomputation produces their
    gradients.
    """
    from st_ext import losses

    model = load_model(model_dir, checkpointing=True, checkpoint_kwargs={"use_reentrant": True})
    ddp = wrap_in_ddp(model, find_unused_parameters=True)
    loss = losses.MultipleNegativesRankingLoss(model)
    use_wrapped_model(loss, ddp)
    try:
        forward_backward(model, loss, rank_share(global_batch(0), dist.get_rank()))
    except RuntimeError as error:
        return str(error)
    return None


def run_loss_checks(model_dir: Path, guide_dir: Path, out_dir: Path, case_names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD_SIZE, "launch with --nproc_per_node 2"
    for name in case_names:
        torch.save(ddp_run(name, model_dir, guide_dir), out_dir / f"{name}-rank{rank}.pt")
        if fsdp2_available():
            for resharding in FSDP2_RESHARDING:
                records = fsdp2_run(name, model_dir, guide_dir, resharding)
                torch.save(records, out_dir / f"{name}-fsdp2-{resharding}-rank{rank}.pt")
    # The failure cases go last, each leaving its DDP reducer mid-iteration.
    torch.save(without_unused_parameter_detection(model_dir), out_dir / f"no-unused-detection-rank{rank}.pt")
    torch.save({"error": reentrant_checkpointing_error(model_dir)}, out_dir / f"reentrant-rank{rank}.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The user's training scripts, unchanged under torchrun


# What both unchanged training scripts ask of their trainer: two steps, checkpointing, gloo on the CPU.
TRAINER_SETTINGS = dict(
    max_steps=2,
    per_device_train_batch_size=ROWS_PER_RANK,
    gradient_checkpointing=True,
    ddp_backend="gloo",
    use_cpu=True,
    optim="sgd",  # linear in the gradients, so engines that reduce in another order agree to round-off
    learning_rate=1e-3,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def two_step_dataset():
    """The rows of two global batches, as a dataset of the three text columns."""
    from datasets import Dataset

    first, second = global_batch(0), global_batch(1)
    return Dataset.from_dict({name: first[i] + second[i] for i, name in enumerate(COLUMNS)})


def train_sentence_transformer(model_dir: Path, output_dir: Path, **engine_settings):
    """A plain st_ext script: cached Matryoshka loss, gradient checkpointing, two steps on the CPU; the
    trained model is saved in ``output_dir/final``. ``engine_settings`` replace training arguments."""
    from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses

    model = sentence_transformer_from(model_dir)
    dataset = two_step_dataset()
    loss = losses.MatryoshkaLoss(
        model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE), MATRYOSHKA_DIMS
    )
    args = SentenceTransformerTrainingArguments(output_dir=str(output_dir), **{**TRAINER_SETTINGS, **engine_settings})
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    trainer.train()
    trainer.save_model(str(output_dir / "final"))
    return trainer


def train_cross_encoder(classifier_dir: Path, output_dir: Path):
    """A plain st_ext CrossEncoder script (default loss), with gradient checkpointing, two steps."""
    from datasets import Dataset

    from st_ext import CrossEncoderTrainer, CrossEncoderTrainingArguments

    model = cross_encoder_from(classifier_dir)
    anchors, positives, negatives = global_batch(0)
    labels = [1.0] * len(positives) + [0.0] * len(negatives)
    dataset = Dataset.from_dict({"query": anchors + anchors, "passage": positives + negatives, "label": labels})
    args = CrossEncoderTrainingArguments(output_dir=str(output_dir), **TRAINER_SETTINGS)
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return trainer


def parameter_digest(model: nn.Module) -> str:
    """A hash of every parameter's bytes (an FSDP2 shard gathered whole): equal on all ranks iff the
    engine kept the replicas identical."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(full(p.detach()).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def trainer_report(trainer) -> dict:
    """What the trainer did: whether it trained distributed, under which DDP settings, and the result."""
    wrapped = trainer.model_wrapped
    return {
        "world_size": trainer.args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "global_step": trainer.state.global_step,
        "wrapped_in": type(wrapped).__name__,
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        "checkpointing": bool(trainer.model.is_gradient_checkpointing),
        "digest": parameter_digest(trainer.model),
    }


def run_and_report(train: Callable, *args, **kwargs) -> dict:
    """The trainer's report, or the error it stopped with (raised alike on every rank, so none hangs)."""
    try:
        return {"report": trainer_report(train(*args, **kwargs)), "error": None}
    except RuntimeError as error:
        return {"report": None, "error": f"{type(error).__name__}: {error}"}


def run_training_scripts(model_dir: Path, classifier_dir: Path, out_dir: Path) -> None:
    reports = {
        "sentence_transformer": run_and_report(train_sentence_transformer, model_dir, out_dir / "st"),
        "cross_encoder": run_and_report(train_cross_encoder, classifier_dir, out_dir / "ce"),
    }
    save_report_and_close(out_dir, "train", reports)


def save_report_and_close(out_dir: Path, name: str, report: dict) -> None:
    """Write this rank's ``report`` as ``out_dir/{name}-rank{rank}.json``, then close the trainers' process
    group: left open, it can abort the interpreter's exit ("terminate called without an active
    exception") while its threads are torn down."""
    rank = int(os.environ["RANK"])
    (out_dir / f"{name}-rank{rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def trainer_deepspeed_config(stage: int) -> dict:
    """What a user writes for the Trainer: sizes, clipping and optimizer left to the Trainer ("auto"); at
    stage 3 the weights are gathered on save, so that the saved model holds them."""
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {"stage": stage}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }


#: The Trainer's settings for DeepSpeed at each ZeRO stage. Without ``use_cpu``: with it, accelerate
#: trains with DDP and ignores the DeepSpeed config; DeepSpeed picks its CPU accelerator itself.
DEEPSPEED_SETTINGS = {stage: {"deepspeed": trainer_deepspeed_config(stage), "use_cpu": False} for stage in ZERO_STAGES}


def run_deepspeed_training(model_dir: Path, out_dir: Path, stage: int) -> None:
    """The unchanged sentence-transformer script with the Trainer's ``deepspeed`` argument at ``stage``.

    On a machine without an accelerator, accelerate counts one process (it finds no backend) while
    DeepSpeed's engine spans both ranks: every rank reads the whole dataset and the engine averages
    identical gradients, so the run equals one process's training.
    """
    settings = DEEPSPEED_SETTINGS[stage]
    report = run_and_report(train_sentence_transformer, model_dir, out_dir / f"zero{stage}", **settings)
    save_report_and_close(out_dir, f"train-zero{stage}", report)


#: How a script is put under FSDP2: an accelerate config, or the Trainer's own arguments.
FSDP2_ROUTES = ("accelerate-config", "trainer-arguments")
#: FSDP2 through the Trainer's own arguments (transformers 5; its default FSDP version is 2). Sharding
#: each BERT layer, then the whole model, as the accelerate config in ``examples/`` does.
FSDP2_TRAINER_ARGUMENTS = dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["BertLayer"]})


def let_accelerate_shard_on_cpu() -> None:
    """accelerate turns FSDP on only for GPU-type distributed runs: on CPU ranks (``MULTI_CPU``) it keeps
    DDP and drops the FSDP plugin, though its FSDP2 path (``fully_shard`` over a device mesh) runs on
    gloo. Keep the plugin on CPU ranks as accelerate does on GPUs, so that the Trainer's FSDP2 path runs
    here. ``AcceleratorState()`` is called again later without the plugin (by the prepared optimizer),
    so the plugin is remembered and put back each time."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__
    remembered = []

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            remembered[:] = [fsdp_plugin]
        if remembered and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = remembered[0]

    AcceleratorState.__init__ = init


def run_fsdp2_training(model_dir: Path, out_dir: Path, route: str) -> None:
    """The unchanged sentence-transformer script under FSDP2, set by an accelerate config (the launching
    test puts the environment ``accelerate launch`` derives from it) or by the Trainer's arguments."""
    let_accelerate_shard_on_cpu()
    settings = FSDP2_TRAINER_ARGUMENTS if route == "trainer-arguments" else {}
    report = run_and_report(train_sentence_transformer, model_dir, out_dir / route, **settings)
    save_report_and_close(out_dir, f"fsdp2-{route}", report)


def train_with_guide_loaded_last(
    model_dir: Path, guide_dir: Path, output_dir: Path, frozen_encoders: str = "resident", **engine_settings
):
    """An arguments-first st_ext script, as scripts parsing their arguments with ``HfArgumentParser``
    are: the training arguments, then the model and its GIST guide, cached GIST loss, two steps; the
    trained model is saved in ``output_dir/final``. Returns the trainer and whether the guide was
    partitioned across ranks when the loss got it."""
    from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from st_ext.gradient_sync import zero3_partitioned

    args = SentenceTransformerTrainingArguments(output_dir=str(output_dir), **{**TRAINER_SETTINGS, **engine_settings})
    model, guide = sentence_transformer_from(model_dir), load_guide(guide_dir)
    partitioned = zero3_partitioned(guide)
    loss = cached_gist(gathered=False)(model, guide)
    dataset = two_step_dataset()
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=loss, frozen_encoders=frozen_encoders
    )
    trainer.train()
    trainer.save_model(str(output_dir / "final"))
    return trainer, partitioned


def offload_refusal(model_dir: Path, guide_dir: Path, output_dir: Path) -> str | None:
    """The error of ``frozen_encoders="offload"`` for a guide loaded (so partitioned) after ZeRO-3 arguments."""
    from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    settings = {**TRAINER_SETTINGS, **DEEPSPEED_SETTINGS[3]}
    args = SentenceTransformerTrainingArguments(output_dir=str(output_dir), **settings)
    model, guide = sentence_transformer_from(model_dir), load_guide(guide_dir)
    try:
        SentenceTransformerTrainer(
            model=model, args=args, train_dataset=two_step_dataset(), loss=cached_gist(gathered=False)(model, guide),
            frozen_encoders="offload",
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    return None


def run_guide_loaded_last(model_dir: Path, guide_dir: Path, out_dir: Path, frozen_encoders: str) -> None:
    """The arguments-first GIST script under ZeRO-3 (see ``run_deepspeed_training`` for what it equals)."""
    output_dir = out_dir / frozen_encoders
    try:
        trainer, partitioned = train_with_guide_loaded_last(
            model_dir, guide_dir, output_dir, frozen_encoders, **DEEPSPEED_SETTINGS[3]
        )
        report = {"report": trainer_report(trainer), "guide_partitioned": partitioned, "error": None}
    except (RuntimeError, ValueError) as error:
        report = {"report": None, "error": f"{type(error).__name__}: {error}"}
    if frozen_encoders == "resident":
        report["offload_error"] = offload_refusal(model_dir, guide_dir, out_dir / "offload")
    save_report_and_close(out_dir, f"guide-{frozen_encoders}", report)


# ---------------------------------------------------------------------------------------------
# Engine parity with upstream's cached losses (tests/test_engine_parity.py)

#: The losses each parity scenario runs: upstream's uncached loss (the reference), st_ext's cached loss
#: and upstream's own cached loss, both at ``MINI_BATCH_SIZE`` (several mini-batches per column).
PARITY_KINDS = ("plain", "st_ext", "st_ext_partial", "upstream")


#: Where ``archetype-engines`` trains every archetype's upstream cached loss: DDP, FSDP2 (by the example
#: accelerate config, whose environment the launching test sets), and each ZeRO stage.
ARCHETYPE_ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
#: Two steps of 8 rows per rank, evaluated after each (an eval loss over 8 rows in batches of 4, and for the
#: SentenceTransformer an information-retrieval evaluator), so that step 2 follows an evaluation.
ARCHETYPE_TRAINER_SETTINGS = dict(
    max_steps=2,
    per_device_train_batch_size=ROWS_PER_RANK,
    per_device_eval_batch_size=4,
    eval_strategy="steps",
    eval_steps=1,
    logging_steps=1,
    ddp_backend="gloo",
    use_cpu=True,
    optim="sgd",
    learning_rate=0.5,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def archetype_evaluator(archetype: str, queries: list[str], documents: list[str]):
    """For the SentenceTransformer, upstream's information-retrieval evaluator over the eval rows."""
    if archetype != "SentenceTransformer":
        return None
    from st_ext._compat import information_retrieval_evaluator

    return information_retrieval_evaluator()(
        queries={str(i): text for i, text in enumerate(queries)},
        corpus={str(i): text for i, text in enumerate(documents)},
        relevant_docs={str(i): {str(i)} for i in range(len(queries))},
        name="ir",
        show_progress_bar=False,
    )


def train_archetype(
    name: str, model_dirs: dict[str, Path], output_dir: Path, *, eval_loss: bool = True, **engine_settings
):
    """``archetype_losses.CASES[name]``: upstream's cached loss object, trained by st_ext's trainer of its
    archetype with ``engine_settings``, and evaluated after each step (the eval loss only with ``eval_loss``);
    the trained model is saved in ``output_dir/final``."""
    from archetype_losses import CASES, case_dataset, case_loss, case_model

    import st_ext

    case = CASES[name]
    model = case_model(name, model_dirs)
    evaluation = case_dataset(name, rows=8, seed=3)
    columns = list(evaluation.column_names)
    settings = {**ARCHETYPE_TRAINER_SETTINGS, **engine_settings}
    evaluator = archetype_evaluator(case.archetype, evaluation[columns[0]], evaluation[columns[1]])
    if evaluator is None and not eval_loss:
        settings["eval_strategy"] = "no"
    args = getattr(st_ext, f"{case.archetype}TrainingArguments")(output_dir=str(output_dir), **settings)
    trainer = getattr(st_ext, f"{case.archetype}Trainer")(
        model=model,
        args=args,
        train_dataset=case_dataset(name),
        eval_dataset=evaluation if eval_loss else None,
        loss=case_loss(name, model),
        evaluator=evaluator,
    )
    trainer.train()
    try:
        trainer.save_model(str(output_dir / "final"))
    except RuntimeError as error:
        # Upstream's Dense module saves with safetensors, which refuses a weight that is a view into ZeRO 1/2's
        # flat parameter buffer ("None is covering the entire storage"); the weights are whole on every rank.
        if "covering the entire storage" not in str(error):
            raise
        torch.save({key: value.detach().clone() for key, value in model.named_parameters()}, output_dir / UNSAVED)
    return trainer


#: Where :func:`train_archetype` puts the trained weights when upstream cannot save the model.
UNSAVED = "weights-upstream-could-not-save.pt"


def archetype_report(trainer) -> dict:
    """What the trainer did (upstream's models lack the checkpointing flag :func:`trainer_report` reads), and
    every logged training loss and evaluation result."""
    logged = [
        {
            key: value
            for key, value in entry.items()
            if key == "loss" or (key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")))
        }
        for entry in trainer.state.log_history
    ]
    return {
        "world_size": trainer.args.world_size,
        "wrapped_in": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "digest": parameter_digest(trainer.model),
        "logged": [entry for entry in logged if entry],
        "engine_forwards": len(trainer.engine_forwards),
    }


def archetype_eval_loss(engine: str) -> bool:
    """Whether the runs under ``engine`` evaluate the loss. Not under DeepSpeed on CPU ranks: accelerate counts
    one process there (see :func:`run_deepspeed_training`) while its gather of the eval losses spans the
    engine's two ("ProcessGroupGloo::allgather: invalid output tensor list"); on accelerators it counts both."""
    return not engine.startswith("zero")


def run_archetype_engines(model_dirs: dict[str, Path], out_dir: Path, engine: str, names: list[str]) -> None:
    """Each case through st_ext's trainer under ``engine``; DeepSpeed's global state is released between
    cases, so that a ZeRO-3 config does not partition the next case's model while it loads."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if engine == "fsdp2":
        let_accelerate_shard_on_cpu()
    settings = DEEPSPEED_SETTINGS[int(engine[-1])] if engine.startswith("zero") else {}
    reports = {}
    for name in names:
        try:
            trainer = train_archetype(
                name, model_dirs, out_dir / name, eval_loss=archetype_eval_loss(engine), **settings
            )
            reports[name] = {"report": archetype_report(trainer)}
        except (RuntimeError, ValueError, TypeError) as error:
            reports[name] = {"report": None, "error": "".join(traceback.format_exception(error)[-14:])}
        if engine.startswith("zero"):
            unset_hf_deepspeed_config()
            AcceleratorState._reset_state(reset_partial_state=False)
    save_report_and_close(out_dir, f"archetypes-{engine}", reports)


#: Marks the column that :class:`DetachedColumn` embeds without a graph: a tensor with a row each, so every
#: engine (upstream 4.1's slices every value) cuts it into mini-batches.
FROZEN_COLUMN_KEY = "frozen_column"
PARITY_STEPS = 2


class DetachedColumn(nn.Module):
    """A model's last module: the column whose features carry ``FROZEN_COLUMN_KEY`` comes out without a
    graph, as a column routed through frozen weights (a frozen Router route) does. Given to the last
    column, it makes a cached step's final mini-batch one that no backward runs through."""

    def forward(self, features: dict) -> dict:
        if FROZEN_COLUMN_KEY in features:
            features["sentence_embedding"] = features["sentence_embedding"].detach()
        return features


def parity_loss(kind: str, model: nn.Module) -> nn.Module:
    from st_ext import losses
    from st_ext._compat import st_losses

    if kind == "plain":
        return st_losses().MultipleNegativesRankingLoss(model)
    if kind == "st_ext_partial":
        return cached_mnrl(model, gathered=False, kept_graphs=PARTIAL_KEPT_GRAPHS)
    upstream = st_losses().CachedMultipleNegativesRankingLoss
    cached = losses.CachedMultipleNegativesRankingLoss if kind == "st_ext" else upstream
    return cached(model, mini_batch_size=MINI_BATCH_SIZE)


def counted_reductions(ddp: nn.Module) -> list[int]:
    """A one-element counter of the gradient buckets DDP all-reduces (its communication hook's calls)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    count = [0]

    def hook(state, bucket):
        count[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return count


def parity_run(kind: str, model_dir: Path, *, frozen_last: bool = False, static_graph: bool = False) -> list[dict]:
    """``PARITY_STEPS`` DDP steps of the ``kind`` loss (the first only with ``frozen_last``); each record
    holds the loss, how many buckets DDP all-reduced in the step, the gradients and the updated
    parameters, or the error that stopped the step."""
    rank = dist.get_rank()
    model = load_model(model_dir)
    if frozen_last:
        model.append(DetachedColumn())
    loss = parity_loss(kind, model)
    engine = {"static_graph": True} if static_graph else {"find_unused_parameters": True}
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, **engine)
    reductions = counted_reductions(ddp)
    use_wrapped_model(loss, ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    records = []
    for step in range(1 if frozen_last else PARITY_STEPS):
        features = features_of(model, rank_share(global_batch(step), rank))
        if frozen_last:
            features[-1][FROZEN_COLUMN_KEY] = torch.ones(ROWS_PER_RANK, dtype=torch.bool)
        reductions[0] = 0
        try:
            value = loss(features, None)
            value.backward()
        except Exception as error:  # the scenario records what upstream or st_ext raised
            records.append({"error": f"{type(error).__name__}: {error}"})
            break
        record = {"loss": value.item(), "reductions": reductions[0]}
        apply_update(model, optimizer, loss, record)
        records.append(record)
    return records


def frozen_last_reference(model_dir: Path) -> list[dict]:
    """The step :func:`parity_run` with ``frozen_last`` stands for, in this process without DDP: the mean of
    the uncached loss's gradients over every rank's share (DDP's average), and the update it makes."""
    model = load_model(model_dir)
    model.append(DetachedColumn())
    loss = parity_loss("plain", model)
    grads: dict[str, torch.Tensor] = {}
    for rank in range(WORLD_SIZE):
        features = features_of(model, rank_share(global_batch(0), rank))
        features[-1][FROZEN_COLUMN_KEY] = torch.ones(ROWS_PER_RANK, dtype=torch.bool)
        loss(features, None).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = grads.get(name, 0) + p.grad / WORLD_SIZE
        model.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        p.grad = grads.get(name)
    record: dict = {}
    apply_update(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), loss, record)
    return [record]


def run_engine_parity(model_dir: Path, out_dir: Path) -> None:
    """Every parity scenario on this rank, saved to ``parity-rank<rank>.pt``. A collective that one rank
    skips fails after a minute instead of hanging; the frozen-last-column runs go last, since one that
    leaves DDP's reducer mid-iteration is of no use to a later run."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {
        "ddp": {kind: parity_run(kind, model_dir) for kind in PARITY_KINDS},
        "static_graph": {kind: parity_run(kind, model_dir, static_graph=True) for kind in PARITY_KINDS},
        "frozen_last": {
            "reference": frozen_last_reference(model_dir),
            **{kind: parity_run(kind, model_dir, frozen_last=True) for kind in PARITY_KINDS if kind != "plain"},
        },
    }
    torch.save(results, out_dir / f"parity-rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    losses_parser = sub.add_parser("losses")
    losses_parser.add_argument("--model", type=Path, required=True)
    losses_parser.add_argument("--guide", type=Path, required=True)
    losses_parser.add_argument("--out", type=Path, required=True)
    losses_parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    deepspeed_parser = sub.add_parser("deepspeed")
    deepspeed_parser.add_argument("--model", type=Path, required=True)
    deepspeed_parser.add_argument("--guide", type=Path, required=True)
    deepspeed_parser.add_argument("--out", type=Path, required=True)
    deepspeed_parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    deepspeed_train_parser = sub.add_parser("deepspeed-train")
    deepspeed_train_parser.add_argument("--model", type=Path, required=True)
    deepspeed_train_parser.add_argument("--out", type=Path, required=True)
    deepspeed_train_parser.add_argument("--stage", type=int, choices=ZERO_STAGES, required=True)
    guide_parser = sub.add_parser("deepspeed-guide")
    guide_parser.add_argument("--model", type=Path, required=True)
    guide_parser.add_argument("--guide", type=Path, required=True)
    guide_parser.add_argument("--out", type=Path, required=True)
    guide_parser.add_argument("--frozen-encoders", choices=("resident", "precompute"), required=True)
    fsdp_parser = sub.add_parser("fsdp2-train")
    fsdp_parser.add_argument("--model", type=Path, required=True)
    fsdp_parser.add_argument("--out", type=Path, required=True)
    fsdp_parser.add_argument("--route", choices=FSDP2_ROUTES, required=True)
    parity_parser = sub.add_parser("engine-parity")
    parity_parser.add_argument("--model", type=Path, required=True)
    parity_parser.add_argument("--out", type=Path, required=True)
    archetypes_parser = sub.add_parser("archetype-engines")
    archetypes_parser.add_argument("--models", type=Path, required=True)
    archetypes_parser.add_argument("--out", type=Path, required=True)
    archetypes_parser.add_argument("--engine", choices=ARCHETYPE_ENGINES, required=True)
    archetypes_parser.add_argument("cases", nargs="+")
    train_parser = sub.add_parser("train")
    train_parser.add_argument("--model", type=Path, required=True)
    train_parser.add_argument("--classifier", type=Path, required=True)
    train_parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.mode == "losses":
        run_loss_checks(args.model, args.guide, args.out, args.cases)
    elif args.mode == "deepspeed":
        run_deepspeed_checks(args.model, args.guide, args.out, args.cases)
    elif args.mode == "deepspeed-train":
        run_deepspeed_training(args.model, args.out, args.stage)
    elif args.mode == "fsdp2-train":
        run_fsdp2_training(args.model, args.out, args.route)
    elif args.mode == "engine-parity":
        run_engine_parity(args.model, args.out)
    elif args.mode == "archetype-engines":
        model_dirs = {path.name: path for path in args.models.iterdir()}
        run_archetype_engines(model_dirs, args.out, args.engine, args.cases)
    elif args.mode == "deepspeed-guide":
        run_guide_loaded_last(args.model, args.guide, args.out, args.frozen_encoders)
    else:
        run_training_scripts(args.model, args.classifier, args.out)


if __name__ == "__main__":
    main()
    # Every report is written and the process group closed. The interpreter's teardown can still abort a
    # rank now and then ("terminate called without an active exception", a C++ thread of torch's process
    # group runtime destroyed while joinable), failing a run whose results are all in: end without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
