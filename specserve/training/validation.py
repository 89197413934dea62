"""Validation: a draft's KL to the target and the acceptance length of greedy chain
drafting, replayed exactly under teacher forcing on the target's own answers."""
from __future__ import annotations

import torch

from specserve.training.data import KINDS, collate


def chain_acceptance(agree: list[list[bool]], k: int) -> tuple[int, int]:
    """Greedy chain drafting replayed on one response: ``agree[t][i]`` says whether the
    t-th draft of a chain whose first proposal is token i - t predicts response token i as
    the target does (a layers draft under teacher forcing sees exactly the accepted tokens,
    so its one row serves every t; an EAGLE head has one row per unrolled pass). Token 0
    comes from the prefill; each verify step proposes from the next token on, accepts the
    run of agreeing drafts (at most k) and emits one more. Returns (verify steps, accepted
    drafts)."""
    length = len(agree[0])
    steps = accepted = 0
    i = 1
    while i < length:
        run = 0
        while run < k and i + run < length and agree[min(run, len(agree) - 1)][i + run]:
            run += 1
        steps += 1
        accepted += run
        i += run + 1
    return steps, accepted


@torch.no_grad()
def validate(model, batches, device, pad, autocast, score, k: int = 4) -> dict:
    """Mean KL, pass 0's top-1 agreement and the acceptance length of greedy chain drafting
    at ``k`` replayed on each greedy answer (``chain_acceptance``), and the answers replayed, per kind.
    ``score(ids, rows, cols)`` gives the batch's (mean KL, agreement ``[passes, rows]``).
    Every kind of ``KINDS`` reports its answers, 0 where none was replayed (a generation
    budget may leave a kind none), and then no acceptance or agreement."""
    model.eval()
    kl_sum = n = 0.0
    counts: dict[str, list[int]] = {}
    for batch in batches:
        ids, rows, cols = collate(batch, device, pad)
        with autocast():
            kl, agree = score(ids, rows, cols)
        kl_sum += kl.item() * len(rows)
        n += len(rows)
        agree = agree.tolist()
        start = 0
        for e in batch:
            length = len(e.token_ids) - e.num_prompt
            if not e.sampled:
                steps, accepted = chain_acceptance([a[start:start + length] for a in agree], k)
                c = counts.setdefault(e.kind, [0, 0, 0, 0, 0])
                c[0] += steps
                c[1] += accepted
                c[2] += sum(agree[0][start:start + length])
                c[3] += length
                c[4] += 1
            start += length
    model.train()
    result = {"kl": round(kl_sum / max(n, 1), 4)}
    for kind in sorted({*KINDS, *counts}):
        steps, accepted, top1, length, answers = counts.get(kind, (0, 0, 0, 0, 0))
        if answers:
            result[f"sim_accept_len_{kind}"] = round(1 + accepted / max(steps, 1), 3)
            result[f"top1_agreement_{kind}"] = round(top1 / max(length, 1), 4)
        result[f"answers_{kind}"] = answers  # replayed (a budget may have left some prompts unanswered)
    return result
