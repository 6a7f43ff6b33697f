"""What a user's environment sees of us: import names no other distribution owns, and Hub downloads that fetch
what the engine loads and fail in one line. The fresh-venv install next to Hugging Face's `kernels` runs in
.ci/run (`.ci/install_guard.sh`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_core.loading import hub

ROOT = Path(__file__).resolve().parents[1]
OURS = {"peagle_core", "peagle_kernels", "peagle_cluster", "peagle_loadtest"}

# openai/gpt-oss-120b's files, as its Hub repo lists them.
GPT_OSS_FILES = (["config.json", "generation_config.json", "model.safetensors.index.json", "chat_template.jinja",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "LICENSE", "README.md",
                  "USAGE_POLICY", "metal/model.bin", "original/config.json", "original/dtypes.json"]
                 + [f"model-{i:05d}-of-00014.safetensors" for i in range(15)]
                 + [f"original/model--{i:05d}-of-00007.safetensors" for i in range(1, 8)])


def test_hub_patterns_fetch_the_checkpoint_and_skip_original():
    from huggingface_hub.utils import filter_repo_objects  # the filter snapshot_download applies

    got = set(filter_repo_objects(GPT_OSS_FILES, allow_patterns=hub.ALLOW_PATTERNS,
                                  ignore_patterns=hub.IGNORE_PATTERNS))
    assert not any(f.startswith(("original/", "metal/")) for f in got)
    assert {f"model-{i:05d}-of-00014.safetensors" for i in range(15)} <= got
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json",
            "chat_template.jinja"} <= got


def test_offline_hub_fails_fast_in_one_line(tmp_path):
    code = ("from peagle_core.loading.hub import resolve\n"
            f"resolve('openai/gpt-oss-20b', revision='main', download_dir={str(tmp_path)!r})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError:") and "HF_HUB_OFFLINE" in last and "local directory" in last


def test_hub_failures_name_the_cause_and_the_remedy():
    from huggingface_hub import errors

    def error(cls):  # the Hub's HTTP errors want a live response; only their class matters here
        return cls.__new__(cls)

    gated = hub._hub_failure("openai/gpt-oss-120b", None, error(errors.GatedRepoError))
    assert "gated" in gated and "HF_TOKEN" in gated and "\n" not in gated
    missing = hub._hub_failure("nobody/none", None, error(errors.RepositoryNotFoundError))
    assert "not on the Hugging Face Hub" in missing and "HF_TOKEN" in missing
    assert "no revision 'v9'" in hub._hub_failure("openai/gpt-oss-20b", "v9", error(errors.RevisionNotFoundError))


def test_missing_shipped_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(hub.SHIPPED, "tiny", tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="shipped model 'tiny' is missing"):
        hub.resolve("tiny")


def test_code_folders_cannot_shadow_other_packages():
    """kernels/, cluster/ and loadtest/ are plain folders (no __init__.py): from the repository root they are at
    most namespace portions, which any installed regular package of the same name wins over."""
    for folder in ("kernels", "cluster", "loadtest"):
        assert not (ROOT / folder / "__init__.py").exists()
        packages = {p.parent.name for p in (ROOT / folder).glob("*/__init__.py")}
        assert packages and packages <= OURS, f"{folder}/ holds {packages}"
    top = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top <= OURS, f"top-level packages {top - OURS} would shadow installed ones"
