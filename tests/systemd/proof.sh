#!/bin/sh
# Runs as a oneshot service inside the container that tests/tests/systemd.rs boots with
# systemd-nspawn (systemd as PID 1 over an overlay of this machine's root). It installs the
# packages as an administrator would, lets the units do their work, and writes one
# "CHECK PASS name" or "CHECK FAIL name: why" line per check to /proof/result, then powers off.
R=/proof/result
: >"$R"
check() {
    _name=$1
    shift
    if _out=$("$@" 2>&1); then
        echo "CHECK PASS $_name" >>"$R"
    else
        echo "CHECK FAIL $_name: $(echo "$_out" | tail -n 5 | tr '\n' ' ')" >>"$R"
    fi
}
field() { vmhostctl get "$1" 2>/dev/null | awk -v k="$2:" '$1 == k {print $2}'; }
wait_for() { # SECONDS COMMAND...: polls every 0.5 s
    _n=$(($1 * 2))
    shift
    while [ "$_n" -gt 0 ]; do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
        _n=$((_n - 1))
    done
    "$@"
}
inactive() { ! systemctl is-active --quiet "$1"; }
alive() { kill -0 "$1" && ! grep -q '^State:.*Z' "/proc/$1/status"; }

# Installation: postinst creates the users, writes the config, enables and starts the socket.
check dpkg-install dpkg -i /proof/vmhostd_*.deb /proof/vmhost-agent_*.deb
check socket-listening systemctl is-active vmhostd.socket
check postinst-started-the-service systemctl is-active vmhostd.service
# With the service stopped and the socket left listening, the first client starts the service
# again (socket activation) and is answered.
systemctl stop vmhostd.service
check service-waits-for-a-client inactive vmhostd.service
check socket-still-listening systemctl is-active vmhostd.socket
check first-call-activates vmhostctl info
check service-active systemctl is-active vmhostd.service
check sandbox-in-force sh -c 'vmhostctl check 2>&1 | grep -Eq "^sandbox +ok "'

# KVM does not work here (ENVIRONMENT.md): the packaged config's accel must be edited, as an
# operator on such a host would.
sed -i 's/^accel = .*/accel = "tcg"/' /etc/vmhost/vmhostd.toml
# The test guest's kernel and initrd are in /proof: a boot directory of this host (paths.boot).
sed -i 's|^# boot = .*|boot = ["/proof"]|' /etc/vmhost/vmhostd.toml
# A network, so the VM's NIC proves taps under the unit's device policy (the container has a
# network namespace of its own).
cat >>/etc/vmhost/vmhostd.toml <<'EOF'

[networks.lan]
bridge = "br-sd"
create = true
address = "10.0.0.1/24"
subnet = "10.0.0.0/24"
EOF
check check-config vmhostd --check-config
# Type=notify: a restart returns only once the new daemon sent READY=1.
check restart systemctl restart vmhostd.service
cat >/proof/vm.json <<'EOF'
{"name": "sd", "cpu": 1, "memory_mib": 256,
 "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.5/24"}}],
 "boot": {"kernel": "/proof/vmlinuz", "initrd": "/proof/initrd", "cmdline": "console=ttyS0 panic=-1 quiet"}}
EOF
check create vmhostctl create /proof/vm.json
pid=$(field sd pid)
echo "qemu pid $pid" >>"$R"
qemu_uid=$(id -u vmhost-qemu)
check qemu-runs-as-vmhost-qemu sh -c "awk '/^Uid:/ {print \$2\$3\$4\$5}' /proc/$pid/status | grep -qx '$qemu_uid$qemu_uid$qemu_uid$qemu_uid'"
check qemu-in-the-service-cgroup grep -q vmhostd.service "/proc/$pid/cgroup"
check guest-boots wait_for 120 grep -q VMHOST-GUEST-READY /var/lib/vmhost/logs/sd.serial.log
check tap-on-the-bridge sh -c 'ip -o link show master br-sd | grep -q "alias vmhost:vm=sd"'
check qemu-holds-the-tap sh -c "ls -l /proc/$pid/fd | grep -q /dev/net/tun"
# The unit allows AF_INET and AF_INET6 (curl downloads images from inside it), yet QEMU cannot
# open an IP socket: the spawner starts it under a seccomp filter that refuses every family but
# AF_UNIX (docs/sandbox.md). QMP chardev-add of a UDP and of a TCP client backend fail with
# EAFNOSUPPORT; a Unix socket backend still connects (the filter refuses IP, not sockets).
cat >/proof/qmp.py <<'EOF'
import json, os, socket, sys
kind = sys.argv[1]
peer = "/proof/peer.sock"
inet = {"type": "inet", "data": {"host": "127.0.0.1", "port": "9"}}
backend = {
    "udp": {"type": "udp", "data": {"remote": inet}},
    "tcp": {"type": "socket", "data": {"addr": inet, "server": False}},
    "unix": {"type": "socket", "data": {"addr": {"type": "unix", "data": {"path": peer}}, "server": False}},
}[kind]
if kind == "unix":
    if os.path.exists(peer):
        os.unlink(peer)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(peer)
    os.chmod(peer, 0o777)
    listener.listen(1)
    listener.settimeout(10)
qmp = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
qmp.settimeout(30)
qmp.connect("/run/vmhost/sd/qmp")
lines = qmp.makefile("rw")
def answer():
    while True:
        v = json.loads(lines.readline())
        if "event" not in v:
            return v
answer()
for cmd in [{"execute": "qmp_capabilities"}, {"execute": "chardev-add", "arguments": {"id": kind, "backend": backend}}]:
    lines.write(json.dumps(cmd) + "\n")
    lines.flush()
    got = answer()
print(json.dumps(got))
if kind == "unix":
    listener.accept()
    sys.exit(0 if got == {"return": {}} else 1)
sys.exit(0 if "Address family not supported" in got.get("error", {}).get("desc", "") else 1)
EOF
check qemu-no-udp-socket python3 /proof/qmp.py udp
check qemu-no-tcp-socket python3 /proof/qmp.py tcp
check qemu-unix-socket-works python3 /proof/qmp.py unix

# KillMode=process: a restart of the service leaves the VM running; the new daemon adopts it.
check restart-keeps-the-vm systemctl restart vmhostd.service
check qemu-survived alive "$pid"
check vm-adopted sh -c "test \"\$(vmhostctl get sd | awk '\$1 == \"status:\" {print \$2}')\" = running"
check same-qemu sh -c "test \"\$(vmhostctl get sd | awk '\$1 == \"pid:\" {print \$2}')\" = $pid"

# vmhost-guests.service: its stop, which host shutdown does, powers the VM off and keeps it
# desired running; the next vmhostd start (as after a boot) starts it again (autostart).
vm_is() { test "$(field sd status)" = "$1" && test "$(field sd desired)" = "$2"; }
gone() { ! kill -0 "$1" 2>/dev/null || grep -q '^State:.*Z' "/proc/$1/status"; }
check guests-unit-active systemctl is-active vmhost-guests.service
check guests-stop-powers-off systemctl stop vmhost-guests.service
check qemu-powered-off wait_for 10 gone "$pid"
check vm-stopped-desired-running vm_is stopped running
check guests-start systemctl start vmhost-guests.service
check restart-autostarts systemctl restart vmhostd.service
check vm-autostarted wait_for 60 vm_is running running
pid=$(field sd pid)

check destroy vmhostctl destroy sd
check tap-removed sh -c '! ip -o link show | grep -q "alias vmhost:vm=sd"'
check qemu-gone wait_for 10 sh -c "! kill -0 $pid 2>/dev/null || grep -q '^State:.*Z' /proc/$pid/status"
check service-stop systemctl stop vmhost-guests.service vmhostd.service vmhostd.socket
check purge dpkg --purge vmhostd vmhost-agent
check nothing-left sh -c '! ls -d /etc/vmhost /var/lib/vmhost /run/vmhost 2>/dev/null && ! getent passwd vmhost-qemu'
echo DONE >>"$R"
systemctl --no-block poweroff
