#!/bin/bash
# Call 2: part 2 of the wheel kept (device_carry_b).
cp device_carry_b/part_ab /root/w/ && ls -la /root/w
