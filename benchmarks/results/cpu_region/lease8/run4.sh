#!/bin/bash
# lease 8, call 4 (warm): beside llama.cpp (carried site), this tree, plain decoding at 8 and 2 threads (cores 0-7)
REPO=$1
cp -r $REPO/device_carry_q4/site /root/site
cd /root
T0=$(date +%s)
taskset -c 0-7 timeout 400 /root/py_new $REPO/benchmarks/gguf_cpu.py --threads 8,2 --prompts 3 --max-tokens 128 \
  --methods quantized --json $OUT/gguf_cpu_xeon8_plain.json > $OUT/gguf_cpu_xeon8_plain.log 2>&1
tail -12 $OUT/gguf_cpu_xeon8_plain.log
echo "  at $(( $(date +%s) - T0 )) s"
