"""Verification of draft tokens against the target: the rejection sampler.

Terms (for one request with k draft tokens d_1..d_k, verified by k + 1 target rows):
  * accepted tokens — the longest prefix of the drafts the target keeps;
  * recovered token — drawn at the first rejected position, from the residual
    normalize(max(0, p − q));
  * bonus token — drawn from p at row k + 1 when all k drafts are accepted.
Each step emits the accepted tokens plus one recovered or bonus token, so 1 ≤ emitted ≤ k + 1.
With k = 0 this is ordinary sampling, so every step of the engine goes through here.

Greedy requests accept while d_j equals the target's argmax at row j and emit the argmax
at the stop row. Sampling requests accept d_j with probability min(1, p(d_j) / q(d_j)),
the rule of Leviathan et al. and Chen et al. (2023), which makes the emitted tokens follow
the target distribution p exactly. p and q come from the same ``target_probs`` (same
temperature, top-k, top-p, min-p); a deterministic drafter (n-gram, greedy-by-construction)
has q one-hot on its proposal. Random numbers are keyed by the request's seed and the
output position they decide (``Uniforms``), so seeded requests are bit-identical whatever
shares the batch. Not whatever k they get: which drafts were verified where changes which
tokens the same numbers draw (the distribution stays p), so the engine keeps a seeded
sampling request's k fixed under adaptive speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampler import SamplingMetadata, Uniforms, sample_from_probs, target_probs
from specserve.sampling_params import SamplingParams
from specserve.transfer import to_device


@dataclass
class VerifyRequest:
    """One sampling request of the step, in schedule order."""

    req_id: str
    params: SamplingParams
    draft_token_ids: list[int]    # k proposals (empty: plain sampling)
    first_position: int = 0       # index in the request's tokens of the first token emitted


class RejectionSampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.uniforms = Uniforms(seed)

    def free(self, req_id: str) -> None:
        self.uniforms.free(req_id)

    def __call__(self, logits: torch.Tensor, requests: list[VerifyRequest],
                 draft_probs: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None) -> list[list[int]]:
        """logits ``[Σ(1 + k_i), vocab]``: request i's k_i + 1 verify rows, in order.
        draft_probs ``[Σ k_i, vocab]`` or None (q one-hot on each proposal).
        draft_ids ``[Σ k_i]`` int64 on the device, or None: the drafts are the requests'
        ``draft_token_ids``. When given (a drafter that leaves its proposals on the
        device), those lists are placeholders of the right length, overwritten here with
        the drafts' values, which come back in the same copy as the sampled tokens.
        Returns, per request, its accepted tokens followed by one recovered/bonus token.
        One device->host copy.
        """
        if not requests:
            return []
        rows_per_req = [len(r.draft_token_ids) + 1 for r in requests]
        num_rows = sum(rows_per_req)
        greedy = logits.argmax(dim=-1)                        # [R]
        all_greedy = all(r.params.greedy for r in requests)
        if all_greedy and num_rows == len(requests):  # plain greedy decoding: nothing to verify
            return [[token] for token in greedy.tolist()]
        # Row index of every draft token's verifying row (all of a request's rows but its last).
        verify_rows: list[int] = []
        start = 0
        for n in rows_per_req:
            verify_rows += range(start, start + n - 1)
            start += n
        total_drafts = len(verify_rows)
        on_host = draft_ids is None
        arrays = [verify_rows]
        if on_host:
            arrays.append([t for r in requests for t in r.draft_token_ids])
        verify_idx, *host_drafts = to_device(arrays, torch.int64, logits.device)
        draft_ids = host_drafts[0] if on_host else draft_ids

        if all_greedy:  # no sampling metadata needed
            accepted = draft_ids == greedy[verify_idx]
            emitted = greedy
        else:
            row_params = [r.params for r, n in zip(requests, rows_per_req) for _ in range(n)]
            meta = SamplingMetadata.build(row_params, logits.device)
            accepted, emitted = self._sample(logits, meta, requests, rows_per_req, draft_ids,
                                             verify_idx, total_drafts, draft_probs, greedy)
        parts = [emitted, accepted[:total_drafts].to(emitted.dtype)] + ([] if on_host else [draft_ids])
        packed = torch.cat(parts).tolist()
        emitted_host = packed[:num_rows]
        accepted_host = packed[num_rows:num_rows + total_drafts]
        if not on_host:
            _fill_drafts(requests, packed[num_rows + total_drafts:])
        return _assemble(requests, rows_per_req, emitted_host, accepted_host)

    def _sample(self, logits, meta, requests, rows_per_req, draft_ids, verify_idx, num_drafts,
                draft_probs, greedy):
        p = target_probs(logits, meta)                       # [R, V]
        # Uniforms: for row j of a request, one to accept its draft, one to draw its token,
        # both keyed by the output position the row decides.
        accept_u, draw_u = [], []
        for req, n in zip(requests, rows_per_req):
            if req.params.greedy:
                accept_u += [0.0] * (n - 1)
                draw_u += [0.0] * n
                continue
            positions = range(req.first_position, req.first_position + n)
            accept_u += self.uniforms.at(req.req_id, req.params, positions[:-1], Uniforms.ACCEPT)
            draw_u += self.uniforms.at(req.req_id, req.params, positions, Uniforms.DRAW)
        accept_u, draw_u = to_device([accept_u or [0.0], draw_u],
                                     torch.float32, logits.device)
        is_greedy_row = meta.temperature == 0
        # Residual distributions at the verify rows; p itself at the bonus rows.
        dist = p.clone()
        if num_drafts:
            p_rows = p[verify_idx]
            if draft_probs is None:
                q_of_draft = torch.ones(num_drafts, device=p.device)
                residual = p_rows.scatter(1, draft_ids[:, None], 0.0)
            else:
                q = draft_probs.float()
                q_of_draft = q.gather(1, draft_ids[:, None])[:, 0]
                residual = (p_rows - q).clamp_(min=0)
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            dist[verify_idx] = torch.where(empty, p_rows, residual)
            p_of_draft = p_rows.gather(1, draft_ids[:, None])[:, 0]
            ratio = p_of_draft / q_of_draft.clamp(min=1e-30)
            accepted = torch.where(is_greedy_row[verify_idx], draft_ids == greedy[verify_idx],
                                   accept_u < ratio)
        else:
            accepted = torch.zeros(1, dtype=torch.bool, device=p.device)
        sampled = sample_from_probs(dist, draw_u)
        return accepted, torch.where(is_greedy_row, greedy, sampled)


def _fill_drafts(requests, draft_ids: list[int]) -> None:
    start = 0
    for req in requests:
        n = len(req.draft_token_ids)
        req.draft_token_ids[:] = draft_ids[start:start + n]
        start += n


def _assemble(requests, rows_per_req, emitted, accepted) -> list[list[int]]:
    """Walk each request's rows on the host: accepted drafts, then the token at the stop row."""
    out, row, draft = [], 0, 0
    for req, n in zip(requests, rows_per_req):
        tokens = []
        for j, token in enumerate(req.draft_token_ids):
            if not accepted[draft + j]:
                break
            tokens.append(token)
        tokens.append(emitted[row + len(tokens)])
        out.append(tokens)
        row += n
        draft += n - 1
    return out
