#!/bin/bash
# The CPU load sweep at the final code of 2026-12-04 (the measured bar, the constrained fit), three rounds.
for w in chat code-edit; do
  python -m specserve.cli bench offline --workload $w --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf --rounds 3 \
      --result-json sweep_cpu_${w/-/_}.json > sweep_cpu_${w/-/_}.log 2>&1
done
