"""Which of st_ext's modules one cached Matryoshka step hands its features to, in order.

Runs one forward and backward pass of ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` on a tiny
model and records every call into st_ext that receives the step's features (a column's dict of token ids,
or a list of them) as an argument, in call order. Consecutive calls into one module are one stay; a stay in
a module the features had already left is a return. Fewer returns means a path one can follow by reading
the modules in order. The loop over mini-batches repeats one cycle of stays per mini-batch; the figures are
given as traced and with each repeat of a cycle counted once (the path's shape, whatever the batch size). It reads only st_ext's public API, so it measures an older checkout too:

    python tools/trace_features_path.py                      # this checkout
    PYTHONPATH=/path/to/old/checkout python tools/trace_features_path.py
    python tools/trace_features_path.py --every-call         # every call into st_ext, features or not
    python tools/trace_features_path.py --upstream           # upstream's own classes, calls into its loss modules
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *"the a cat dog sat ran on in mat tree bird flew".split()]
ANCHORS = ["the cat sat", "a dog ran", "the bird flew", "a cat ran"]
POSITIVES = ["a cat on the mat", "the dog ran", "a bird flew in a tree", "the cat ran on"]


def tiny_model(path: Path):
    from sentence_transformers.models import Pooling, Transformer

    from st_ext import SentenceTransformer

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    BertModel(config).save_pretrained(path)
    tokenizer = Tokenizer(WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)
    transformer = Transformer(str(path))
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_word_embedding_dimension())])


def holds_features(value) -> bool:
    """A column's features (a tokenizer's ``BatchEncoding`` or a dict of token ids), or a list of them."""
    if isinstance(value, Mapping):
        return "input_ids" in value
    return isinstance(value, (list, tuple)) and any(holds_features(item) for item in value)


def traced_modules(step, package_root: str, every_call: bool, module_part: str = "") -> list[str]:
    """The module of every call into ``package_root`` (whose module name holds ``module_part``) that receives
    features as an argument, or of every call with ``every_call``, in call order."""
    modules: list[str] = []

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package_root):
            return
        module = frame.f_globals.get("__name__", "?")
        if module_part not in module:
            return
        arguments = frame.f_code.co_varnames[: frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
        if every_call or any(holds_features(frame.f_locals.get(name)) for name in arguments):
            modules.append(module)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return modules


def without_repeats(stays: list[str]) -> list[str]:
    """``stays`` with every block that repeats the block just before it removed, until none does."""
    path = list(stays)
    changed = True
    while changed:
        changed = False
        for length in range(1, len(path) // 2 + 1):
            for start in range(len(path) - 2 * length + 1):
                if path[start : start + length] == path[start + length : start + 2 * length]:
                    del path[start + length : start + 2 * length]
                    changed = True
                    break
            if changed:
                break
    return path


def returns(stays: list[str]) -> int:
    return sum(module in stays[:index] for index, module in enumerate(stays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--every-call", action="store_true", help="trace every call, not only those given features")
    parser.add_argument(
        "--upstream", action="store_true", help="run upstream's classes and trace calls into its loss modules"
    )
    options = parser.parse_args()
    if options.upstream:
        import sentence_transformers as traced_package
        from sentence_transformers import losses

        module_part = ".losses"
    else:
        import st_ext as traced_package
        from st_ext import losses

        module_part = ""

    with tempfile.TemporaryDirectory() as directory:
        model = tiny_model(Path(directory))
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = losses.MatryoshkaLoss(model, inner, [16, 8])
    preprocess = getattr(model, "preprocess", None) or model.tokenize  # preprocess from sentence-transformers 5
    features = [preprocess(ANCHORS), preprocess(POSITIVES)]

    def step() -> None:
        loss(features, None).backward()

    step()  # imports and first-call set-up stay out of the trace
    package_root = str(Path(traced_package.__file__).parent)
    stays = []
    for module in traced_modules(step, package_root, options.every_call or options.upstream, module_part):
        if not stays or stays[-1] != module:
            stays.append(module)
    shape = without_repeats(stays)
    prefix = traced_package.__name__ + "."
    print(f"{traced_package.__name__} at {package_root}")
    print(f"modules visited: {len(set(stays))}")
    print(f"as traced: {len(stays)} stays, {returns(stays)} returns to a module already left")
    print(f"each repeated cycle once: {len(shape)} stays, {returns(shape)} returns")
    print("path: " + " -> ".join(module.removeprefix(prefix) for module in shape))


if __name__ == "__main__":
    main()
