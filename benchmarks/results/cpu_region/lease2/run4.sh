#!/bin/bash
# lease 2, call 4 (warm): new against base, speculation off, taking turns; 8 threads (cores 0-7), then 2 (cores 0-1)
REPO=$1
cp -r $REPO/device_carry_q4/site /root/site
cd /root
T0=$(date +%s)
for C in 0-7 0-1; do
  taskset -c $C timeout 250 /root/py_new $REPO/benchmarks/ab_checkouts.py --python base=/root/py_base --python new=/root/py_new \
    --mode speed --rounds 2 --prompts 3 --max-tokens 128 --settings off --json $OUT/ab_region_xeon_cores$C.json > /tmp/ab_$C.log 2>&1
  grep "^| off" /tmp/ab_$C.log | sed "s/^/cores $C: /"; cp /tmp/ab_$C.log $OUT/
  echo "  at $(( $(date +%s) - T0 )) s"
done
