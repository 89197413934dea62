#!/bin/bash
# Call 6 (the machine still warm, the wheel installed, the head of call 5 in /root/w/e3):
# held-out prompts, k = 4 fixed, batch 1 and 64 at once: speculation off, the built-in
# draft and the EAGLE-3 head, taking turns.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
timeout 500 python benchmarks/draft_acceptance.py --device cuda --prompts 64 --batch 1,64 --k 4 \
  --methods none,draft_model,draft_model@/root/w/e3 --json $OUT/eagle3_h100.json 2>&1 \
  | sed 's/\r/\n/g' | grep -v "it/s]" | tee $OUT/speed.log
