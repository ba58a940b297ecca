"""tools/hub_stand_ins.py: the stand-in for the static embedding model that upstream's Matryoshka tests load."""

from __future__ import annotations

import sys
from pathlib import Path

from sentence_transformers import SentenceTransformer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import hub_stand_ins  # noqa: E402  (a tool, not a package)


def test_static_retrieval_stand_in_loads_with_the_real_models_dimension(tmp_path: Path) -> None:
    """``test_matryoshka.py`` checks dimensions against 1024, the real model's: the stand-in has them, so that its
    tests run offline instead of failing at setup."""
    builder = hub_stand_ins.STAND_INS["sentence-transformers/static-retrieval-mrl-en-v1"]
    builder(tmp_path / "static")
    model = SentenceTransformer(str(tmp_path / "static"), device="cpu")
    embeddings = model.encode(["a man plays the guitar", "a dog"], convert_to_tensor=True)
    assert embeddings.shape == (2, 1024)
