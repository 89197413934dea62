#!/bin/bash
# Calls 1-3 of a lease: one quarter of the default model's wheel kept each
# (device_carry_a, _b, _c; the working tree leaves ~23 MB a call).
mkdir -p /root/w && cp device_carry_?/part_a? /root/w/ && ls /root/w && nvidia-smi --query-gpu=name --format=csv,noheader
