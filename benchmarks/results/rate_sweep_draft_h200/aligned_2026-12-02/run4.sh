#!/bin/bash
# call 4 (the machine still warm from call 3): batch 1 against every fixed k
ln -sfn ../kernels specserve/kernels; ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
for rv in new1 base1 base2 new2; do
  v=${rv%?}; case $v in new) R=$PWD;; base) R=/root/base;; lazyp) R=/root/lazyp;; esac
  (cd $R && PYTHONPATH=$R timeout 140 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping" --json $OUT/ptd_${rv}.json > /tmp/ptd_${rv}.log 2>&1; grep "^|" /tmp/ptd_${rv}.log | cut -d"|" -f2-8 | grep -v "\-\-\-" | grep -v "k=" | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
