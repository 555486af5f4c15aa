# Helpers for lab scenarios (busybox sh). A scenario starts with
#   . /lab/lib.sh
# and ends with `finish`, which prints the LAB-RESULT line and powers the lab off.
# See tests/lab/README.md for the protocol and an example.
#
# Output conventions (all on the lab's serial console):
#   LAB[<uptime>] text          say: progress, timings
#   CHECK PASS <name>           check/require succeeded
#   CHECK FAIL <name> (exit N)  followed by the command's output, each line "  | ..."
#   LAB-RESULT PASS | LAB-RESULT FAIL <reason>   exactly once, last

LAB_DIR=${LAB_DIR:-/run/lab}
LAB_SOCKET=$LAB_DIR/vmhostd.sock
LAB_CONFIG=$LAB_DIR/vmhostd.toml
LAB_STATE=$LAB_DIR/state
LAB_RUN=$LAB_DIR/run
LAB_IMAGES=$LAB_DIR/images
LAB_DAEMON_LOG=$LAB_DIR/vmhostd.log
# The test guest (tests/guest) for nested VMs; it prints VMHOST-GUEST-READY when up.
LAB_GUEST_KERNEL=/lab/guest/vmlinuz
LAB_GUEST_INITRD=/lab/guest/initramfs.cpio.gz
# shellcheck disable=SC2034  # used by scenarios
LAB_GUEST_READY=VMHOST-GUEST-READY
# iproute2 (full `ip` and `bridge`). Busybox sh runs its own applets before searching
# PATH, so a bare `ip` is always busybox's (no tuntap, no bridge or VLAN-filtering
# options, no -d details): call iproute2 by path, as "$IP".
IP=/usr/local/sbin/ip
BRIDGE=/usr/local/sbin/bridge
export IP BRIDGE
LAB_NFAIL=0
LAB_FIRST_FAIL=
LAB_VMHOSTD_PID=
mkdir -p "$LAB_DIR"

# Seconds since the lab kernel booted (two decimals).
lab_uptime() {
    read -r _u _ </proc/uptime
    echo "$_u"
}

# say TEXT...: a progress line with the lab's uptime. Written to the console directly,
# so it shows even inside `check` (which captures its command's output).
say() {
    echo "LAB[$(lab_uptime)] $*" >/dev/console
}

# Seconds (with decimals) between two lab_uptime values: elapsed START END.
elapsed() {
    awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'
}

# check NAME CMD [ARGS...]: runs CMD, prints CHECK PASS/FAIL NAME. On failure the
# command's output follows, indented; the scenario goes on, and `finish` will report
# FAIL naming the first failed check. Returns CMD's status. LAB_VERBOSE=1 also
# prints the output of passing checks.
check() {
    _name=$1
    shift
    _out=$("$@" 2>&1)
    _rc=$?
    if [ "$_rc" -eq 0 ]; then
        echo "CHECK PASS $_name"
        [ "${LAB_VERBOSE:-0}" = 1 ] && [ -n "$_out" ] && echo "$_out" | sed 's/^/  | /'
    else
        echo "CHECK FAIL $_name (exit $_rc)"
        [ -n "$_out" ] && echo "$_out" | sed 's/^/  | /'
        LAB_NFAIL=$((LAB_NFAIL + 1))
        [ -n "$LAB_FIRST_FAIL" ] || LAB_FIRST_FAIL=$_name
    fi
    return "$_rc"
}

# require NAME CMD [ARGS...]: like check, but a failure ends the scenario at once.
require() {
    check "$@" || finish "required check failed: $1"
}

# expect_fail NAME CMD [ARGS...]: passes when CMD fails (a refusal that must happen).
expect_fail() {
    _name=$1
    shift
    check "$_name" _lab_not "$@"
}
_lab_not() {
    if "$@"; then
        echo "(succeeded, but it must fail)"
        return 1
    fi
    return 0
}

# start_vmhostd [EXTRA_TOML]: writes $LAB_CONFIG (accel tcg, paths under $LAB_DIR,
# hardware cpu/memory from LAB_HW_CPU/LAB_HW_MEM_GIB, defaults 4/4) plus EXTRA_TOML
# (e.g. [networks.x] tables), starts vmhostd with its log in $LAB_DAEMON_LOG and waits
# (60 s) until `vmhostctl info` answers. Fails the scenario if it does not come up.
start_vmhostd() {
    mkdir -p "$LAB_STATE" "$LAB_RUN" "$LAB_IMAGES"
    cat >"$LAB_CONFIG" <<EOF
sandbox = "${LAB_SANDBOX:-require}"
[paths]
state = "$LAB_STATE"
run = "$LAB_RUN"
images = "$LAB_IMAGES"
socket = "$LAB_SOCKET"
boot = ["$LAB_IMAGES", "$(dirname "$LAB_GUEST_KERNEL")", "$(dirname "$LAB_GUEST_INITRD")"]   # kernels and initrds VMs may boot
[qemu]
binary = "/usr/bin/qemu-system-x86_64"
accel = "tcg"
machine = "q35"
launch_timeout_s = 120
[hardware]
cpu = ${LAB_HW_CPU:-4}
memory_gib = ${LAB_HW_MEM_GIB:-4}
reserved_cpu = 1
reserved_memory_gib = 1
${1:-}
EOF
    restart_vmhostd
}

# restart_vmhostd: starts vmhostd again with the existing $LAB_CONFIG (after
# kill_vmhostd, for crash-recovery scenarios).
restart_vmhostd() {
    _t0=$(lab_uptime)
    NO_COLOR=1 VMHOST_LOG=${VMHOST_LOG:-debug} vmhostd --config "$LAB_CONFIG" >>"$LAB_DAEMON_LOG" 2>&1 &
    LAB_VMHOSTD_PID=$!
    _i=0
    while ! vmhostctl --socket "$LAB_SOCKET" info >/dev/null 2>&1; do
        if ! kill -0 "$LAB_VMHOSTD_PID" 2>/dev/null; then
            finish "vmhostd exited at start-up"
        fi
        _i=$((_i + 1))
        [ "$_i" -le 600 ] || finish "vmhostd did not answer within 60 s"
        sleep 0.1
    done
    say "vmhostd up (pid $LAB_VMHOSTD_PID) after $(elapsed "$_t0" "$(lab_uptime)") s"
}

# kill_vmhostd [SIGNAL]: signals vmhostd (default KILL) and waits for it to go.
kill_vmhostd() {
    [ -n "$LAB_VMHOSTD_PID" ] || return 0
    kill "-${1:-KILL}" "$LAB_VMHOSTD_PID" 2>/dev/null
    wait "$LAB_VMHOSTD_PID" 2>/dev/null
    LAB_VMHOSTD_PID=
}

# ctl ARGS...: vmhostctl against the lab's daemon.
ctl() {
    vmhostctl --socket "$LAB_SOCKET" "$@"
}

# sandbox_in_force: `vmhostctl check` shows the four sandbox items ok (docs/sandbox.md), the
# daemon's Landlock ruleset enforced (the cloud kernel 6.1 has ABI 2: "partially enforced") and
# the daemon's documented capability sets. Prints the four lines.
sandbox_in_force() {
    _c=$(ctl check 2>&1)
    echo "$_c" | grep -E '^(sandbox|capabilities|landlock|seccomp) '
    for _i in sandbox capabilities landlock seccomp; do
        echo "$_c" | grep -Eq "^$_i +ok " || return 1
    done
    echo "$_c" | grep -Eq '^landlock +ok +daemon: (fully|partially) enforced' &&
        echo "$_c" | grep -Eq '^capabilities +ok +daemon: effective=cap_kill,cap_net_admin permitted=cap_kill,cap_net_admin bounding=cap_kill,cap_net_admin inheritable=none ambient=none; '
}

# kernel_spec NAME [CMDLINE] [MEMORY_MIB]: a direct-kernel spec booting the test guest
# (the JSON of tests/src/lib.rs kernel_spec). Prints it.
kernel_spec() {
    cat <<EOF
{"name": "$1", "cpu": 1, "memory_mib": ${3:-256},
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$LAB_GUEST_INITRD",
          "cmdline": "${2:-console=ttyS0 panic=-1 quiet}"}}
EOF
}

# create_vm NAME [CMDLINE] [MEMORY_MIB]: vmhostctl create with kernel_spec. For other
# specs write the JSON yourself and run `ctl create FILE`.
create_vm() {
    kernel_spec "$@" >"$LAB_DIR/$1.json"
    ctl create "$LAB_DIR/$1.json"
}

# serial_log VM: path of a nested VM's serial console log.
serial_log() {
    echo "$LAB_STATE/logs/$1.serial.log"
}

# wait_serial VM MARKER TIMEOUT_S: waits until the VM's serial log contains MARKER
# (fixed string). Prints how long it took; returns 1 on timeout.
wait_serial() {
    _t0=$(lab_uptime)
    _log=$(serial_log "$1")
    _n=$(($3 * 2))
    while [ "$_n" -gt 0 ]; do
        if grep -qF -- "$2" "$_log" 2>/dev/null; then
            say "$1: \"$2\" after $(elapsed "$_t0" "$(lab_uptime)") s"
            return 0
        fi
        sleep 0.5
        _n=$((_n - 1))
    done
    say "$1: no \"$2\" within $3 s"
    return 1
}

# vm_status VM: the VM's status word from `vmhostctl get` (running, stopped, ...).
vm_status() {
    ctl get "$1" | awk '$1 == "status:" { print $2 }'
}

# vm_listed VM STATUS: `vmhostctl list` has a row for VM with that status (prints the
# table, which `check` shows on failure).
vm_listed() {
    ctl list | awk -v n="$1" -v s="$2" '{ print } $1 == n && $2 == s { found = 1 } END { exit !found }'
}

# wait_status VM STATUS TIMEOUT_S
wait_status() {
    _n=$(($3 * 2))
    while [ "$_n" -gt 0 ]; do
        [ "$(vm_status "$1")" = "$2" ] && return 0
        sleep 0.5
        _n=$((_n - 1))
    done
    echo "$1 is $(vm_status "$1"), not $2, after $3 s"
    return 1
}

# qmp SOCKET COMMAND [ARGUMENTS_JSON]: one QMP command on a QEMU monitor socket; prints
# QEMU's replies (greeting, capabilities, then the command's return or error). A QMP
# socket takes one client at a time: this works for QEMUs started by the scenario, not
# for one whose monitor vmhostd holds.
qmp() {
    if [ -n "${3:-}" ]; then
        _cmd="{\"execute\": \"$2\", \"arguments\": $3}"
    else
        _cmd="{\"execute\": \"$2\"}"
    fi
    # -t 5: after sending, wait up to 5 s for the replies before closing.
    printf '{"execute": "qmp_capabilities"}\n%s\n' "$_cmd" | socat -t 5 - "UNIX-CONNECT:$1"
}

# vm_qemu_pid VM: PID of VM's nested QEMU (its argv has `-name guest=VM,...`).
vm_qemu_pid() {
    for _d in /proc/[0-9]*; do
        case $(readlink "$_d/exe" 2>/dev/null) in *qemu-system-*) ;; *) continue ;; esac
        tr '\0' ' ' <"$_d/cmdline" 2>/dev/null | grep -q -- "guest=$1," && { echo "${_d##*/}"; return 0; }
    done
    echo "no QEMU for $1" >&2
    return 1
}

# qemu_threads VM: one line per thread of VM's QEMU: TID, Cpus_allowed_list, comm (vCPU
# threads are "CPU N/TCG": vmhostd starts QEMU with debug-threads=on).
qemu_threads() {
    _p=$(vm_qemu_pid "$1") || return 1
    for _t in /proc/"$_p"/task/*; do
        echo "${_t##*/} $(awk '$1 == "Cpus_allowed_list:" { print $2 }' "$_t/status") $(cat "$_t/comm")"
    done
}

# vcpu_cpus VM [N]: Cpus_allowed_list of the thread of VM's vCPU N (default 0).
vcpu_cpus() {
    _th=$(qemu_threads "$1") || return 1
    _l=$(echo "$_th" | awk -v c="CPU ${2:-0}/TCG" '{ t = $3; for (i = 4; i <= NF; i++) t = t " " $i } t == c { print $2 }')
    [ -n "$_l" ] || { echo "$1: no thread \"CPU ${2:-0}/TCG\":" >&2; echo "$_th" >&2; return 1; }
    echo "$_l"
}

# flat_json ARGS...: `vmhostctl --json ARGS` with every blank and newline taken out, for grep
# (`"key":value`; values with blanks lose them too).
flat_json() {
    ctl --json "$@" | tr -d ' \n'
}

# dump_logs: vmhostd's log and the tail of every nested serial log, for diagnosis.
dump_logs() {
    if [ -f "$LAB_DAEMON_LOG" ]; then
        echo "----- vmhostd log (last 80 lines) -----"
        tail -n 80 "$LAB_DAEMON_LOG"
    fi
    for _f in "$LAB_STATE"/logs/*.serial.log; do
        [ -f "$_f" ] || continue
        echo "----- ${_f##*/} (last 40 lines) -----"
        tail -n 40 "$_f"
    done
    echo "-----"
}

# finish [REASON]: ends the scenario. FAIL when REASON is given or any check failed
# (then the logs are dumped first), else PASS. Powers the lab off; never returns.
finish() {
    if [ -n "${1:-}" ] || [ "$LAB_NFAIL" -gt 0 ]; then
        dump_logs
        _reason=${1:-"$LAB_NFAIL check(s) failed, first: $LAB_FIRST_FAIL"}
        echo "LAB-RESULT FAIL $_reason"
    else
        echo "LAB-RESULT PASS"
    fi
    sync
    # Let the UART drain before the machine goes away.
    sleep 1
    poweroff -f
    sleep 60
}
