#!/bin/sh
# A hostile "guest agent" for tests (tests/tests/agent.rs): it floods the agent port with
# oversize lines, invalid UTF-8 and replies with extra fields, never a valid answer.
# init.sh starts /bin/vmhost-agent a second time with --exec (the exec ports' server): this
# stand-in is for the agent port only, so that second start does nothing.
[ "${1:-}" = --exec ] && exit 0
for d in /sys/class/virtio-ports/*; do
    [ "$(cat "$d/name" 2>/dev/null)" = org.vmhost.agent.0 ] && port=/dev/${d##*/}
done
[ -n "$port" ] || exit 1
while true; do
    head -c 1048576 /dev/zero | tr '\0' 'x' >"$port" 2>/dev/null
    printf '\377\376 garbage\n{"jsonrpc":"2.0","id":1,"result":{"agent_version":"x","protocol_version":1,"capabilities":[],"host_path":"/etc/shadow"}}\n' >"$port" 2>/dev/null
    sleep 0.2
done
