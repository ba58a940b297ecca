"""``st-ext swap-imports``: a training script's imports rewritten by the README's contract, nothing else.

The fixture scripts below are short scripts of each archetype whose import lines are those upstream's own
example scripts use (sentence-transformers 6.x paths, and the 4.x/5.x ones).
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap

import pytest

from st_ext.cli import main
from st_ext.cli.swap_imports import swapped

SENTENCE_TRANSFORMER_6 = '''\
"""Matryoshka on NLI pairs."""
import logging

from datasets import load_dataset

from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.sampler import BatchSamplers
from sentence_transformers.sentence_transformer.evaluation import (
    EmbeddingSimilarityEvaluator,
    SequentialEvaluator,
)
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

model = SentenceTransformer("some-model")
inner = MultipleNegativesRankingLoss(model)
loss = MatryoshkaLoss(model, inner, [768, 512, 256])
'''

SENTENCE_TRANSFORMER_4 = """\
from sentence_transformers import SentenceTransformer, losses
from sentence_transformers.losses import CachedMultipleNegativesRankingLoss as CMNRL  # the cached loss
from sentence_transformers.trainer import SentenceTransformerTrainer
from sentence_transformers.training_args import BatchSamplers, SentenceTransformerTrainingArguments
from sentence_transformers.evaluation import InformationRetrievalEvaluator

def build(model_name):
    model = SentenceTransformer(model_name)
    return SentenceTransformerTrainer(model=model, loss=losses.MatryoshkaLoss(model, CMNRL(model), [64]))
"""

CROSS_ENCODER_6 = """\
from sentence_transformers.cross_encoder import CrossEncoder
from sentence_transformers.cross_encoder.evaluation import CrossEncoderNanoBEIREvaluator
from sentence_transformers.cross_encoder.losses import MSELoss
from sentence_transformers.cross_encoder.trainer import CrossEncoderTrainer
from sentence_transformers.cross_encoder.training_args import CrossEncoderTrainingArguments

model = CrossEncoder("some-reranker")
"""

SPARSE_ENCODER_6 = """\
from sentence_transformers import (
    SparseEncoder,
    SparseEncoderModelCardData,
    SparseEncoderTrainer,
    SparseEncoderTrainingArguments,
)
from sentence_transformers.sparse_encoder.evaluation import SparseNanoBEIREvaluator
from sentence_transformers.sparse_encoder.losses import SparseMarginMSELoss, SpladeLoss
"""

MULTI_VECTOR_6 = """\
from sentence_transformers import (
    MultiVectorEncoder,
    MultiVectorEncoderTrainer,
    MultiVectorEncoderTrainingArguments,
    evaluation,
)
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
"""

SCRIPTS = {
    "sentence_transformer_6": SENTENCE_TRANSFORMER_6,
    "sentence_transformer_4": SENTENCE_TRANSFORMER_4,
    "cross_encoder_6": CROSS_ENCODER_6,
    "sparse_encoder_6": SPARSE_ENCODER_6,
    "multi_vector_6": MULTI_VECTOR_6,
}


def import_lines(source: str) -> list[str]:
    """Each import statement, as one normalised line (``ast.unparse``)."""
    return [ast.unparse(node) for node in ast.parse(source).body if isinstance(node, (ast.Import, ast.ImportFrom))]


def other_statements(source: str) -> list[str]:
    return [ast.dump(node) for node in ast.parse(source).body if not isinstance(node, (ast.Import, ast.ImportFrom))]


@pytest.mark.parametrize("name", SCRIPTS)
def test_only_imports_change_and_a_swapped_script_swaps_to_itself(name):
    source = SCRIPTS[name]
    result = swapped(source)
    assert other_statements(result) == other_statements(source)
    assert swapped(result) == result
    changed = [line for line in result.splitlines() if line not in source.splitlines()]
    assert all(
        line.lstrip().startswith(("from ", "import ")) or line.strip() in ("", ")") or line.startswith("    ")
        for line in changed
    ), changed


def test_a_6x_sentence_transformer_script_gets_st_ext_models_trainers_and_losses():
    lines = import_lines(swapped(SENTENCE_TRANSFORMER_6))
    assert (
        "from st_ext import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments"
        in lines
    )
    assert "from st_ext.losses import MatryoshkaLoss, MultipleNegativesRankingLoss" in lines
    assert "from sentence_transformers.base.sampler import BatchSamplers" in lines, (
        "what st_ext does not replace stays"
    )
    assert any(line.startswith("from sentence_transformers.sentence_transformer.evaluation import") for line in lines)
    assert "from datasets import load_dataset" in lines


def test_a_4x_script_keeps_its_aliases_comments_and_what_st_ext_lacks():
    result = swapped(SENTENCE_TRANSFORMER_4)
    assert "from st_ext.losses import CachedMultipleNegativesRankingLoss as CMNRL  # the cached loss\n" in result
    lines = import_lines(result)
    assert "from st_ext import SentenceTransformer, losses" in lines
    assert "from st_ext import SentenceTransformerTrainer" in lines
    assert (
        "from sentence_transformers.training_args import BatchSamplers, SentenceTransformerTrainingArguments" in lines
    )
    assert "from sentence_transformers.evaluation import InformationRetrievalEvaluator" in lines


def test_other_archetypes_take_st_ext_models_and_trainers_and_keep_their_own_losses():
    cross = import_lines(swapped(CROSS_ENCODER_6))
    assert "from st_ext import CrossEncoder" in cross and "from st_ext import CrossEncoderTrainer" in cross
    assert "from sentence_transformers.cross_encoder.losses import MSELoss" in cross
    sparse = swapped(SPARSE_ENCODER_6)
    assert "from st_ext import (\n    SparseEncoder,\n    SparseEncoderModelCardData,\n" in sparse
    assert "from sentence_transformers.sparse_encoder.losses import SparseMarginMSELoss, SpladeLoss" in sparse
    multi = import_lines(swapped(MULTI_VECTOR_6))
    assert (
        "from st_ext import MultiVectorEncoder, MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments"
        in multi
    )
    assert "from sentence_transformers import evaluation" in multi, "a name st_ext lacks stays with upstream"


def test_the_other_archetypes_losses_modules_are_never_st_ext_losses():
    source = "from sentence_transformers.cross_encoder import losses\nfrom sentence_transformers.sentence_transformer import losses as st_losses\n"
    assert import_lines(swapped(source)) == [
        "from sentence_transformers.cross_encoder import losses",
        "from st_ext import losses as st_losses",
    ]


def test_nested_and_shared_line_imports():
    source = textwrap.dedent(
        """\
        def load():
            from sentence_transformers.losses import GISTEmbedLoss
            return GISTEmbedLoss
        if True: from sentence_transformers import SentenceTransformer, evaluation
        """
    )
    result = swapped(source)
    assert "    from st_ext.losses import GISTEmbedLoss\n" in result
    assert "if True: from st_ext import SentenceTransformer; from sentence_transformers import evaluation\n" in result
    compile(result, "swapped", "exec")


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers.sentence_transformer") is None, reason="6.x module paths"
)
def test_the_swapped_imports_of_a_6x_script_bind_st_ext_classes():
    from st_ext import SentenceTransformer, SentenceTransformerTrainer, losses as st_ext_losses

    namespace: dict = {}
    exec("\n".join(import_lines(swapped(SENTENCE_TRANSFORMER_6))[1:]), namespace)  # all but `import logging`
    assert namespace["SentenceTransformer"] is SentenceTransformer
    assert namespace["SentenceTransformerTrainer"] is SentenceTransformerTrainer
    assert namespace["MatryoshkaLoss"] is st_ext_losses.MatryoshkaLoss


def test_the_command_prints_a_diff_and_writes_only_with_in_place(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SENTENCE_TRANSFORMER_6)
    assert main(["swap-imports", str(script)]) == 0
    diff = capsys.readouterr().out
    assert "-from sentence_transformers.sentence_transformer.losses import" in diff
    assert "+from st_ext.losses import MatryoshkaLoss, MultipleNegativesRankingLoss" in diff
    assert script.read_text() == SENTENCE_TRANSFORMER_6, "a diff only, by default"
    assert main(["swap-imports", "--in-place", str(script)]) == 0
    assert script.read_text() == swapped(SENTENCE_TRANSFORMER_6)
    capsys.readouterr()
    assert main(["swap-imports", str(script)]) == 0
    assert capsys.readouterr().out == "", "a swapped script has nothing left to swap"


def test_a_file_that_cannot_be_swapped_is_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("from sentence_transformers import (\n")
    assert main(["swap-imports", str(broken)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "broken.py is not valid Python" in error
    assert main(["swap-imports", str(tmp_path / "missing.py")]) == 2
    assert "cannot read" in capsys.readouterr().err
