#!/bin/bash
# lease 2, call 5 (warm): the table, new tree: llama.cpp beside specserve at 8 and 2 threads
REPO=$1
cd /root
T0=$(date +%s)
taskset -c 0-7 timeout 540 /root/py_new $REPO/benchmarks/gguf_cpu.py --threads 8,2 --prompts 3 --max-tokens 128 \
  --methods quantized,ngram,draft --json $OUT/gguf_cpu_xeon8_region.json > $OUT/gguf_cpu_xeon8_region.log 2>&1
grep "^|" $OUT/gguf_cpu_xeon8_region.log
echo "  at $(( $(date +%s) - T0 )) s"
