"""Models and datasets named by their Hugging Face Hub id, found in the local cache or downloaded.

Without a network they end in one line saying so (and what works offline) instead of half a minute of
retries and a traceback: the cache is tried first, then ``HF_HUB_OFFLINE`` is honoured, then one quick
connection to the Hub decides whether to try at all.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from st_ext.cli.errors import ConfigError

#: owner/name (or a bare name), as the Hub spells ids; anything else is a local path.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
CONNECT_TIMEOUT_S = 5.0


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not Path(name).exists()


def offline_mode() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def unreachable_reason() -> str | None:
    """Why the Hub cannot be reached now, or None if a connection opens."""
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        return f"{host} cannot be reached ({error.strerror or error})"
    return None


def model_config(model_id: str, setting: str = "model") -> Path:
    """The Hub model's ``config.json``, from the cache or downloaded: proof that the id loads, and its limits."""
    from huggingface_hub import hf_hub_download

    where = f"{setting}: {model_id!r} is not a local directory and"
    try:
        return Path(hf_hub_download(model_id, "config.json", local_files_only=True))
    except Exception:  # not in the cache: huggingface_hub raises several types for that
        pass
    if offline_mode():
        raise ConfigError(
            f"{where} is not in the local Hugging Face cache (HF_HUB_OFFLINE is set); download it once online, or pass a local directory."
        )
    reason = unreachable_reason()
    if reason is not None:
        raise ConfigError(
            f"{where} is not in the local Hugging Face cache, and {reason}; download it once online, or pass a local directory."
        )
    try:
        return Path(hf_hub_download(model_id, "config.json"))
    except Exception as error:  # RepositoryNotFound, gated, ... : one line with the Hub's reason
        raise ConfigError(f"{where} cannot be loaded from the Hub: {_first_line(error)}") from None


def load_dataset_from_hub(name: str, split: str = "train"):
    """Split ``split`` of the Hub dataset ``name`` (the cache is used under ``HF_HUB_OFFLINE``)."""
    from datasets import load_dataset

    where = f"data: {name!r} is not a local file and"
    if not offline_mode():
        reason = unreachable_reason()
        if reason is not None:
            raise ConfigError(
                f"{where} {reason}; a dataset already in your Hugging Face cache loads with HF_HUB_OFFLINE=1, "
                "or pass a JSONL, CSV or Parquet file."
            )
    try:
        return load_dataset(name, split=split)
    except Exception as error:  # the datasets library raises many types
        raise ConfigError(f"{where} cannot be loaded from the Hub: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__).rstrip(".") + "."
