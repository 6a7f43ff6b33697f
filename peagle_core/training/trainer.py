"""The training loop shared by the P-EAGLE and EAGLE-3 heads.

One step: a batch of sequences -> COD sampling per sequence -> the samples (P-EAGLE: split into
`sequence_partitions` partitions) packed into a few drafter passes -> one batched frozen-target forward
-> per pass, the method's forward/backward with every loss divided by the batch's total count of
charged elements -> gradient clipping -> fused AdamW -> linear warmup/decay. The passes' index tensors
reach the device in one copy, and the step's log values come back in one read after the optimizer:
nothing in between waits for the device, so a GPU never idles waiting for the host. On a GPU a step is
bound by the host's operator launches, not by arithmetic: hence large passes (`default_pass_elements`)
and, optionally, a compiled drafter (`compile`).
The drafter keeps fp32 parameters; with dtype bfloat16 the target runs in bf16 and the drafter's
forward under autocast (fp32 master weights, bf16 matmuls).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import Literal

import torch

from peagle_core.config import DrafterConfig, GptOssConfig
from peagle_core.loading.checkpoint import init_random_, save_drafter
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss
from peagle_core.training.data import Example, batches
from peagle_core.training.eagle3 import eagle3_pass_loss
from peagle_core.training.features import extract_features, slot_valid
from peagle_core.training.losses import DepthStats
from peagle_core.training.peagle import cod_sample, passes_to, peagle_pass_loss, plan_passes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


BUDGET_PROBE_STEPS = 10  # steps timed before a time budget fixes the step count


@dataclass
class TrainConfig:
    method: Literal["peagle", "eagle3"] = "peagle"
    num_depths: int = 8                 # P-EAGLE: K_train parallel depths; EAGLE-3: unrolled steps
    steps: int = 1000
    batch_size: int = 1
    lr: float = 1e-4
    warmup_ratio: float = 0.0025        # the paper's
    min_lr_ratio: float = 0.0           # linear decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    cod_ratio: float | None = None      # None: 0.8 for P-EAGLE (paper), 1.0 (no dropping) for EAGLE-3
    cod_ratio_min: float = 0.2
    sequence_partitions: int = 1
    # elements per drafter pass (sequences or partitions are packed up to it). None: `default_pass_elements`
    pass_elements: int | None = None
    loss: Literal["kl", "ce"] = "kl"
    feed: Literal["target", "draft"] = "target"  # EAGLE-3 fed-back token
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    share_target_embeddings: bool = False  # freeze embed/LM head at the target's and omit them on save
    time_budget_s: float | None = None  # fit `steps` to this wall time (measured over the first steps)
    # torch.compile the drafter's forward (and so its backward): its norms, rotations and attention plumbing
    # become generated kernels (operator events a pass, measured on a CPU: P-EAGLE ~1850 -> ~660, EAGLE-3
    # ~4760 -> ~1340). Costs a minute or so of compilation up front
    compile: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("peagle", "eagle3"):
            raise ValueError(f"method must be 'peagle' or 'eagle3', got {self.method!r}")
        if self.num_depths < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("num_depths, steps and batch_size must be at least 1")
        if self.pass_elements is not None and self.pass_elements < 1:
            raise ValueError(f"pass elements must be at least 1, got {self.pass_elements}")
        if self.sequence_partitions < 1:
            raise ValueError(f"sequence partitions must be at least 1, got {self.sequence_partitions}")
        if self.method == "eagle3" and self.sequence_partitions != 1:
            raise ValueError("sequence partitioning applies to --method peagle only (EAGLE-3 unrolls its steps "
                             "through one graph per sequence)")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.cod_ratio is None:
            self.cod_ratio = 0.8 if self.method == "peagle" else 1.0
        if not 0 < self.cod_ratio <= 1 or not 0 <= self.cod_ratio_min <= 1:
            raise ValueError(f"COD ratios must lie in (0, 1] and [0, 1]; got cod_ratio={self.cod_ratio}, "
                             f"cod_ratio_min={self.cod_ratio_min}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss must be 'kl' or 'ce', got {self.loss!r}")

    @property
    def warmup_steps(self) -> int:
        return max(1, math.ceil(self.warmup_ratio * self.steps)) if self.warmup_ratio > 0 else 0


# --------------------------------------------------------------------------------------------
# Drafter initialisation
# --------------------------------------------------------------------------------------------


def default_mask_token_id(tcfg: GptOssConfig, special_tokens: dict[str, int] | None = None) -> int:
    """A reserved special token of the tokenizer (one named like a mask first, then the highest
    `reserved` one); without one, the highest id that is not an end/pad token."""
    special = {n: i for n, i in (special_tokens or {}).items() if 0 <= i < tcfg.vocab_size}
    for pick in (lambda n: "mask" in n.lower(), lambda n: "reserved" in n.lower()):
        ids = [i for n, i in special.items() if pick(n)]
        if ids:
            return max(ids)
    taken = set(tcfg.eos_token_id) | ({tcfg.pad_token_id} if tcfg.pad_token_id is not None else set())
    return next(i for i in range(tcfg.vocab_size - 1, -1, -1) if i not in taken)


def init_drafter(target: GptOss, method: str, layers: int, seed: int, aux_layer_ids: list[int] | None = None,
                 mask_token_id: int | None = None, intermediate_size: int | None = None,
                 device: torch.device | str = "cpu", special_tokens: dict[str, int] | None = None) -> Drafter:
    """A fresh head in the published layout, sized from the target; embeddings and LM head copied from it."""
    tcfg = target.config
    L = tcfg.num_hidden_layers
    aux = list(aux_layer_ids) if aux_layer_ids else [2, L // 2, L - 3]  # vLLM's default, as in DrafterConfig
    bad = [i for i in aux if not 0 <= i <= tcfg.num_hidden_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} are outside 0..{tcfg.num_hidden_layers} (the target's layers)")
    if layers < 1:
        raise ValueError(f"the drafter needs at least 1 layer, got {layers}")
    parallel = method == "peagle"
    if parallel:
        mask_token_id = default_mask_token_id(tcfg, special_tokens) if mask_token_id is None else mask_token_id
        if not 0 <= mask_token_id < tcfg.vocab_size:
            raise ValueError(f"mask token id {mask_token_id} is outside the vocabulary (0..{tcfg.vocab_size - 1})")
    cfg = DrafterConfig(
        hidden_size=tcfg.hidden_size, num_hidden_layers=layers, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        intermediate_size=intermediate_size or 4 * tcfg.hidden_size, vocab_size=tcfg.vocab_size,
        draft_vocab_size=tcfg.vocab_size, target_hidden_size=tcfg.hidden_size, rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_theta, max_position_embeddings=tcfg.max_position_embeddings,
        aux_layer_ids=aux, mask_token_id=mask_token_id if parallel else None, parallel_drafting=parallel)
    drafter = init_random_(Drafter(cfg, len(aux)), seed)
    with torch.no_grad():  # P-EAGLE trains the embeddings; start from the target's (paper, speculators)
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight.float())
        drafter.lm_head.weight.copy_(target.lm_head.weight.float())
    return drafter.to(device)


def check_drafter(drafter: Drafter, target: GptOss, method: str) -> None:
    cfg, tcfg = drafter.config, target.config
    if cfg.draft_vocab_size != tcfg.vocab_size or bool(drafter.d2t.any()):
        raise ValueError("training supports a drafter vocabulary equal to the target's (d2t all zero)")
    if method == "peagle" and (cfg.mask_token_id is None or drafter.mask_hidden is None):
        raise ValueError("--method peagle needs a drafter with a mask token id and mask_hidden (an EAGLE-3 head "
                         "was given to --init)")


def save_head(drafter: Drafter, path: Path, dtype: torch.dtype, shared: bool = False) -> None:
    """Write the head in the published layout, in the training dtype (bf16 like released heads).

    With `shared`, the embedding and LM head (frozen copies of the target's) are left out, as in
    heads that vLLM serves by sharing the target's."""
    head = drafter if dtype == torch.float32 else copy.deepcopy(drafter).to(dtype)
    save_drafter(head, Path(path), exclude=("embed_tokens.weight", "lm_head.weight") if shared else ())


# --------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------


# Default pass size on a GPU. There a pass is launch-bound: its ~2000 operator events of forward and backward
# (a 2-layer head) cost the host tens of ms whatever its size, so a step should run as few passes as fit. What grows
# with the size T: the dense [T, T] mask (T^2 bytes and a few transient copies: 0.27 GB at 16k), the dense
# attention (T x elements a step: ~5 TFLOP at 16k for 42k elements and 2 layers, some 50-100 ms of
# memory-efficient attention at head_dim 32 on an H200, about what the host needs to launch those passes), and
# the loss's [T, vocab] fp32 tensors (target and draft log-probabilities and their gradients, ~8 alive), hence
# the vocabulary bound: 16384 at the tiny pair's 8k vocabulary (0.5 GiB each), 4096 at GPT-OSS's 201k (3.3 GiB).
GPU_PASS_ELEMENTS = (4096, 16384)
LOGITS_BYTES_PER_PASS = 1 << 29  # one fp32 [elements, vocab] tensor


def default_pass_elements(device: torch.device | str, vocab_size: int) -> int:
    """Elements per drafter pass when --pass-elements is not given: on a GPU as many as the vocabulary allows
    within GPU_PASS_ELEMENTS (a power of two); on a CPU 1 (each sequence alone), since a CPU pays for every
    attention pair of the dense mask while its per-operator overhead is small."""
    if torch.device(device).type == "cpu":
        return 1
    lo, hi = GPU_PASS_ELEMENTS
    fit = LOGITS_BYTES_PER_PASS // (4 * vocab_size)
    return max(lo, min(hi, 1 << max(fit, 1).bit_length() - 1))


def fused_adamw(params: list[torch.nn.Parameter], device: torch.device, **kw) -> torch.optim.AdamW:
    """AdamW as one fused operator per step where the device has one (CUDA, CPU) instead of a dozen operators
    per parameter (or a few per parameter group with foreach): a handful of launches whatever the head's size."""
    return torch.optim.AdamW(params, fused=True if device.type in ("cuda", "cpu") else None, **kw)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return max(min_ratio, 1.0 - (1.0 - min_ratio) * frac)


class Trainer:
    def __init__(self, target: GptOss, drafter: Drafter, examples: list[Example], cfg: TrainConfig):
        check_drafter(drafter, target, cfg.method)
        if not examples:
            raise ValueError("no training sequences")
        mask_id = drafter.config.mask_token_id
        if cfg.method == "peagle":
            hits = sum(e.input_ids.count(mask_id) for e in examples)
            if hits:  # legal, but the MASK embedding then also has to serve as that token's embedding
                warnings.warn(f"mask token id {mask_id} occurs {hits} times in the training data; a reserved id "
                              f"the tokenizer never emits is better (--mask-token-id)", stacklevel=2)
        self.target, self.drafter, self.examples, self.cfg = target, drafter, examples, cfg
        self.device = drafter.fc.weight.device
        self.aux_layer_ids = drafter.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
        target.requires_grad_(False).eval()
        drafter.requires_grad_(True).train()
        if cfg.share_target_embeddings:  # frozen copies of the target's: the saved head omits them
            drafter.embed_tokens.requires_grad_(False)
            drafter.lm_head.requires_grad_(False)
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = fused_adamw(params, self.device, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.generator = torch.Generator().manual_seed(cfg.seed)  # COD draws: same seed, same elements for any P
        self.pass_elements = cfg.pass_elements or default_pass_elements(self.device, drafter.config.vocab_size)
        # what the passes call: the drafter, or a compiled wrapper sharing its parameters (the drafter itself
        # stays an eager module for saving and inference). Pass sizes vary, hence dynamic shapes from the start
        self.model = torch.compile(drafter, dynamic=True) if cfg.compile else drafter
        self.batches = batches(examples, cfg.batch_size, cfg.seed)
        self.step_num = 0

    def autocast(self):
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.dtype])

    def step(self) -> dict:
        """One optimizer step; returns its log record."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = next(self.batches)
        valid = [slot_valid(e.loss_mask) for e in batch]
        samples = [cod_sample(ok.numel(), cfg.num_depths, cfg.cod_ratio, cfg.cod_ratio_min, self.generator, ok)
                   for ok in valid]
        starts = list(accumulate((len(e.input_ids) for e in batch[:-1]), initial=0))
        passes = passes_to(plan_passes(samples, valid, starts, cfg.sequence_partitions, self.pass_elements),
                           self.device)
        denom = sum(len(p.charged) for p in passes)
        feats = extract_features(self.target, batch, self.aux_layer_ids, self.device)
        stats, loss = DepthStats(cfg.num_depths, self.device), torch.zeros((), device=self.device)
        with self.autocast():
            for p in passes:
                if cfg.method == "peagle":
                    part = peagle_pass_loss(self.model, feats, p, self.drafter.config.mask_token_id, stats,
                                            denom, cfg.loss)
                else:
                    part = eagle3_pass_loss(self.model, feats, p, stats, denom, cfg.loss, cfg.feed)
                part.backward()
                loss += part.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_num += 1
        # the step's one read from the device: loss, gradient norm and per-depth sums together
        read = torch.cat([torch.stack([loss, grad_norm]).double(), stats.sums.flatten()]).tolist()
        _, count, acc = stats.summary([read[2:2 + cfg.num_depths], read[2 + cfg.num_depths:]])
        rec = {"step": self.step_num, "loss": read[0], "acc": acc, "lr": lr, "grad_norm": read[1]}
        dt = time.perf_counter() - t0  # after the reads above, which wait for the device
        tokens = sum(len(e.input_ids) for e in batch)
        return rec | {"tokens": tokens, "elements": sum(count), "max_attn_tokens": stats.max_attn_tokens,
                      "passes": len(passes), "tokens_per_s": tokens / dt, "step_time_s": dt}

    def fit_steps_to_budget(self, elapsed: float, records: list[dict]) -> None:
        """Shrink `steps` so the run ends inside the time budget. The learning-rate schedule reads
        cfg.steps at every step, so warm-up and decay stretch to the new length."""
        per_step = sum(r["step_time_s"] for r in records[1:]) / max(1, len(records) - 1)  # first: compile, caches
        fit = self.step_num + int((self.cfg.time_budget_s - elapsed) / per_step)
        if fit < self.cfg.steps:
            self.cfg.steps = max(self.step_num + 1, fit)

    def train(self, log_jsonl: str | Path | None = None, progress: bool = True, out: str | Path | None = None,
              save_every: int = 0) -> list[dict]:
        """Run `cfg.steps` steps with a progress bar; one JSON line per step; checkpoints under `out`."""
        from tqdm import tqdm

        records = []
        log = open(log_jsonl, "w", encoding="utf-8") if log_jsonl else None
        try:
            bar = tqdm(total=self.cfg.steps - self.step_num, disable=not progress, desc=f"train {self.cfg.method}",
                       dynamic_ncols=True)
            started = time.perf_counter()
            while self.step_num < self.cfg.steps:
                rec = self.step()
                records.append(rec)
                if self.step_num == BUDGET_PROBE_STEPS and self.cfg.time_budget_s:
                    self.fit_steps_to_budget(time.perf_counter() - started, records)
                    bar.total = self.cfg.steps
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                acc0 = rec["acc"][0]
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0="-" if acc0 is None else f"{acc0:.2f}",
                                tok_s=f"{rec['tokens_per_s']:.0f}")
                bar.update(1)
                if out and save_every and self.step_num % save_every == 0 and self.step_num < self.cfg.steps:
                    save_head(self.drafter, Path(out) / f"checkpoint-{self.step_num}", DTYPES[self.cfg.dtype],
                              self.cfg.share_target_embeddings)
            bar.close()
        finally:
            if log:
                log.close()
        if out:
            save_head(self.drafter, Path(out), DTYPES[self.cfg.dtype], self.cfg.share_target_embeddings)
            (Path(out) / "training_args.json").write_text(json.dumps(asdict(self.cfg), indent=2))
        return records
