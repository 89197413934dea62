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

from dataclasses import dataclass, field

import torch

from specserve.logits_process import RowHistory, process_rows
from specserve.logprobs import TokenLogprob
from specserve.sampler import (SamplingMetadata, Uniforms, greedy_tokens, sample_from_probs, target_logprobs,
                               target_probs)
from specserve.sampling_params import SamplingParams
from specserve.transfer import to_device


@dataclass
class VerifyRequest:
    """One sampling request of the step, in schedule order."""

    req_id: str
    params: SamplingParams
    draft_token_ids: list[int]    # k proposals (empty: plain sampling)
    first_position: int = 0       # index in the request's tokens of the first token emitted
    history: RowHistory | None = None  # what its logits processing reads (None: no processing)


@dataclass
class PromptRows:
    """Logits rows of prompt positions whose next token's log-probability is wanted."""

    logits: torch.Tensor        # [num_rows, vocab]
    next_token_ids: list[int]   # the prompt token each row predicts
    num_top: list[int]          # how many likeliest tokens each row reports


@dataclass
class SampledTokens:
    """Per request of the step: its accepted tokens followed by one recovered/bonus token,
    and their log-probabilities where it asked for them (``logprobs`` None: nobody did);
    one entry per ``PromptRows`` row."""

    new_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None] | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


class RejectionSampler:
    def __init__(self, device: torch.device, seed: int, logprobs_mode: str = "raw_logprobs") -> None:
        self.device = device
        self.uniforms = Uniforms(seed)
        self.processed_logprobs = logprobs_mode == "processed_logprobs"

    def free(self, req_id: str) -> None:
        self.uniforms.free(req_id)

    def __call__(self, logits: torch.Tensor, requests: list[VerifyRequest],
                 draft_probs: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None) -> list[list[int]]:
        """The tokens of ``sample``."""
        return self.sample(logits, requests, draft_probs, draft_ids).new_token_ids

    def sample(self, logits: torch.Tensor, requests: list[VerifyRequest],
               draft_probs: torch.Tensor | None = None,
               draft_ids: torch.Tensor | None = None, prompt: PromptRows | None = None) -> SampledTokens:
        """logits ``[Σ(1 + k_i), vocab]``: request i's k_i + 1 verify rows, in order.
        draft_probs ``[Σ k_i, vocab]`` or None (q one-hot on each proposal).
        draft_ids ``[Σ k_i]`` int64 on the device, or None: the drafts are the requests'
        ``draft_token_ids``. When given (a drafter that leaves its proposals on the
        device), those lists are placeholders of the right length, overwritten here with
        the drafts' values, which come back in the same copy as the sampled tokens.
        A request's ``history`` processes its rows' logits (penalties, bias, ...) from the
        same state the drafter's q was processed from: see ``logits_process``.
        Returns, per request, its accepted tokens followed by one recovered/bonus token,
        and their log-probabilities for requests that ask; and those of ``prompt``'s rows
        (the model's own distribution). One device->host copy.
        """
        if not requests and prompt is None:
            return SampledTokens([])
        rows_per_req = [len(r.draft_token_ids) + 1 for r in requests]
        num_rows = sum(rows_per_req)
        raw = logits
        histories = [r.history for r in requests]
        processing = any(h is not None and h.params.processes_logits for h in histories)
        wants_logprobs = any(r.params.logprobs is not None for r in requests)
        all_greedy = all(r.params.greedy for r in requests)
        if all_greedy and num_rows == len(requests) and not wants_logprobs and prompt is None:
            # Plain greedy decoding: nothing to verify.
            if processing:
                logits = process_rows(logits, histories, [0] * num_rows, None)
            return SampledTokens([[token] for token in greedy_tokens(logits).tolist()])
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
        if processing:
            logits = process_rows(logits, histories, [n - 1 for n in rows_per_req], draft_ids)
        greedy = greedy_tokens(logits)                        # [R]

        if all_greedy:  # no sampling metadata needed
            accepted = draft_ids == greedy[verify_idx]
            emitted = greedy
        else:
            row_params = [r.params for r, n in zip(requests, rows_per_req) for _ in range(n)]
            meta = SamplingMetadata.build(row_params, logits.device)
            accepted, emitted = self._sample(logits, meta, requests, rows_per_req, draft_ids,
                                             verify_idx, total_drafts, draft_probs, greedy)
        parts = [emitted, accepted[:total_drafts].to(emitted.dtype)] + ([] if on_host else [draft_ids])
        floats = wants_logprobs or prompt is not None
        lp_parts, layout = [], (0, 0, 0)
        if wants_logprobs:
            lp_parts, layout = self._logprobs(raw, logits, requests, rows_per_req, draft_ids, emitted)
        prompt_parts = [] if prompt is None else _prompt_logprobs(prompt)
        if floats:  # one copy in float64, exact for token ids
            packed = torch.cat([part.double() for part in parts + lp_parts + prompt_parts]).tolist()
        else:
            packed = torch.cat(parts).tolist()
        num_ints = num_rows + total_drafts + (0 if on_host else total_drafts)
        ints = [int(x) for x in packed[:num_ints]] if floats else packed
        emitted_host = ints[:num_rows]
        accepted_host = ints[num_rows:num_rows + total_drafts]
        if not on_host:
            _fill_drafts(requests, ints[num_rows + total_drafts:])
        tokens = _assemble(requests, rows_per_req, emitted_host, accepted_host)
        if not floats:
            return SampledTokens(tokens)
        num_lp = sum(part.numel() for part in lp_parts)
        logprobs = _logprobs_of(requests, tokens, packed[num_ints:num_ints + num_lp], *layout) \
            if wants_logprobs else None
        prompt_lps = [] if prompt is None else _prompt_logprobs_of(prompt, packed[num_ints + num_lp:])
        return SampledTokens(tokens, logprobs, prompt_lps)

    def _logprobs(self, raw, processed, requests, rows_per_req, draft_ids, emitted):
        """On the device, for the rows of requests that want log-probabilities: the
        target's log-probability of the token emitted at each row and of the draft each
        verify row checked (which of the two a row's token is, the host knows after the
        copy), and the ``top`` likeliest tokens per row. Returns the tensors to copy and
        their layout (rows, verify rows, top)."""
        rows, verify, places, top = [], [], [], 0
        row = draft = 0
        for req, n in zip(requests, rows_per_req):
            if req.params.logprobs is not None:
                verify += range(len(rows), len(rows) + n - 1)
                rows += range(row, row + n)
                places += range(draft, draft + n - 1)
                top = max(top, req.params.logprobs)
            row += n
            draft += n - 1
        rows_t, verify_t, places_t = to_device([rows, verify, places], torch.int64, raw.device)
        if self.processed_logprobs:
            row_params = [r.params for r, n in zip(requests, rows_per_req) if r.params.logprobs is not None
                          for _ in range(n)]
            meta = SamplingMetadata.build(row_params, raw.device)
            source = target_logprobs(processed.index_select(0, rows_t), meta)
        else:
            source = raw.index_select(0, rows_t).float().log_softmax(dim=-1)
        of_emitted = source.gather(1, emitted.index_select(0, rows_t)[:, None])[:, 0]
        parts = [of_emitted]
        if verify:
            of_draft = source.index_select(0, verify_t).gather(1, draft_ids.index_select(0, places_t)[:, None])
            parts.append(of_draft[:, 0])
        if top:
            values, ids = source.topk(top, dim=-1)
            parts += [ids.flatten(), values.flatten()]
        return parts, (len(rows), len(verify), top)

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


def _prompt_logprobs(prompt: PromptRows) -> list[torch.Tensor]:
    """On the device: each prompt row's log-probability of its next token and its
    likeliest tokens' (``max(num_top)`` per row)."""
    source = prompt.logits.float().log_softmax(dim=-1)
    (next_t,) = to_device([prompt.next_token_ids], torch.int64, source.device)
    of_next = source.gather(1, next_t[:, None])
    parts = [of_next[:, 0], (source > of_next).sum(dim=-1) + 1]
    top = max(prompt.num_top, default=0)
    if top:
        values, ids = source.topk(top, dim=-1)
        parts += [ids.flatten(), values.flatten()]
    return parts


def _prompt_logprobs_of(prompt: PromptRows, packed: list[float]) -> list[TokenLogprob]:
    n, top = len(prompt.next_token_ids), max(prompt.num_top, default=0)
    ranks, ids, values = packed[n:2 * n], packed[2 * n:2 * n + n * top], packed[2 * n + n * top:]
    return [TokenLogprob(token, packed[r], tuple((int(ids[r * top + i]), values[r * top + i]) for i in range(want)),
                         int(ranks[r]))
            for r, (token, want) in enumerate(zip(prompt.next_token_ids, prompt.num_top))]


def _logprobs_of(requests, tokens, packed, num_rows, num_verify, top) -> list[list[TokenLogprob] | None]:
    """The host side of ``RejectionSampler._logprobs``: per request, a TokenLogprob per
    emitted token (an accepted draft's from its verify row, the last token's from its row)."""
    of_emitted = packed[:num_rows]
    of_draft = packed[num_rows:num_rows + num_verify]
    ids = packed[num_rows + num_verify:num_rows + num_verify + num_rows * top]
    values = packed[num_rows + num_verify + num_rows * top:]
    out: list[list[TokenLogprob] | None] = []
    row = verify = 0
    for req, emitted in zip(requests, tokens):
        want = req.params.logprobs
        if want is None:
            out.append(None)
            continue
        lps = []
        for j, token in enumerate(emitted):
            r = row + j
            value = of_draft[verify + j] if j < len(emitted) - 1 else of_emitted[r]
            best = tuple((int(ids[r * top + i]), values[r * top + i]) for i in range(want))
            lps.append(TokenLogprob(token, value, best))
        out.append(lps)
        row += len(req.draft_token_ids) + 1
        verify += len(req.draft_token_ids)
    return out


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
