"""Drafter training: P-EAGLE (parallel, COD + amortized mask + sequence partitioning) and EAGLE-3 (TTT).

Modules: data (JSONL -> token ids + loss mask, target regeneration), features (frozen target's aux
hidden states and distribution), peagle (COD sampling, mask, partitioned objective), eagle3
(training-time test), losses, trainer (the loop), cli (`peagle train`), bench (partitioning memory/time).
"""
from peagle_core.training.data import Example, load_examples, regenerate
from peagle_core.training.peagle import PeagleMask, allowed, assign_segments, cod_sample
from peagle_core.training.trainer import TrainConfig, Trainer, init_drafter

__all__ = ["Example", "load_examples", "regenerate", "PeagleMask", "allowed", "assign_segments", "cod_sample",
           "TrainConfig", "Trainer", "init_drafter"]
