#!/bin/sh
# A hostile exec-port server for tests (the daemon's vm.exec against a guest that never answers):
# packed as /bin/vmhost-agent, init.sh starts it plainly (then it does nothing: no network agent)
# and with --exec. On every port org.vmhost.exec.N it answers `sync` and `hello` like the real
# server, so the host gets a session, and then reads every request and chunk and never answers
# any of them. A daemon must give up after its timeout, free the slot and stay responsive.
[ "${1:-}" = --exec ] || exit 0
serve() {
    while :; do
        exec 3<>"$1"
        while IFS= read -r line <&3; do
            [ -n "$line" ] || continue
            id=${line#*\"id\":}
            case $id in
                \"*) id=${id#\"}; id=\"${id%%\"*}\" ;;
                *) id=${id%%[,\}]*} ;;
            esac
            method=${line#*\"method\":\"}
            method=${method%%\"*}
            case $method in
                sync)
                    nonce=${line#*\"nonce\":\"}
                    nonce=${nonce%%\"*}
                    printf '\n{"jsonrpc":"2.0","id":%s,"result":{"nonce":"%s"}}\n' "$id" "$nonce" >&3 ;;
                hello)
                    printf '{"jsonrpc":"2.0","id":%s,"result":{"agent_version":"0.1.0","protocol_version":1,"capabilities":["exec","file.push","file.pull","time.set","guest.shutdown","ssh.authorize"]}}\n' "$id" >&3 ;;
                *) ;;
            esac
        done
        exec 3<&-
        sleep 1
    done
}
for d in /sys/class/virtio-ports/*; do
    case $(cat "$d/name" 2>/dev/null) in
        org.vmhost.exec.*) serve "/dev/${d##*/}" & ;;
    esac
done
wait
