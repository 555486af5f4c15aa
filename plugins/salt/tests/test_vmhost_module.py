"""The vmhost execution module against a fake vmhostd: requests sent, results, and every error path."""

import os
import socket
import tempfile
import time
import types
import unittest

from salt.exceptions import CommandExecutionError
from vmhost_fakes import FakeVmhostd, answer, config_get, error, load, send

SHA = "ab" * 32


class ModuleTest(unittest.TestCase):
    def start(self, handler=None, on_accept=None, **options):
        self.daemon = FakeVmhostd(handler, on_accept)
        self.addCleanup(self.daemon.close)
        self.mod = self.module(socket=self.daemon.path, **options)
        return self.daemon

    def module(self, **options):
        opts = {f"vmhost:{k}": v for k, v in options.items()}
        return load("modules", {"__salt__": {"config.get": config_get(opts)}})


class Requests(ModuleTest):
    def echo(self, request, conn):
        send(conn, answer(request, {"method": request["method"], "params": request["params"]}))

    def test_each_function_sends_its_method_and_params(self):
        self.start(self.echo)
        spec = {"name": "web", "cpu": 1}
        cases = [
            (self.mod.info, (), "host.info", {}),
            (self.mod.check_host, (), "host.check", {}),
            (self.mod.list_, (), "vm.list", {}),
            (self.mod.get, ("web",), "vm.get", {"name": "web"}),
            (
                self.mod.apply,
                (spec,),
                "vm.apply",
                {"spec": spec, "replace": False, "restart": True, "timeout_s": 30},
            ),
            (
                self.mod.apply,
                ('{"name": "web", "cpu": 1}', True),
                "vm.apply",
                {"spec": spec, "replace": True, "restart": True, "timeout_s": 30},
            ),
            (
                self.mod.apply,
                (spec, "False", "false", "5"),
                "vm.apply",
                {"spec": spec, "replace": False, "restart": False, "timeout_s": 5},
            ),
            (self.mod.start, ("web",), "vm.start", {"name": "web"}),
            (self.mod.stop, ("web",), "vm.stop", {"name": "web", "timeout_s": 30, "force": False}),
            (self.mod.stop, ("web", "5", True), "vm.stop", {"name": "web", "timeout_s": 5, "force": True}),
            (self.mod.restart, ("web", 7), "vm.restart", {"name": "web", "timeout_s": 7, "force": False}),
            (self.mod.destroy, ("web",), "vm.destroy", {"name": "web"}),
            (self.mod.check, ("web",), "vm.check", {"name": "web"}),
            (self.mod.guest_info, ("web",), "vm.guest_info", {"name": "web"}),
            (self.mod.guest_network, ("web",), "vm.guest_network", {"name": "web"}),
            (self.mod.stats, (), "vm.stats", {}),
            (self.mod.stats, ("web",), "vm.stats", {"name": "web"}),
            (
                self.mod.reconcile,
                ([spec],),
                "host.reconcile",
                {"vms": [spec], "prune": False, "dry_run": False, "replace": False},
            ),
            (
                self.mod.reconcile,
                ({"vms": [spec]}, True, True),
                "host.reconcile",
                {"vms": [spec], "prune": True, "dry_run": True, "replace": False},
            ),
            (
                self.mod.reconcile,
                ([spec], False, True, True),
                "host.reconcile",
                {"vms": [spec], "prune": False, "dry_run": True, "replace": True},
            ),
            (self.mod.image_list, (), "image.list", {}),
            (self.mod.image_delete, ("base.raw",), "image.delete", {"name": "base.raw"}),
            (self.mod.image_import, ("base.raw", SHA), "image.import", {"name": "base.raw", "sha256": SHA}),
            (
                self.mod.image_import,
                ("base.raw", SHA, "upload.raw", "60"),
                "image.import",
                {"name": "base.raw", "sha256": SHA, "source": "upload.raw", "timeout_s": 60},
            ),
            (
                self.mod.image_import,
                ("base.raw", SHA, "https://example.org/base.raw"),
                "image.import",
                {"name": "base.raw", "sha256": SHA, "source": "https://example.org/base.raw"},
            ),
        ]
        for fn, args, method, params in cases:
            with self.subTest(method=method, args=args):
                self.assertEqual(fn(*args), {"method": method, "params": params})
        for request in self.daemon.requests:
            self.assertEqual(request["jsonrpc"], "2.0")
        ids = [r["id"] for r in self.daemon.requests]
        self.assertEqual(len(set(ids)), len(ids), "request ids must be unique")

    def test_list_and_import_are_exposed_under_their_names(self):
        self.assertEqual(self.module().__func_alias__, {"list_": "list", "import_": "import"})

    def test_reconcile_returns_the_report_unchanged(self):
        report = {
            "dry_run": False,
            "plan": [{"vm": "a", "action": "create", "reason": "not defined on this host", "error": None}],
            "results": [{"vm": "a", "action": "create", "ok": False, "changed": False, "error": error(3002, "no")}],
            "ok": False,
        }
        self.start(lambda request, conn: send(conn, answer(request, report)))
        self.assertEqual(self.mod.reconcile([{"name": "a"}]), report)

    def test_bad_spec_arguments_are_refused_before_sending(self):
        self.start(self.echo)
        with self.assertRaisesRegex(CommandExecutionError, "spec is not JSON"):
            self.mod.apply("{not json")
        with self.assertRaisesRegex(CommandExecutionError, "spec must be a dict"):
            self.mod.apply(["x"])
        with self.assertRaisesRegex(CommandExecutionError, "vms must be a list"):
            self.mod.reconcile({"name": "a"})
        with self.assertRaisesRegex(CommandExecutionError, "timeout_s must be an integer"):
            self.mod.stop("web", timeout_s="soon")
        with self.assertRaisesRegex(CommandExecutionError, "timeout_s must be an integer"):
            self.mod.apply({"name": "web"}, timeout_s="soon")
        # A flag written as text is read as YAML reads it, never as a truthy string.
        with self.assertRaisesRegex(CommandExecutionError, "replace must be True or False, not 'maybe'"):
            self.mod.apply({"name": "web"}, replace="maybe")
        with self.assertRaisesRegex(CommandExecutionError, "restart must be True or False"):
            self.mod.apply({"name": "web"}, restart=[])
        with self.assertRaisesRegex(CommandExecutionError, "timeout_s must be an integer"):
            self.mod.image_import("base.raw", SHA, "upload.raw", timeout_s="an hour")
        self.assertEqual(self.daemon.requests, [])

    def test_socket_path_falls_back_to_the_flat_option_and_the_default(self):
        daemon = self.start(self.echo)
        flat = load("modules", {"__salt__": {"config.get": config_get({"vmhost.socket": daemon.path})}})
        self.assertEqual(flat.info()["method"], "host.info")
        default = self.module()
        self.assertEqual(default._option("socket", default.DEFAULT_SOCKET), "/run/vmhost/vmhostd.sock")
        if not os.path.exists(default.DEFAULT_SOCKET):
            with self.assertRaisesRegex(CommandExecutionError, "no socket at /run/vmhost/vmhostd.sock"):
                default.info()

    def test_notifications_before_the_answer_are_skipped(self):
        def handler(request, conn):
            send(conn, {"jsonrpc": "2.0", "method": "events.event", "params": {}})
            conn.sendall(b"\n")
            send(conn, answer(request, [1, 2]))

        self.start(handler)
        self.assertEqual(self.mod.list_(), [1, 2])


class DaemonErrors(ModuleTest):
    def test_error_carries_code_field_and_message(self):
        err = error(2001, "10.0.0.0/24 is the network address", field="spec.nics[0].ipv4.address", kind="invalid_spec")
        self.start(lambda request, conn: send(conn, answer(request, err=err)))
        with self.assertRaises(CommandExecutionError) as ctx:
            self.mod.apply({"name": "web"})
        self.assertEqual(
            str(ctx.exception), "vmhostd error 2001 (spec.nics[0].ipv4.address): 10.0.0.0/24 is the network address"
        )
        self.assertEqual(ctx.exception.code, 2001)
        self.assertEqual(ctx.exception.kind, "invalid_spec")
        self.assertEqual(ctx.exception.field, "spec.nics[0].ipv4.address")

    def test_details_are_shown_and_kept(self):
        details = {"conflicts": [{"class": "sfp", "holder": "a", "index": 5, "pci": "0000:ca:00.0"}]}
        err = error(3003, "SFP index 5 in use by a", field="spec.hardware.sfp[0]", details=details)
        self.start(lambda request, conn: send(conn, answer(request, err=err)))
        with self.assertRaises(CommandExecutionError) as ctx:
            self.mod.apply({"name": "b"})
        self.assertIn("vmhostd error 3003 (spec.hardware.sfp[0]): SFP index 5 in use by a", str(ctx.exception))
        self.assertIn('"holder": "a"', str(ctx.exception))
        self.assertEqual(ctx.exception.details, details)

    def test_error_without_field_or_data(self):
        self.start(
            lambda request, conn: send(conn, answer(request, err={"code": -32601, "message": "Method not found"}))
        )
        with self.assertRaises(CommandExecutionError) as ctx:
            self.mod.info()
        self.assertEqual(str(ctx.exception), "vmhostd error -32601: Method not found")

    def test_unauthorized_line_at_accept(self):
        line = {"jsonrpc": "2.0", "id": None, "error": error(1001, "uid 65534 may not use this socket")}
        self.start(on_accept=lambda conn: send(conn, line))
        with self.assertRaisesRegex(CommandExecutionError, r"^vmhostd error 1001: uid 65534 may not use this socket$"):
            self.mod.list_()

    def test_unauthorized_line_read_after_the_daemon_closed(self):
        # The daemon sends the 1001 line and closes before the request is written: the write
        # fails with EPIPE, and the line must still be read.
        line = {"jsonrpc": "2.0", "id": None, "error": error(1001, "uid 65534 may not use this socket")}
        self.start(on_accept=lambda conn: send(conn, line))

        class LateSocket(socket.socket):
            def sendall(self, data):
                time.sleep(0.3)
                return super().sendall(data)

        self.mod.socket = types.SimpleNamespace(
            socket=LateSocket, AF_UNIX=socket.AF_UNIX, SOCK_STREAM=socket.SOCK_STREAM
        )
        with self.assertRaisesRegex(CommandExecutionError, r"^vmhostd error 1001: uid 65534 may not use this socket$"):
            self.mod.list_()


class TransportErrors(ModuleTest):
    def test_no_socket(self):
        mod = self.module(socket="/nonexistent/vmhostd.sock")
        with self.assertRaisesRegex(CommandExecutionError, "no socket at /nonexistent/vmhostd.sock"):
            mod.info()

    def test_connection_refused(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, tmp)
        path = os.path.join(tmp, "stale.sock")
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)  # bound, never listening: connect() is refused
        self.addCleanup(os.unlink, path)
        self.addCleanup(stale.close)
        with self.assertRaisesRegex(CommandExecutionError, "connection refused"):
            self.module(socket=path).info()

    def test_garbage_reply(self):
        self.start(lambda request, conn: conn.sendall(b"this is not json\n"))
        with self.assertRaisesRegex(CommandExecutionError, "undecodable reply from vmhostd"):
            self.mod.info()

    def test_reply_that_is_not_an_object(self):
        self.start(lambda request, conn: conn.sendall(b"[1,2]\n"))
        with self.assertRaisesRegex(CommandExecutionError, "not a JSON object"):
            self.mod.info()

    def test_reply_without_result_or_error(self):
        self.start(lambda request, conn: send(conn, {"jsonrpc": "2.0", "id": request["id"]}))
        with self.assertRaisesRegex(CommandExecutionError, "neither result nor error"):
            self.mod.info()

    def test_oversize_reply_line_is_refused_without_reading_it_all(self):
        chunk = b"x" * (1024 * 1024)
        sent = []

        def handler(request, conn):
            conn.sendall(b'{"jsonrpc":"2.0","id":"' + request["id"].encode() + b'","result":"')
            for _ in range(64):  # 64 MiB, never a newline
                conn.sendall(chunk)
                sent.append(len(chunk))

        self.start(handler)
        with self.assertRaisesRegex(CommandExecutionError, "longer than 16777216 bytes"):
            self.mod.info()
        self.assertLess(sum(sent), 64 * len(chunk), "the client must stop reading at the cap")

    def test_a_line_of_exactly_the_cap_is_accepted(self):
        padding = []

        def handler(request, conn):
            head = b'{"jsonrpc":"2.0","id":"' + request["id"].encode() + b'","result":"'
            padding.append(16 * 1024 * 1024 - len(head) - 2)
            conn.sendall(head + b"y" * padding[0] + b'"}\n')

        self.start(handler)
        self.assertEqual(len(self.mod.info()), padding[0])

    def test_one_byte_over_the_cap_is_refused(self):
        def handler(request, conn):
            head = b'{"jsonrpc":"2.0","id":"' + request["id"].encode() + b'","result":"'
            conn.sendall(head + b"y" * (16 * 1024 * 1024 - len(head) - 1) + b'"}\n')

        self.start(handler)
        with self.assertRaisesRegex(CommandExecutionError, "longer than 16777216 bytes"):
            self.mod.info()

    def test_timeout(self):
        def silent(request, conn):
            time.sleep(3)

        self.start(silent, timeout=0.5)
        began = time.monotonic()
        with self.assertRaisesRegex(CommandExecutionError, r"did not answer host\.info within 0\.5 s"):
            self.mod.info()
        self.assertLess(time.monotonic() - began, 2.5)

    def test_a_slow_trickle_does_not_extend_the_deadline(self):
        def trickle(request, conn):
            for _ in range(30):
                conn.sendall(b" ")
                time.sleep(0.1)

        self.start(trickle, timeout=0.5)
        began = time.monotonic()
        with self.assertRaisesRegex(CommandExecutionError, "did not answer"):
            self.mod.info()
        self.assertLess(time.monotonic() - began, 2.0)

    def test_id_mismatch(self):
        self.start(lambda request, conn: send(conn, {"jsonrpc": "2.0", "id": "someone-else", "result": {}}))
        with self.assertRaisesRegex(CommandExecutionError, "answered request id 'someone-else', expected 'salt-"):
            self.mod.info()

    def test_eof_without_answer(self):
        self.start(lambda request, conn: None)
        with self.assertRaisesRegex(CommandExecutionError, "closed the connection without answering"):
            self.mod.info()

    def test_stop_waits_longer_than_its_timeout_s(self):
        def slow(request, conn):
            time.sleep(0.8)
            send(conn, answer(request, {"changed": True, "vm": None}))

        self.start(slow, timeout=0.5)
        # base 0.5 s + timeout_s 1 s: the 0.8 s answer arrives in time.
        self.assertEqual(self.mod.stop("web", timeout_s=1), {"changed": True, "vm": None})
        with self.assertRaisesRegex(CommandExecutionError, "did not answer vm.stop"):
            self.mod.stop("web", timeout_s=0)

    def test_apply_waits_longer_than_its_timeout_s(self):
        def slow(request, conn):
            time.sleep(0.8)
            send(conn, answer(request, {"changed": True, "vm": None}))

        self.start(slow, timeout=0.5)
        # A restart for an in-place change waits for the guest's power-off: timeout_s is added.
        self.assertEqual(self.mod.apply({"name": "web"}, timeout_s=1), {"changed": True, "vm": None})
        with self.assertRaisesRegex(CommandExecutionError, "did not answer vm.apply"):
            self.mod.apply({"name": "web"}, timeout_s=0)

    def test_image_import_waits_longer_than_its_timeout_s(self):
        def slow(request, conn):
            time.sleep(0.8)
            send(conn, answer(request, {"changed": True, "image": {"name": "base.raw"}}))

        self.start(slow, timeout=0.5)
        # A download may take up to timeout_s: it is added to the base wait.
        self.assertEqual(self.mod.image_import("base.raw", SHA, "upload.raw", timeout_s=1)["changed"], True)
        # Without timeout_s the daemon's default (3600 s) is added.
        self.assertEqual(self.mod.image_import("base.raw", SHA, "upload.raw")["changed"], True)
        with self.assertRaisesRegex(CommandExecutionError, "did not answer image.import within 0.5 s"):
            self.mod.image_import("base.raw", SHA, "upload.raw", timeout_s=0)
        # The other image calls are quick: the base wait only.
        with self.assertRaisesRegex(CommandExecutionError, "did not answer image.delete within 0.5 s"):
            self.mod.image_delete("base.raw")

    def test_image_errors_carry_code_field_and_details(self):
        err = error(
            4093,
            'image "base.raw" is there with sha256 ' + "cd" * 32 + ", not " + SHA + ": delete it first",
            field="name",
            details={"sha256": "cd" * 32},
            kind="image_exists",
        )
        self.start(lambda request, conn: send(conn, answer(request, err=err)))
        with self.assertRaises(CommandExecutionError) as ctx:
            self.mod.image_import("base.raw", SHA, "upload.raw")
        self.assertEqual((ctx.exception.code, ctx.exception.field), (4093, "name"))
        self.assertEqual(ctx.exception.details, {"sha256": "cd" * 32})
        self.assertTrue(str(ctx.exception).startswith("vmhostd error 4093 (name): "), str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
