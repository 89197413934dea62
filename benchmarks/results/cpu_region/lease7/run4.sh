#!/bin/bash
# lease 7, call 4 (warm): beside llama.cpp (carried site), this tree, 8 and 2 threads (cores 0-7), 3 prompts
REPO=$1
cp -r $REPO/device_carry_q4/site /root/site
cd /root
T0=$(date +%s)
taskset -c 0-7 timeout 560 /root/py_new $REPO/benchmarks/gguf_cpu.py --threads 8,2 --prompts 3 --max-tokens 128 \
  --methods quantized,ngram,draft --json $OUT/gguf_cpu_xeon8_whole_pass.json > $OUT/gguf_cpu_xeon8_whole_pass.log 2>&1
tail -22 $OUT/gguf_cpu_xeon8_whole_pass.log
echo "  at $(( $(date +%s) - T0 )) s"
