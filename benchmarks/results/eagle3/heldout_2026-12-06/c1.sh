#!/bin/bash
# Calls 1-4 of a round: one part of the default model's wheel kept each (device_carry_a ..
# _d, 23 MB or 12 MB: the working tree leaves ~22 MB a call); the fifth part (device_carry_e)
# travels with the call that joins and installs it (train.sh).
mkdir -p /root/w && cp device_carry_?/part_a? /root/w/ && ls /root/w && nvidia-smi --query-gpu=name --format=csv,noheader
