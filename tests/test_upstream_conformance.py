"""A swapped import changes nothing but memory: st_ext's replacements of upstream losses against
the installed upstream release, on its own terms.

* calls: upstream's positional parameters first, in the installed release's order, with its
  defaults; st_ext's own options keyword-only; positional calls put every argument where
  upstream puts it;
* errors and warnings: the same exception types (and messages where upstream's constructor runs),
  the same log records;
* MatryoshkaLoss: every loss upstream's accepts, with upstream's values and gradients;
* model cards: the same loss name, documentation link, parameters, tags and citations after
  training with upstream's trainer.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import sentence_transformers
import torch
from datasets import Dataset
from loss_checks import assert_same_grads, guide_from, loss_and_grads, pair_dataset, text_columns
from sentence_transformers import util
from tiny_models import build_tokenizer, sentence_transformer_from

from st_ext import losses
from st_ext._compat import st_losses, st_modules
from st_ext.model_card import card_name

upstream = st_losses()
pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("one_torch_thread")]

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY

#: Every name st_ext.losses exports that is an upstream loss name but not upstream's object.
REPLACED = sorted(
    name for name in losses.__all__ if hasattr(upstream, name) and getattr(losses, name) is not getattr(upstream, name)
)
EXPECTED_REPLACED = [
    "AdaptiveLayerLoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchSemiHardTripletLoss",
    "CachedGISTEmbedLoss",
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "GISTEmbedLoss",
    "Matryoshka2dLoss",
    "MatryoshkaLoss",
]
#: The one relaxation: a guide may be left out when precomputed guide embeddings replace it.
OPTIONAL_HERE = {("GISTEmbedLoss", "guide"), ("CachedGISTEmbedLoss", "guide")}


def init_parameters(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


def same_default(ours: object, theirs: object) -> bool:
    return ours is theirs or (type(ours) is type(theirs) and ours == theirs)


# --------------------------------------------------------------------------------------------
# Signatures


def test_the_replaced_classes_are_the_expected_ones():
    assert REPLACED == EXPECTED_REPLACED
    for name in ("MultipleNegativesRankingLoss", "CoSENTLoss"):
        assert getattr(losses, name) is getattr(upstream, name)


@pytest.mark.parametrize("name", EXPECTED_REPLACED)
def test_signature_starts_with_upstreams_positional_parameters(name):
    ours, theirs = init_parameters(getattr(losses, name)), init_parameters(getattr(upstream, name))
    assert not [p for p in ours if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)], "no *args/**kwargs"
    their_positional = [p for p in theirs if p.kind is POSITIONAL]
    our_positional = [p for p in ours if p.kind is POSITIONAL]
    assert [p.name for p in our_positional] == [p.name for p in their_positional]
    assert ours[: len(their_positional)] == our_positional, "positional parameters come first"
    for our, their in zip(our_positional, their_positional):
        if their.default is inspect.Parameter.empty and (name, their.name) in OPTIONAL_HERE:
            assert our.default is None
        else:
            assert same_default(our.default, their.default), (their.name, our.default, their.default)
    for our in ours[len(their_positional) :]:
        assert our.kind is KEYWORD_ONLY, f"st_ext's own option {our.name!r} must be keyword-only"
    for their in (p for p in theirs if p.kind is KEYWORD_ONLY):
        assert same_default(
            inspect.signature(getattr(losses, name).__init__).parameters[their.name].default, their.default
        )


@pytest.mark.parametrize("name", ["GISTEmbedLoss", "CachedGISTEmbedLoss"])
def test_leaving_out_the_guide_raises_typeerror_as_upstream(model, name):
    with pytest.raises(TypeError):
        getattr(upstream, name)(model)
    with pytest.raises(TypeError, match="needs a guide model, or precomputed guide_embeddings"):
        getattr(losses, name)(model)


def test_an_unknown_keyword_or_extra_positional_raises_typeerror_as_upstream(model, guide):
    for call in (
        lambda cls: cls(model, guide, no_such_option=1),
        lambda cls: cls(model, guide, *[None] * 20),
    ):
        with pytest.raises(TypeError):
            call(upstream.CachedGISTEmbedLoss)
        with pytest.raises(TypeError):
            call(losses.CachedGISTEmbedLoss)


# --------------------------------------------------------------------------------------------
# Positional calls put every argument where upstream puts it


def positional_values(cls: type, context: SimpleNamespace, flip: int) -> list[object]:
    """Upstream's positional arguments of ``cls``, each a valid non-default value.

    Booleans alternate between flipped and default (``flip`` picks which half), so that two
    neighbouring flags swapped show up as a wrong value in one of the two calls.
    """
    values, flag = [], 0
    for parameter in init_parameters(cls):
        if parameter.kind is not POSITIONAL:
            continue
        if isinstance(parameter.default, bool):
            values.append(parameter.default ^ (flag % 2 == flip))
            flag += 1
        else:
            values.append(context.values[parameter.name]())
    return values


@pytest.fixture
def context(model, guide):
    metrics = upstream.BatchHardTripletLossDistanceFunction
    return SimpleNamespace(
        values={
            "model": lambda: model,
            "guide": lambda: guide,
            "loss": lambda: upstream.MultipleNegativesRankingLoss(model),
            "matryoshka_dims": lambda: [16, 32, 8],
            "matryoshka_weights": lambda: [0.5, 1.0, 2.0],
            "n_dims_per_step": lambda: 2,
            "temperature": lambda: 0.05,
            "mini_batch_size": lambda: 4,
            "mini_batch_num_tokens": lambda: 100,
            "margin_strategy": lambda: "relative",
            "margin": lambda: 0.25,
            "distance_metric": lambda: metrics.cosine_distance,
            "scale": lambda: 7.5,
            "similarity_fct": lambda: util.dot_score,
            "directions": lambda: ("query_to_doc", "doc_to_query"),
            "partition_mode": lambda: "per_direction",
            "hardness_mode": lambda: "hard_negatives",
            "hardness_strength": lambda: 0.5,
            "n_layers_per_step": lambda: 2,
            "last_layer_weight": lambda: 1.5,
            "prior_layers_weight": lambda: 0.75,
            "kl_div_weight": lambda: 0.6,
            "kl_temperature": lambda: 0.2,
            "layer_weighting": lambda: "log",
        }
    )


def attributes_holding_arguments(instance: object, arguments: dict[str, object]) -> dict[str, object]:
    """The attributes in which upstream stored a constructor argument: by the argument's name, or
    (for values that identify their argument) under another name, e.g. ``triplet_margin``. An inner
    loss upstream builds for itself (6.x's cached ranking losses keep their options in ``loss``,
    Matryoshka2dLoss its dimensions) is searched too, as ``loss.<attribute>``."""
    found = {}
    candidates = {**vars(instance), **getattr(instance, "_modules", {})}
    inner = getattr(instance, "_modules", {}).get("loss")
    if inner is not None and inner is not arguments.get("loss"):
        candidates.pop("loss")  # upstream's own object, compared through its attributes
        candidates.update({f"loss.{name}": value for name, value in vars(inner).items() if not name.startswith("_")})
    for attribute, value in candidates.items():
        if attribute.startswith("_"):
            continue
        if attribute.split(".")[-1] in arguments:
            found[attribute] = value
            continue
        if isinstance(value, bool) or value is None:
            continue
        if any(
            value is argument or (type(value) is type(argument) and value == argument)
            for argument in arguments.values()
        ):
            found[attribute] = value
    return found


def attribute_of(instance: object, path: str) -> object:
    for name in path.split("."):
        instance = getattr(instance, name)
    return instance


@pytest.mark.parametrize("name", EXPECTED_REPLACED)
@pytest.mark.parametrize("flip", [0, 1])
def test_positional_call_puts_arguments_where_upstream_does(context, name, flip):
    ours_cls, theirs_cls = getattr(losses, name), getattr(upstream, name)
    values = positional_values(theirs_cls, context, flip)
    names = [p.name for p in init_parameters(theirs_cls) if p.kind is POSITIONAL]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = theirs_cls(*values)
        ours = ours_cls(*values)
    stored = attributes_holding_arguments(theirs, dict(zip(names, values)))
    assert len(stored) >= len(names) - 2, stored  # Matryoshka sorts dims and weights into tuples
    for attribute, value in stored.items():
        assert attribute_of(ours, attribute) is value or attribute_of(ours, attribute) == value, attribute
    if hasattr(theirs, "get_config_dict"):
        assert ours.get_config_dict() == theirs.get_config_dict()


# --------------------------------------------------------------------------------------------
# Model-card surface: config, citation, the class's name and module


@pytest.mark.parametrize("name", EXPECTED_REPLACED)
def test_card_surface_is_upstreams(context, name):
    ours_cls, theirs_cls = getattr(losses, name), getattr(upstream, name)
    assert ours_cls.__module__.startswith("st_ext.losses."), "st_ext's class, under its own module"
    values = positional_values(theirs_cls, context, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, ours = theirs_cls(*values), ours_cls(*values)
    assert card_name(ours) == sentence_transformers.util.fullname(theirs)
    for attribute in ("citation", "get_config_dict"):
        assert hasattr(ours, attribute) == hasattr(theirs, attribute), attribute
    if hasattr(theirs, "citation"):
        assert ours.citation == theirs.citation


def test_own_options_join_the_card_only_when_changed(model, guide, guide_dir):
    baseline = upstream.CachedGISTEmbedLoss(model, guide, 0.05).get_config_dict()
    assert losses.CachedGISTEmbedLoss(model, guide, 0.05).get_config_dict() == baseline
    offloaded_guide = guide_from(guide_dir)
    offloaded = losses.CachedGISTEmbedLoss(model, offloaded_guide, 0.05, offload_guide=True).get_config_dict()
    assert offloaded == {**baseline, "guide": offloaded_guide, "offload_guide": True}
    assert list(offloaded)[: len(baseline)] == list(baseline)


def test_named_classes_still_pickle_and_copy_as_themselves(model):
    loss = losses.BatchAllTripletLoss(model, margin=2.5)
    for clone in (pickle.loads(pickle.dumps(loss)), copy.deepcopy(loss)):
        assert type(clone) is losses.BatchAllTripletLoss and clone.margin == 2.5
        assert [n for n, _ in clone.named_parameters()] == [n for n, _ in loss.named_parameters()]


# --------------------------------------------------------------------------------------------
# Errors and warnings


def outcome(build: Callable[[], object], caplog) -> tuple:
    """(exception type and message or None, log records, warnings) of one construction."""
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        try:
            build()
            error = None
        except Exception as exception:  # noqa: BLE001 - compared with upstream's, whatever it is
            error = (type(exception), str(exception))
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    caught = [
        (w.category, str(w.message)) for w in caught if not issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]
    return error, records, caught


@pytest.mark.parametrize(
    "dims, weights, n_dims_per_step",
    [
        ([], None, -1),
        ([32, 0], None, -1),
        ([32, -8], None, -1),
        ([64, 16], None, -1),
        ([32, 16], [1.0], -1),
        ([16, 8], None, -1),  # the model's 32 left out: upstream 5.x+ logs a warning
        ([32, 16], None, 0),
        ([32, 16], None, -2),
    ],
    ids=["empty", "zero", "negative", "too-large", "weights-mismatch", "full-dim-missing", "n-0", "n-minus-2"],
)
@pytest.mark.parametrize("inner", ["cached", "plain"])
def test_matryoshka_checks_and_warnings_are_upstreams(model, caplog, dims, weights, n_dims_per_step, inner):
    """Over a cached loss too, where st_ext runs its own GradCache: upstream's checks still run."""

    def inner_loss():
        if inner == "cached":
            return upstream.CachedMultipleNegativesRankingLoss(model)
        return upstream.MultipleNegativesRankingLoss(model)

    theirs = outcome(
        lambda: upstream.MatryoshkaLoss(
            model, upstream.MultipleNegativesRankingLoss(model), dims, weights, n_dims_per_step
        ),
        caplog,
    )
    ours = outcome(lambda: losses.MatryoshkaLoss(model, inner_loss(), dims, weights, n_dims_per_step), caplog)
    assert ours == theirs


def test_matryoshka_warning_for_a_missing_full_dimension(model, caplog):
    """Upstream's warning, on the release that gives it, reaches the user through the same logger."""
    theirs = outcome(
        lambda: upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), [16, 8]), caplog
    )
    ours = outcome(
        lambda: losses.MatryoshkaLoss(model, upstream.CachedMultipleNegativesRankingLoss(model), [16, 8]), caplog
    )
    assert ours == theirs
    if theirs[1]:
        ((logger_name, level, message),) = ours[1]
        assert logger_name == upstream.MatryoshkaLoss.__module__ and level == logging.WARNING
        assert "32" in message and "[16, 8]" in message


def test_matryoshka_dimension_error_at_the_first_forward_is_upstreams(model, monkeypatch):
    """A model that does not declare its size: both fail at the first batch with the same error."""
    for method in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        if hasattr(model, method):
            monkeypatch.setattr(model, method, lambda: None)
    columns = text_columns(4, 2)
    errors = []
    for wrapper, inner in (
        (upstream.MatryoshkaLoss, upstream.MultipleNegativesRankingLoss(model)),
        (losses.MatryoshkaLoss, upstream.CachedMultipleNegativesRankingLoss(model)),
    ):
        with pytest.raises(ValueError) as raised:
            loss_and_grads(model, wrapper(model, inner, [48, 16]), columns, train=False)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "48" in errors[0]


@pytest.mark.parametrize("name", ["GISTEmbedLoss", "CachedGISTEmbedLoss"])
def test_gist_errors_are_upstreams(model, guide, caplog, name):
    static = sentence_transformers.SentenceTransformer(
        modules=[st_modules().StaticEmbedding(build_tokenizer(), embedding_dim=32)], device="cpu"
    )
    calls = {
        "bad-margin-strategy": lambda cls: cls(model, guide, margin_strategy="percent"),
        "static-embedding-model": lambda cls: cls(static, guide),
        "fine": lambda cls: cls(model, guide, 0.01),
    }
    for label, call in calls.items():
        theirs = outcome(lambda: call(getattr(upstream, name)), caplog)
        ours = outcome(lambda: call(getattr(losses, name)), caplog)
        assert (ours[0] and ours[0][0]) == (theirs[0] and theirs[0][0]), (label, ours, theirs)
        assert ours[1:] == theirs[1:], label
        assert (theirs[0] is None) == (label == "fine"), (label, theirs)


@pytest.mark.parametrize("wrapper", ["AdaptiveLayerLoss", "Matryoshka2dLoss"])
def test_layer_wrappers_behave_as_upstream_except_over_cached_losses(model, caplog, wrapper):
    """Over a plain loss: upstream's warnings and errors. Over a cached loss upstream warns that it is not
    compatible; st_ext's runs it (tests/test_adaptive_layer.py), so it does not warn."""
    args = ([32, 16],) if wrapper == "Matryoshka2dLoss" else ()
    calls = {
        "plain": lambda namespace: getattr(namespace, wrapper)(
            model, upstream.MultipleNegativesRankingLoss(model), *args
        ),
    }
    if "layer_weighting" in inspect.signature(getattr(upstream, wrapper).__init__).parameters:
        calls["bad-weighting"] = lambda namespace: getattr(namespace, wrapper)(
            model, upstream.MultipleNegativesRankingLoss(model), *args, layer_weighting="cubic"
        )
    for label, call in calls.items():
        assert outcome(lambda: call(losses), caplog) == outcome(lambda: call(upstream), caplog), label
    theirs = outcome(
        lambda: getattr(upstream, wrapper)(model, upstream.CachedMultipleNegativesRankingLoss(model), *args), caplog
    )
    ours = outcome(
        lambda: getattr(losses, wrapper)(model, upstream.CachedMultipleNegativesRankingLoss(model), *args), caplog
    )
    assert theirs[0] is None and ours == (None, [], [])


# --------------------------------------------------------------------------------------------
# MatryoshkaLoss over every loss upstream's accepts


BATCH = 8
DIMS = [32, 16, 8]


def _classes():
    return torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


INNER_LOSSES = {
    "MultipleNegativesRankingLoss": (lambda m, g: upstream.MultipleNegativesRankingLoss(m), 2, None),
    "CachedMultipleNegativesRankingLoss": (
        lambda m, g: upstream.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3),
        3,
        None,
    ),
    "MultipleNegativesSymmetricRankingLoss": (lambda m, g: upstream.MultipleNegativesSymmetricRankingLoss(m), 2, None),
    "CachedMultipleNegativesSymmetricRankingLoss": (
        lambda m, g: upstream.CachedMultipleNegativesSymmetricRankingLoss(m, mini_batch_size=3),
        2,
        None,
    ),
    "CoSENTLoss": (lambda m, g: upstream.CoSENTLoss(m), 2, lambda: torch.linspace(0, 1, BATCH)),
    "AnglELoss": (lambda m, g: upstream.AnglELoss(m), 2, lambda: torch.linspace(0, 1, BATCH)),
    "CosineSimilarityLoss": (lambda m, g: upstream.CosineSimilarityLoss(m), 2, lambda: torch.linspace(0, 1, BATCH)),
    "ContrastiveLoss": (lambda m, g: upstream.ContrastiveLoss(m), 2, lambda: torch.tensor([1, 0] * (BATCH // 2))),
    "OnlineContrastiveLoss": (
        lambda m, g: upstream.OnlineContrastiveLoss(m),
        2,
        lambda: torch.tensor([1, 0] * (BATCH // 2)),
    ),
    "TripletLoss": (lambda m, g: upstream.TripletLoss(m), 3, None),
    "MegaBatchMarginLoss": (lambda m, g: upstream.MegaBatchMarginLoss(m, mini_batch_size=3), 2, None),
    "MegaBatchMarginLoss-plain": (
        lambda m, g: upstream.MegaBatchMarginLoss(m, use_mini_batched_version=False),
        2,
        None,
    ),
    "BatchAllTripletLoss": (lambda m, g: upstream.BatchAllTripletLoss(m), 1, _classes),
    "BatchHardSoftMarginTripletLoss": (lambda m, g: upstream.BatchHardSoftMarginTripletLoss(m), 1, _classes),
    "GISTEmbedLoss": (lambda m, g: upstream.GISTEmbedLoss(m, g), 2, None),
    "CachedGISTEmbedLoss": (lambda m, g: upstream.CachedGISTEmbedLoss(m, g, mini_batch_size=3), 3, None),
    "MarginMSELoss": (lambda m, g: upstream.MarginMSELoss(m), 3, lambda: torch.linspace(-1, 1, BATCH)),
    "MSELoss": (
        lambda m, g: upstream.MSELoss(m),
        1,
        lambda: torch.rand(BATCH, 32, generator=torch.Generator().manual_seed(0)),
    ),
}


def run_or_error(model, loss, columns, labels):
    try:
        return loss_and_grads_with(model, loss, columns, labels)
    except Exception as exception:  # noqa: BLE001 - compared with upstream's
        return type(exception)


def loss_and_grads_with(model, loss, columns, labels):
    if labels is None:
        return loss_and_grads(model, loss, columns, train=False)
    wrapped = _WithLabels(loss, labels)
    return loss_and_grads(model, wrapped, columns, train=False)


class _WithLabels(torch.nn.Module):
    """Feeds fixed labels to a loss (``loss_and_grads`` passes None)."""

    def __init__(self, loss, labels):
        super().__init__()
        self.loss, self.labels = loss, labels

    def forward(self, features, _labels):
        return self.loss(features, self.labels)


@pytest.mark.parametrize("name", list(INNER_LOSSES))
def test_matryoshka_over_every_loss_matches_upstream(model, guide, name):
    build, num_columns, labels = INNER_LOSSES[name]
    columns = text_columns(BATCH, num_columns)
    labels = labels() if labels else None
    inner = build(model, guide)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = losses.MatryoshkaLoss(model, inner, DIMS, [1.0, 0.5, 0.25])
        theirs = upstream.MatryoshkaLoss(model, build(model, guide), DIMS, [1.0, 0.5, 0.25])
    expected = run_or_error(model, theirs, columns, labels)
    actual = run_or_error(model, ours, columns, labels)
    if isinstance(expected, type):
        assert actual is expected
        return
    assert not isinstance(actual, type), actual
    assert_same_grads(actual, expected)
    assert "calculate_loss" not in vars(inner), "the wrapped loss is left as it was"


def test_mega_batch_margin_loss_runs_in_mini_batch_memory_where_upstream_caches(model):
    inner = upstream.MegaBatchMarginLoss(model, mini_batch_size=3)
    wrapped = losses.MatryoshkaLoss(model, inner, DIMS)
    assert wrapped.uses_gradient_cache == bool(getattr(inner, "uses_gradient_cache", False))


# --------------------------------------------------------------------------------------------
# Model cards written after training with upstream's trainer


def card_of(model, loss, dataset, output_dir) -> str:
    args = sentence_transformers.SentenceTransformerTrainingArguments(
        output_dir=str(output_dir / "run"),
        max_steps=1,
        per_device_train_batch_size=8,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    sentence_transformers.SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss).train()
    model.save(str(output_dir / "saved"))
    return (output_dir / "saved" / "README.md").read_text()


def loss_sections(card: str) -> dict[str, object]:
    """What the card says about losses: the ``loss:`` tags, each dataset's loss line with its
    parameters, and the citations."""
    lines = card.splitlines()
    tags = [line for line in lines if line.startswith("- loss:")]
    sections, index = [], 0
    while index < len(lines):
        if lines[index].startswith("* Loss:"):
            block = [lines[index]]
            if lines[index].endswith("with these parameters:"):
                end = lines.index("  ```", index + 2)
                block += lines[index + 1 : end + 1]
            sections.append("\n".join(block))
        index += 1
    citations = re.findall(r"#### ([^\n]+)\n```bibtex\n(.*?)```", card, flags=re.DOTALL)
    return {"tags": tags, "loss": sections, "citations": citations}


def labelled_dataset() -> Dataset:
    texts = text_columns(8, 1, seed=5)[0]
    return Dataset.from_dict({"sentence": texts, "label": [0, 0, 1, 1, 2, 2, 3, 3]})


CARD_CASES = {
    "MatryoshkaLoss(CachedMNRL)": (
        lambda ns, m, g: ns.MatryoshkaLoss(m, ns.CachedMultipleNegativesRankingLoss(m, mini_batch_size=4), [32, 16]),
        pair_dataset,
    ),
    "CachedGISTEmbedLoss": (lambda ns, m, g: ns.CachedGISTEmbedLoss(m, g, 0.05, 4), pair_dataset),
    "GISTEmbedLoss": (lambda ns, m, g: ns.GISTEmbedLoss(m, g, 0.05, "relative", 0.1), pair_dataset),
    "BatchAllTripletLoss": (lambda ns, m, g: ns.BatchAllTripletLoss(m, margin=2.0), lambda rows: labelled_dataset()),
    "BatchSemiHardTripletLoss": (lambda ns, m, g: ns.BatchSemiHardTripletLoss(m), lambda rows: labelled_dataset()),
}


@pytest.mark.parametrize("case", list(CARD_CASES))
def test_model_card_names_and_describes_the_loss_as_upstream(tiny_bert_dir, guide, tmp_path, case):
    build, dataset = CARD_CASES[case]
    cards = {}
    for side, namespace in (("upstream", upstream), ("st_ext", losses)):
        model = sentence_transformer_from(tiny_bert_dir)
        cards[side] = loss_sections(card_of(model, build(namespace, model, guide), dataset(8), tmp_path / side))
    assert cards["st_ext"] == cards["upstream"]
    name = case.split("(")[0]
    (line,) = [section for section in cards["st_ext"]["loss"]]
    assert (
        f"[<code>{name}</code>](https://sbert.net/docs/package_reference/sentence_transformer/losses.html#{name.lower()})"
        in line
    )
    assert f"- loss:{name}" in cards["st_ext"]["tags"]


def without_entry(section: str, key: str) -> str:
    """``section`` with one config entry removed, whether the card wrote the config as JSON or,
    when a value is not JSON (4.x with a guide model), as the dict's repr."""
    json_entry = re.compile(rf',\n\s*"{key}": [^\n]*?(?=\n)')
    repr_entry = re.compile(rf", '{key}': [^,}}]*")
    return repr_entry.sub("", json_entry.sub("", section))


def test_model_card_lists_a_changed_own_option_and_nothing_else_new(tiny_bert_dir, guide_dir, tmp_path):
    cards = {}
    for side, namespace, options in (("upstream", upstream, {}), ("st_ext", losses, {"offload_guide": True})):
        model = sentence_transformer_from(tiny_bert_dir)
        loss = namespace.CachedGISTEmbedLoss(model, guide_from(guide_dir), 0.05, 4, **options)
        cards[side] = loss_sections(card_of(model, loss, pair_dataset(8), tmp_path / side))
    (theirs,), (ours,) = cards["upstream"]["loss"], cards["st_ext"]["loss"]
    assert "offload_guide" in ours and ours != theirs
    assert without_entry(ours, "offload_guide") == theirs
    assert {k: v for k, v in cards["st_ext"].items() if k != "loss"} == {
        k: v for k, v in cards["upstream"].items() if k != "loss"
    }


def test_distillation_card_lists_the_wrapped_loss_and_only_the_options_in_use(model, guide, guide_dir):
    """DistillationLoss has no upstream namesake: its card shows the wrapped loss's parameters, the
    teacher (as GIST cards show their guide), and its own options only when they are in use."""
    inner = upstream.MarginMSELoss(model)
    resident = losses.DistillationLoss(inner, guide).get_config_dict()
    inner_config = inner.get_config_dict() if hasattr(inner, "get_config_dict") else {}  # none on 4.x
    assert resident == {"loss": "MarginMSELoss", **inner_config, "teacher": guide}
    offloaded_teacher = guide_from(guide_dir)
    offloaded = losses.DistillationLoss(upstream.MarginMSELoss(model), offloaded_teacher, offload_teacher=True)
    assert offloaded.get_config_dict() == {**resident, "teacher": offloaded_teacher, "offload_teacher": True}


@pytest.mark.parametrize("dims", [[32, 16.5], [32.0, 16], [True, 16], ["32", 16]])
@pytest.mark.parametrize("inner", ["cached", "plain"])
def test_matryoshka_refuses_dimensions_that_are_not_integers_at_construction(model, dims, inner):
    """Upstream accepts them and fails at the first step; st_ext refuses them where the mistake is."""
    loss = (
        losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
        if inner == "cached"
        else upstream.MultipleNegativesRankingLoss(model)
    )
    with pytest.raises(ValueError, match=r"matryoshka_dims must be integers, got .* at position"):
        losses.MatryoshkaLoss(model, loss, dims)


def test_a_deprecated_upstream_loss_warns_when_constructed_and_not_at_import(model):
    """Upstream's deprecation of a class st_ext replaces reaches the user's line that constructs it, as
    upstream's does, and importing st_ext.losses says nothing."""
    script = "import warnings; warnings.simplefilter('error', DeprecationWarning); import st_ext.losses"
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True).returncode == 0
    name = "CachedMultipleNegativesSymmetricRankingLoss"
    deprecated = getattr(getattr(upstream, name), "__deprecated__", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(losses, name)(model)
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and "deprecated" in str(w.message)]
    assert [str(w.message) for w in ours] == ([deprecated] if deprecated else [])
    assert all(w.filename == __file__ for w in ours)
