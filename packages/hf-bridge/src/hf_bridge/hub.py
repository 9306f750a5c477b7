"""Hugging Face Hub ids: download a snapshot when a hub is reachable, fail at once with a clear error otherwise."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from .errors import HfBridgeError

# "gpt2" or "org/name": what the hub accepts as a repository id.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
TRUE = ("1", "true", "yes", "on")


def looks_like_hub_id(path: str) -> bool:
    """Whether a path that is not on disk could be a hub repository id."""
    return bool(HUB_ID.match(path)) and ".." not in path


def hub_offline() -> bool:
    """Whether the environment asks for no hub network access (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def download_snapshot(repo_id: str, patterns: Sequence[str], revision: str | None = None) -> Path:
    """A local directory with the files of `repo_id` matching `patterns` (from the hub, or its cache offline)."""
    try:
        import huggingface_hub
    except ImportError:
        raise HfBridgeError(
            f"{repo_id!r} is not a local directory or file, and looks like a Hugging Face Hub id, but the hub "
            "client is not installed. Install it with `pip install 'hf-bridge[hub]'`, or download the files "
            "and pass their local directory."
        ) from None
    offline = hub_offline()
    try:
        # local_files_only never touches the network: offline, a missing snapshot fails at once.
        local = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(patterns), local_files_only=offline
        )
    except Exception as e:
        if offline:
            raise HfBridgeError(
                f"{repo_id!r} is not a local directory and is not in the Hugging Face cache, and the hub is "
                "off (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set). Download it where the hub is reachable "
                "(e.g. `hf download " + repo_id + "`), or pass a local directory."
            ) from None
        raise HfBridgeError(
            f"Could not download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Check the id, "
            "your network and token, or pass a local directory."
        ) from None
    return Path(local)
