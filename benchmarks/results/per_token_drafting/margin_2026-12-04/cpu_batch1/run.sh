#!/bin/bash
cd /work/main
source /tmp/civenv/bin/activate
export TORCH_EXTENSIONS_DIR=/tmp/ext_main
for round in 1 2; do
  for g in 0.10 0.0; do
    sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = $g/" specserve/spec/controller.py
    python benchmarks/per_token_drafting.py --prompts 6 --settings "off;k=1;k=2;k=3;adaptive" --json /tmp/mgcpu/mg_${g}_r${round}.json > /tmp/mgcpu/mg_${g}_r${round}.log 2>&1
    grep "^|" /tmp/mgcpu/mg_${g}_r${round}.log | cut -d"|" -f2-9 | grep -v "\-\-\-" | sed "s/^/$g r$round /" >> /tmp/mgcpu/rows.txt
  done
done
sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = 0.10/" specserve/spec/controller.py
echo done >> /tmp/mgcpu/rows.txt
