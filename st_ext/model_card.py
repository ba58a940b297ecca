"""Model cards that name each st_ext loss as the upstream loss it replaces.

Upstream's card names a loss by its class's module and name, and links the loss's documentation only for a
module under ``sentence_transformers.``. st_ext's losses are st_ext's own classes (they pickle and show their
source by st_ext's path), so the card data of st_ext's models writes that one value, the loss's full name, as
the upstream class's: the one its class declares as ``model_card_namesake`` (set by
:func:`st_ext.losses._signatures.named_like_upstream`). Tags, citations and parameters come from the loss, as they
do upstream.
"""

from __future__ import annotations

from typing import Any

import sentence_transformers
from sentence_transformers.util import fullname

#: The class attribute in which an st_ext loss names the upstream class that model cards show for it.
NAMESAKE_ATTRIBUTE = "model_card_namesake"


def card_name(loss: Any) -> str:
    """The full name a model card gives ``loss``: the upstream namesake its own class declares (a user's subclass
    is named as itself), else upstream's ``fullname``."""
    namesake = vars(type(loss)).get(NAMESAKE_ATTRIBUTE)
    return fullname(loss) if namesake is None else f"{namesake.__module__}.{namesake.__name__}"


class SentenceTransformerModelCardData(sentence_transformers.SentenceTransformerModelCardData):
    """Upstream's ``SentenceTransformerModelCardData``, naming st_ext's losses as their upstream namesakes."""

    def compute_dataset_metrics(
        self, dataset: Any, dataset_info: dict[str, Any], loss: Any, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        # Upstream annotates its result dict[str, str], but its "loss" entry is a dict.
        metrics: dict[str, Any] = super().compute_dataset_metrics(dataset, dataset_info, loss, *args, **kwargs)
        metrics["loss"]["fullname"] = card_name(loss)
        return metrics
