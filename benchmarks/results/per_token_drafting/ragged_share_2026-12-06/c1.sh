#!/bin/bash
# Calls 1-4 of a lease: one fifth of the default model's wheel kept each (device_carry_a
# ... _d; the working tree leaves ~24 MB a call).
mkdir -p /root/w && cp device_carry_?/part_a? /root/w/ && ls /root/w && nvidia-smi --query-gpu=name --format=csv,noheader
