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

``image_import`` waits ``vmhost:timeout`` plus its ``timeout_s`` (the daemon's default for a
download, 3600, when it is not given).

A daemon error raises ``CommandExecutionError`` (the subclass ``VmhostdError``, with ``code``,
``kind``, ``field`` and ``details``) whose message reads
``vmhostd error 2001 (spec.nics[0].ipv4.address): ...``.
"""

import json
import os
import socket
import time

from salt.exceptions import CommandExecutionError

__virtualname__ = "vmhost"
__func_alias__ = {"list_": "list"}

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
    ``guest_interfaces`` live, and change an existing VM whose spec differs **in place, keeping
    its disk** (CPUs, memory, role, devices, NICs, kernel/initrd/cmdline, a larger disk). A
    running VM restarts for such a change (ACPI power-off, killed after ``timeout_s`` seconds, at
    most 3600, then started with the new spec) unless ``restart=False``, which only records the
    change for its next start (the VM view shows ``pending_restart: true``). Only a change of
    ``boot.image`` needs ``replace=True``, which recreates the VM with a new disk (**the old disk
    overlay is deleted**); without it vmhostd refuses with 2002. Returns ``{changed, vm}``.

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
