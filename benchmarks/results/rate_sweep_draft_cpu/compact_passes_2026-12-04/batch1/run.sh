#!/bin/bash
source /tmp/civenv/bin/activate
for r in 1 2; do
  cd /tmp/oldtree && TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/oldtree python benchmarks/per_token_drafting.py --prompts 6 --settings 'k=1;k=3;adaptive' --json /tmp/s42/b1_old_$r.json 2>&1 | grep -E "^\| (chat|code)" > /tmp/s42/b1_old_$r.md
  cd /work/main && TORCH_EXTENSIONS_DIR=/tmp/ext_main PYTHONPATH=/work/main python benchmarks/per_token_drafting.py --prompts 6 --settings 'k=1;k=3;adaptive' --json /tmp/s42/b1_new_$r.json 2>&1 | grep -E "^\| (chat|code)" > /tmp/s42/b1_new_$r.md
done
echo done
