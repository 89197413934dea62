#!/bin/bash
# Call 1 of a lease: part 1 of the default model's wheel kept (device_carry_a).
mkdir -p /root/w && cp device_carry_a/part_aa /root/w/ && nvidia-smi --query-gpu=name --format=csv,noheader
