"""Drafter training: P-EAGLE (parallel, COD + mask + sequence partitioning) and EAGLE-3 (TTT).

Modules: data (JSONL -> token ids + loss mask, target regeneration), features (frozen target's aux
hidden states and distribution), peagle (COD sampling, mask, partitioned and packed passes), eagle3
(training-time test), losses, trainer (the loop), cli (`peagle train`), bench (partitioning memory/time).
"""
from peagle_core.training.data import Example, load_examples, regenerate
from peagle_core.training.peagle import assign_segments, cod_sample, peagle_mask, plan_passes
from peagle_core.training.trainer import TrainConfig, Trainer, init_drafter

__all__ = ["Example", "load_examples", "regenerate", "assign_segments", "cod_sample", "peagle_mask",
           "plan_passes", "TrainConfig", "Trainer", "init_drafter"]
