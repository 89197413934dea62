#!/bin/bash
# The default model's Q4_1 file requantized by llama.cpp into each file kind, then every
# file run by llama.cpp and by specserve kept quantized (and, for Q4_K_M, dequantised to
# bf16: what every file but Q4_1 and Q6_K ran as before), one file after another.
# From the repository root: bash benchmarks/results/gguf_kquants_cpu/run.sh DIR
set -e
dir=${1:-/tmp/gguf}
here=benchmarks/results/gguf_kquants_cpu
src=$(python -c "from specserve.loader import default_model_gguf; print(default_model_gguf())")
mkdir -p "$dir"
python $here/requantize.py "$src" "$dir" Q4_K_M,Q5_K_M,Q3_K_M,Q2_K,IQ4_XS,Q6_K,Q5_1 2>/dev/null | grep " rc "
for kind in Q4_1 Q4_K_M Q5_K_M Q3_K_M Q2_K IQ4_XS Q6_K Q5_1; do
  file="$dir/SmolLM2-135M-Instruct.$kind.gguf"
  [ "$kind" = Q4_1 ] && file="$src"
  methods=quantized
  [ "$kind" = Q4_K_M ] && methods=quantized,bf16
  python benchmarks/gguf_cpu.py --gguf "$file" --methods $methods --prompts 4 --max-tokens 128 \
    --json $here/$kind.json 2>&1 | grep -v "^llama\|^load\|^print_info" | tee $here/$kind.log
done
