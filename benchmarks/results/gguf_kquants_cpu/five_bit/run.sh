#!/bin/bash
# After the 5-bit form: the files with Q5_0, Q5_1 or Q5_K tensors (and Q4_1 for scale) run
# again beside llama.cpp, each file's two engines one after the other.
# From the repository root: bash benchmarks/results/gguf_kquants_cpu/five_bit/run.sh DIR (run.sh's)
dir=${1:-/tmp/gguf}
here=benchmarks/results/gguf_kquants_cpu/five_bit
src=$(python -c "from specserve.loader import default_model_gguf; print(default_model_gguf())")
for kind in Q4_1 Q4_K_M Q5_K_M Q3_K_M Q5_1; do
  file="$dir/SmolLM2-135M-Instruct.$kind.gguf"
  [ "$kind" = Q4_1 ] && file="$src"
  python benchmarks/gguf_cpu.py --gguf "$file" --methods quantized --prompts 4 --max-tokens 128 \
    --json $here/$kind.json 2>&1 | grep -v "^llama\|^load\|^print_info" | tee $here/$kind.log
done
