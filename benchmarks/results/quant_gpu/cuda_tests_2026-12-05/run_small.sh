#!/bin/bash
# The FP8 GEMM at the tiny model's shapes (the engine test over a tiny FP8 checkpoint fails on
# CUDA; the GEMM test's own CUDA shapes are all large).
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD:$PWD/tests timeout 400 python benchmarks/results/quant_gpu/cuda_tests_2026-12-05/fp8_small_shapes.py 2>&1 \
  | tee $OUT/fp8_small_shapes.log | tail -30
