#!/bin/bash
# Call 2 of a lease: keeps the model wheel's second part; the CUDA tests of the draft fed
# beside the target's pass and of captured graphs (the final form of 2026-12-04's change
# had not run on a GPU).
cp device_carry_q2/part_ab /root/w/
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 240 python -m pytest -q -p no:cacheprovider \
  tests/test_model_drafter.py tests/test_cuda_graphs.py -k cuda > $OUT/pytest_gpu.log 2>&1
tail -5 $OUT/pytest_gpu.log
