#!/bin/sh
# A guest that prints to its serial console in a loop, forever (tests/tests/logs.rs): numbered
# lines of 121 bytes, "FLOOD 00000001 xxx...", so a test can tell how much it wrote in all.
pad=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx
i=0
while true; do
    i=$((i + 1))
    printf 'FLOOD %08d %s\n' "$i" "$pad"
done
