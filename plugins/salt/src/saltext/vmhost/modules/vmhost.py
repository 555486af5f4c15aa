"""
Execution module for vmhost: drive the local vmhostd over its JSON-RPC socket.

Why it exists: Salt is one of the ways operators declare the VMs of a hypervisor. vmhostd does
all the work (validation against the hardware model, capacity, QEMU, rollback); this module is
only a thin, dependable client of its API (docs/api.md) so that Salt states, the Salt engine and
people at the command line can call it. It is one file using the Python standard library only,
so it can be dropped into ``salt://_modules/`` as well as installed as the ``saltext.vmhost``
extension.

Configuration (minion config, grains or pillar, read with ``config.get``):

``vmhost:socket`` (or ``vmhost.socket``)
    vmhostd's socket, default ``/run/vmhost/vmhostd.sock``.
``vmhost:timeout`` (or ``vmhost.timeout``)
    seconds to wait for an answer, default 120; ``apply``, ``stop`` and ``restart`` add their
    ``timeout_s``.
``vmhost:reconcile_timeout`` (or ``vmhost.reconcile_timeout``)
    seconds to wait for a ``reconcile`` that is not a dry run, default 900.
``vmhost:move_timeout`` (or ``vmhost.move_timeout``)
    seconds to wait for a ``move`` (whole disk files travel), default 21600; ``migrate`` waits
    ``vmhost:timeout`` plus its ``timeout_s`` (3600 when not given).
``vmhost:import_timeout`` (or ``vmhost.import_timeout``)
    seconds to wait for an ``import`` or a ``backups_prune`` (whole disk files are copied and
    hashed), default 21600;
    ``snapshot``, ``revert``, ``snapshot_delete`` and ``export`` wait ``vmhost:timeout`` plus their ``timeout_s``
    (3600, the daemon's default, when not given).

``image_import`` waits ``vmhost:timeout`` plus its ``timeout_s`` (the daemon's default for a
download, 3600, when it is not given); ``guest_exec`` waits ``vmhost:timeout`` plus its
``timeout_s``.

``snapshot``, ``snapshots``, ``revert``, ``snapshot_delete``, ``export``, ``import`` and
``backups_prune`` are the daemon's snapshot and backup methods (``vm.snapshot`` ...
``vm.import``, ``vm.backups_prune``); their params go
through as given (a param this module does not know, such as one a newer vmhostd added, is
sent as is and vmhostd accepts or refuses it), so every rule stays the daemon's.

``guest_exec``, ``guest_file_push`` and ``guest_file_pull`` reach into the guest as root
through vmhostd (``vm.exec``, ``vm.file_push``, ``vm.file_pull``; off unless the host's
``[agent] allow_exec`` is true). Every rule (limits, who may, what is logged) is the daemon's;
these functions only shape the request. With ``test=True`` (or a ``test`` run) they return the
request they would send and send nothing.

A daemon error raises ``CommandExecutionError`` (the subclass ``VmhostdError``, with ``code``,
``kind``, ``field`` and ``details``) whose message reads
``vmhostd error 2001 (spec.nics[0].ipv4.address): ...``.
"""

import base64
import binascii
import hashlib
import json
import os
import socket
import time

from salt.exceptions import CommandExecutionError

__virtualname__ = "vmhost"
__func_alias__ = {"list_": "list", "import_": "import"}

DEFAULT_SOCKET = "/run/vmhost/vmhostd.sock"
DEFAULT_TIMEOUT = 120
DEFAULT_RECONCILE_TIMEOUT = 900
# vmhostd's own default for image.import's timeout_s (the longest a download may take).
DEFAULT_IMPORT_TIMEOUT_S = 3600
# Longest reply line accepted. The daemon's replies are far smaller; a longer line means
# something other than vmhostd is on the socket, and reading it unbounded could exhaust memory.
MAX_REPLY_BYTES = 16 * 1024 * 1024


def __virtual__():
    return __virtualname__


class VmhostdError(CommandExecutionError):
    """An error answer from vmhostd (docs/api.md, "Errors")."""

    def __init__(self, error):
        data = error.get("data") if isinstance(error.get("data"), dict) else {}
        self.code = error.get("code")
        self.daemon_message = str(error.get("message", ""))
        self.kind = data.get("kind")
        self.field = data.get("field")
        self.details = data.get("details")
        text = f"vmhostd error {self.code}"
        if self.field:
            text += f" ({self.field})"
        text += f": {self.daemon_message}"
        if self.details:
            text += f" [details: {json.dumps(self.details, sort_keys=True)}]"
        super().__init__(text)


def _option(key, default):
    value = __salt__["config.get"](f"vmhost:{key}")
    if value in (None, ""):
        value = __salt__["config.get"](f"vmhost.{key}")
    return default if value in (None, "") else value


def _call(method, params=None, timeout=None):
    """Sends one request on a fresh connection and returns its result (or raises)."""
    path = str(_option("socket", DEFAULT_SOCKET))
    if timeout is None:
        timeout = float(_option("timeout", DEFAULT_TIMEOUT))
    request_id = f"salt-{os.getpid()}-{os.urandom(6).hex()}"
    request = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params or {}}
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise CommandExecutionError(
                f"cannot connect to vmhostd: no socket at {path} (is vmhostd running? "
                "set vmhost:socket if it listens elsewhere)"
            ) from None
        except ConnectionRefusedError:
            raise CommandExecutionError(
                f"cannot connect to vmhostd at {path}: connection refused (vmhostd is not running)"
            ) from None
        except OSError as exc:
            raise CommandExecutionError(f"cannot connect to vmhostd at {path}: {exc.strerror or exc}") from None
        try:
            try:
                sock.sendall(json.dumps(request).encode() + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # vmhostd may have refused us at accept (1001) and closed: read its line
            return _read_reply(sock, request_id, deadline)
        except TimeoutError:
            raise CommandExecutionError(f"vmhostd did not answer {method} within {timeout:g} s") from None
        except OSError as exc:
            raise CommandExecutionError(f"connection to vmhostd at {path} failed: {exc.strerror or exc}") from None


def _read_reply(sock, request_id, deadline):
    """Reads lines until the answer to `request_id`; bounded in size and time."""
    buf = bytearray()
    while True:
        end = buf.find(b"\n")
        while end < 0:
            if len(buf) > MAX_REPLY_BYTES:
                raise CommandExecutionError(f"vmhostd sent a reply line longer than {MAX_REPLY_BYTES} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = sock.recv(min(65536, MAX_REPLY_BYTES + 1 - len(buf)))
            if not chunk:
                raise CommandExecutionError("vmhostd closed the connection without answering")
            end = chunk.find(b"\n")
            if end >= 0:
                end += len(buf)
            buf += chunk
        # buf never exceeds the cap + 1 bytes, so neither does the line
        line = bytes(buf[:end])
        del buf[: end + 1]
        if not line.strip():
            continue
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise CommandExecutionError(f"undecodable reply from vmhostd: {exc}") from None
        if not isinstance(reply, dict):
            raise CommandExecutionError("undecodable reply from vmhostd: not a JSON object")
        if "id" not in reply:
            continue  # a notification, not an answer
        if reply["id"] is None and isinstance(reply.get("error"), dict):
            raise VmhostdError(reply["error"])  # e.g. 1001 at accept
        if reply["id"] != request_id:
            raise CommandExecutionError(f"vmhostd answered request id {reply['id']!r}, expected {request_id!r}")
        if isinstance(reply.get("error"), dict):
            raise VmhostdError(reply["error"])
        if "result" not in reply:
            raise CommandExecutionError("undecodable reply from vmhostd: neither result nor error")
        return reply["result"]


def _spec(spec):
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise CommandExecutionError(f"spec is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise CommandExecutionError("spec must be a dict (a VM spec, see docs/api.md)")
    return spec


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _flag(value, name):
    """A boolean argument. Text is read as YAML would (``"False"`` is false, never truthy), so a
    quoted ``replace: "False"`` cannot turn into a replace that deletes a disk."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise CommandExecutionError(f"{name} must be True or False, not {value!r}")


def _timeout_s(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CommandExecutionError(f"timeout_s must be an integer, not {value!r}") from None


def info():
    """
    Host capacity, accelerator, hardware model with holders, networks (``host.info``).

    CLI Example: ``salt '*' vmhost.info``
    """
    return _call("host.info")


def check_host():
    """
    Preflight report ``{ok, items}``: can this host run VMs as configured (``host.check``).

    CLI Example: ``salt '*' vmhost.check_host``
    """
    return _call("host.check")


def list_():
    """
    Every VM as a VM view, ordered by name (``vm.list``).

    CLI Example: ``salt '*' vmhost.list``
    """
    return _call("vm.list")


def get(name):
    """
    One VM view (``vm.get``); error 4040 when there is no such VM.

    CLI Example: ``salt '*' vmhost.get sensor1``
    """
    return _call("vm.get", {"name": name})


def apply(spec, replace=False, restart=True, timeout_s=30):
    """
    Make one VM so (``vm.apply``): create it, converge its run state to ``spec.state``, apply
    ``guest_interfaces`` and ``ssh`` live, and change an existing VM whose spec differs **in place, keeping
    its disk** (CPUs, memory, role, devices, NICs, kernel/initrd/cmdline, a larger disk). A
    running VM restarts for such a change (ACPI power-off, killed after ``timeout_s`` seconds, at
    most 3600, then started with the new spec) unless ``restart=False``, which only records the
    change for its next start (the VM view shows ``pending_restart: true``). Only a change of
    ``boot.image`` needs ``replace=True``, which recreates the VM with a new disk (**the old disk
    overlay is deleted**); without it vmhostd refuses with 2002. The placement members
    (``cpu_policy``, ``numa``, ``hugepages``, ``emulator_cpu``, a NIC's ``queues``) are spec
    members like the others, sent as given and checked by vmhostd (3001 when the host cannot
    give them at all, 3002 when too little is free now). So are a NIC's capture and trunk
    members (``mode: monitor`` with ``source`` and ``direction``, ``vlans``, ``trunk``): a
    monitor NIC gets copies of a host interface's frames and sends nothing (docs/capture.md);
    vmhostd refuses a source its ``[capture] interfaces`` does not list, or that is not on the
    host, with 3001 on ``spec.nics[N].source``. A change of them restarts. Returns
    ``{changed, vm}``.

    CLI Example: ``salt '*' vmhost.apply '{"name": "web", "cpu": 1, ...}' timeout_s=60``
    """
    timeout_s = _timeout_s(timeout_s)
    params = {
        "spec": _spec(spec),
        "replace": _flag(replace, "replace"),
        "restart": _flag(restart, "restart"),
        "timeout_s": timeout_s,
    }
    # A restart waits for the guest's power-off (timeout_s) on top of the usual answer time.
    return _call("vm.apply", params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + max(timeout_s, 0))


def start(name):
    """
    Start a VM (``vm.start``). Returns ``{changed, vm}``.

    CLI Example: ``salt '*' vmhost.start sensor1``
    """
    return _call("vm.start", {"name": name})


def stop(name, timeout_s=30, force=False):
    """
    Stop a VM (``vm.stop``): ACPI power-off, killed after ``timeout_s`` (at most 3600), or at
    once with ``force=True``. Returns ``{changed, vm}``.

    CLI Example: ``salt '*' vmhost.stop sensor1 timeout_s=60``
    """
    timeout_s = _timeout_s(timeout_s)
    params = {"name": name, "timeout_s": timeout_s, "force": _flag(force, "force")}
    return _call("vm.stop", params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + max(timeout_s, 0))


def restart(name, timeout_s=30, force=False):
    """
    Stop then start a VM as one operation (``vm.restart``). Returns ``{changed, vm}``.

    CLI Example: ``salt '*' vmhost.restart sensor1 force=True``
    """
    timeout_s = _timeout_s(timeout_s)
    params = {"name": name, "timeout_s": timeout_s, "force": _flag(force, "force")}
    return _call("vm.restart", params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + max(timeout_s, 0) + 60)


def destroy(name):
    """
    Destroy a VM (``vm.destroy``): QEMU killed, disk overlay and record removed. Returns
    ``{changed: true, vm: null}``; error 4040 when there is no such VM.

    CLI Example: ``salt '*' vmhost.destroy sensor1``
    """
    return _call("vm.destroy", {"name": name})


def reconcile(vms, prune=False, dry_run=False, replace=False):
    """
    Converge the host to a whole desired set of VMs (``host.reconcile``), or with
    ``dry_run=True`` only plan and validate it. ``prune=True`` destroys VMs not in ``vms``. A VM
    whose spec differs is changed in place, keeping its disk (plan action ``reconfigure``); one
    whose ``boot.image`` differs is recreated with a new disk (``replace``, the old disk deleted)
    only with ``replace=True``, else its plan entry carries error 2002 and it is left alone.
    Returns the daemon's report ``{dry_run, plan, results, ok}`` unchanged; failures of single
    VMs are inside it, not raised.

    CLI Example: ``salt '*' vmhost.reconcile '[{"name": "web", ...}]' dry_run=True``
    """
    if isinstance(vms, str):
        try:
            vms = json.loads(vms)
        except ValueError as exc:
            raise CommandExecutionError(f"vms is not JSON: {exc}") from None
    if isinstance(vms, dict) and "vms" in vms:
        vms = vms["vms"]
    if not isinstance(vms, list):
        raise CommandExecutionError("vms must be a list of VM specs")
    params = {
        "vms": [_spec(s) for s in vms],
        "prune": _flag(prune, "prune"),
        "dry_run": _flag(dry_run, "dry_run"),
        "replace": _flag(replace, "replace"),
    }
    timeout = None if params["dry_run"] else float(_option("reconcile_timeout", DEFAULT_RECONCILE_TIMEOUT))
    return _call("host.reconcile", params, timeout=timeout)


def check(name):
    """
    Is the guest's network what the spec declares (``vm.check``, through the guest agent)?
    Returns ``{ok, checks}``; a failing check is ``ok: false``, not an error.

    CLI Example: ``salt '*' vmhost.check sensor1``
    """
    return _call("vm.check", {"name": name})


def guest_info(name):
    """
    The guest agent's ``agent.info`` (``vm.guest_info``).

    CLI Example: ``salt '*' vmhost.guest_info sensor1``
    """
    return _call("vm.guest_info", {"name": name})


def guest_network(name):
    """
    The guest's interfaces, routes and DNS as its agent sees them (``vm.guest_network``).

    CLI Example: ``salt '*' vmhost.guest_network sensor1``
    """
    return _call("vm.guest_network", {"name": name})


def stats(name=None):
    """
    Counters of one VM, or of every VM when ``name`` is not given (``vm.stats``): CPU seconds
    of QEMU and of each vCPU, RSS, per-disk and per-NIC counters, uptime, restarts, with a
    ``timestamp_ms``; rates are the difference of two calls. A part that could not be read is
    named in the VM's ``missing``.

    CLI Example: ``salt '*' vmhost.stats`` or ``salt '*' vmhost.stats sensor1``
    """
    return _call("vm.stats", {} if name is None else {"name": name})


def image_list():
    """
    Every image in vmhostd's images directory (``image.list``): ``name``, ``bytes``,
    ``format``, ``virtual_size``, the ``sha256`` it was imported with (``None`` for a file put
    there by hand, without a record), ``source``, ``imported_at`` and ``used_by`` (the VMs that
    boot from it).

    CLI Example: ``salt '*' vmhost.image_list``
    """
    return _call("image.list")


def image_import(name, sha256, source=None, timeout_s=None):
    """
    Put an image into vmhostd's images directory, verified by its sha256 (``image.import``).

    name
        the image's file name there (what a VM's ``boot.image`` names).
    sha256
        the sha256 the image must have (64 hex digits). A copy with another one is refused with
        2003 and nothing is kept.
    source
        an ``http://`` or ``https://`` URL, or a file in vmhostd's import directory
        (``paths.import``: its name, or its absolute path there). Not given: the file is already
        in the images directory (put there by hand) and is hashed and recorded where it is.
    timeout_s
        the longest a download may take, in seconds (the daemon's default: 3600). The call
        waits that long on top of ``vmhost:timeout``.

    Returns ``{changed, image}``; ``changed`` is False when the image is there with that sha256
    already. An image of that name with another sha256 is never replaced (error 4093: delete it
    first).

    CLI Example: ``salt '*' vmhost.image_import base.qcow2 6a3f...e1 source=https://example.org/base.qcow2``
    """
    params = {"name": name, "sha256": sha256}
    if source not in (None, ""):
        params["source"] = source
    wait = DEFAULT_IMPORT_TIMEOUT_S
    if timeout_s not in (None, ""):
        params["timeout_s"] = _timeout_s(timeout_s)
        wait = max(params["timeout_s"], 0)
    # A download (or the copy and hash of a large file) may take long: wait for the daemon's
    # own limit on top of the usual answer time.
    return _call("image.import", params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + wait)


def image_delete(name):
    """
    Delete an image from vmhostd's images directory, with its record (``image.delete``).
    Returns ``{changed, name}`` (``changed`` False when there was no such image); error 4092
    (``details.vms``) while VMs boot from it.

    CLI Example: ``salt '*' vmhost.image_delete old-base.qcow2``
    """
    return _call("image.delete", {"name": name})


# vm.migrate's own default for timeout_s (the longest a whole migration may take).
DEFAULT_MIGRATE_TIMEOUT_S = 3600
# How long vmhost.move waits for vm.move by default (vm.move has no timeout of its own: it
# streams whole disk files).
DEFAULT_MOVE_TIMEOUT = 6 * 3600


def _optional_int(params, key, value):
    if value not in (None, ""):
        params[key] = _int_arg(value, key)


def _int_arg(value, name):
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise CommandExecutionError(f"{name} must be an integer, not {value!r}") from None
    if number < 0:
        raise CommandExecutionError(f"{name} must not be negative, not {number}")
    return number


def migrate_in(spec, mode="live"):
    """
    Prepare this host to receive a VM from another vmhostd (``vm.migrate_in``): the spec is
    validated and admitted as a create would be, NICs and disks are made (``live``: QEMU waits
    for the incoming stream) and the answer says where the source sends and with which one-time
    secret.

    spec
        the VM as the source runs it (its ``vm.get`` spec), every bridge NIC's ``mac`` set to
        the MAC the source gave it.
    mode
        ``live`` (default; the source then calls ``vmhost.migrate``) or ``cold`` (the source
        calls ``vmhost.move``).

    Returns ``{name, address, secret, expires_in_s}``: the source must connect within
    ``expires_in_s`` seconds, or the destination removes what it prepared. The secret is good
    for this one migration; it is in the job's return (and the master's job cache) until then.

    CLI Example: ``salt hv2 vmhost.migrate_in '{"name": "web", ...}'``
    """
    if mode not in ("live", "cold"):
        raise CommandExecutionError(f"mode must be live or cold, not {mode!r}")
    return _call("vm.migrate_in", {"spec": _spec(spec), "mode": mode})


def migrate(name, destination, secret, max_downtime_ms=None, bandwidth_mib_s=None, timeout_s=None):
    """
    Send a running VM to a destination prepared with ``vmhost.migrate_in`` (``vm.migrate``):
    its disks are mirrored, then its memory, then the guest switches over; until the
    destination confirms, the guest keeps running here.

    name
        the VM.
    destination, secret
        ``address`` and ``secret`` of the destination's ``vmhost.migrate_in``.
    max_downtime_ms
        longest pause of the guest at the switch-over (the daemon's default: 300).
    bandwidth_mib_s
        cap of the memory stream in MiB/s (default: none).
    timeout_s
        longest the whole migration may take (the daemon's default: 3600); then it is
        cancelled and the guest keeps running here. The call waits that long plus
        ``vmhost:timeout``.

    Returns ``{name, destination, mode, total_ms, downtime_ms, ram_bytes, disk_bytes}``.
    vmhostd refuses with 4097 (``details.reason``: ``status``, ``passthrough``,
    ``pending_change``) before anything moves.

    CLI Example: ``salt hv1 vmhost.migrate web 10.0.0.2:7070 SECRET``
    """
    params = {"name": name, "destination": str(destination), "secret": str(secret)}
    _optional_int(params, "max_downtime_ms", max_downtime_ms)
    _optional_int(params, "bandwidth_mib_s", bandwidth_mib_s)
    _optional_int(params, "timeout_s", timeout_s)
    wait = params.get("timeout_s", DEFAULT_MIGRATE_TIMEOUT_S)
    return _call("vm.migrate", params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + wait)


def move(name, destination, secret, stop=False):
    """
    Move a stopped VM to a destination prepared with ``vmhost.migrate_in`` ``mode=cold``
    (``vm.move``): its spec and disk files are streamed there, each checked by sha256, and the
    VM is removed here only after the destination confirmed (kept data disks stay, as a
    destroy keeps them). With ``stop=True`` a running VM is stopped first and started on the
    destination.

    The call waits ``vmhost:move_timeout`` seconds (default 21600: whole disk files travel).
    Returns ``{name, destination, mode, total_ms, downtime_ms, ram_bytes, disk_bytes}``.

    CLI Example: ``salt hv1 vmhost.move sensor1 10.0.0.2:7070 SECRET stop=True``
    """
    params = {"name": name, "destination": str(destination), "secret": str(secret), "stop": _flag(stop, "stop")}
    return _call("vm.move", params, timeout=float(_option("move_timeout", DEFAULT_MOVE_TIMEOUT)))


def migrate_settle(name, outcome):
    """
    Say what became of a move whose outcome this host could not learn (``vm.migrate_settle``;
    the VM is ``failed`` with its migration ``committing``), after looking at the destination:
    ``committed`` ends the VM here as a destroy does, ``abandoned`` keeps it here. vmhostd asks
    the destination first and refuses (4090) an answer the destination contradicts.

    Returns ``{name, outcome, destination, status}``.

    CLI Example: ``salt hv1 vmhost.migrate_settle sensor1 abandoned``
    """
    if outcome not in ("committed", "abandoned"):
        raise CommandExecutionError("outcome must be committed or abandoned")
    return _call("vm.migrate_settle", {"name": name, "outcome": outcome})


# vm.exec's and vm.file_push's limits (docs/api.md); the daemon checks them again.
MAX_EXEC_STDIN = 1024 * 1024
MAX_PUSH_INLINE = 768 * 1024
# Seconds vmhostd may take past a command's timeout_s before it answers 5002.
EXEC_ANSWER_MARGIN = 10


def _test_mode(test):
    """``test`` when given, else the run's ``test`` option (``salt-call ... test=True``)."""
    if test is not None:
        return _flag(test, "test")
    # Salt injects __opts__ as a dict-like loader context, not a dict.
    opts = globals().get("__opts__")
    return bool(opts.get("test")) if hasattr(opts, "get") else False


def _argv(argv):
    """A command as a list of strings: a list, or JSON text of one. A plain string is refused
    rather than split: there is no shell unless the argv names one (``["sh", "-c", "..."]``)."""
    if isinstance(argv, str):
        try:
            argv = json.loads(argv)
        except ValueError:
            raise CommandExecutionError(
                f"argv must be a list of strings, not the string {argv!r}: no shell is run unless "
                'the list names one, e.g. ["sh", "-c", "..."]'
            ) from None
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise CommandExecutionError("argv must be a non-empty list of strings")
    return list(argv)


def _bytes(value, name):
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise CommandExecutionError(f"{name} must be text or bytes")


def _b64(data):
    return base64.b64encode(data).decode("ascii")


def _mode(mode):
    """Permission bits: digits read as octal whatever their type (``644``, ``"0644"``, as
    Salt's file functions read them), at most 7777."""
    text = str(mode).strip()
    text = text[2:] if text.lower().startswith("0o") else text
    try:
        value = int(text, 8)
    except ValueError:
        raise CommandExecutionError(f"mode must be octal permission bits such as 0644, not {mode!r}") from None
    if not 0 <= value <= 0o7777:
        raise CommandExecutionError(f"mode {mode!r} is above 7777")
    return value


def _exit_status(result):
    """The shell's exit status of a vm.exec answer: the code, 128 + signal, 124 at the timeout."""
    if result.get("timed_out"):
        return 124
    if isinstance(result.get("signal"), int):
        return 128 + result["signal"]
    code = result.get("exit_code")
    return code if isinstance(code, int) else 255


def guest_exec(
    name,
    argv,
    env=None,
    cwd=None,
    stdin=None,
    timeout_s=60,
    max_output=None,
    encoding=None,
    test=None,
):
    """
    Run a command as root in the guest (``vm.exec``; needs ``[agent] allow_exec = true`` on the
    host and no ``guest_exec: false`` in the VM's spec). No shell unless ``argv`` names one.

    name
        the VM.
    argv
        the program and its arguments, a list (or JSON text of one); a plain string is refused.
    env
        a list of ``NAME=value`` (or a dict) added to the guest's fixed base environment.
    cwd
        absolute working directory in the guest (default ``/``).
    stdin
        text or bytes for the command's stdin (at most 1 MiB); none: ``/dev/null``.
    timeout_s
        seconds the command may run (1-86400, default 60); then its process group is killed
        and the answer says ``timed_out: true``. The call waits that long plus
        ``vmhost:timeout``.
    max_output
        bytes kept per stream (daemon default 1 MiB, at most 4 MiB); ``*_truncated`` says when
        more was written.
    encoding
        ``text`` (the daemon's default: output as UTF-8, invalid bytes replaced) or ``base64``.
    test
        True: return ``{"test": true, "method": "vm.exec", "params": ...}`` (stdin as its
        length) and run nothing. Default: the run's ``test`` option.

    Returns the daemon's answer ``{exit_code, signal, timed_out, duration_ms, stdout, stderr,
    stdout_bytes, stderr_bytes, stdout_truncated, stderr_truncated, encoding, slot}``; a command
    that fails is an answer, not an error, and sets the job's retcode to its exit status
    (128 + signal, 124 at the timeout). vmhostd's refusals raise: 4095 exec off (``details.reason``
    ``host`` or ``spec``), 4096 all 8 slots busy, 5001 no exec server in the guest.

    CLI Example: ``salt 'hv1' vmhost.guest_exec sensor1 '["systemctl", "is-active", "salt-minion"]'``
    """
    params = {"name": name, "argv": _argv(argv), "timeout_s": _timeout_s(timeout_s)}
    if env not in (None, ""):
        if isinstance(env, dict):
            env = [f"{k}={v}" for k, v in env.items()]
        if not isinstance(env, (list, tuple)) or not all(isinstance(e, str) for e in env):
            raise CommandExecutionError("env must be a list of NAME=value strings (or a dict)")
        params["env"] = list(env)
    if cwd not in (None, ""):
        params["cwd"] = cwd
    data = None
    if stdin is not None:
        data = _bytes(stdin, "stdin")
        if len(data) > MAX_EXEC_STDIN:
            raise CommandExecutionError(f"stdin is {len(data)} bytes, above vm.exec's {MAX_EXEC_STDIN}")
        params["stdin"] = _b64(data)
    if max_output not in (None, ""):
        params["max_output"] = _timeout_s(max_output)
    if encoding not in (None, ""):
        if encoding not in ("text", "base64"):
            raise CommandExecutionError(f"encoding must be text or base64, not {encoding!r}")
        params["encoding"] = encoding
    if _test_mode(test):
        shown = dict(params)
        if data is not None:
            shown["stdin"] = f"<{len(data)} bytes>"
        return {"test": True, "method": "vm.exec", "params": shown}
    wait = float(_option("timeout", DEFAULT_TIMEOUT)) + max(params["timeout_s"], 0) + EXEC_ANSWER_MARGIN
    result = _call("vm.exec", params, timeout=wait)
    # Salt injects __context__ as a dict-like loader context (not a dict); cmd.run sets the
    # job's retcode through it the same way.
    context = globals().get("__context__")
    if isinstance(result, dict) and hasattr(context, "__setitem__"):
        status = _exit_status(result)
        if status:
            context["retcode"] = status
    return result


def guest_file_push(
    name,
    path,
    content=None,
    source=None,
    mode=None,
    owner=None,
    mkdir=False,
    test=None,
):
    """
    Write a file in the guest (``vm.file_push``): atomically (a temp file beside it, renamed
    into place once its sha256 checked), owned by root unless ``owner`` says otherwise. Needs
    ``[agent] allow_exec = true`` on the host.

    name
        the VM.
    path
        absolute path in the guest. Its directory must exist unless ``mkdir=True``.
    content
        text or bytes, at most 768 KiB; sent with its sha256, which vmhostd and the guest check.
    source
        instead of ``content``: a path relative to the host's ``[agent] files_dir``, which
        vmhostd reads itself (up to ``[agent] max_file_mib``).
    mode
        permission bits, digits read as octal (``644`` or ``"0644"``); the daemon's default 0644.
    owner
        ``user[:group]`` in the guest, names or numbers.
    mkdir
        create missing parent directories.
    test
        True: return the request (content as its size and sha256) and send nothing.

    Returns ``{path, size, sha256}``.

    CLI Example: ``salt 'hv1' vmhost.guest_file_push sensor1 /etc/motd content='managed by vmhost'``
    """
    if (content is None) == (source in (None, "")):
        raise CommandExecutionError("give exactly one of content or source")
    params = {"name": name, "path": path, "mkdir": _flag(mkdir, "mkdir")}
    if mode not in (None, ""):
        params["mode"] = _mode(mode)
    if owner not in (None, ""):
        params["owner"] = str(owner)
    data = None
    if content is not None:
        data = _bytes(content, "content")
        if len(data) > MAX_PUSH_INLINE:
            raise CommandExecutionError(
                f"content is {len(data)} bytes, above the {MAX_PUSH_INLINE} vm.file_push takes inline: "
                "put the file in the host's [agent] files_dir and give source"
            )
        params["content"] = _b64(data)
        params["sha256"] = hashlib.sha256(data).hexdigest()
    else:
        params["source"] = source
    if _test_mode(test):
        shown = dict(params)
        if data is not None:
            shown["content"] = f"<{len(data)} bytes>"
        return {"test": True, "method": "vm.file_push", "params": shown}
    return _call("vm.file_push", params)


def guest_file_pull(name, path, max_bytes=None, dest=None, test=None):
    """
    Read a file from the guest (``vm.file_pull``). Needs ``[agent] allow_exec = true`` on the
    host.

    name
        the VM.
    path
        absolute path of a regular file in the guest.
    max_bytes
        refuse a larger file (daemon default 1 MiB, at most 2 MiB; a larger file is error 4001).
    dest
        an absolute path on the minion to write the file to, atomically (temp file, fsync,
        rename), with a new file's mode (0666 less the umask), never the guest's; the answer
        then has no ``content``.
    test
        True: return the request and send nothing.

    Returns ``{path, size, sha256, mode, content}`` (``content`` base64), after checking that
    the content has that size and sha256 (``CommandExecutionError`` otherwise, nothing written).

    CLI Example: ``salt 'hv1' vmhost.guest_file_pull sensor1 /etc/os-release``
    """
    params = {"name": name, "path": path}
    if max_bytes not in (None, ""):
        params["max_bytes"] = _timeout_s(max_bytes)
    if dest not in (None, "") and not os.path.isabs(str(dest)):
        raise CommandExecutionError(f"dest must be an absolute path, not {dest!r}")
    if _test_mode(test):
        return {"test": True, "method": "vm.file_pull", "params": params, "dest": dest}
    result = _call("vm.file_pull", params)
    if not isinstance(result, dict) or not isinstance(result.get("content"), str):
        raise CommandExecutionError("vm.file_pull answered without content")
    try:
        data = base64.b64decode(result["content"], validate=True)
    except (binascii.Error, ValueError):
        raise CommandExecutionError("vm.file_pull's content is not base64") from None
    if result.get("size") != len(data) or result.get("sha256") != hashlib.sha256(data).hexdigest():
        raise CommandExecutionError(
            f"vm.file_pull's content ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}) does not "
            f"match the answer's size {result.get('size')!r} and sha256 {result.get('sha256')!r}: nothing written"
        )
    if dest not in (None, ""):
        _write_atomically(str(dest), data)
        result = {k: v for k, v in result.items() if k != "content"}
        result["dest"] = str(dest)
    return result


def _write_atomically(dest, data):
    """``dest`` replaced by ``data`` whole: a reader sees the old file or the new one."""
    directory = os.path.dirname(dest) or "/"
    tmp = os.path.join(directory, f".{os.path.basename(dest)}.vmhost-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CommandExecutionError(f"cannot write {dest}: {exc.strerror or exc}") from None


# How long vmhost.import waits for vm.import by default (it has no timeout of its own: whole
# disk files are copied out of the backup and hashed).
DEFAULT_BACKUP_IMPORT_TIMEOUT = 6 * 3600
# vm.snapshot's, vm.revert's and vm.export's own default for timeout_s.
DEFAULT_COPY_TIMEOUT_S = 3600


def _passed_through(kwargs):
    """The caller's extra keyword arguments, as params for the daemon. Salt adds its own
    (``__pub_fun``, ``__pub_jid``, ...) to a function that takes ``**kwargs``: those are not
    the caller's and are dropped."""
    return {k: v for k, v in kwargs.items() if not str(k).startswith("__")}


def _copy_call(method, params, test):
    """Sends a snapshot or backup request (or, with ``test``, returns it), waiting
    ``vmhost:timeout`` plus the request's ``timeout_s`` (the daemon's default when not given,
    or when it is not a number: then the daemon refuses it at once)."""
    if _test_mode(test):
        return {"test": True, "method": method, "params": params}
    bound = params.get("timeout_s", DEFAULT_COPY_TIMEOUT_S)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        bound = DEFAULT_COPY_TIMEOUT_S
    return _call(method, params, timeout=float(_option("timeout", DEFAULT_TIMEOUT)) + bound)


def snapshot(name, snapshot, timeout_s=None, requires=None, test=None, **kwargs):
    """
    Keep VM ``name``'s disks as they are now in snapshot ``snapshot`` (``vm.snapshot``; running
    or stopped, docs/snapshots.md).

    name
        the VM.
    snapshot
        the snapshot's name (1-64 of ``A-Z a-z 0-9 . _ -``, not starting with a dot; vmhostd
        checks it).
    timeout_s
        longest the copy may take (the daemon's default: 3600). The call waits that long plus
        ``vmhost:timeout``.
    requires
        ``frozen``: vmhostd refuses (4094 on ``requires``) rather than keep a copy that would be
        crash-consistent.
    test
        True: return ``{"test": true, "method": "vm.snapshot", "params": ...}`` and send
        nothing. Default: the run's ``test`` option.

    Other keyword arguments are sent as params as given (vmhostd refuses one it does not take).
    Returns the daemon's snapshot (``name``, ``created_at``, ``live``, ``consistency``,
    ``reason``, ``frozen``, ``spec``, ``disks``, ...).

    CLI Example: ``salt hv1 vmhost.snapshot sensor1 before-upgrade requires=frozen``
    """
    params = {"name": name, "snapshot": str(snapshot)}
    if timeout_s not in (None, ""):
        params["timeout_s"] = timeout_s
    if requires not in (None, ""):
        params["requires"] = requires
    params.update(_passed_through(kwargs))
    return _copy_call("vm.snapshot", params, test)


def snapshots(name):
    """
    VM ``name``'s snapshots, oldest first, each as ``vmhost.snapshot`` returned it
    (``vm.snapshots``); error 4040 when there is no such VM.

    CLI Example: ``salt hv1 vmhost.snapshots sensor1``
    """
    return _call("vm.snapshots", {"name": name})


def revert(name, snapshot, timeout_s=None, test=None, **kwargs):
    """
    Put VM ``name``'s disks back as they were in snapshot ``snapshot`` (``vm.revert``). The VM
    must not run (vmhostd refuses with 4090: stop it first); it is not started.

    timeout_s
        longest the copy back may take (the daemon's default: 3600). The call waits that long
        plus ``vmhost:timeout``.
    test
        True: return the request and send nothing.

    Other keyword arguments are sent as params as given. Returns the daemon's mutation
    ``{changed, vm}``. Errors: 4040 (no VM; no such snapshot, on ``snapshot``), 4090, 2001 on
    ``snapshot`` (the VM's disks are not the snapshot's), 2003 (a copy is not what the snapshot
    recorded; no disk replaced).

    CLI Example: ``salt hv1 vmhost.revert sensor1 before-upgrade``
    """
    params = {"name": name, "snapshot": str(snapshot)}
    if timeout_s not in (None, ""):
        params["timeout_s"] = timeout_s
    params.update(_passed_through(kwargs))
    return _copy_call("vm.revert", params, test)


def snapshot_delete(name, snapshot, timeout_s=None, test=None, **kwargs):
    """
    Delete snapshot ``snapshot`` of VM ``name`` (``vm.snapshot_delete``). Returns
    ``{changed, snapshot}``; ``changed`` is False when there was no such snapshot.

    timeout_s
        longest deleting the snapshot's internal snapshots from the disks may take (the
        daemon's default: 3600). The call waits that long plus ``vmhost:timeout``.
    test
        True: return the request and send nothing.

    CLI Example: ``salt hv1 vmhost.snapshot_delete sensor1 before-upgrade``
    """
    params = {"name": name, "snapshot": str(snapshot)}
    if timeout_s not in (None, ""):
        params["timeout_s"] = timeout_s
    params.update(_passed_through(kwargs))
    return _copy_call("vm.snapshot_delete", params, test)


def export(name, timeout_s=None, requires=None, test=None, **kwargs):
    """
    Write VM ``name``'s spec and disks to a new backup directory in vmhostd's ``paths.backups``
    (``vm.export``; running or stopped, docs/backup.md).

    timeout_s
        longest the copy may take (the daemon's default: 3600). The call waits that long plus
        ``vmhost:timeout``.
    requires
        ``frozen``: refused (4094) rather than a crash-consistent copy.
    test
        True: return the request and send nothing.

    Other keyword arguments (e.g. the backup options of a newer vmhostd) are sent as params as
    given; vmhostd checks them. Returns ``{backup, path, manifest}``: ``backup`` is what
    ``vmhost.import`` takes.

    CLI Example: ``salt hv1 vmhost.export sensor1 requires=frozen``
    """
    params = {"name": name}
    if timeout_s not in (None, ""):
        params["timeout_s"] = timeout_s
    if requires not in (None, ""):
        params["requires"] = requires
    params.update(_passed_through(kwargs))
    return _copy_call("vm.export", params, test)


def import_(backup, name=None, state=None, test=None, **kwargs):
    """
    Make a VM from backup ``backup`` (a directory name in vmhostd's ``paths.backups``, what
    ``vmhost.export`` returned as ``backup``) (``vm.import``). Called as ``vmhost.import``.

    backup
        the backup directory's name.
    name
        the new VM's name (default: the exported VM's); a VM of that name must not exist (2001
        on ``name``).
    state
        ``running`` or ``stopped`` (default: the exported spec's).
    test
        True: return the request and send nothing.

    Other keyword arguments are sent as params as given. The call waits
    ``vmhost:import_timeout`` seconds (default 21600: whole disk files are copied and hashed).
    Returns ``vm.create``'s mutation ``{changed, vm}``. A file whose sha256 is not the
    manifest's is 2003 on ``backup`` (``details.file``), and nothing is left.

    CLI Example: ``salt hv1 vmhost.import sensor1-20261204T141502Z name=sensor1-copy state=stopped``
    """
    params = {"backup": str(backup)}
    if name not in (None, ""):
        params["name"] = name
    if state not in (None, ""):
        params["state"] = state
    params.update(_passed_through(kwargs))
    if _test_mode(test):
        return {"test": True, "method": "vm.import", "params": params}
    return _call("vm.import", params, timeout=float(_option("import_timeout", DEFAULT_BACKUP_IMPORT_TIMEOUT)))


def backups_prune(name, keep, test=None, **kwargs):
    """
    Keep VM ``name``'s newest ``keep`` backups in vmhostd's ``paths.backups`` and remove the
    others (``vm.backups_prune``; by the backups' manifests, the VM need not exist). A kept
    increment whose parent goes is first merged into a full backup of the same name
    (docs/backup.md).

    name
        the VM whose backups are pruned.
    keep
        how many of its newest backups to keep (at least 1: else 2001 on ``keep``).
    test
        True: return the request and send nothing.

    Other keyword arguments are sent as params as given. The call waits
    ``vmhost:import_timeout`` seconds (default 21600: a merge copies and hashes whole disk
    files). Returns ``{removed, merged, kept}``, backup directories oldest first (``merged``:
    the pairs merged). A chain to merge that does not check is 2003 or 4040 on ``backup``, and
    nothing is removed.

    CLI Example: ``salt hv1 vmhost.backups_prune sensor1 keep=7``
    """
    params = {"name": name, "keep": keep}
    params.update(_passed_through(kwargs))
    if _test_mode(test):
        return {"test": True, "method": "vm.backups_prune", "params": params}
    return _call("vm.backups_prune", params, timeout=float(_option("import_timeout", DEFAULT_BACKUP_IMPORT_TIMEOUT)))
