#!/usr/bin/env bash
# A user's environment: a fresh venv where transformers (the latest, which brings Hugging Face's `kernels`) came
# first, then a non-editable install of this project. From the repository root and from elsewhere, transformers'
# GPT-OSS, HF's `kernels` and our CLI must all work side by side.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
py="$work/venv/bin/python"
pip() { "$py" -m pip install -q --disable-pip-version-check "$@"; }
pip torch==2.13.0                      # the CPU wheel, before anything can pull a CUDA build
pip transformers kernels
rm -rf "$repo/build"                    # setuptools builds in the tree: no stale files in the wheel
pip "$repo"                             # non-editable: a wheel into site-packages
check='
import kernels, transformers, torch
assert "site-packages" in kernels.__file__, kernels.__file__
from transformers import GptOssConfig, GptOssForCausalLM
cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
GptOssForCausalLM(cfg)(torch.tensor([[1, 2, 3]]))
import peagle_core, peagle_kernels, peagle_cluster, peagle_loadtest  # from the root, peagle_core is the checkout
for m in (peagle_kernels, peagle_cluster, peagle_loadtest):  # nested in plain folders: always the installed ones
    assert "site-packages" in m.__file__, m.__file__
print("imports ok: kernels", kernels.__file__, "transformers", transformers.__version__)
'
for dir in "$repo" "$work"; do
    echo "== from $dir"
    (cd "$dir" && "$py" -c "$check" && "$work/venv/bin/peagle" -h >/dev/null \
        && "$work/venv/bin/peagle" generate --model tiny --mode peagle --k 3 --prompt "def add(a, b):" \
           --max-tokens 8 --device cpu --json)
done
echo "install guard passed"
