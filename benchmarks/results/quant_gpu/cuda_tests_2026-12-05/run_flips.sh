#!/bin/bash
# On CUDA: the engine test as it now stands (transformers follows the engine's roundings),
# then diag_flips.py (inputs, float8 codes that differ, logits on substituted inputs).
set -u
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
cp benchmarks/results/quant_gpu/cuda_tests_2026-12-05/diag_flips.py tests/
T0=$(date +%s)
if [ "${2:-}" = engine ]; then  # the engine test first (about 2 minutes on an H100)
  PYTHONPATH=$PWD timeout 300 python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
    -k engine_decodes > $OUT/engine_test.log 2>&1
  echo "engine test rc $? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/engine_test.log
fi
PYTHONPATH=$PWD timeout ${1:-250} python -m pytest -q -s -p no:cacheprovider tests/diag_flips.py > $OUT/diag_flips.log 2>&1
echo "diag rc $? at $(( $(date +%s) - T0 )) s"
grep -v "Loading weights\|Writing model" $OUT/diag_flips.log | tail -60
timeout 120 python benchmarks/results/quant_gpu/cuda_tests_2026-12-05/fp8_accumulation.py 2>&1 | tee $OUT/fp8_accumulation.log | tail -12
if [ -n "${3:-}" ]; then  # then the suite's CUDA-specific files, for up to $3 seconds
  T1=$(date +%s)
  PYTHONPATH=$PWD timeout $3 python -m pytest -q -p no:cacheprovider -rf tests/test_triton_kernels.py \
    tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_tree_attention.py tests/test_draft_tree.py \
    tests/test_eagle3.py tests/test_eagle.py tests/test_model_drafter.py tests/test_deterministic.py \
    tests/test_confidence_stopping.py > $OUT/cuda_files.log 2>&1
  echo "cuda files rc $? at $(( $(date +%s) - T1 )) s"; grep -E "passed|failed|FAILED|Error" $OUT/cuda_files.log | tail -25
fi
