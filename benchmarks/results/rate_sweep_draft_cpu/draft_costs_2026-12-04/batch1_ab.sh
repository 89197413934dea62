#!/bin/bash
source /tmp/civenv/bin/activate
for r in 1 2; do
  cd /tmp/old43 && TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/old43 python benchmarks/per_token_drafting.py --prompts 6 --settings 'k=1;k=3;adaptive' --json /tmp/s43/b1_old_$r.json 2>&1 | grep -E "^\| (chat|code)" > /tmp/s43/b1_old_$r.md
  cd /work/main && TORCH_EXTENSIONS_DIR=/tmp/ext_main PYTHONPATH=/work/main python benchmarks/per_token_drafting.py --prompts 6 --settings 'k=1;k=3;adaptive' --json /tmp/s43/b1_new_$r.json 2>&1 | grep -E "^\| (chat|code)" > /tmp/s43/b1_new_$r.md
done
echo done
