"""Record every step's draft-tree candidates: run the built-in draft with a tree at batch 1
on held-out prompts and write, per prompt, its tokens and, per step, every candidate node
the tree grew (before the verified ones are chosen), for ``select_eval.py``.

    python dump_trees.py LEVELS EXPAND K NODES PROMPTS DTYPE OUT.json.gz [DRAFT_QUANTIZATION]

LEVELS x EXPAND: the tree's expansion passes and the nodes each expands (shipped: 2 x 2);
K: the chain's length; NODES: further nodes verified (``--draft-tree-nodes``)."""
import gzip
import json
import sys

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import tree

levels, expand, k, max_nodes, count = (int(a) for a in sys.argv[1:6])
dtype, out = sys.argv[6], sys.argv[7]
quantization = sys.argv[8] if len(sys.argv) > 8 else None
defaults = list(tree.DraftTrees.__init__.__defaults__)
defaults[0], defaults[1] = levels, expand
tree.DraftTrees.__init__.__defaults__ = tuple(defaults)

steps, current = [], {}
grow, choose = tree.DraftTrees.grow, tree.choose


def recording_grow(self, output, *args, **kwargs):
    current["output"] = output
    return grow(self, output, *args, **kwargs)


def recording_choose(trees, *args, **kwargs):
    planned = current["output"].scheduled
    for i, nodes in trees.items():
        p = planned[i]
        steps.append({"end": p.start_pos + len(p.token_ids), "k": len(p.draft_token_ids),
                      "nodes": [(n.parent, n.token, round(n.chance, 7), n.depth, n.chain, n.expanded)
                                for n in nodes]})
    return choose(trees, *args, **kwargs)


tree.DraftTrees.grow, tree.choose = recording_grow, recording_choose
settings = {"speculative_method": "draft_model", "draft_tree_nodes": max_nodes, "num_speculative_tokens": k}
if quantization:
    settings["draft_quantization"] = quantization
llm = LLM(dtype=dtype, speculative_adaptive=False, max_model_len=4096, **settings)
params = SamplingParams(temperature=0, max_tokens=128, num_speculative_tokens=k)
result = {"levels": levels, "expand": expand, "k": k, "nodes": max_nodes, "dtype": dtype,
          "draft": llm.engine.speculator.drafter.describe()}
for kind in ("chat", "code"):
    runs = []
    for prompt in chat_prompts(llm.engine.tokenizer, held_out_prompts(kind, count)):
        steps.clear()
        before = llm.engine.spec_stats.copy()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        stats = llm.engine.spec_stats
        runs.append({"prompt_ids": list(output.prompt_token_ids), "out": list(output.token_ids),
                     "steps": list(steps), "verify_steps": stats.num_drafts - before.num_drafts,
                     "accepted": stats.num_accepted_tokens - before.num_accepted_tokens})
    result[kind] = runs
    verify = sum(r["verify_steps"] for r in runs)
    print(f"{kind}: engine acceptance length {1 + sum(r['accepted'] for r in runs) / verify:.3f} "
          f"over {verify} verify steps", flush=True)
with gzip.open(out, "wt") as f:
    json.dump(result, f, separators=(",", ":"))
