#!/bin/bash
# IQ4 weights as 4-bit indices (after) against the 8-bit form (before: the commit before it,
# a worktree at BASE), taking turns, each run beside llama.cpp on the same IQ4_XS file; then
# the Q4_1 file once for scale and the greedy agreement with transformers.
# From the repository root: bash benchmarks/results/gguf_kquants_cpu/iq4_table/run.sh DIR BASE
# (DIR: run.sh's requantized files; BASE: a worktree of the commit before, with
# specserve/kernels -> ../kernels and specserve/drafts -> ../drafts)
dir=${1:-/tmp/gguf}
base=${2:-/tmp/base_iq4}
here=$(pwd)/benchmarks/results/gguf_kquants_cpu/iq4_table
file=$dir/SmolLM2-135M-Instruct.IQ4_XS.gguf
for round in 1 2; do
  for side in before after; do
    tree=$(pwd)
    [ $side = before ] && tree=$base
    (cd "$tree" && PYTHONPATH=$tree TORCH_EXTENSIONS_DIR=/tmp/ext_$side python benchmarks/gguf_cpu.py --gguf "$file" \
      --methods quantized --prompts 4 --max-tokens 128 --json "$here/${side}_$round.json" 2>&1 \
      | grep -v "^llama\|^load\|^print_info" > "$here/${side}_$round.log")
  done
done
src=$(python -c "from specserve.loader import default_model_gguf; print(default_model_gguf())")
python benchmarks/gguf_cpu.py --gguf "$src" --methods quantized --prompts 4 --max-tokens 128 --json "$here/Q4_1.json" \
  2>&1 | grep -v "^llama\|^load\|^print_info" > "$here/Q4_1.log"
python benchmarks/results/gguf_kquants_cpu/agreement.py "$dir" IQ4_XS > "$here/agreement.log"
