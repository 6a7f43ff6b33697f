"""Resolve a model name to a local directory: a path, the shipped tiny model, or a Hub snapshot."""
from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = {"tiny": ASSETS / "tiny" / "target", "tiny-peagle": ASSETS / "tiny" / "peagle",
           "tiny-eagle3": ASSETS / "tiny" / "eagle3"}
# What a checkpoint needs. GPT-OSS repos also carry `original/` (a second copy of the weights in OpenAI's own
# layout, ~61 GB for 120B) and `metal/`, which `*.safetensors` would match too: fnmatch's `*` crosses `/`.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
IGNORE_PATTERNS = ["original/*", "metal/*"]


def resolve(name: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """Local directory for `name`: an existing path, a shipped model, or a Hub snapshot (vLLM's `revision`
    and `download_dir`, which is the Hub cache directory)."""
    if name in SHIPPED:
        path = SHIPPED[name]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the shipped model {name!r} is missing from {path}: this install of peagle "
                                    "is incomplete; reinstall it (pip install --force-reinstall peagle)")
        return path
    path = Path(os.path.expanduser(name))
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path {path} is a file; pass the checkpoint directory")
        return path
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise FileNotFoundError(f"model {name!r} is neither a local directory nor a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=download_dir,
                                      allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    except Exception as e:  # one line that says what went wrong and what to do, never a Hub traceback
        raise FileNotFoundError(_hub_failure(name, revision, e)) from None


def _hub_failure(name: str, revision: str | None, e: Exception) -> str:
    from huggingface_hub import errors

    local = f"or pass a local directory (model=/models/{name.split('/')[-1]})"
    if isinstance(e, errors.GatedRepoError):
        return f"{name!r} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN, {local}"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{name!r} has no revision {revision!r} on the Hugging Face Hub"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"{name!r} is not on the Hugging Face Hub, or is private: check the name or set HF_TOKEN, {local}"
    if isinstance(e, errors.LocalEntryNotFoundError) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return (f"{name!r} is not in the Hub cache and the Hub cannot be reached (no network, or HF_HUB_OFFLINE=1): "
                f"download it where there is a network, {local}")
    return f"could not fetch {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}); {local}"
