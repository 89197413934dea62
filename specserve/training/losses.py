"""What a draft learns: the target's distribution at each training row, and the distances
to it (forward KL, cross-entropy to the target's argmax, agreement)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def logits_at(model, ids, rows, cols, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits at the training rows; with ``vocab`` (a draft vocabulary), those
    tokens' only, in its order."""
    hidden = model.model(input_ids=ids).last_hidden_state
    return head_logits(model.lm_head, hidden[rows, cols], vocab)


def head_logits(lm_head, hidden: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    weight = lm_head.weight if vocab is None else lm_head.weight[vocab]
    return F.linear(hidden, weight).float()


class TargetDistribution:
    """What a draft learns at each training row: the target's distribution p over the
    draft's vocabulary (the whole one, or ``vocab``: p renormalised over those tokens — all
    the draft can propose, as the engine's q is then zero elsewhere) and its argmax, with
    which a draft's logits over the same tokens give per-row forward KL(p || q),
    cross-entropy to the argmax and agreement."""

    def __init__(self, target_logits: torch.Tensor, vocab: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            argmax = target_logits.argmax(dim=-1)
            self.column = argmax  # the argmax's column in the draft's logits; -1: not there
            if vocab is not None:
                column_of = torch.full((target_logits.shape[-1],), -1, dtype=torch.long, device=vocab.device)
                column_of[vocab] = torch.arange(len(vocab), device=vocab.device)
                self.column = column_of[argmax]
                target_logits = target_logits[:, vocab]
            self.log_p = F.log_softmax(target_logits.float(), dim=-1)
            self.p = self.log_p.exp()
            self.p_log_p = (self.p * self.log_p).sum(-1)  # minus p's entropy

    def terms(self, draft_logits: torch.Tensor):
        """Per row: (KL(p || q), cross-entropy to the argmax — 0 where the draft's vocabulary
        lacks it —, whether it is in the vocabulary, whether the draft's argmax is it)."""
        log_q = F.log_softmax(draft_logits, dim=-1)
        kl = self.p_log_p - (self.p * log_q).sum(-1)
        has = self.column >= 0
        ce = -log_q.gather(1, self.column.clamp(min=0)[:, None]).squeeze(1) * has
        return kl, ce, has, (draft_logits.argmax(-1) == self.column) & has

    def loss(self, draft_logits: torch.Tensor, ce_weight: float, valid: torch.Tensor | None = None):
        """(kl + ce_weight × ce, kl, ce, agree) averaged over the rows (``valid`` ones)."""
        kl, ce, has, agree = self.terms(draft_logits)
        if valid is not None:
            has, agree = has & valid, agree & valid
        rows = valid if valid is not None else torch.ones_like(has)
        kl = (kl * rows).sum() / rows.sum().clamp(min=1)
        ce = (ce * has).sum() / has.sum().clamp(min=1)
        return kl + ce_weight * ce, kl, ce, agree


def distill_loss(draft_logits, target_logits, ce_weight: float, vocab: torch.Tensor | None = None):
    loss, kl, ce, _ = TargetDistribution(target_logits, vocab).loss(draft_logits, ce_weight)
    return loss, kl, ce
