#!/bin/sh
# A hostile "guest agent" for tests (tests/tests/agent.rs): it speaks the protocol well enough to
# get a session, but every string it chooses is crafted to forge log lines and terminal output:
# newlines, carriage returns, ESC (CSI, OSC) and C1 sequences. JSON escapes carry them (\n, \r,
# \u001b, \u009b), so the daemon receives them as characters in valid replies.
# init.sh starts /bin/vmhost-agent a second time with --exec (the exec ports' server): this
# stand-in is for the agent port only, so that second start does nothing.
[ "${1:-}" = --exec ] && exit 0
for d in /sys/class/virtio-ports/*; do
    [ "$(cat "$d/name" 2>/dev/null)" = org.vmhost.agent.0 ] && port=/dev/${d##*/}
done
[ -n "$port" ] || exit 1
evil='\nFORGED-LINE level=ERROR vmhostd: root shell granted\r\u001b[2K\u001b]0;pwned\u0007\u009b31m'
# A read of the port returns end-of-file while the host side is not connected (before the
# daemon's first connection, and between its attempts when an answer came too late under a
# loaded TCG): open it again, as the real agent does, instead of exiting.
while :; do
exec 3<>"$port"
while IFS= read -r line <&3; do
    [ -n "$line" ] || continue
    # Fields by parameter expansion only: no fork per line, so answers stay quick under TCG.
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
            result="{\"nonce\":\"$nonce\"}" ;;
        hello)
            result="{\"agent_version\":\"0.9$evil\",\"protocol_version\":1,\"capabilities\":[\"agent.info\",\"net.check\"]}" ;;
        agent.info)
            result="{\"version\":\"0.9$evil\",\"hostname\":\"liar$evil\",\"kernel\":\"k\",\"uptime_s\":1,\"boot_id\":\"b\",\"rss_kib\":1}" ;;
        net.check)
            result="{\"ok\":false,\"checks\":[{\"name\":\"eth0$evil\",\"ok\":false,\"expected\":\"\\u001b[32mok\\u001b[0m\",\"observed\":\"x\\rFORGED-CELL\"}]}" ;;
        *)
            printf '{"jsonrpc":"2.0","id":%s,"error":{"code":5100,"message":"refused%s"}}\n' "$id" "$evil" >&3
            continue ;;
    esac
    printf '{"jsonrpc":"2.0","id":%s,"result":%s}\n' "$id" "$result" >&3
done
exec 3<&-
sleep 1
done
