"""Shared fixtures: tiny random checkpoints built once per session (no downloads)."""
from __future__ import annotations

import os

# Tiny models on 2 shared cores: intra-op threads only fight each other (and Ray's workers),
# making small ops 10-40x slower. One thread per process, inherited by spawned servers.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from peagle_core.testing import build_drafter, build_target, tiny_target_config


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny random GPT-OSS target (peaked logits) with random P-EAGLE and EAGLE-3 heads."""
    d = tmp_path_factory.mktemp("tiny_pair")
    cfg = tiny_target_config()
    build_target(d / "target", cfg, seed=0, scale=4.0)
    build_drafter(d / "peagle", cfg, parallel=True)
    build_drafter(d / "eagle3", cfg, parallel=False)
    return {"target": str(d / "target"), "peagle": str(d / "peagle"), "eagle3": str(d / "eagle3"), "config": cfg}
