"""sentence-transformers' own cached losses, every archetype's, forwarded by st_ext's engine in st_ext's trainers.

One process: st_ext's trainer over upstream's loss object trains to the weights upstream's trainer reaches
with the loss's own forward, while no step of upstream's engine runs; the loss st_ext's engine returns has
the ``grad_fn`` DeepSpeed's ``engine.backward`` needs. What cannot run on st_ext's engine is refused when the
trainer is built. The same losses on two ranks under DDP, FSDP2 and ZeRO 1-3: ``tests/test_distributed.py``.
"""

from __future__ import annotations

import warnings

import pytest
import sentence_transformers
import torch
from archetype_losses import CASES, MINI_BATCH_SIZE, case_dataset, case_loss, case_model, save_case_models
from test_trainer import training_args

import st_ext
from st_ext._compat import archetype_loss_class
from st_ext.losses.upstream_forwards import engine_forward

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_case_models(tmp_path_factory.mktemp("archetype_models"))


def available(name: str):
    case = CASES[name]
    return pytest.param(
        name, id=name, marks=pytest.mark.skipif(case.missing() is not None, reason=case.missing() or "")
    )


ALL_CASES = [available(name) for name in CASES]


def train(name: str, model_dirs, tmp_path, *, on_st_ext: bool, mini_batch_size=MINI_BATCH_SIZE, **overrides):
    """Two steps of ``name``'s upstream loss: through st_ext's trainer, or through upstream's."""
    case = CASES[name]
    model = case_model(name, model_dirs)
    loss = case_loss(name, model, mini_batch_size=mini_batch_size)
    package = st_ext if on_st_ext else sentence_transformers
    trainer_class = getattr(package, f"{case.archetype}Trainer")
    settings = dict(gradient_checkpointing=False, per_device_train_batch_size=8, optim="sgd", learning_rate=0.5)
    args = training_args(getattr(package, f"{case.archetype}TrainingArguments"), tmp_path, **{**settings, **overrides})
    trainer = trainer_class(model=model, args=args, train_dataset=case_dataset(name), loss=loss)
    trainer.train()
    return trainer, {key: value.detach().clone() for key, value in model.named_parameters()}


@pytest.mark.parametrize("name", ALL_CASES)
def test_st_ext_trainer_trains_upstream_loss_on_its_engine_to_upstreams_weights(
    name, model_dirs, tmp_path, monkeypatch
):
    case = CASES[name]
    upstream_class = type(case_loss(name, case_model(name, model_dirs)))
    expected_trainer, expected = train(name, model_dirs, tmp_path / "upstream", on_st_ext=False)
    for step in case.upstream_engine_steps:
        # Where the step is defined (a base class's step is every subclass's), so no subclass looks overridden.
        owner = next(cls for cls in upstream_class.__mro__ if step in vars(cls))
        monkeypatch.setattr(owner, step, _never(step))
    trainer, trained = train(name, model_dirs, tmp_path / "st_ext", on_st_ext=True)
    assert trainer.engine_forwards, "st_ext's trainer did not forward the loss on its engine"
    assert trained.keys() == expected.keys()
    changed = False
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-5, msg=key)
        changed = changed or not torch.equal(value, dict(case_model(name, model_dirs).named_parameters())[key])
    assert changed, "training changed nothing"
    train_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    expected_losses = [entry["loss"] for entry in expected_trainer.state.log_history if "loss" in entry]
    assert train_losses == pytest.approx(expected_losses, rel=1e-4)


def _never(step: str):
    def called(*args, **kwargs):
        raise AssertionError(f"upstream's {step} ran: st_ext's engine should forward this loss")

    return called


@pytest.mark.parametrize("name", ALL_CASES)
def test_engine_loss_has_a_grad_fn_and_upstreams_gradients(name, model_dirs):
    """DeepSpeed's engine.backward refuses a loss without grad_fn, which upstream's forward returns."""
    model = case_model(name, model_dirs)
    loss = case_loss(name, model)
    forward = engine_forward(loss)
    assert forward is not None
    inputs, labels = CASES[name].batch(model)
    upstream_value = loss(inputs, labels)
    if isinstance(upstream_value, dict):  # CachedSpladeLoss's terms: the first is made from the hooked total
        upstream_value = sum(upstream_value.values())
    else:
        assert upstream_value.grad_fn is None
    upstream_value.backward()
    expected = {key: param.grad.clone() for key, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    value = forward.forward(inputs, labels)
    value = sum(value.values()) if isinstance(value, dict) else value
    assert value.grad_fn is not None
    torch.testing.assert_close(value.detach(), upstream_value.detach(), rtol=1e-5, atol=1e-6)
    value.backward()
    grads = {key: param.grad for key, param in model.named_parameters() if param.grad is not None}
    assert grads.keys() == expected.keys()
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", [available(name) for name in ("cross_encoder_cmnrl", "multi_vector_cmnrl")])
def test_auto_mini_batch_is_refused_where_the_model_has_no_sentence_embedding(name, model_dirs, tmp_path):
    case = CASES[name]
    model = case_model(name, model_dirs)
    loss = case_loss(name, model, mini_batch_size="auto")
    args = training_args(getattr(st_ext, f"{case.archetype}TrainingArguments"), tmp_path, gradient_checkpointing=False)
    trainer_class = getattr(st_ext, f"{case.archetype}Trainer")
    with pytest.raises(ValueError, match="mini_batch_size='auto'.*give mini_batch_size a number") as error:
        trainer_class(model=model, args=args, train_dataset=case_dataset(name), loss=loss)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", [available("splade"), available("sentence_transformer_cmnrl")])
def test_auto_mini_batch_sizes_an_upstream_loss(name, model_dirs, tmp_path):
    trainer, _ = train(name, model_dirs, tmp_path, on_st_ext=True, mini_batch_size="auto", max_steps=1)
    chosen = [entry["mini_batch_size"] for entry in trainer.state.log_history if "mini_batch_size" in entry]
    assert chosen and all(isinstance(size, int) and size > 0 for size in chosen)


@pytest.mark.skipif(
    archetype_loss_class("cross_encoder", "CachedMultipleNegativesRankingLoss") is None
    or CASES["cross_encoder_cmnrl"].missing() is None,
    reason="this release's CrossEncoder cached loss runs on st_ext's engine",
)
def test_cross_encoder_cached_loss_before_6_keeps_its_own_forward(model_dirs):
    """4.x's CrossEncoder loss calls the Hugging Face classifier on raw pairs inside itself."""
    from st_ext._compat import st_modules  # noqa: F401  (the release's modules load)

    loss_class = archetype_loss_class("cross_encoder", "CachedMultipleNegativesRankingLoss")
    model = st_ext.CrossEncoder(str(model_dirs["classifier"]), num_labels=1, device="cpu")
    assert engine_forward(loss_class(model, mini_batch_size=2)) is None


# ---------------------------------------------------------------------------------------------
# Upstream's classes that st_ext replaces, handed to st_ext's trainer


def pairs_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"anchor": [f"query {i}" for i in range(8)], "positive": [f"text {i}" for i in range(8)]})


def st_ext_trainer(model, loss, tmp_path):
    args = training_args(st_ext.SentenceTransformerTrainingArguments, tmp_path, gradient_checkpointing=False)
    return st_ext.SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs_dataset(), loss=loss)


def test_upstream_wrapper_warns_once_naming_the_import_line_to_change(model, tmp_path, monkeypatch):
    from st_ext._compat import embedding_dimension, st_losses
    from st_ext.training import engine_forwards

    monkeypatch.setattr(engine_forwards, "_warned", set())
    upstream = st_losses()
    dims = [embedding_dimension(model), 8]

    def wrapped():
        return upstream.MatryoshkaLoss(
            model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), dims
        )

    with pytest.warns(UserWarning) as records:
        st_ext_trainer(model, wrapped(), tmp_path)
    messages = [str(record.message) for record in records if "st-ext swap-imports" in str(record.message)]
    assert len(messages) == 1, messages
    assert f"`from {upstream.__name__} import MatryoshkaLoss, CachedMultipleNegativesRankingLoss`" in messages[0]
    assert "`from st_ext.losses import MatryoshkaLoss, CachedMultipleNegativesRankingLoss`" in messages[0]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        st_ext_trainer(model, wrapped(), tmp_path)
    assert not [record for record in again if "st-ext swap-imports" in str(record.message)], "once per class"


@pytest.mark.parametrize("how", ["bare upstream cached loss", "st_ext wrapper over upstream's cached loss"])
def test_what_st_ext_runs_as_its_own_class_would_is_not_warned_about(model, tmp_path, monkeypatch, how):
    from st_ext._compat import embedding_dimension, st_losses
    from st_ext.training import engine_forwards

    monkeypatch.setattr(engine_forwards, "_warned", set())
    inner = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = (
        inner
        if how.startswith("bare")
        else st_ext.losses.MatryoshkaLoss(model, inner, [embedding_dimension(model), 8])
    )
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        trainer = st_ext_trainer(model, loss, tmp_path)
    assert not [record for record in records if "st-ext swap-imports" in str(record.message)]
    assert (id(loss) in trainer.engine_forwards) == how.startswith("bare"), "the bare one runs on st_ext's engine"
