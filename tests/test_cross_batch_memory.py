"""CrossBatchMemoryLoss: the wrapped loss with an empty queue, the loss over batch + detached queue with
a filled one (reference built by hand), FIFO bookkeeping, checkpoints and resume, DDP gathering,
and the errors bad input gets."""

from __future__ import annotations

import inspect
import logging
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from loss_checks import assert_same_grads, features_of, loss_and_grads, random_texts, text_columns
from sentence_transformers.util import cos_sim
from tiny_models import sentence_transformer_from
from transformers import TrainerCallback

from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from st_ext._compat import st_losses
from st_ext.losses import triplet
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss
from st_ext.losses.gathering import gather_from_ranks
from st_ext.losses.memory_bank import MemoryBank, document_keys, enqueue
from st_ext.training.memory_checkpoints import MEMORY_FILENAME, CrossBatchMemoryCallback, MissingMemoryError

upstream = st_losses()
BATCH = 6
# (build the wrapped loss, dropout on): a cached loss's mini-batches draw dropout masks of their own
# (trimmed) shape, so with dropout the whole batch is one mini-batch; without, it is split in three.
RANKING = [
    pytest.param(lambda model: upstream.MultipleNegativesRankingLoss(model), True, id="mnrl"),
    pytest.param(
        lambda model: upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=BATCH),
        True,
        id="cached-dropout",
    ),
    pytest.param(
        lambda model: upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), False, id="cached-3"
    ),
]
COLUMNS = [pytest.param(2, id="pairs"), pytest.param(3, id="hard-negative")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fill(loss, columns, labels=None):
    """One training-mode forward, which enqueues the batch; returns the queue as it was before."""
    before = (loss.memory_embeddings, loss.memory_labels)
    loss.model.train()
    loss(features_of(loss.model, columns), labels)
    return before


class ExplicitRankingReference(torch.nn.Module):
    """MNRL over (anchor, positive, negatives...) with a fixed queue appended to the candidates."""

    def __init__(self, model, queue, scale=20.0, left_out=()):
        super().__init__()
        self.model, self.queue, self.scale, self.left_out = model, queue, scale, left_out

    def forward(self, sentence_features, labels):
        """``left_out``: (anchor row, queue row) pairs removed from that anchor's softmax."""
        embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        documents = torch.cat(embeddings[1:])
        scores = cos_sim(embeddings[0], torch.cat([documents, self.queue.detach()])) * self.scale
        for row, queue_row in self.left_out:
            scores = scores.index_put(
                (torch.tensor(row), torch.tensor(len(documents) + queue_row)), torch.tensor(-torch.inf)
            )
        return F.cross_entropy(scores, torch.arange(len(scores)))


# ---------------------------------------------------------------------------------------------
# Values and gradients


@pytest.mark.parametrize("make_loss, train", RANKING)
@pytest.mark.parametrize("num_columns", COLUMNS)
def test_empty_memory_equals_the_wrapped_loss(model, make_loss, train, num_columns):
    columns = text_columns(BATCH, num_columns)
    inner = make_loss(model)
    memory = CrossBatchMemoryLoss(model, inner, memory_size=32)
    assert_same_grads(
        loss_and_grads(model, memory, columns, train=train), loss_and_grads(model, inner, columns, train=train)
    )


@pytest.mark.parametrize("make_loss, train", RANKING)
@pytest.mark.parametrize("num_columns", COLUMNS)
def test_filled_memory_equals_the_loss_over_batch_and_queue(model, make_loss, train, num_columns):
    loss = CrossBatchMemoryLoss(model, make_loss(model), memory_size=32)
    fill(loss, text_columns(BATCH, num_columns, seed=1))
    fill(loss, text_columns(BATCH, num_columns, seed=2))
    queue = loss.memory_embeddings.clone()
    assert len(queue) == 2 * BATCH * (num_columns - 1)
    columns = text_columns(BATCH, num_columns, seed=3)
    reference = ExplicitRankingReference(model, queue)
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=train), loss_and_grads(model, reference, columns, train=train)
    )


def loss_over_candidates(model, features, queue, scale=20.0):
    """MNRL's cross-entropy computed by hand: every anchor against the batch's documents followed by ``queue``."""
    embeddings = [model(f)["sentence_embedding"] for f in features]
    candidates = torch.cat([*embeddings[1:], queue])
    scores = cos_sim(embeddings[0], candidates) * scale
    return F.cross_entropy(scores, torch.arange(len(scores)))


@pytest.mark.parametrize(
    "make_loss",
    [
        pytest.param(lambda model: upstream.MultipleNegativesRankingLoss(model), id="mnrl"),
        pytest.param(lambda model: upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), id="cached"),
    ],
)
def test_queued_copies_of_the_batchs_documents_are_left_out_of_the_candidates(model, make_loss):
    """A queued row with the token ids of any of this batch's documents (anchor 0's positive, another
    anchor's hard negative) is left out of every anchor's candidates; the rest of the queue stays."""
    first = text_columns(BATCH, 3, seed=1)
    second = text_columns(BATCH, 3, seed=2)
    second[1][0] = first[1][3]  # anchor 0's positive was queued by the first batch (queue row 3)
    second[2][4] = first[2][1]  # anchor 4's hard negative too (queue row BATCH + 1)
    masked = CrossBatchMemoryLoss(model, make_loss(model), memory_size=32)
    unmasked = CrossBatchMemoryLoss(model, make_loss(model), 32, mask_own_positive=False)
    fill(masked, first)
    fill(unmasked, first)
    queue = masked.memory_embeddings
    kept = [row for row in range(len(queue)) if row not in (3, BATCH + 1)]
    model.eval()
    features = features_of(model, second)
    with torch.no_grad():
        expected_masked = loss_over_candidates(model, features, queue[kept])
        expected_unmasked = loss_over_candidates(model, features, unmasked.memory_embeddings)
    with torch.enable_grad():  # a training-mode step reads the queue
        torch.testing.assert_close(masked(features, None).detach(), expected_masked)
        torch.testing.assert_close(unmasked(features, None).detach(), expected_unmasked)


@pytest.mark.parametrize("loss_name", ["BatchAllTripletLoss", "BatchHardTripletLoss", "BatchSemiHardTripletLoss"])
def test_triplet_memory_uses_queued_references(model, loss_name):
    """Same loss, values and gradients as the triplet loss over batch + queue (queue detached)."""
    inner = getattr(triplet, loss_name)(model, margin=0.5)
    loss = CrossBatchMemoryLoss(model, inner, memory_size=64)
    fill(loss, [random_texts(8, seed=1)], torch.arange(8) % 4)
    fill(loss, [random_texts(8, seed=2)], torch.arange(8) % 4)
    queue, queue_labels = loss.memory_embeddings.clone(), loss.memory_labels.clone()
    texts, labels = random_texts(8, seed=3), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])

    def with_reference(features, _labels):
        embeddings = model(features[0])["sentence_embedding"]
        return inner.compute_loss_from_embeddings([embeddings], labels, queue, queue_labels)

    assert_same_grads(
        loss_and_grads(model, lambda f, _: loss(f, labels), [texts], train=True),
        loss_and_grads(model, with_reference, [texts], train=True),
    )
    plain = loss_and_grads(model, lambda f, _: inner(f, labels), [texts], train=True)[0]
    assert plain != loss_and_grads(model, with_reference, [texts], train=True)[0]


def test_upstream_triplet_loss_is_accepted(model):
    inner = upstream.BatchAllTripletLoss(model, margin=0.5)
    loss = CrossBatchMemoryLoss(model, inner, memory_size=16)
    columns, labels = [random_texts(8, seed=4)], torch.arange(8) % 3
    expected = loss_and_grads(model, lambda f, _: inner(f, labels), columns, train=True)
    assert_same_grads(loss_and_grads(model, lambda f, _: loss(f, labels), columns, train=True), expected)


def test_evaluation_computes_the_plain_loss_and_leaves_the_queue(model):
    inner = upstream.MultipleNegativesRankingLoss(model)
    loss = CrossBatchMemoryLoss(model, inner, memory_size=32)
    fill(loss, text_columns(BATCH, 2, seed=1))
    queue = loss.memory_embeddings
    model.eval()
    features = features_of(model, text_columns(BATCH, 2, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(loss(features, None), inner(features, None))
    assert loss.memory_embeddings is queue


# ---------------------------------------------------------------------------------------------
# The queue


def test_fifo_order_wrap_around_and_size():
    bank, history, history_labels = MemoryBank(), [], []
    for step in range(7):
        rows = torch.full((3, 2), float(step)) + torch.arange(3.0)[:, None] / 10
        labels = torch.arange(3) + 10 * step
        bank = enqueue(bank, rows, labels, memory_size=5)
        history.append(rows)
        history_labels.append(labels)
        torch.testing.assert_close(bank.embeddings, torch.cat(history)[-5:])
        torch.testing.assert_close(bank.labels, torch.cat(history_labels)[-5:])
    bank = enqueue(bank, torch.randn(8, 2), torch.arange(8), memory_size=5)  # more rows than the memory
    assert bank.labels.tolist() == [3, 4, 5, 6, 7]


def test_queue_holds_no_graph_and_stays_bounded(model):
    loss = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=10)
    for seed in range(3):
        model.train()
        loss(features_of(model, text_columns(BATCH, 2, seed=seed)), None).backward()
    assert len(loss.memory_embeddings) == len(loss.memory_labels) == 10
    assert not loss.memory_embeddings.requires_grad and loss.memory_embeddings.grad_fn is None


def test_document_keys_ignore_padding(model):
    texts = ["the cat is in the house", "a dog"]
    alone = document_keys(features_of(model, [texts[1:]])[0])
    padded = document_keys(features_of(model, [texts])[0])
    assert alone[0] == padded[1] and padded[0] != padded[1] and (padded >= 0).all()


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume


def triplet_dataset(rows: int = 16) -> Dataset:
    return Dataset.from_dict({"text": random_texts(rows, seed=11), "label": [i % 4 for i in range(rows)]})


def memory_trainer(path, output_dir, max_steps=2):
    model = sentence_transformer_from(path)
    loss = CrossBatchMemoryLoss(model, triplet.BatchAllTripletLoss(model, margin=0.5), memory_size=12)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=triplet_dataset(), loss=loss), loss


def assert_same_state(state, expected):
    assert state["memory_size"] == expected["memory_size"]
    torch.testing.assert_close(state["embeddings"], expected["embeddings"], rtol=0, atol=0)
    assert torch.equal(state["labels"], expected["labels"])


class RecordMemoryAtStart(TrainerCallback):
    """The queue as training (re)starts, after the checkpoint is loaded."""

    def __init__(self, loss):
        self.loss, self.state = loss, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = self.loss.memory_state()


def test_resume_restores_the_queue(tiny_bert_dir, tmp_path):
    trainer, loss = memory_trainer(tiny_bert_dir, tmp_path)
    trainer.train()
    saved = {step: torch.load(tmp_path / f"checkpoint-{step}" / MEMORY_FILENAME)["losses"]["loss"] for step in (1, 2)}
    assert len(saved[1]["embeddings"]) == 4 and len(saved[2]["embeddings"]) == 8
    assert_same_state(loss.memory_state(), saved[2])

    resumed, resumed_loss = memory_trainer(tiny_bert_dir, tmp_path)
    at_start = RecordMemoryAtStart(resumed_loss)
    resumed.add_callback(at_start)
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint
    assert_same_state(at_start.state, saved[2])

    continued, continued_loss = memory_trainer(tiny_bert_dir, tmp_path / "again")
    continued.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))  # restores step 1, runs step 2
    torch.testing.assert_close(continued_loss.memory_state()["embeddings"], saved[2]["embeddings"])
    assert torch.equal(continued_loss.memory_state()["labels"], saved[2]["labels"])


class Killed(BaseException):
    """Stands in for SIGKILL inside the trainer's checkpoint save."""


def test_the_queue_is_in_the_checkpoint_before_anything_else_happens(tiny_bert_dir, tmp_path, monkeypatch):
    """Killed right after the model is saved (before the optimizer, the trainer state and the rotation of
    older checkpoints), the checkpoint already holds the queue."""
    trainer, loss = memory_trainer(tiny_bert_dir, tmp_path, max_steps=1)

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", killed)
    with pytest.raises(Killed):
        trainer.train()
    saved = torch.load(tmp_path / "checkpoint-1" / MEMORY_FILENAME, weights_only=True)["losses"]["loss"]
    assert_same_state(loss.memory_state(), saved)


def test_resuming_without_the_queue_is_an_error_unless_asked_for(tiny_bert_dir, tmp_path, caplog):
    trainer, _ = memory_trainer(tiny_bert_dir, tmp_path)
    trainer.train()
    (tmp_path / "checkpoint-1" / MEMORY_FILENAME).unlink()
    resumed, _ = memory_trainer(tiny_bert_dir, tmp_path / "again")
    with pytest.raises(
        MissingMemoryError, match=r"checkpoint-1/cross_batch_memory.pt does not exist.*resume_empty_memory=True"
    ):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))

    model = sentence_transformer_from(tiny_bert_dir)
    loss = CrossBatchMemoryLoss(model, triplet.BatchAllTripletLoss(model, margin=0.5), memory_size=12)
    args = resumed.args
    empty_ok = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=triplet_dataset(), loss=loss, resume_empty_memory=True
    )
    with caplog.at_level(logging.WARNING):
        empty_ok.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert "starts empty" in caplog.text and empty_ok.state.global_step == 2


def test_the_callback_saves_the_queue_with_an_upstream_trainer(tiny_bert_dir, tmp_path):
    import sentence_transformers

    trainer, loss = memory_trainer(tiny_bert_dir, tmp_path, max_steps=1)
    upstream_trainer = sentence_transformers.SentenceTransformerTrainer(
        model=trainer.model,
        args=trainer.args,
        train_dataset=triplet_dataset(),
        loss=loss,
        callbacks=[CrossBatchMemoryCallback(loss)],
    )
    upstream_trainer.train()
    saved = torch.load(tmp_path / "checkpoint-1" / MEMORY_FILENAME, weights_only=True)["losses"]["loss"]
    assert_same_state(loss.memory_state(), saved)


def test_a_damaged_queue_file_is_named(tiny_bert_dir, tmp_path):
    trainer, _ = memory_trainer(tiny_bert_dir, tmp_path, max_steps=1)
    trainer.train()
    path = tmp_path / "checkpoint-1" / MEMORY_FILENAME
    path.write_bytes(path.read_bytes()[:40])  # truncated, as by a full disk
    resumed, _ = memory_trainer(tiny_bert_dir, tmp_path / "again")
    with pytest.raises(ValueError, match=f"{path} cannot be read"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_memory_state_round_trip_and_smaller_memory(model, tmp_path):
    loss = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=32)
    fill(loss, text_columns(BATCH, 2, seed=1))
    torch.save(loss.memory_state(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    restored = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=32)
    restored.load_memory_state(state)
    assert_same_state(restored.memory_state(), loss.memory_state())
    smaller = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=4)
    smaller.load_memory_state(state)
    assert torch.equal(smaller.memory_labels, loss.memory_labels[-4:])


# ---------------------------------------------------------------------------------------------
# DDP: every rank enqueues every rank's rows


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ddp_worker(rank, world_size, port, model_dir, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        rows = torch.full((rank + 1, 2), float(rank))  # unequal sizes: 1 row on rank 0, 2 on rank 1
        gathered = gather_from_ranks(rows)
        model = sentence_transformer_from(model_dir)
        loss = CrossBatchMemoryLoss(model, triplet.BatchHardTripletLoss(model), memory_size=64)
        model.train()
        texts = random_texts(4, seed=rank)
        loss(features_of(model, [texts]), torch.arange(4) + 10 * rank).backward()
        torch.save({"gathered": gathered, "state": loss.memory_state()}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


class TwoRanks:
    """``torch.distributed`` as rank 1 of 2 sees it, rank 0 contributing ``other_rows``."""

    def __init__(self, other_rows):
        self.other_rows = other_rows

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self):
        return 2

    def all_gather(self, outputs, tensor):
        if tensor.dtype == torch.int64 and tensor.shape == (1,):  # the size exchange
            outputs[0].fill_(len(self.other_rows))
        else:
            outputs[0].zero_()
            outputs[0][: len(self.other_rows)] = self.other_rows
        outputs[1].copy_(tensor)


@pytest.mark.parametrize("own_rows, other_rows", [(3, 1), (1, 3), (2, 2), (0, 2)])
def test_gather_pads_unequal_ranks_and_keeps_rank_order(monkeypatch, own_rows, other_rows):
    import st_ext.losses.gathering as gathering

    other = torch.arange(other_rows * 2.0).reshape(other_rows, 2) + 100
    own = torch.arange(own_rows * 2.0).reshape(own_rows, 2)
    monkeypatch.setattr(gathering, "dist", TwoRanks(other))
    assert torch.equal(gather_from_ranks(own), torch.cat([other, own]))


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_gathers_every_rank_before_enqueueing(tiny_bert_dir, tmp_path):
    """Two gloo processes (slow: each imports the stack): both queues hold both ranks' rows, in rank order."""
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), str(tiny_bert_dir), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for result in results:
        assert result["gathered"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert result["state"]["labels"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert_same_state(results[0]["state"], results[1]["state"])


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("memory_size", [0, -5, 2.5, True, None])
def test_memory_size_must_be_positive(model, memory_size):
    with pytest.raises(ValueError, match="memory_size must be a positive number of rows"):
        CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=memory_size)


def test_embedding_size_change_is_explained(model):
    loss = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=32)
    fill(loss, text_columns(BATCH, 2))
    loss.load_memory_state({**loss.memory_state(), "embeddings": torch.zeros(4, 7), "labels": torch.arange(4)})
    with pytest.raises(ValueError, match="7-dimensional embeddings.*32 dimensions.*changed mid-run"):
        fill(loss, text_columns(BATCH, 2, seed=5))


def test_missing_labels_for_a_triplet_loss_are_explained(model):
    loss = CrossBatchMemoryLoss(model, triplet.BatchAllTripletLoss(model), memory_size=32)
    with pytest.raises(ValueError, match="needs a class label for every text.*'label' column"):
        fill(loss, [random_texts(4, seed=0)])


@pytest.mark.parametrize(
    "make_loss, error, message",
    [
        (lambda m: upstream.CosineSimilarityLoss(m), TypeError, "cannot wrap CosineSimilarityLoss"),
        (lambda m: upstream.MultipleNegativesSymmetricRankingLoss(m), TypeError, "Symmetric variants"),
        (
            lambda m: upstream.MultipleNegativesRankingLoss(sentence_transformer_from_same(m)),
            ValueError,
            "another model",
        ),
    ],
)
def test_unsupported_losses_are_explained(model, make_loss, error, message):
    with pytest.raises(error, match=message):
        CrossBatchMemoryLoss(model, make_loss(model), memory_size=8)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"hardness_mode": "all_negatives", "hardness_strength": 1.0}, "leave them at their defaults"),
        ({"gather_across_devices": True}, "set gather_across_devices=False"),
    ],
)
@pytest.mark.parametrize("ranking_class", ["MultipleNegativesRankingLoss", "CachedMultipleNegativesRankingLoss"])
def test_options_that_cannot_take_extra_candidates_are_refused_in_one_line(model, ranking_class, options, message):
    loss_class = getattr(upstream, ranking_class)
    if not set(options) <= set(inspect.signature(loss_class).parameters):
        pytest.skip(f"{ranking_class} has no {', '.join(options)} on this release")
    with pytest.raises(ValueError, match=message) as raised:
        CrossBatchMemoryLoss(model, loss_class(model, **options), memory_size=8)
    assert "\n" not in str(raised.value)


def test_subclasses_of_the_supported_losses_are_accepted(model):
    class LabelledMNRL(upstream.MultipleNegativesRankingLoss):
        pass

    class LabelledBatchHard(upstream.BatchHardTripletLoss):
        pass

    ranking = CrossBatchMemoryLoss(model, LabelledMNRL(model), memory_size=32)
    fill(ranking, text_columns(BATCH, 2, seed=1))
    columns = text_columns(BATCH, 2, seed=3)
    reference = ExplicitRankingReference(model, ranking.memory_embeddings.clone())
    assert_same_grads(
        loss_and_grads(model, ranking, columns, train=False), loss_and_grads(model, reference, columns, train=False)
    )
    inner = LabelledBatchHard(model, margin=0.5)
    triplets = CrossBatchMemoryLoss(model, inner, memory_size=16)
    texts, labels = [random_texts(8, seed=4)], torch.arange(8) % 3
    assert_same_grads(
        loss_and_grads(model, lambda f, _: triplets(f, labels), texts, train=True),
        loss_and_grads(model, lambda f, _: inner(f, labels), texts, train=True),
    )
    with pytest.raises(TypeError, match="cannot wrap BatchHardSoftMarginTripletLoss"):
        CrossBatchMemoryLoss(model, upstream.BatchHardSoftMarginTripletLoss(model), memory_size=8)


def sentence_transformer_from_same(model):
    import copy

    return copy.deepcopy(model)


def test_wrong_columns_are_explained(model):
    ranking = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), memory_size=8)
    with pytest.raises(ValueError, match="needs \\(anchor, positive"):
        fill(ranking, [random_texts(4, seed=0)])
    triplets = CrossBatchMemoryLoss(model, triplet.BatchAllTripletLoss(model), memory_size=8)
    with pytest.raises(ValueError, match="takes one text column"):
        fill(triplets, text_columns(4, 2), torch.arange(4))


def test_with_memory_builds_a_registry_style_loss(model):
    from st_ext.losses.registry import with_memory

    build = with_memory(lambda m, **kwargs: upstream.CachedMultipleNegativesRankingLoss(m, **kwargs))
    loss = build(model, memory_size=64, mini_batch_size=2)
    assert isinstance(loss, CrossBatchMemoryLoss) and loss.memory_size == 64 and loss.loss.mini_batch_size == 2
    assert loss.uses_gradient_cache
