"""Unit tests of the vmhost_events minion engine: event -> (tag, data), and a real Unix socket
that plays vmhostd's events.subscribe."""

import json
import logging
import os
import socket
import tempfile
import threading
import unittest

from vmhost_fakes import load_engine

ev = load_engine("vmhost_events")
# The failures these tests provoke are logged on purpose; keep the test output readable.
ev.log.setLevel(logging.CRITICAL)


def note(vm, frm, to, reason="vm.create"):
    return {
        "jsonrpc": "2.0",
        "method": "events.event",
        "params": {
            "subscription": 7,
            "result": {"vm": vm, "from": frm, "to": to, "reason": reason, "time": "2026-12-02T11:38:44Z"},
        },
    }


class MappingTest(unittest.TestCase):
    def test_event_to_tag_data(self):
        tag, data = ev.event_to_tag_data("hv1", note("sensor1-sensor", "creating", "running"))
        self.assertEqual(tag, "vmhost/hv1/sensor1-sensor/running")
        self.assertEqual(
            data,
            {
                "hypervisor": "hv1",
                "vm": "sensor1-sensor",
                "status": "running",
                "from": "creating",
                "to": "running",
                "reason": "vm.create",
                "time": "2026-12-02T11:38:44Z",
                "source": "vmhostd",
            },
        )
        tag, data = ev.event_to_tag_data("hv1", note("x", "destroying", None, "destroyed"))
        self.assertEqual(tag, "vmhost/hv1/x/destroyed")
        self.assertIsNone(data["to"])

    def test_a_capture_change_is_forwarded_when_well_formed(self):
        msg = note("s1_sensor", "running", "running", "capture source eth1 lost")
        msg["params"]["result"]["capture"] = {"nic": 1, "source": "eth1", "state": "source_missing"}
        tag, data = ev.event_to_tag_data("hv1", msg)
        self.assertEqual(tag, "vmhost/hv1/s1_sensor/running")
        self.assertEqual(
            (data["reason"], data["capture"]),
            ("capture source eth1 lost", {"nic": 1, "source": "eth1", "state": "source_missing"}),
        )
        self.assertNotIn("capture", ev.event_to_tag_data("hv1", note("s1_sensor", "creating", "running"))[1])
        for bad in (
            "eth1",
            {"nic": "1", "source": "eth1", "state": "attached"},
            {"nic": True, "source": "eth1", "state": "attached"},
            {"nic": -1, "source": "eth1", "state": "attached"},
            {"nic": 0, "source": "../x", "state": "attached"},
            {"nic": 0, "source": "a" * 16, "state": "attached"},
            {"nic": 0, "source": "eth 1", "state": "attached"},
            {"nic": 0, "source": "eth1", "state": "Lost/x"},
        ):
            msg["params"]["result"]["capture"] = bad
            with self.subTest(bad=bad):
                tag, data = ev.event_to_tag_data("hv1", msg)
                self.assertNotIn("capture", data, "a malformed capture member is left out, the event kept")

    def test_rejects_what_is_not_an_event(self):
        for msg in (
            {"jsonrpc": "2.0", "id": 1, "result": 5},
            {"jsonrpc": "2.0", "method": "other", "params": {}},
            note("Bad_Name", None, "creating"),
            note("../../x", None, "creating"),
            note("ok", None, "run/ning"),
            note("ok", 5, "running"),
            {"jsonrpc": "2.0", "method": "events.event", "params": "x"},
            [],
        ):
            with self.subTest(msg=msg):
                self.assertIsNone(ev.event_to_tag_data("hv1", msg))

    def test_socket_path(self):
        self.assertEqual(ev.socket_path({"socket": "/a"}, {"vmhost.socket": "/b"}, {}), "/a")
        self.assertEqual(ev.socket_path({}, {"vmhost.socket": "/b"}, {"vmhost": {"socket": "/c"}}), "/b")
        self.assertEqual(ev.socket_path({}, {"vmhost": {"socket": "/n"}}, {"vmhost": {"socket": "/c"}}), "/n")
        self.assertEqual(ev.socket_path({}, {}, {"vmhost": {"socket": "/c"}}), "/c")
        self.assertEqual(ev.socket_path({}, {}, {}), "/run/vmhost/vmhostd.sock")


class FakeDaemon:
    """Answers events.subscribe on a Unix socket, then sends the given lines and closes."""

    def __init__(self, path, lines, answer=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.lines = lines
        self.answer = answer
        self.request = None
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.sock.accept()
        with conn:
            f = conn.makefile("rb")
            self.request = json.loads(f.readline())
            answer = self.answer or {"jsonrpc": "2.0", "id": self.request["id"], "result": 7}
            conn.sendall(json.dumps(answer).encode() + b"\n")
            for line in self.lines:
                conn.sendall(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n")
        self.sock.close()


class ForwarderTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.path = os.path.join(self.tmp.name, "d.sock")
        self.sent = []

    def test_forwards_events_until_eof(self):
        daemon = FakeDaemon(
            self.path,
            [
                note("a", None, "creating"),
                b"not json\n",
                {"jsonrpc": "2.0", "method": "something.else"},
                note("a", "creating", "running"),
                note("a", "destroying", None, "destroyed"),
            ],
        )
        fwd = ev.Forwarder("hv1", self.path, lambda tag, data: self.sent.append((tag, data)), connect_timeout=5)
        with self.assertRaises(ConnectionError):
            fwd.run_connection()
        daemon.thread.join(5)
        self.assertEqual(daemon.request["method"], "events.subscribe")
        self.assertEqual(
            [t for t, _ in self.sent],
            [
                "vmhost/hv1/_hypervisor/events_connected",
                "vmhost/hv1/a/creating",
                "vmhost/hv1/a/running",
                "vmhost/hv1/a/destroyed",
            ],
        )
        self.assertTrue(fwd.subscribed)
        self.assertEqual(fwd.forwarded, 3)

    def test_refused_subscription(self):
        err = {"code": 1001, "message": "uid 65534 may not use this socket", "data": {"kind": "unauthorized"}}
        FakeDaemon(self.path, [], answer={"jsonrpc": "2.0", "id": None, "error": err})
        fwd = ev.Forwarder("hv1", self.path, lambda tag, data: self.sent.append((tag, data)), connect_timeout=5)
        with self.assertRaises(ValueError) as ctx:
            fwd.run_connection()
        self.assertIn("may not use this socket", str(ctx.exception))
        self.assertFalse(fwd.subscribed)
        self.assertEqual(self.sent, [])

    def test_send_failure_does_not_stop_forwarding(self):
        FakeDaemon(self.path, [note("a", None, "creating"), note("b", None, "creating")])
        calls = []

        def send(tag, data):
            calls.append(tag)
            if tag.endswith("/a/creating"):
                raise RuntimeError("master unreachable")

        fwd = ev.Forwarder("hv1", self.path, send, connect_timeout=5)
        with self.assertRaises(ConnectionError):
            fwd.run_connection()
        self.assertEqual(calls[-1], "vmhost/hv1/b/creating")

    def test_no_daemon(self):
        fwd = ev.Forwarder("hv1", self.path, lambda tag, data: None, connect_timeout=1)
        with self.assertRaises(OSError):
            fwd.run_connection()


if __name__ == "__main__":
    unittest.main()
