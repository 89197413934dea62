"""The training loop: AdamW with warm-up and cosine decay, a step count fitted to a time
budget, data-parallel ranks, validation along the way."""
from __future__ import annotations

import math
import random
import time

import torch
from tqdm.auto import tqdm

from specserve.distributed import SINGLE, TPGroup
from specserve.training.data import Example, collate, make_batches
from specserve.training.runtime import average_gradients, log, quiet, use_bf16
from specserve.training.students import Student
from specserve.training.validation import validate


def lr_at(step: int, steps: int | None, args) -> float:
    """Linear warm-up over ``--warmup-steps``, then cosine decay to ``min_lr_frac`` × lr at
    ``steps`` (not yet known while a time budget is being calibrated: warm-up only)."""
    warmup = max(1, args.warmup_steps)
    if step < warmup or steps is None:
        return args.lr * min(1.0, (step + 1) / warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


class StepBudget:
    """How many training steps fit before ``deadline``. Steps [40, 100) are timed (the
    first ones pay one-off costs: kernel selection, the allocator growing for new shapes)
    and fix the number; until then the learning rate warms up and holds at its peak. Steps
    [100, 300) are timed again and fix it anew — they have run faster than the first window
    — while a long run's cosine decay has barely begun. Validations (``val_seconds``, one
    entry each, appended by the caller; the first before training) are not step time, and
    about ten a run are set aside. Past the deadline training stops where it is."""

    MARKS = (40, 100, 300)

    def __init__(self, deadline: float, val_seconds: list[float]) -> None:
        self.deadline = deadline
        self.val_seconds = val_seconds
        self.steps: int | None = None
        self.message = ""
        self._timer = self._from = self._vals = None

    def at(self, step: int, now: float) -> int | None:
        """Called before each step: the number of steps (None until step 100)."""
        if step in self.MARKS and (self.steps is None or self.steps > 2 * self.MARKS[-1]):
            if self._timer is not None:
                per_step = (now - self._timer - sum(self.val_seconds[self._vals:])) / (step - self._from)
                left = self.deadline - now - max(0, 11 - len(self.val_seconds)) * self.val_seconds[-1]
                self.steps = step + max(1, int(left / (per_step * 1.03)))  # 3 %: jitter
                self.message = (f"training: {per_step * 1000:.0f} ms per step over steps [{self._from}, {step}) "
                                f"-> {self.steps} steps (pass --steps {self.steps} to reproduce)")
            self._timer, self._from, self._vals = now, step, len(self.val_seconds)
        if now > self.deadline and (self.steps is None or step < self.steps):
            self.steps = step
            self.message = f"training: the budget ran out at step {step}"
        return self.steps


def train(args, student: Student, target, examples, device, pad, deadline: float | None,
          group: TPGroup = SINGLE) -> dict:
    """Train ``student`` on ``examples`` (the target frozen). With several ranks each step
    takes ``group.size`` batches of the one shuffled order, one a rank; rank 0 validates
    and decides when a time budget ends."""
    rng = random.Random(args.seed)
    budget = args.batch_tokens or (16384 if device.type == "cuda" else 2048)
    train_set = [e for e in examples if e.split == "train"]
    val_batches = make_batches([e for e in examples if e.split == "val"], budget, random.Random(0))
    params = student.parameters()
    for p in target.parameters():
        p.requires_grad_(False)
    for p in params.values():  # one starting point (a head's new weights are random)
        group.broadcast(p.data)
    optimizer = torch.optim.AdamW(student.param_groups(args.weight_decay, args.fc_lr_mult), lr=args.lr,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    bf16 = use_bf16(device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    history = {"train": [], "val": []}

    def check(batches) -> dict:
        return validate(student.module, batches, device, pad, autocast, student.score, student.passes)

    val_started = time.time()
    initial = check(val_batches) if group.is_driver else {}
    val_seconds = [time.time() - val_started]  # each validation's time: not training time
    history["val"].append({"step": 0, **initial})
    log(f"validation before training: {initial}")

    def next_batch() -> list[Example]:
        """This rank's batch of the step: the rank-th of the next ``group.size``."""
        nonlocal epoch_batches
        taken = []
        for _ in range(group.size):
            if not epoch_batches:
                epoch_batches = make_batches(train_set, budget, rng)
            taken.append(epoch_batches.pop())
        return taken[group.rank]

    epoch_batches: list = []
    steps = args.steps if args.steps or deadline is None else None
    steps = steps or (1000 if deadline is None else None)
    budget_steps = StepBudget(deadline, val_seconds) if steps is None else None
    step = tokens_seen = 0
    started = time.time()
    bar = None
    student.module.train()
    while True:
        if budget_steps is not None:
            if step in budget_steps.MARKS and device.type == "cuda":
                torch.cuda.synchronize(device)
            fixed = budget_steps.at(step, time.time())
            if group.size > 1:  # rank 0's clock decides
                fixed = int(group.broadcast(torch.tensor([-1 if fixed is None else fixed], device=device)).item())
                fixed = None if fixed < 0 else fixed
            if fixed != steps:
                steps = fixed
                log(budget_steps.message)
                if bar is not None:
                    bar.total = steps
        if steps is not None and step >= steps:
            break
        if bar is None and steps is not None:
            bar = tqdm(total=steps, initial=step, desc="training", unit="step", mininterval=10, disable=quiet())
        ids, rows, cols = collate(next_batch(), device, pad)
        lr = lr_at(step, steps, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr * param_group["lr_mult"]
        with autocast():
            loss, kl, ce = student.losses(ids, rows, cols, args.ce_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(list(params.values()), group)
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        tokens_seen += len(rows)
        step += 1
        if bar is not None:
            bar.update(1)
        every = args.eval_every or max(1, (steps or 10**9) // 10)
        if step % 10 == 0 or step == steps:
            history["train"].append({"step": step, "lr": round(lr, 7), "loss": round(loss.item(), 4),
                                     "kl": round(kl.item(), 4), "ce": round(ce.item(), 4),
                                     "grad_norm": round(norm.item(), 3)})
        if steps is not None and (step % every == 0 or step == steps) and group.is_driver:
            val_started = time.time()
            result = {"step": step, **check(val_batches)}
            val_seconds.append(time.time() - val_started)
            history["val"].append(result)
            log(f"step {step}/{steps}: train kl {kl.item():.3f} ce {ce.item():.3f} | val {result}")
    if bar is not None:
        bar.close()
    seconds = time.time() - started
    if group.size > 1:
        tokens_seen = int(group.all_reduce(torch.tensor([tokens_seen], device=device)).item())
    test = [e for e in examples if e.split == "test"]
    held_out = check(make_batches(test, budget, random.Random(0))) if test and group.is_driver else None
    if held_out:
        log(f"held-out prompts, teacher-forced: {held_out}")
    return {"steps": steps, "seconds": round(seconds, 1), "batch_tokens": budget, "ranks": group.size,
            "held_out_replay": held_out,
            "response_tokens_seen": tokens_seen, "epochs": round(tokens_seen / max(1, sum(
                len(e.token_ids) - e.num_prompt for e in train_set)), 2),
            "history": history, "final_val": history["val"][-1]}
