#!/bin/sh
# A hostile exec-port server for tests (the daemon's vm.exec against a flooding guest): packed as
# /bin/vmhost-agent, init.sh starts it plainly (then it does nothing: no network agent) and with
# --exec. On every port org.vmhost.exec.N it answers `sync` and `hello` like the real server, so
# the host gets a session, and then answers any request with an endless flood: `exec.output`
# notifications for the request's id alternating with 1 MiB lines of garbage, and never a final
# reply. A daemon must bound what it keeps, give up after its timeout and stay responsive.
# The flood does not end when the host hangs up (QEMU drops what the guest writes to a port with
# no host, so the writes keep succeeding): a later session on that port gets flood lines and no
# sync answer; the other ports answer until they get a request themselves. Measured under TCG:
# about 4 MB/s (41 MB in 10 s).
[ "${1:-}" = --exec ] || exit 0
pad=$(head -c 3000 /dev/zero | tr '\0' A)
serve() {
    # A read returns end-of-file while no host is connected: open the port again, as the real
    # server does.
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
                *)
                    # The flood: ends only when a write fails (the host hung up).
                    while printf '{"jsonrpc":"2.0","method":"exec.output","params":{"id":%s,"stream":"stdout","data":"%s"}}\n' "$id" "$pad" >&3; do
                        { head -c 1048576 /dev/zero | tr '\0' x; echo; } >&3 2>/dev/null || break
                    done
                    break ;;
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
