#!/bin/bash
# Q6_K in 6 bits: the commit before (27abccb, a worktree at BASE with specserve/kernels ->
# ../kernels and specserve/drafts -> ../drafts) and this one, taking turns on the Q6_K and
# Q4_K_M files, two rounds, each run beside llama.cpp; then the one-layer timing.
# From the repository root: bash benchmarks/results/gguf_kquants_cpu/six_bit/run.sh DIR BASE
dir=${1:-/tmp/gguf}
base=${2:-/tmp/base_six}
here=$(pwd)
out=$here/benchmarks/results/gguf_kquants_cpu/six_bit
for round in 1 2; do
  for kind in Q6_K Q4_K_M; do
    for side in before after; do
      tree=$here
      [ $side = before ] && tree=$base
      (cd "$tree" && PYTHONPATH=$tree TORCH_EXTENSIONS_DIR=/tmp/ext_$side python benchmarks/gguf_cpu.py \
        --gguf "$dir/SmolLM2-135M-Instruct.$kind.gguf" --methods quantized --prompts 4 --max-tokens 128 \
        --json "$out/${kind}_${side}_$round.json" 2>&1 | grep -v "^llama\|^load\|^print_info" > "$out/${kind}_${side}_$round.log")
    done
  done
done
python "$out/sixbench.py" > "$out/sixbench.log"
