"""st_ext.mining against pytorch-metric-learning 2.9.0, the implementation it replaces.

Every implementation behind the public functions (a dense mask for tiny inputs; the grouped
expansion, with runs of negatives copied or gathered) is checked on every case, by moving the
thresholds that choose between them.
"""

from __future__ import annotations

import ast
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity, LpDistance
from pytorch_metric_learning.miners import TripletMarginMiner as PMLTripletMarginMiner
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from st_ext import mining
from st_ext.memory import measure_peak

INT_MAX = torch.iinfo(torch.int32).max
TIE_TOLERANCE = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


INDEX_PATHS = {
    # name: (DENSE_MAX_ELEMENTS, REPEATED_RUNS_MAX_JUMP_SHARE)
    "dense": (2**62, 16),
    "grouped-runs": (-1, 1),  # negatives always copied run by run
    "grouped-gather": (-1, 2**62),  # negatives always gathered
}


@pytest.fixture(params=list(INDEX_PATHS))
def path(request, monkeypatch):
    """Force one of the implementations behind all_triplets_indices."""
    dense_max, jump_share = INDEX_PATHS[request.param]
    monkeypatch.setattr(mining, "DENSE_MAX_ELEMENTS", dense_max)
    monkeypatch.setattr(mining, "REPEATED_RUNS_MAX_JUMP_SHARE", jump_share)
    return request.param


@pytest.fixture(params=["grouped-runs", "grouped-gather"])
def grouped_path(request, monkeypatch):
    """The two grouped implementations only: for inputs too big for a B×M×M mask."""
    monkeypatch.setattr(mining, "REPEATED_RUNS_MAX_JUMP_SHARE", INDEX_PATHS[request.param][1])
    return request.param


@pytest.fixture(params=["dense", "grouped"])
def miner_path(request, monkeypatch):
    """Force the dense or the grouped way of mining."""
    monkeypatch.setattr(mining, "DENSE_MAX_ELEMENTS", 2**62 if request.param == "dense" else -1)
    return request.param


def assert_same_tensors(expected, actual):
    """Same triplets in the same order; ours are always int64."""
    assert len(expected) == len(actual) == 3
    for expected_column, actual_column in zip(expected, actual):
        assert actual_column.dtype == torch.int64
        assert torch.equal(expected_column.to(torch.int64), actual_column)


def as_set(triplets) -> set[tuple[int, int, int]]:
    columns = [column.tolist() for column in triplets]
    return set(zip(*columns))


# ---------------------------------------------------------------------------------------------
# all_triplets_indices
# ---------------------------------------------------------------------------------------------

LABEL_GRID = list(
    itertools.product(
        [0, 1, 2, 7, 33],  # batch size
        [0, 1, 5, 40],  # memory size
        [1, 2, 3, 50],  # number of classes
    )
)


@pytest.mark.parametrize("batch, memory, num_classes", LABEL_GRID)
def test_indices_equal_pml_with_ref_labels(path, batch, memory, num_classes):
    torch.manual_seed(batch * 1000 + memory * 10 + num_classes)
    labels = torch.randint(0, num_classes, (batch,))
    ref_labels = torch.randint(0, num_classes, (memory,))
    assert_same_tensors(
        lmu.get_all_triplets_indices(labels, ref_labels), mining.all_triplets_indices(labels, ref_labels)
    )


@pytest.mark.parametrize("batch, num_classes", [(b, c) for b in [0, 1, 2, 7, 33, 70] for c in [1, 2, 3, 50]])
def test_indices_equal_pml_without_ref_labels(path, batch, num_classes):
    torch.manual_seed(batch * 100 + num_classes)
    labels = torch.randint(0, num_classes, (batch,))
    expected = lmu.get_all_triplets_indices(labels)
    assert_same_tensors(expected, mining.all_triplets_indices(labels))
    assert not (expected[0] == expected[1]).any(), "an anchor must never be its own positive"


def test_indices_same_object_as_ref_means_self_reference(path):
    """PML's rule: ref_labels that *is* labels excludes anchor == positive; an equal copy does not."""
    torch.manual_seed(0)
    labels = torch.randint(0, 4, (30,))
    same_object = mining.all_triplets_indices(labels, labels)
    copy = mining.all_triplets_indices(labels, labels.clone())
    assert_same_tensors(lmu.get_all_triplets_indices(labels, labels), same_object)
    assert_same_tensors(lmu.get_all_triplets_indices(labels, labels.clone()), copy)
    assert len(copy[0]) > len(same_object[0])


@pytest.mark.parametrize(
    "labels, ref_labels",
    [
        (torch.zeros(12, dtype=torch.long), None),  # one class: no negatives
        (torch.arange(12), None),  # all distinct: no positives
        (torch.arange(12), torch.arange(100, 130)),  # no anchor's class in the memory
        (torch.zeros(5, dtype=torch.long), torch.zeros(9, dtype=torch.long)),
        (torch.arange(12), torch.arange(12)),  # all distinct, memory given: one positive each
    ],
)
def test_indices_degenerate_label_sets(path, labels, ref_labels):
    assert_same_tensors(
        lmu.get_all_triplets_indices(labels, ref_labels), mining.all_triplets_indices(labels, ref_labels)
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float32, torch.float64])
def test_indices_other_label_dtypes(path, dtype):
    torch.manual_seed(1)
    labels = torch.randint(-3, 3, (25,)).to(dtype)
    ref_labels = torch.randint(-3, 3, (31,)).to(dtype)
    assert_same_tensors(
        lmu.get_all_triplets_indices(labels, ref_labels), mining.all_triplets_indices(labels, ref_labels)
    )
    assert_same_tensors(lmu.get_all_triplets_indices(labels), mining.all_triplets_indices(labels))


def test_indices_past_int_max_with_memory(grouped_path):
    """B·M·M > INT_MAX (PML falls back to its per-anchor loop, the reference here), while few
    memory entries share a class with the batch, so the output stays small."""
    torch.manual_seed(2)
    batch, memory = 21, 10200
    assert batch * memory * memory > INT_MAX
    labels = torch.randint(0, 5, (batch,))
    labels[:3] = 7  # anchors whose class is absent from the memory
    ref_labels = torch.arange(1000, 1000 + memory)  # distinct classes nobody in the batch has
    shared = torch.randperm(memory)[:30]
    ref_labels[shared] = torch.randint(0, 5, (30,))

    with measure_peak("cpu") as peak:
        actual = mining.all_triplets_indices(labels, ref_labels)
    assert_same_tensors(lmu.get_all_triplets_indices(labels, ref_labels), actual)
    output_bytes = 3 * 8 * len(actual[0])
    assert 0 < len(actual[0]) < 10**7
    assert peak.peak_bytes < 2 * output_bytes + 64 * batch * memory, peak


def test_indices_past_int_max_without_memory(grouped_path):
    """Self-reference past INT_MAX: mostly distinct labels, a few pairs sharing a class."""
    torch.manual_seed(3)
    batch = 1300
    assert batch**3 > INT_MAX
    labels = torch.arange(batch) + 100
    pairs = torch.randperm(batch)[:80]
    labels[pairs] = torch.arange(40).repeat(2)

    with measure_peak("cpu") as peak:
        actual = mining.all_triplets_indices(labels)
    assert_same_tensors(lmu.get_all_triplets_indices(labels), actual)
    assert len(actual[0]) == 80 * (batch - 2)
    assert peak.peak_bytes < 2 * 3 * 8 * len(actual[0]) + 64 * batch * batch, peak


def test_grouped_path_memory_follows_output_not_cube(grouped_path):
    """Below INT_MAX PML builds the B×M×M mask; the grouped path stays near its output size."""
    torch.manual_seed(4)
    labels, ref_labels = torch.randint(0, 100, (21,)), torch.randint(0, 100, (4000,))
    with measure_peak("cpu") as peak:
        actual = mining.all_triplets_indices(labels, ref_labels)
    output_bytes = 3 * 8 * len(actual[0])
    assert peak.peak_bytes < 1.25 * output_bytes + 64 * 21 * 4000, (peak, output_bytes)
    assert peak.peak_bytes < 21 * 4000 * 4000 / 4


@pytest.mark.parametrize("seed", range(5))
def test_expansion_helpers_match_loops(seed):
    """The in-place block writers against their one-line (but memory-hungry) definitions."""
    torch.manual_seed(seed)
    lengths = torch.randint(1, 6, (40,))
    starts = torch.randint(0, 100, (40,))
    values = torch.randint(-50, 50, (40,))
    offsets = mining.exclusive_cumsum(lengths)
    total = int(lengths.sum())

    constant = torch.empty(total, dtype=torch.long)
    mining.fill_piecewise_constant(constant, offsets, values)
    assert torch.equal(constant, values.repeat_interleave(lengths))

    ranges = torch.empty(total, dtype=torch.long)
    mining.fill_ragged_arange(ranges, offsets, starts, lengths)
    segments = [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())]
    assert torch.equal(ranges, torch.cat(segments))

    source = torch.randint(0, 1000, (200,))
    gathered, scratch = torch.empty(total, dtype=torch.long), torch.empty(total, dtype=torch.long)
    mining.gather_segments(gathered, scratch, offsets, source, starts, lengths)
    assert torch.equal(gathered, source[torch.cat(segments)])


@pytest.mark.parametrize("seed", range(5))
def test_repeated_runs_match_concatenation(seed):
    torch.manual_seed(seed)
    run_length = torch.randint(1, 30, (6,))
    run_start = mining.exclusive_cumsum(run_length)
    # Sorted, mostly consecutive runs, like lists of negatives: a few jumps each.
    source = torch.cat([torch.sort(torch.randperm(60)[:n]).values for n in run_length.tolist()])
    block_run = torch.randint(0, 6, (25,))
    offsets = mining.exclusive_cumsum(run_length[block_run])
    out = torch.empty(int(run_length[block_run].sum()), dtype=torch.long)
    jumps = mining.run_jumps(source, run_start)
    mining.fill_repeated_runs(out, offsets, block_run, source, run_start, run_length, jumps)
    runs = [source[start : start + length] for start, length in zip(run_start.tolist(), run_length.tolist())]
    assert torch.equal(out, torch.cat([runs[r] for r in block_run.tolist()]))


# ---------------------------------------------------------------------------------------------
# TripletMarginMiner
# ---------------------------------------------------------------------------------------------

DISTANCE_PAIRS = {"euclidean": LpDistance, "cosine": CosineSimilarity}


def margin_terms(distance_name, embeddings, ref_emb, triplets) -> torch.Tensor:
    """PML's margin term for each triplet, from PML's own distance matrix."""
    distance = DISTANCE_PAIRS[distance_name]()
    matrix = distance(embeddings, ref_emb)
    anchors, positives, negatives = triplets
    ap, an = matrix[anchors, positives], matrix[anchors, negatives]
    return ap - an if distance.is_inverted else an - ap


def without_ties(triplets, terms, boundaries) -> set:
    """Triplets whose margin term is not within TIE_TOLERANCE of any selection boundary."""
    near = torch.zeros_like(terms, dtype=torch.bool)
    for boundary in boundaries:
        near |= (terms - boundary).abs() <= TIE_TOLERANCE
    return as_set(tuple(column[~near] for column in triplets))


def assert_same_mined_set(distance_name, margin, embeddings, ref_emb, expected, actual):
    """Equal sets, except triplets sitting on the margin (or on 0), where float rounding may
    legitimately decide either way; those may appear in one result only."""
    assert len(as_set(actual)) == len(actual[0]), "duplicate triplets"
    boundaries = (margin, 0.0)
    expected_set = without_ties(expected, margin_terms(distance_name, embeddings, ref_emb, expected), boundaries)
    actual_set = without_ties(actual, margin_terms(distance_name, embeddings, ref_emb, actual), boundaries)
    assert expected_set == actual_set


MINER_GRID = list(
    itertools.product(
        ["all", "hard", "semihard", "easy"],
        ["euclidean", "cosine"],
        [0.2, 0.0, -0.05, 1.5],  # margin
    )
)


@pytest.mark.parametrize("type_of_triplets, distance_name, margin", MINER_GRID)
def test_miner_equals_pml(miner_path, type_of_triplets, distance_name, margin):
    torch.manual_seed(MINER_GRID.index((type_of_triplets, distance_name, margin)))
    pml_miner = PMLTripletMarginMiner(
        margin=margin, type_of_triplets=type_of_triplets, distance=DISTANCE_PAIRS[distance_name]()
    )
    ours = mining.TripletMarginMiner(margin=margin, type_of_triplets=type_of_triplets, distance=distance_name)
    for batch, memory, num_classes in [(24, 37, 4), (9, 60, 3), (30, 30, 30), (16, 5, 1)]:
        embeddings, labels = torch.randn(batch, 6), torch.randint(0, num_classes, (batch,))
        ref_emb, ref_labels = torch.randn(memory, 6), torch.randint(0, num_classes, (memory,))
        for args in [(embeddings, labels), (embeddings, labels, ref_emb, ref_labels)]:
            reference = args[2] if len(args) == 4 else embeddings
            expected, actual = pml_miner(*args), ours(*args)
            assert all(column.dtype == torch.int64 for column in actual)
            assert_same_mined_set(distance_name, margin, embeddings, reference, expected, actual)


@pytest.mark.parametrize("type_of_triplets", ["all", "hard", "semihard", "easy"])
@pytest.mark.parametrize(
    "make_distance, margin",
    [
        (lambda: LpDistance(p=1, normalize_embeddings=False), 1.0),
        (lambda: DotProductSimilarity(normalize_embeddings=False), 1.0),
        (lambda: LpDistance(p=1, normalize_embeddings=False), 0.0),
    ],
)
def test_miner_exact_on_the_margin(miner_path, type_of_triplets, make_distance, margin):
    """Small-integer embeddings under L1 / dot product give exactly representable margin terms,
    many of them exactly on the margin or on 0: the boundaries must be decided as PML decides them."""
    torch.manual_seed(5)
    embeddings = torch.randint(-2, 3, (40, 3)).float()
    labels = torch.randint(0, 4, (40,))
    ref_emb, ref_labels = torch.randint(-2, 3, (55, 3)).float(), torch.randint(0, 4, (55,))
    pml_miner = PMLTripletMarginMiner(margin=margin, type_of_triplets=type_of_triplets, distance=make_distance())
    ours = mining.TripletMarginMiner(margin=margin, type_of_triplets=type_of_triplets, distance=make_distance())
    for args in [(embeddings, labels), (embeddings, labels, ref_emb, ref_labels)]:
        expected, actual = pml_miner(*args), ours(*args)
        every_triplet = lmu.get_all_triplets_indices(args[1], args[3] if len(args) == 4 else None)
        terms = margin_terms_from(make_distance(), args, every_triplet)
        assert (terms == margin).any() and (terms == 0).any(), "the case must contain exact ties"
        assert as_set(expected) == as_set(actual)
        assert len(actual[0]) == len(expected[0])


def margin_terms_from(distance, args, triplets) -> torch.Tensor:
    embeddings, reference = args[0], args[2] if len(args) == 4 else args[0]
    matrix = distance(embeddings, reference)
    anchors, positives, negatives = triplets
    ap, an = matrix[anchors, positives], matrix[anchors, negatives]
    return ap - an if distance.is_inverted else an - ap


@pytest.mark.parametrize("seed", range(3))
def test_count_prefix_corrects_any_guess(seed):
    """The searchsorted guess may be off near the boundary; whatever the guess, counts are exact."""
    torch.manual_seed(seed)
    rows = torch.sort(torch.randn(8, 50), dim=1).values
    rows[:, 40:] = math.inf  # padding, as for anchors with fewer positives
    queries = torch.randn(8, 30)
    bound = 0.1

    def passes(row_value, query):
        return query - row_value > bound

    expected = torch.tensor([[int(passes(rows[r], q).sum()) for q in queries[r].tolist()] for r in range(8)])
    for guess in [
        torch.randint(0, 51, (8, 30)),
        torch.zeros(8, 30, dtype=torch.long),
        torch.full((8, 30), 50),
    ]:
        assert torch.equal(mining.count_prefix(rows, queries, passes, guess), expected)


def test_miner_past_int_max_matches_brute_force_subsample():
    """A memory large enough that B·M·M > INT_MAX: compare one anchor's mined triplets with a
    brute-force evaluation of PML's rule for that anchor."""
    torch.manual_seed(7)
    batch, memory = 21, 10200
    assert batch * memory * memory > INT_MAX
    labels = torch.randint(0, 3, (batch,))
    ref_labels = torch.arange(100, 100 + memory)
    ref_labels[torch.randperm(memory)[:12]] = torch.randint(0, 3, (12,))
    embeddings, ref_emb = torch.randn(batch, 8), torch.randn(memory, 8)
    anchors, positives, negatives = mining.TripletMarginMiner(0.1, "semihard")(embeddings, labels, ref_emb, ref_labels)

    matrix = LpDistance()(embeddings, ref_emb)
    for anchor in [0, batch // 2, batch - 1]:
        positive_idx = torch.nonzero(ref_labels == labels[anchor]).squeeze(1)
        negative_idx = torch.nonzero(ref_labels != labels[anchor]).squeeze(1)
        terms = matrix[anchor, negative_idx].unsqueeze(0) - matrix[anchor, positive_idx].unsqueeze(1)
        keep = (terms > 0) & (terms <= 0.1)
        expected = {(anchor, int(positive_idx[p]), int(negative_idx[n])) for p, n in torch.nonzero(keep).tolist()}
        mine = anchors == anchor
        assert as_set((anchors[mine], positives[mine], negatives[mine])) == expected


def test_miner_is_a_module_and_ignores_gradients():
    miner = mining.TripletMarginMiner()
    embeddings = torch.randn(50, 4, requires_grad=True)
    labels = torch.randint(0, 5, (50,))
    anchors, positives, negatives = miner(embeddings, labels)
    assert isinstance(miner, torch.nn.Module)
    assert not anchors.requires_grad and len(anchors) == len(positives) == len(negatives) > 0


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels, ref_labels, error, message",
    [
        (torch.zeros(4, 2), None, ValueError, "must be 1-D"),
        ([0, 1, 1], None, TypeError, "torch.as_tensor"),
        (torch.tensor([0.0, float("nan")]), None, ValueError, "NaN"),
        (torch.zeros(4), torch.zeros(3, 1), ValueError, "ref_labels must be 1-D"),
        (
            torch.zeros(4, dtype=torch.long),
            torch.zeros(3, dtype=torch.long, device="meta"),
            ValueError,
            "same device",
        ),
    ],
)
def test_indices_reject_bad_labels(labels, ref_labels, error, message):
    with pytest.raises(error, match=message):
        mining.all_triplets_indices(labels, ref_labels)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"type_of_triplets": "hardest"}, "type_of_triplets must be one of"),
        ({"distance": "manhattan"}, "distance must be one of"),
        ({"distance": 3}, "distance must be a name or a callable"),
        ({"margin": "0.2"}, "margin must be a finite real number"),
        ({"margin": float("nan")}, "margin must be a finite real number"),
    ],
)
def test_miner_rejects_bad_settings(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        mining.TripletMarginMiner(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(5, 3), torch.zeros(4)), "has 5 rows but labels has 4"),
        ((torch.randn(5), torch.zeros(5)), "must be 2-D"),
        ((torch.randn(5, 3), torch.zeros(5, 1)), "labels must be 1-D"),
        ((torch.randn(5, 3), torch.zeros(5), torch.randn(6, 3)), "go together"),
        ((torch.randn(5, 3), torch.zeros(5), None, torch.zeros(6)), "go together"),
        (
            (torch.randn(5, 3), torch.zeros(5), torch.randn(6, 3), torch.zeros(7)),
            "has 6 rows but ref_labels has 7",
        ),
        ((torch.randn(5, 3), torch.zeros(5), torch.randn(6, 4), torch.zeros(6)), "same model"),
        ((torch.full((5, 3), float("nan")), torch.tensor([0, 0, 1, 1, 2])), "NaN or inf"),
    ],
)
def test_miner_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        mining.TripletMarginMiner()(*args)


def test_module_imports_only_torch_and_the_standard_library():
    """Losses may import mining; mining must not import models, trainers or the CLI."""
    tree = ast.parse(Path(mining.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0] if node.level == 0 else "<relative>")
    outside = {name for name in imported if name not in sys.stdlib_module_names and name != "torch"}
    assert not outside, outside
