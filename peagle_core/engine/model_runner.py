"""One engine step on the device: target forward, verification, drafting.

The step reads like the method (DESIGN.md, "One engine step"):
  1. target forward over every request's `[uncomputed tokens, drafts[:k]]`, keeping the aux hidden states;
  2. accept/reject the drafts against the target (greedy or rejection sampling) and pick the bonus token;
  3. rejected K/V need no work: the request's length rolls back and later writes overwrite them;
  4. drafter: P-EAGLE runs ONE forward over `[accepted, bonus, MASK x (K-1)]` and reads K drafts;
     EAGLE-3 runs one forward over `[accepted, bonus]`, then K-1 single-token passes feeding itself back;
  5. one device-to-host copy brings back emitted tokens and drafts for the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.draft_inputs import fill_hidden, prepare_draft_inputs
from kernels.sampling import rejection_sample
from peagle_core.engine.graphs import GraphRunner, is_uniform_decode
from peagle_core.engine.scheduler import Scheduled
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta


@dataclass
class StepResult:
    tokens: list[list[int]]       # per scheduled request: emitted tokens (accepted drafts + bonus); [] if not sampling
    num_accepted: list[int]
    drafts: list[list[int]]       # per request: K new drafts (empty without a drafter)


class ModelRunner:
    def __init__(self, target: GptOss, drafter: Drafter | None, mode: str, num_spec: int, block_size: int,
                 num_blocks: int, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 vocab_size: int):
        self.target, self.drafter, self.mode, self.K = target, drafter, mode, num_spec
        self.block_size, self.max_model_len, self.device, self.vocab_size = block_size, max_model_len, device, vocab_size
        self.target_cache = self._bind_cache(target, num_blocks, dtype)
        self.drafter_cache = self._bind_cache(drafter, num_blocks, dtype) if drafter is not None else None
        self.shared_hidden = None
        if drafter is not None:
            target.set_aux_layers(drafter.config.resolved_aux_layer_ids(target.config.num_hidden_layers))
            if mode == "peagle":
                with torch.no_grad():
                    self.shared_hidden = drafter.shared_hidden()  # fc(mask_hidden), projected once
                self.mask_token_id = drafter.config.mask_token_id
        self.global_generator = torch.Generator(device=device).manual_seed(0)
        self.graphs: GraphRunner | None = None  # CUDA graphs (the engine sets them)

    def _bind_cache(self, model, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        layers = model.attention_layers()
        a = layers[0]
        cache = torch.zeros(2, len(layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                            dtype=dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.kv_cache = (cache[0, i], cache[1, i])
        return cache

    @staticmethod
    def cache_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        layers = model.attention_layers()
        return 2 * len(layers) * block_size * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize

    # ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: list[Scheduled], draft_len: int | None = None) -> StepResult:
        """Run one step; the drafter proposes `draft_len` tokens (default K) for the next step to verify."""
        dev = self.device
        ids, pos, qsl = [], [], [0]
        for s in batch:
            r = s.req
            toks = r.token_ids[r.num_computed:r.num_computed + s.num_new] + r.drafts[:s.num_drafts]
            ids += toks
            pos += range(r.num_computed, r.num_computed + len(toks))
            qsl.append(qsl[-1] + len(toks))
        B = len(batch)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        query_start_loc = torch.tensor(qsl, dtype=torch.long, device=dev)
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        seq_lens = q_lens + torch.tensor([s.req.num_computed for s in batch], dtype=torch.long, device=dev)
        block_tables = self._block_tables(batch)
        req_of_token = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=len(ids))
        meta = ForwardMeta(positions=positions, query_start_loc=query_start_loc, seq_lens=seq_lens,
                           slot_mapping=self.slots(positions, req_of_token, block_tables), block_tables=block_tables)
        uniform = is_uniform_decode(batch)  # no prefill, one k: the decode graphs' shape
        hidden, aux = self._forward(self.target, input_ids, None, meta, uniform)

        tokens, num_accepted, next_ids = self._verify(batch, hidden, qsl)
        drafts = None
        if self.drafter is not None:
            num_rejected = torch.tensor([s.num_drafts for s in batch], device=dev) - num_accepted
            drafts = self._draft(batch, input_ids, positions, query_start_loc, seq_lens, block_tables, aux,
                                 next_ids, num_rejected, self.K if draft_len is None else max(1, draft_len), uniform)
        return self._to_host(batch, tokens, num_accepted, drafts)

    def _verify(self, batch: list[Scheduled], hidden: torch.Tensor, qsl: list[int]):
        """Rejection-sample the requests that reach their end; others continue with their next prompt token."""
        dev = self.device
        B = len(batch)
        sampling = [i for i, s in enumerate(batch) if s.samples]
        next_ids = torch.tensor([s.req.token_ids[s.req.num_computed + s.num_new] if not s.samples else 0
                                 for s in batch], dtype=torch.long, device=dev)
        tokens = torch.full((B, self.K + 1), -1, dtype=torch.long, device=dev)
        num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
        if not sampling:
            return tokens, num_accepted, next_ids
        rows, draft_ids, cu = [], [], [0]
        for i in sampling:
            s = batch[i]
            rows += range(qsl[i + 1] - s.num_drafts - 1, qsl[i + 1])  # the last 1 + k positions
            draft_ids += s.req.drafts[:s.num_drafts] + [-1]
            cu.append(cu[-1] + s.num_drafts + 1)
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        logits = self.target.compute_logits(hidden[rows_t]).float()
        params = [batch[i].req.params for i in sampling]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        filtered = any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev) if filtered else None
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev) if filtered else None
        uniforms, noise = self._noise([batch[i] for i in sampling], cu, logits.shape[1])
        sampled, accepted = rejection_sample(logits, torch.tensor(draft_ids, dtype=torch.long, device=dev),
                                             torch.tensor(cu, dtype=torch.long, device=dev), temperature, top_k,
                                             top_p, uniforms, noise, max_rows=self.K + 1)
        idx = torch.tensor(sampling, dtype=torch.long, device=dev)
        tokens[idx, :sampled.shape[1]] = sampled
        num_accepted[idx] = accepted
        next_ids[idx] = sampled.gather(1, accepted[:, None])[:, 0]
        return tokens, num_accepted, next_ids

    def _noise(self, items: list[Scheduled], cu: list[int], vocab: int):
        """Uniforms and Exp(1) noise per verified row; seeded requests draw from their own generator."""
        if all(s.req.params.greedy for s in items):
            return None, None
        n = cu[-1]
        uniforms = torch.empty(n, device=self.device)
        noise = torch.empty(n, vocab, device=self.device)
        for j, s in enumerate(items):
            g = s.req.generator or self.global_generator
            uniforms[cu[j]:cu[j + 1]].uniform_(generator=g)
            noise[cu[j]:cu[j + 1]].exponential_(generator=g)
        return uniforms, noise

    def _forward(self, model, input_ids, hidden, meta: ForwardMeta, uniform: bool):
        """The target's (hidden is None) or the drafter's forward; replayed from a graph when it can be."""
        if self.graphs is not None:
            graphs = self.graphs.target if model is self.target else self.graphs.drafter
            key = graphs.key(meta.seq_lens.shape[0], input_ids.shape[0], uniform, meta.block_tables.shape[1])
            if key is not None:
                return graphs.run(input_ids, hidden, meta, key)
        return model(input_ids, meta) if hidden is None else model(input_ids, hidden, meta)

    def _draft(self, batch, input_ids, positions, qsl, seq_lens, block_tables, aux, next_ids, num_rejected,
               draft_len: int, uniform: bool = False):
        dev, K, B = self.device, self.K, len(batch)
        drafter = self.drafter
        # P-EAGLE drafts what the next step will verify, in one pass (K when the depth is fixed);
        # EAGLE-3's first pass has only the bonus slot.
        P = min(K, draft_len) if self.mode == "peagle" else 1
        mask_id = self.mask_token_id if self.mode == "peagle" else 0
        d_ids, d_pos, is_rejected, is_masked, sample_idx, hidden_map = prepare_draft_inputs(
            input_ids, positions, next_ids, qsl, num_rejected, mask_id, P)
        target_h = drafter.combine(aux)
        shared = self.shared_hidden if self.shared_hidden is not None else torch.zeros_like(target_h[0])
        hidden = fill_hidden(target_h, hidden_map, is_masked, shared)
        d_qsl = qsl + torch.arange(B + 1, device=dev) * (P - 1)
        d_seq = (seq_lens + P - 1 - num_rejected).clamp(max=self.max_model_len)
        req = torch.repeat_interleave(torch.arange(B, device=dev), d_qsl[1:] - d_qsl[:-1], output_size=d_ids.shape[0])
        slots = self.slots(d_pos, req, block_tables, valid=~is_rejected)
        meta = ForwardMeta(positions=d_pos, query_start_loc=d_qsl, seq_lens=d_seq, slot_mapping=slots,
                           block_tables=block_tables)
        normed, prenorm = self._forward(drafter, d_ids, hidden, meta, uniform)
        logits = drafter.compute_logits(normed[sample_idx])
        first = drafter.to_target_ids(logits.argmax(-1)).view(B, P)
        if self.mode == "peagle":
            return first
        # EAGLE-3: K-1 more passes, one token per request, feeding back the drafter's own pre-norm state.
        out, h, last_pos = [first[:, 0]], prenorm[sample_idx], d_pos[sample_idx]
        ar = torch.arange(B + 1, device=dev)
        for i in range(1, min(draft_len, K)):
            p = last_pos + i
            meta = ForwardMeta(positions=p, query_start_loc=ar, seq_lens=(p + 1).clamp(max=self.max_model_len),
                               slot_mapping=self.slots(p, ar[:-1], block_tables), block_tables=block_tables)
            normed, h = self._forward(drafter, out[-1], h, meta, True)  # one token per request: uniform
            out.append(drafter.to_target_ids(drafter.compute_logits(normed).argmax(-1)))
        return torch.stack(out, dim=1)

    def slots(self, positions, req_index, block_tables, valid=None) -> torch.Tensor:
        """Flat cache slot of each token; -1 (no write) when invalid or past max_model_len."""
        ok = positions < self.max_model_len
        if valid is not None:
            ok &= valid
        p = positions.clamp(0, self.max_model_len - 1)
        block = block_tables[req_index, p // self.block_size]
        return torch.where(ok, block * self.block_size + p % self.block_size, torch.full_like(p, -1))

    def _block_tables(self, batch: list[Scheduled]) -> torch.Tensor:
        width = max(len(s.req.block_table) for s in batch)
        rows = [s.req.block_table + [0] * (width - len(s.req.block_table)) for s in batch]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _to_host(self, batch, tokens, num_accepted, drafts) -> StepResult:
        tokens, num_accepted = tokens.tolist(), num_accepted.tolist()  # the step's one sync
        drafts = drafts.tolist() if drafts is not None else [[] for _ in batch]
        out_tokens = [t[:a + 1] if s.samples else [] for s, t, a in zip(batch, tokens, num_accepted)]
        return StepResult(out_tokens, num_accepted, drafts)
