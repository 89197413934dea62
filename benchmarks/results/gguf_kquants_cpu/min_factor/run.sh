#!/bin/bash
# Mins as a factor of the scales: the commit before (50016e5, a worktree at BASE with
# specserve/kernels -> ../kernels and specserve/drafts -> ../drafts) and this one, taking
# turns file by file, two rounds, each run beside llama.cpp on the same file; then the
# one-layer timing (minbench.py).
# From the repository root: bash benchmarks/results/gguf_kquants_cpu/min_factor/run.sh DIR BASE
# (DIR: ../run.sh's requantized files)
dir=${1:-/tmp/gguf}
base=${2:-/tmp/base_min}
here=$(pwd)
out=$here/benchmarks/results/gguf_kquants_cpu/min_factor
src=$(python -c "from specserve.loader import default_model_gguf; print(default_model_gguf())")
for round in 1 2; do
  for kind in Q4_K_M Q2_K Q6_K IQ4_XS Q4_1; do
    file=$dir/SmolLM2-135M-Instruct.$kind.gguf
    [ $kind = Q4_1 ] && file=$src
    for side in before after; do
      tree=$here
      [ $side = before ] && tree=$base
      (cd "$tree" && PYTHONPATH=$tree TORCH_EXTENSIONS_DIR=/tmp/ext_$side python benchmarks/gguf_cpu.py --gguf "$file" \
        --methods quantized --prompts 4 --max-tokens 128 --json "$out/${kind}_${side}_$round.json" 2>&1 \
        | grep -v "^llama\|^load\|^print_info" > "$out/${kind}_${side}_$round.log")
    done
  done
done
python "$out/minbench.py" > "$out/minbench.log"
