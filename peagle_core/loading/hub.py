"""Resolve a model name to a local directory: a path, the shipped tiny model, or a Hub snapshot."""
from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = {"tiny": ASSETS / "tiny" / "target", "tiny-peagle": ASSETS / "tiny" / "peagle",
           "tiny-eagle3": ASSETS / "tiny" / "eagle3"}


def resolve(name: str, allow_patterns: list[str] | None = None) -> Path:
    """Local directory for `name`: an existing path, a shipped model, or `huggingface_hub.snapshot_download`."""
    if name in SHIPPED:
        path = SHIPPED[name]
        if (path / "config.json").exists():
            return path
        # A checkout without the trained tiny weights: a random model of the same shape stands in.
        from peagle_core.tiny import ensure_random_tiny

        return ensure_random_tiny()[name]
    path = Path(os.path.expanduser(name))
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path {path} is a file; pass the checkpoint directory")
        return path
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise FileNotFoundError(f"model {name!r} is neither a local directory nor a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=allow_patterns or
                                      ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated: one line that says what to do
        raise FileNotFoundError(
            f"could not fetch {name!r} from the Hugging Face Hub ({type(e).__name__}); "
            f"download it elsewhere and pass the local directory instead, e.g. model=/models/{name.split('/')[-1]}"
        ) from None
