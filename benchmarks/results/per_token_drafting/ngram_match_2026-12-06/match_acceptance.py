"""How often n-gram lookup's proposals are accepted, by the length of the match they follow
and their depth: the signal the drafter's confidence reads (``drafts/ngram.py``).

The default model's greedy output for held-out chat and code prompts (speculation off,
chat template, 128 new tokens, EOS ignored); at every output position, the lookup the
engine makes there (``NgramIndex`` with n = 4..2) and the length of its match
(``match_length``). A proposal's token at depth j counts as accepted where it equals the
output and every token before it did; the first one that differs counts as rejected, the
ones after it are not judged. Then, as a rough guide to what reading it is worth, batch-1
decoding simulated on the same positions with a step costing 1 + c per draft token: every
fixed k against a rule that keeps a token while its chance (the product of the table's
acceptance along the draft) pays c at the step's goodput so far (the table read from the
same positions: an oracle map, which the engine learns online instead).

    python match_acceptance.py > match_acceptance.log
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from specserve.drafts.ngram import NgramIndex, confidence, match_length

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

BUCKETS = (2, 3, 4, 5, 10, 20)  # lower edges: 2, 3, 4, 5-9, 10-19, 20+ (confidence 0.5 ... 0.95+)


def bucket(length: int) -> int:
    return max(b for b in BUCKETS if b <= length)


def proposals(prompt: list[int], output: list[int], k: int = 8) -> list[tuple[list[int], int]]:
    """At every output position: the lookup's proposal (up to k) and its match's length."""
    index, found = NgramIndex(2), []
    for t in range(len(output)):
        tokens = prompt + output[:t]
        end = index.find(tokens, 4)
        found.append(([], 0) if end < 0 else (tokens[end + 1:end + 1 + k], match_length(tokens, end)))
    return found


def accepted(proposal: list[int], output: list[int], t: int) -> int:
    a = 0
    while a < len(proposal) and t + a < len(output) and proposal[a] == output[t + a]:
        a += 1
    return a


def rate(runs, policy, c: float) -> float:
    """Output tokens per step-cost over every position, each step drafting what ``policy``
    keeps of the lookup's proposal and costing 1 + c per draft token."""
    steps = tokens = 0.0
    for _, output, found in runs:
        t = 0
        while t < len(output):
            proposal, length = found[t]
            proposal = proposal[:policy(proposal, length, c)]
            a = accepted(proposal, output, t)
            steps += 1 + c * len(proposal)
            t += a + 1
            tokens += a + 1
    return tokens / steps


def rule(table, proposal, length, c, cap=4) -> int:
    """The drafts kept while each one's chance (``table``'s acceptance, multiplied along the
    draft) pays c at the goodput so far."""
    chance, gain, time, kept = 1.0, 1.0, 1.0, 0
    for j in range(min(len(proposal), cap)):
        a, n = table[(bucket(length), min(j, 3))]
        p = chance * a / max(n, 1)
        if p < gain / time * c:
            break
        chance, gain, time, kept = p, gain + p, time + c, kept + 1
    return kept


def main() -> None:
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for kind in ("code", "chat"):
        prompts = chat_prompts(llm.tokenizer, held_out_prompts(kind, 24))
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs = [(o.prompt_token_ids, o.token_ids, proposals(o.prompt_token_ids, o.token_ids)) for o in outs]
        table = collections.defaultdict(lambda: [0, 0])  # (bucket, depth) -> [accepted, judged]
        for _, output, found in runs:
            for t, (proposal, length) in enumerate(found):
                a = accepted(proposal, output, t)
                for j in range(min(a + 1, len(proposal))):
                    cell = table[(bucket(length), min(j, 3))]
                    cell[1] += 1
                    cell[0] += j < a
        positions = sum(len(found) for _, _, found in runs)
        with_proposal = sum(bool(p) for _, _, found in runs for p, _ in found)
        print(f"\n## {kind}: {len(runs)} prompts, {positions} positions, {with_proposal} with a proposal\n")
        print("| match length | confidence (at its shortest) | depth 0 | depth 1 | depth 2 | depth 3+ |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for b, hi in zip(BUCKETS, BUCKETS[1:] + (None,)):
            name = str(b) if hi == b + 1 else (f"{b}-{hi - 1}" if hi else f"{b}+")
            cells = [table[(b, j)] for j in range(4)]
            print(f"| {name} | {confidence(b):.2f} | " + " | ".join(
                f"{a / n:.2f} ({n})" if n else "-" for a, n in cells) + " |")

        print("\n| c (a draft token's cost, in steps) | best fixed k (tokens a step-cost) | rule, k <= 4 | rule / best |")
        print("| ---: | ---: | ---: | ---: |")
        for c in (0.25, 0.4, 0.5):
            fixed = {k: rate(runs, lambda p, n, c, k=k: k, c) for k in range(1, 7)}
            best = max(fixed, key=fixed.get)
            ruled = rate(runs, lambda p, n, c, table=table: rule(table, p, n, c), c)
            print(f"| {c} | {fixed[best]:.3f} (k = {best}) | {ruled:.3f} | {ruled / fixed[best]:.3f} |")


if __name__ == "__main__":
    main()
