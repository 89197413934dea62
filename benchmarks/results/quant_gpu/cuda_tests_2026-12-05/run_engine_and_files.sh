#!/bin/bash
# On CUDA: the engine test for the W8A8 layouts (transformers following the engine's
# roundings); then the CUDA-specific files collected as run_flips.sh ran them, and the
# tests at the positions that failed there (cuda_files.log: 356-358, 362, 368-373, 378)
# run again by name, for up to $1 seconds.
set -u
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
  -k "engine_decodes and (fp8 or fbgemm)" > $OUT/engine_test.log 2>&1
echo "engine test rc $? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/engine_test.log
FILES="tests/test_triton_kernels.py tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_tree_attention.py
  tests/test_draft_tree.py tests/test_eagle3.py tests/test_eagle.py tests/test_model_drafter.py tests/test_deterministic.py
  tests/test_confidence_stopping.py"
PYTHONPATH=$PWD python -m pytest -q --collect-only -p no:cacheprovider $FILES 2>/dev/null | grep "::" > $OUT/collected.txt
wc -l < $OUT/collected.txt
IDS=$(sed -n '356p;357p;358p;362p;368p;369p;370p;371p;372p;373p;378p' $OUT/collected.txt)
echo "$IDS"
PYTHONPATH=$PWD timeout ${1:-150} python -m pytest -q -p no:cacheprovider -rf $IDS > $OUT/failed_again.log 2>&1
echo "again rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^E  |FAILED|passed|failed" $OUT/failed_again.log | head -40
