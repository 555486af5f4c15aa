"""
vmhost_events: a Salt **minion** engine that subscribes to the local vmhostd's VM status events
(``events.subscribe`` on its Unix socket) and forwards each one to the master's event bus with
``event.send`` under the tag ``vmhost/<minion id>/<vm>/<status>``.

The master cannot reach a minion's Unix socket; this engine is the bridge. Single file, Python
stdlib plus salt only, usable from the installed extension or ``salt://_engines/``. See
docs/salt-engine.md.

Minion config::

    vmhost.socket: /run/vmhost/vmhostd.sock   # or pillar vmhost:socket, or the engine's socket
    engines:
      - vmhost_events: {}
"""

import json
import logging
import re
import socket
import time

log = logging.getLogger(__name__)

TAG_PREFIX = "vmhost"
HYPERVISOR_TAG = "_hypervisor"
DEFAULT_SOCKET = "/run/vmhost/vmhostd.sock"
# Longest line read from the daemon (its own limit for a line is 1 MiB; events are tiny).
MAX_LINE = 1024 * 1024
TAG_PART_RE = re.compile(r"[^A-Za-z0-9._-]")
# vmhostd's VM name rule: 1-63 characters, first [a-z0-9], then [a-z0-9_-].
VM_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
STATUS_RE = re.compile(r"^[a-z_]{1,32}$")
# A host interface name as vmhostd accepts one (1-15 printable characters, no / or :).
IFNAME_RE = re.compile(r"^[!-.0-9;-~]{1,15}$")

__virtualname__ = "vmhost_events"


def __virtual__():
    return True


def tag_part(value):
    """One tag component: characters outside ``[A-Za-z0-9._-]`` become ``_``, at most 64."""
    text = TAG_PART_RE.sub("_", str(value))[:64]
    if text in ("", ".", ".."):
        text = "_"
    return text


def build_tag(hypervisor, vm, status):
    """``vmhost/<hypervisor>/<vm>/<status>``."""
    return "/".join((TAG_PREFIX, tag_part(hypervisor), tag_part(vm), tag_part(status)))


def event_to_tag_data(hypervisor, message):
    """Turns one line from the daemon into ``(tag, data)``, or None when it is not a VM event
    (answers, other notifications, malformed events). A removed VM (``to: null``) gets the
    status ``destroyed``."""
    if not isinstance(message, dict) or message.get("method") != "events.event":
        return None
    params = message.get("params")
    event = params.get("result") if isinstance(params, dict) else None
    if not isinstance(event, dict):
        return None
    vm, to, frm = event.get("vm"), event.get("to"), event.get("from")
    if not isinstance(vm, str) or not VM_NAME_RE.match(vm):
        return None
    if to is not None and (not isinstance(to, str) or not STATUS_RE.match(to)):
        return None
    if frm is not None and (not isinstance(frm, str) or not STATUS_RE.match(frm)):
        return None
    status = "destroyed" if to is None else to
    reason = event.get("reason")
    data = {
        "hypervisor": hypervisor,
        "vm": vm,
        "status": status,
        "from": frm,
        "to": to,
        "reason": reason[:1000] if isinstance(reason, str) else None,
        "time": event.get("time") if isinstance(event.get("time"), str) else None,
        "source": "vmhostd",
    }
    capture = _capture(event.get("capture"))
    if capture is not None:
        data["capture"] = capture
    return build_tag(hypervisor, vm, status), data


def _capture(value):
    """A capture event's ``{nic, source, state}`` (a monitor NIC's source lost or back), or None
    when the event has none or it is not of that shape."""
    if not isinstance(value, dict):
        return None
    nic, source, state = value.get("nic"), value.get("source"), value.get("state")
    if isinstance(nic, bool) or not isinstance(nic, int) or not 0 <= nic < 1024:
        return None
    if not isinstance(source, str) or not IFNAME_RE.match(source) or source in (".", ".."):
        return None
    if not isinstance(state, str) or not STATUS_RE.match(state):
        return None
    return {"nic": nic, "source": source, "state": state}


def socket_path(kwargs, opts, pillar):
    """The daemon socket: the engine's ``socket``, else minion config ``vmhost.socket``, else
    pillar ``vmhost:socket``, else the daemon's default."""
    if kwargs.get("socket"):
        return kwargs["socket"]
    if opts.get("vmhost.socket"):
        return opts["vmhost.socket"]
    nested = opts.get("vmhost")
    if isinstance(nested, dict) and nested.get("socket"):
        return nested["socket"]
    vmhost = (pillar or {}).get("vmhost")
    if isinstance(vmhost, dict) and vmhost.get("socket"):
        return vmhost["socket"]
    return DEFAULT_SOCKET


class Forwarder:
    """Subscribes and forwards until the connection ends. ``send(tag, data)`` puts an event on
    the master bus."""

    def __init__(self, hypervisor, path, send, connect_timeout=10.0):
        self.hypervisor = hypervisor
        self.path = path
        self.send = send
        self.connect_timeout = connect_timeout
        self.forwarded = 0
        self.subscribed = False

    def _send(self, tag, data):
        try:
            self.send(tag, data)
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            log.error("vmhost_events: cannot send %s to the master: %s", tag, exc)

    def run_connection(self):
        """One connection: subscribe, forward events until EOF. Raises OSError/ValueError on
        connection or protocol failure."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.path)
            sock.sendall(b'{"jsonrpc":"2.0","id":"vmhost_events","method":"events.subscribe"}\n')
            stream = sock.makefile("rb")
            subscribed = self.subscribed = False
            while True:
                # Events come whenever a VM changes: no read timeout once subscribed.
                sock.settimeout(None if subscribed else self.connect_timeout)
                line = stream.readline(MAX_LINE + 1)
                if not line:
                    raise ConnectionError("vmhostd closed the connection")
                if len(line) > MAX_LINE:
                    raise ValueError("line from vmhostd longer than 1 MiB")
                try:
                    message = json.loads(line)
                except ValueError:
                    log.warning("vmhost_events: ignoring a line that is not JSON")
                    continue
                if not subscribed and isinstance(message, dict) and message.get("id") == "vmhost_events":
                    if "error" in message:
                        raise ValueError(f"events.subscribe refused: {str(message['error'])[:500]}")
                    subscribed = self.subscribed = True
                    log.info("vmhost_events: subscribed to %s", self.path)
                    self._send(
                        build_tag(self.hypervisor, HYPERVISOR_TAG, "events_connected"),
                        {"hypervisor": self.hypervisor, "socket": self.path, "source": "vmhost_events"},
                    )
                    continue
                if isinstance(message, dict) and message.get("id") is None and "error" in message:
                    # e.g. 1001: the daemon refuses this peer and closes the connection.
                    raise ValueError(f"vmhostd refused the connection: {str(message['error'])[:500]}")
                item = event_to_tag_data(self.hypervisor, message)
                if item is None:
                    continue
                self._send(*item)
                self.forwarded += 1
        finally:
            sock.close()


def start(**kwargs):
    """Engine entry point (salt calls it in its own process on the minion)."""
    opts = __opts__  # noqa: F821  pylint: disable=undefined-variable
    pillar = opts.get("pillar") or {}
    path = socket_path(kwargs, opts, pillar)
    hypervisor = opts["id"]
    send_fn = __salt__["event.send"]  # noqa: F821  pylint: disable=undefined-variable
    forwarder = Forwarder(hypervisor, path, lambda tag, data: send_fn(tag, data))
    backoff, max_backoff = 1.0, float(kwargs.get("max_backoff", 30))
    reported = False
    while True:
        try:
            forwarder.run_connection()
            error = "connection ended"
        except (OSError, ValueError) as exc:
            error = str(exc)
        if forwarder.subscribed:
            # The connection worked: report its loss once and retry quickly.
            backoff, reported = 1.0, False
        if not reported:
            log.warning("vmhost_events: %s: %s; reconnecting", path, error)
            forwarder._send(  # pylint: disable=protected-access
                build_tag(hypervisor, HYPERVISOR_TAG, "events_lost"),
                {"hypervisor": hypervisor, "socket": path, "error": error[:500], "source": "vmhost_events"},
            )
            reported = True
        time.sleep(backoff)
        backoff = min(backoff * 2, max_backoff)
