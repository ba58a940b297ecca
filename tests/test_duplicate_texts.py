"""``document_ids="text"``: rows whose texts are identical are one document, masked in the loss instead of kept
apart by a duplicate-free sampler.

Each check compares with a reference written here: upstream's MultipleNegativesRankingLoss scoring (scaled
cosine similarities, cross-entropy over the anchor's row) with the masked candidates listed by hand as -inf, or,
where a partition of the rows says the same, st_ext's own loss given those integer ids by hand. On a batch
without duplicates the loss is the plain loss. Run as a script under torchrun, this file is also the worker of
the two-rank check (:func:`run_rank`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loss_checks import assert_same_grads, features_of, loss_and_grads, text_columns
from sentence_transformers.util import cos_sim
from tiny_models import save_tiny_bert, sentence_transformer_from

from st_ext import losses
from st_ext._compat import ST_VERSION, st_losses
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss
from st_ext.losses.memory_bank import document_keys
from st_ext.losses.same_document import batch_document_ids, same_document
from st_ext.training.memory_checkpoints import MEMORY_FILENAME, load_memories, save_memories

upstream = st_losses()
BATCH = 6
DIMS = [32, 16]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- batches and their masks, by hand ---------------------------------------------------------------------------


def duplicated_batch() -> list[list[str]]:
    """(anchor, positive, negative) rows with every kind of duplicate."""
    anchors, positives, negatives = text_columns(BATCH, 3, seed=21)
    anchors[3] = anchors[0]  # one query, two positives
    positives[4] = positives[1]  # one passage, two queries
    negatives[2] = positives[5]  # a hard negative that is another row's positive
    negatives[0] = anchors[5]  # a hard negative that is another row's query
    return [anchors, positives, negatives]


#: The rows of duplicated_batch that share a query or a positive (each is its own row's too).
SAME_ROWS = {(0, 3), (3, 0), (1, 4), (4, 1)}
#: (anchor row, hard negative row) pairs of duplicated_batch whose negative is one of the anchor row's texts.
SAME_NEGATIVES = {(5, 2), (5, 0)}


def two_column_duplicates() -> tuple[list[list[str]], torch.Tensor]:
    """(anchor, positive) rows with a repeated query and a repeated positive, and integer ids that say the same."""
    anchors, positives = text_columns(BATCH, 2, seed=22)
    anchors[3] = anchors[0]
    positives[4] = positives[1]
    return [anchors, positives], torch.tensor([0, 1, 2, 0, 1, 5])


def mask_of(pairs: set[tuple[int, int]], rows: int, candidates: int) -> torch.Tensor:
    mask = torch.zeros(rows, candidates, dtype=torch.bool)
    for row, candidate in pairs:
        mask[row, candidate] = True
    return mask


def ranking_mask(
    same_rows: set, same_negatives: set, rows: int, negative_columns: int, queued: int = 0
) -> torch.Tensor:
    """Candidates numbered as upstream's MNRL numbers them: the positives, then each negative column's rows."""
    pairs = set(same_rows) | {(row, rows + negative) for row, negative in same_negatives}
    return mask_of(pairs, rows, rows * (1 + negative_columns) + queued)


def masked_mnrl(anchors: torch.Tensor, candidates: torch.Tensor, mask: torch.Tensor, scale: float = 20.0):
    """Upstream's MultipleNegativesRankingLoss (cosine x scale, cross-entropy over the anchor's row) with the
    ``mask``ed candidates left out."""
    scores = (cos_sim(anchors, candidates) * scale).masked_fill(mask, float("-inf"))
    return F.cross_entropy(scores, torch.arange(len(anchors)))


def mnrl_by_hand(model, mask: torch.Tensor, dims: list[int] | None = None):
    """The masked MNRL over a batch's columns; with ``dims``, summed over those truncations (MatryoshkaLoss)."""

    def loss(features, _labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        candidates = torch.cat(documents)
        return sum(masked_mnrl(anchors[:, :dim], candidates[:, :dim], mask) for dim in dims or [None])

    return loss


def with_labels(loss, labels):
    return lambda features, _: loss(features, labels)


# --- the keys ---------------------------------------------------------------------------------------------------


def test_any_key_of_the_anchor_matching_any_key_of_the_candidate_is_the_same_document():
    anchors = torch.tensor([[1, 2], [3, -1], [-1, -1]])
    candidates = torch.tensor([[2, 9], [9, 9], [-1, 3], [-1, -1]])
    by_hand = torch.tensor(
        [[any(a >= 0 and a in c.tolist() for a in anchor.tolist()) for c in candidates] for anchor in anchors]
    )
    assert torch.equal(same_document(anchors, candidates), by_hand)
    assert by_hand.any() and not by_hand.all()


def test_text_keys_are_a_rows_texts_and_a_negatives_own_text_twice(model):
    features = features_of(model, duplicated_batch())
    anchors, positives, negatives = batch_document_ids("text", features, None)
    anchor_keys, positive_keys, negative_keys = (document_keys(f) for f in features)
    assert torch.equal(anchors, torch.stack([anchor_keys, positive_keys], dim=1))
    assert torch.equal(positives, anchors)
    assert torch.equal(negatives, torch.stack([negative_keys, negative_keys], dim=1))
    assert negative_keys[2] == positive_keys[5] and anchor_keys[3] == anchor_keys[0]


# --- ranking losses: cached and one pass, under Matryoshka and the layer-wise wrappers ----------------------------


@pytest.mark.parametrize("mini_batch_size", [2, 64], ids=["cached", "one-pass"])
def test_without_duplicates_text_ids_give_the_plain_loss(model, mini_batch_size):
    columns = text_columns(BATCH, 3, seed=20)
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size, document_ids="text")
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=False),
        loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=False),
    )


@pytest.mark.parametrize("mini_batch_size", [2, 64], ids=["cached", "one-pass"])
def test_duplicates_are_masked_as_a_reference_masks_them_by_hand(model, mini_batch_size):
    columns = duplicated_batch()
    mask = ranking_mask(SAME_ROWS, SAME_NEGATIVES, BATCH, 1)
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size, document_ids="text")
    expected = loss_and_grads(model, mnrl_by_hand(model, mask), columns, train=False)
    assert_same_grads(loss_and_grads(model, loss, columns, train=False), expected)
    plain = loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=False)
    assert not torch.isclose(plain[0], expected[0])


@pytest.mark.parametrize("mini_batch_size", [2, 64], ids=["cached", "one-pass"])
def test_matryoshka_masks_duplicates_at_every_dimension(model, mini_batch_size):
    columns = duplicated_batch()
    mask = ranking_mask(SAME_ROWS, SAME_NEGATIVES, BATCH, 1)
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size, document_ids="text")
    assert_same_grads(
        loss_and_grads(model, losses.MatryoshkaLoss(model, inner, DIMS), columns, train=False),
        loss_and_grads(model, mnrl_by_hand(model, mask, DIMS), columns, train=False),
    )


def layer_wise(wrapper: str, model, inner):
    if wrapper == "adaptive_layer":
        return losses.AdaptiveLayerLoss(model, inner, n_layers_per_step=1)
    return losses.Matryoshka2dLoss(model, inner, DIMS, n_layers_per_step=1)


@pytest.mark.parametrize("mini_batch_size", [2, 64], ids=["cached", "one-pass"])
@pytest.mark.parametrize("wrapper", ["adaptive_layer", "matryoshka_2d"])
def test_layer_wise_losses_mask_duplicates_as_ids_given_by_hand(model4, wrapper, mini_batch_size):
    columns, ids = two_column_duplicates()

    def ranking(**options):
        inner = losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=mini_batch_size, **options)
        return layer_wise(wrapper, model4, inner)

    expected = loss_and_grads(model4, with_labels(ranking(document_ids="label"), ids), columns, train=False)
    assert_same_grads(loss_and_grads(model4, ranking(document_ids="text"), columns, train=False), expected)
    assert not torch.isclose(loss_and_grads(model4, ranking(), columns, train=False)[0], expected[0])


# --- GIST -------------------------------------------------------------------------------------------------------


def gist_by_hand(model, guide, same_rows: set, same_negatives: set, temperature: float = 0.05, margin: float = -0.1):
    """GISTEmbed's cross-entropy (an absolute margin, both contrasts) over (anchor, positive, negative) with the
    guide's suppression and the masks listed by hand. Below 0, the margin keeps a candidate the guide scores as
    its positive (a duplicate of it): only the mask leaves it out."""

    def loss(features, _labels):
        anchors, positives, negatives = [F.normalize(model(f)["sentence_embedding"], dim=-1) for f in features]
        with torch.no_grad():
            guide_a, guide_p, guide_n = [F.normalize(guide(f)["sentence_embedding"], dim=-1) for f in features]
        rows = torch.arange(len(anchors))
        same = mask_of(same_rows | {(row, row) for row in range(len(anchors))}, len(anchors), len(anchors))
        same_negative = mask_of(same_negatives, len(anchors), len(anchors))
        guide_ap = guide_a @ guide_p.T
        limit = guide_ap[rows, rows][:, None] - margin
        suppress_ap = (guide_ap > limit) | same
        suppress_ap[rows, rows] = False
        blocks = [
            (anchors @ positives.T).masked_fill(suppress_ap, float("-inf")),
            (anchors @ anchors.T).masked_fill((guide_a @ guide_a.T > limit) | same, float("-inf")),
            (positives @ positives.T).masked_fill((guide_p @ guide_p.T > limit) | same, float("-inf")),
            (anchors @ negatives.T).masked_fill((guide_a @ guide_n.T > limit) | same_negative, float("-inf")),
        ]
        return F.cross_entropy(torch.cat(blocks, dim=1) / temperature, rows)

    return loss


@pytest.mark.parametrize("cached", [False, True], ids=["gist", "cached-gist"])
def test_gist_masks_duplicates_as_a_reference_masks_them_by_hand(model, guide, cached):
    options = {"temperature": 0.05, "margin": -0.1, "document_ids": "text"}
    if cached:
        loss = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=2, **options)
    else:
        loss = losses.GISTEmbedLoss(model, guide, **options)
    columns = duplicated_batch()
    expected = loss_and_grads(model, gist_by_hand(model, guide, SAME_ROWS, SAME_NEGATIVES), columns, train=False)
    assert_same_grads(loss_and_grads(model, loss, columns, train=False), expected)
    unmasked = loss_and_grads(model, gist_by_hand(model, guide, set(), set()), columns, train=False)
    assert not torch.isclose(unmasked[0], expected[0])
    distinct = text_columns(BATCH, 3, seed=20)
    assert_same_grads(
        loss_and_grads(model, loss, distinct, train=False),
        loss_and_grads(model, gist_by_hand(model, guide, set(), set()), distinct, train=False),
    )


# --- the cross-batch queue --------------------------------------------------------------------------------------


def returning_batches() -> tuple[list[list[str]], list[list[str]], set[tuple[int, int]]]:
    """Two steps' (anchor, positive, negative) rows, the second repeating texts of the first, and the (anchor of
    the second step, queued row) pairs that share a text: the queue holds the first step's positives, then its
    negatives."""
    first, second = text_columns(BATCH, 3, seed=23), text_columns(BATCH, 3, seed=24)
    second[0][0] = first[0][1]  # an earlier query again, with another positive
    second[1][2] = first[1][3]  # an earlier positive, for another query
    second[1][4] = first[2][4]  # an earlier hard negative, now a positive
    second[0][5], second[1][5] = first[0][0], first[1][0]  # an earlier row again
    return first, second, {(0, 1), (2, 3), (4, BATCH + 4), (5, 0)}


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_a_duplicate_of_a_queued_text_is_masked(model, cached):
    inner = upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2) if cached else None
    loss = CrossBatchMemoryLoss(
        model, inner or upstream.MultipleNegativesRankingLoss(model), memory_size=64, document_ids="text"
    )
    first, second, queued_pairs = returning_batches()
    model.eval()
    with torch.enable_grad():
        loss(features_of(model, first), None)
    queued = loss.memory_embeddings.clone()
    anchor_keys, positive_keys, negative_keys = (document_keys(f) for f in features_of(model, first))
    assert torch.equal(
        loss.memory.document_ids,
        torch.cat([torch.stack([anchor_keys, positive_keys], 1), torch.stack([negative_keys, negative_keys], 1)]),
    )
    mask = ranking_mask(set(), set(), BATCH, 1, queued=len(queued))
    mask[:, 2 * BATCH :] = mask_of(queued_pairs, BATCH, len(queued))

    def reference(features, _labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        return masked_mnrl(anchors, torch.cat([*documents, queued]), mask)

    expected = loss_and_grads(model, reference, second, train=False)
    assert_same_grads(loss_and_grads(model, loss, second, train=False), expected)
    mask[:] = False
    assert not torch.isclose(loss_and_grads(model, reference, second, train=False)[0], expected[0])


def test_text_ids_on_a_memory_that_keeps_queued_copies_is_refused(model):
    with pytest.raises(ValueError, match="mask_own_positive=False") as refused:
        CrossBatchMemoryLoss(
            model, upstream.MultipleNegativesRankingLoss(model), mask_own_positive=False, document_ids="text"
        )
    assert "\n" not in str(refused.value)


# --- memories saved with checkpoints ------------------------------------------------------------------------------


def test_a_memorys_keys_are_saved_and_restored(model, tmp_path):
    def memory():
        return CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), 64, document_ids="text")

    saved = memory()
    with torch.enable_grad():
        saved(features_of(model, duplicated_batch()), None)
    save_memories(saved, tmp_path)
    restored = memory()
    assert load_memories(restored, tmp_path) == ["loss"]
    assert restored.memory.document_ids.shape == (2 * BATCH, 2)
    assert torch.equal(restored.memory.document_ids, saved.memory.document_ids)


def format_1_state(rows: int = 4, *, query_bank: bool = False) -> dict:
    """A memory state as the first format saved it: one document id per row, a query bank's as its labels."""
    ids = torch.tensor([7, 8, -1, -1][:rows])
    bank = {"embeddings": torch.randn(rows, 32), "labels": torch.arange(rows) + 100, "document_ids": ids}
    state = {"format": 1, "memory_size": 64, **bank}
    if query_bank:
        state["queries"] = {"embeddings": torch.randn(rows, 32), "labels": ids}
        state["query_layers"] = {}
    return state


def test_a_first_format_file_loads_as_one_key_per_row(model, tmp_path):
    torch.save({"format": 1, "losses": {"loss": format_1_state()}}, tmp_path / MEMORY_FILENAME)
    memory = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), 64, document_ids="label")
    load_memories(memory, tmp_path)
    assert torch.equal(memory.memory.document_ids, torch.tensor([[7], [8], [-1], [-1]]))
    text_memory = CrossBatchMemoryLoss(model, upstream.MultipleNegativesRankingLoss(model), 64, document_ids="text")
    with pytest.raises(ValueError, match="document key") as refused:
        load_memories(text_memory, tmp_path)
    assert "\n" not in str(refused.value)


def test_a_first_format_query_bank_keeps_its_ids(model):
    if "directions" not in inspect.signature(upstream.MultipleNegativesRankingLoss).parameters:
        pytest.skip(f"sentence-transformers {ST_VERSION}'s ranking losses have no directions: no query bank")
    inner = upstream.MultipleNegativesRankingLoss(model, directions=("query_to_doc", "query_to_query"))
    memory = CrossBatchMemoryLoss(model, inner, 64, query_bank=True, document_ids="label")
    memory.load_memory_state(format_1_state(query_bank=True))
    assert torch.equal(memory.query_memory.document_ids, torch.tensor([[7], [8], [-1], [-1]]))


# --- what cannot work -------------------------------------------------------------------------------------------


def test_the_error_for_an_unknown_source_lists_text(model):
    with pytest.raises(ValueError, match='"text"') as refused:
        losses.CachedMultipleNegativesRankingLoss(model, document_ids="texts")
    assert "\n" not in str(refused.value)


def test_a_batch_without_token_ids_per_row_is_refused_at_the_step(model):
    features = features_of(model, duplicated_batch())
    features[2] = {"inputs_embeds": torch.zeros(BATCH, 4, 32), "attention_mask": features[2]["attention_mask"]}
    with pytest.raises(ValueError, match="column 2 of this batch has no input_ids") as refused:
        batch_document_ids("text", features, None)
    assert "\n" not in str(refused.value)


def test_a_static_embedding_model_is_refused_at_the_step(tiny_bert_dir):
    from st_ext import SentenceTransformer
    from st_ext._compat import st_modules

    static = st_modules().StaticEmbedding(sentence_transformer_from(tiny_bert_dir).tokenizer, embedding_dim=16)
    model = SentenceTransformer(modules=[static], device="cpu")
    loss = losses.GISTEmbedLoss(model, model, document_ids="text")
    with pytest.raises(ValueError, match="no input_ids of one row per text") as refused:
        loss(features_of(model, duplicated_batch()), None)
    assert "\n" not in str(refused.value)


# --- two ranks, embeddings gathered -----------------------------------------------------------------------------

WORLD_SIZE = 2
ROWS_PER_RANK = 4


def global_batch() -> list[list[str]]:
    """Both ranks' (anchor, positive, negative) rows, rank 0's first, with duplicates across the ranks."""
    anchors, positives, negatives = text_columns(WORLD_SIZE * ROWS_PER_RANK, 3, seed=25)
    anchors[5] = anchors[1]  # one query on both ranks
    positives[6] = positives[2]  # one passage on both ranks
    negatives[0] = positives[7]  # rank 0's hard negative is rank 1's positive
    negatives[4] = anchors[3]  # rank 1's hard negative is rank 0's query
    return [anchors, positives, negatives]


#: (anchor, candidate) pairs of global_batch, candidates as the gathered step orders them (every rank's positives,
#: then every rank's negatives).
GLOBAL_MASKED = {(1, 5), (5, 1), (2, 6), (6, 2), (7, 8 + 0), (3, 8 + 4)}


def run_rank(model_dir: Path, out: Path) -> None:
    """One rank's step of a gathered cached MNRL with text ids on its share of :func:`global_batch`; saves its
    loss and the gradients averaged over the ranks (what DDP would hold)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sentence_transformer_from(model_dir).eval()
    loss = losses.CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=2, gather_across_devices=True, document_ids="text"
    )
    share = [column[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for column in global_batch()]
    value = loss(features_of(model, share), None)
    value.backward()
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            grads[name] = parameter.grad / WORLD_SIZE
    torch.save({"loss": value.detach(), "grads": grads}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def gather_supported() -> bool:
    from st_ext._compat import all_gather_with_grad

    parameters = inspect.signature(upstream.CachedMultipleNegativesRankingLoss).parameters
    return all_gather_with_grad() is not None and "gather_across_devices" in parameters


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.distributed
def test_duplicates_on_other_ranks_are_masked_when_gathered(tmp_path):
    if not gather_supported():
        pytest.skip(f"sentence-transformers {ST_VERSION} has no gather_across_devices (added in 5.x)")
    model_dir = save_tiny_bert(tmp_path / "model", dropout=0.0)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(WORLD_SIZE),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        __file__, "--model", str(model_dir), "--out", str(tmp_path),
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    environment = {**os.environ, **offline, "CUDA_VISIBLE_DEVICES": ""}
    environment.setdefault("OMP_NUM_THREADS", "1")
    log = tmp_path / "torchrun.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
    assert returncode == 0, log.read_text()[-4000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]

    model = sentence_transformer_from(model_dir)
    rows = WORLD_SIZE * ROWS_PER_RANK
    mask = mask_of(GLOBAL_MASKED, rows, 2 * rows)
    expected = loss_and_grads(model, mnrl_by_hand(model, mask), global_batch(), train=False)
    for result in ranks:
        assert_same_grads((sum(r["loss"] for r in ranks) / WORLD_SIZE, result["grads"]), expected)
    unmasked = loss_and_grads(model, mnrl_by_hand(model, torch.zeros_like(mask)), global_batch(), train=False)
    assert not torch.isclose(unmasked[0], expected[0])


if __name__ == "__main__":
    arguments = argparse.ArgumentParser(description="One rank of the two-rank check")
    arguments.add_argument("--model", type=Path, required=True)
    arguments.add_argument("--out", type=Path, required=True)
    parsed = arguments.parse_args()
    run_rank(parsed.model, parsed.out)
