#!/bin/sh
# A guest that prints to its serial console in a loop, forever (tests/tests/logs.rs): numbered
# lines of 121 bytes, "FLOOD 00000001 xxx...", so a test can tell how much it wrote in all.
# init.sh starts /bin/vmhost-agent a second time with --exec (the exec ports' server): this
# stand-in is for the console only, so that second start does nothing.
[ "${1:-}" = --exec ] && exit 0
pad=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx
i=0
while true; do
    i=$((i + 1))
    printf 'FLOOD %08d %s\n' "$i" "$pad"
done
