#!/bin/bash
# Call 5 of the second lease: run 2's head (device_carry_h, 19.7 MB) kept in /root/w/e3h.
mkdir -p /root/w/e3h && cp device_carry_h/* /root/w/e3h/ && ls -la /root/w/e3h
