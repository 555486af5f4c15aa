"""The execution module's snapshot and backup functions: vmhost.snapshot, vmhost.snapshots,
vmhost.revert, vmhost.snapshot_delete, vmhost.export, vmhost.import, vmhost.backups_prune (requests sent, params
passed through, how long each call waits, test mode, daemon errors)."""

import unittest

from vmhost_fakes import FakeVmhostd, answer, config_get, error, load, send


class SnapshotFunctions(unittest.TestCase):
    def start(self, handler, **options):
        self.daemon = FakeVmhostd(handler)
        self.addCleanup(self.daemon.close)
        opts = {f"vmhost:{k}": v for k, v in dict(options, socket=self.daemon.path).items()}
        self.mod = load("modules", {"__salt__": {"config.get": config_get(opts)}})

    def echo(self, request, conn):
        send(conn, answer(request, {"method": request["method"], "params": request["params"]}))

    def test_requests(self):
        self.start(self.echo)
        m = self.mod
        cases = [
            (m.snapshot, ("web", "s1"), {}, "vm.snapshot", {"name": "web", "snapshot": "s1"}),
            (
                m.snapshot,
                ("web", "s1"),
                {"timeout_s": 60, "requires": "frozen"},
                "vm.snapshot",
                {"name": "web", "snapshot": "s1", "timeout_s": 60, "requires": "frozen"},
            ),
            (m.snapshots, ("web",), {}, "vm.snapshots", {"name": "web"}),
            (m.revert, ("web", "s1"), {}, "vm.revert", {"name": "web", "snapshot": "s1"}),
            (
                m.revert,
                ("web", "s1"),
                {"timeout_s": 5},
                "vm.revert",
                {"name": "web", "snapshot": "s1", "timeout_s": 5},
            ),
            (m.snapshot_delete, ("web", "s1"), {}, "vm.snapshot_delete", {"name": "web", "snapshot": "s1"}),
            (m.export, ("web",), {}, "vm.export", {"name": "web"}),
            (
                m.export,
                ("web",),
                {"timeout_s": 600, "requires": "frozen"},
                "vm.export",
                {"name": "web", "timeout_s": 600, "requires": "frozen"},
            ),
            (m.import_, ("web-20261204T141502Z",), {}, "vm.import", {"backup": "web-20261204T141502Z"}),
            (
                m.import_,
                ("web-20261204T141502Z", "web2", "stopped"),
                {},
                "vm.import",
                {"backup": "web-20261204T141502Z", "name": "web2", "state": "stopped"},
            ),
            # A snapshot name that YAML read as a number is still sent as the name it was.
            (m.snapshot, ("web", 2026), {}, "vm.snapshot", {"name": "web", "snapshot": "2026"}),
        ]
        for fn, args, kwargs, method, params in cases:
            with self.subTest(method=method, args=args, kwargs=kwargs):
                self.assertEqual(fn(*args, **kwargs), {"method": method, "params": params})

    def test_unknown_params_pass_through_and_salts_own_are_dropped(self):
        self.start(self.echo)
        salt_own = {"__pub_fun": "vmhost.export", "__pub_jid": "2026", "__pub_arg": []}
        got = self.mod.export("web", incremental=True, keep=3, since="web-1", **salt_own)
        self.assertEqual(got["params"], {"name": "web", "incremental": True, "keep": 3, "since": "web-1"})
        got = self.mod.snapshot("web", "s1", future="x", **salt_own)
        self.assertEqual(got["params"], {"name": "web", "snapshot": "s1", "future": "x"})
        got = self.mod.import_("b1", verify_only=True, **salt_own)
        self.assertEqual(got["params"], {"backup": "b1", "verify_only": True})
        got = self.mod.revert("web", "s1", **salt_own)
        self.assertEqual(got["params"], {"name": "web", "snapshot": "s1"})
        got = self.mod.snapshot_delete("web", "s1", **salt_own)
        self.assertEqual(got["params"], {"name": "web", "snapshot": "s1"})
        # Values are not reshaped: the daemon checks them (a string timeout_s is its -32602).
        got = self.mod.export("web", timeout_s="soon")
        self.assertEqual(got["params"], {"name": "web", "timeout_s": "soon"})

    def test_test_mode_sends_nothing(self):
        self.start(self.echo)
        calls = [
            (self.mod.snapshot, ("web", "s1"), "vm.snapshot"),
            (self.mod.revert, ("web", "s1"), "vm.revert"),
            (self.mod.snapshot_delete, ("web", "s1"), "vm.snapshot_delete"),
            (self.mod.export, ("web",), "vm.export"),
            (self.mod.import_, ("b1",), "vm.import"),
        ]
        for fn, args, method in calls:
            with self.subTest(method=method):
                got = fn(*args, test=True)
                self.assertEqual((got["test"], got["method"]), (True, method))
        # The run's test option counts as well.
        self.mod.__opts__ = {"test": True}
        self.assertTrue(self.mod.export("web")["test"])
        self.assertEqual(self.daemon.requests, [])

    def test_waits(self):
        self.start(self.echo, timeout=10, import_timeout=99)
        seen = []
        real = self.mod._call
        self.mod._call = lambda method, params=None, timeout=None: (
            seen.append((method, timeout)) or real(method, params, timeout)
        )
        self.mod.snapshot("web", "s1")
        self.mod.snapshot("web", "s1", timeout_s=20)
        self.mod.snapshots("web")
        self.mod.revert("web", "s1", timeout_s=5)
        self.mod.snapshot_delete("web", "s1")
        self.mod.snapshot_delete("web", "s1", timeout_s=7)
        self.mod.export("web")
        self.mod.export("web", timeout_s="soon")
        self.mod.import_("b1")
        self.assertEqual(
            seen,
            [
                ("vm.snapshot", 3610.0),
                ("vm.snapshot", 30.0),
                ("vm.snapshots", None),
                ("vm.revert", 15.0),
                ("vm.snapshot_delete", 3610.0),
                ("vm.snapshot_delete", 17.0),
                ("vm.export", 3610.0),
                ("vm.export", 3610.0),
                ("vm.import", 99.0),
            ],
        )

    def test_import_waits_six_hours_by_default(self):
        self.start(self.echo)
        seen = []
        real = self.mod._call
        self.mod._call = lambda method, params=None, timeout=None: (
            seen.append((method, timeout)) or real(method, params, timeout)
        )
        self.mod.import_("b1")
        self.assertEqual(seen, [("vm.import", 21600.0)])

    def test_backups_prune(self):
        self.start(self.echo, import_timeout=99)
        seen = []
        real = self.mod._call
        self.mod._call = lambda method, params=None, timeout=None: (
            seen.append((method, timeout)) or real(method, params, timeout)
        )
        salt_own = {"__pub_fun": "vmhost.backups_prune", "__pub_jid": "2026"}
        got = self.mod.backups_prune("web", 3, **salt_own)
        self.assertEqual(got, {"method": "vm.backups_prune", "params": {"name": "web", "keep": 3}})
        # Unknown params pass through; values are not reshaped (the daemon checks keep).
        got = self.mod.backups_prune("web", "0", future=True)
        self.assertEqual(got["params"], {"name": "web", "keep": "0", "future": True})
        # A merge copies whole disks: it waits as long as an import.
        self.assertEqual(seen, [("vm.backups_prune", 99.0), ("vm.backups_prune", 99.0)])
        got = self.mod.backups_prune("web", 1, test=True)
        self.assertEqual(got, {"test": True, "method": "vm.backups_prune", "params": {"name": "web", "keep": 1}})
        self.assertEqual(len(self.daemon.requests), 2)

    def test_backups_prune_answer_and_refusal_are_the_daemons(self):
        pruned = {"removed": ["web-1"], "merged": [["web-3", "web-2"]], "kept": ["web-3"]}

        def prune(request, conn):
            if request["params"]["keep"] < 1:
                send(conn, answer(request, err=error(2001, "keep must be at least 1", "keep", kind="invalid_spec")))
            else:
                send(conn, answer(request, pruned))

        self.start(prune)
        self.assertEqual(self.mod.backups_prune("web", 1), pruned)
        with self.assertRaises(self.mod.VmhostdError) as ctx:
            self.mod.backups_prune("web", 0)
        self.assertEqual((ctx.exception.code, ctx.exception.field), (2001, "keep"))

    def test_daemon_errors_raise_with_code_field_and_details(self):
        details = {"file": "root.qcow2", "expected": "ab" * 32, "found": "cd" * 32, "bytes": 512}

        def refuse(request, conn):
            if request["method"] == "vm.revert":
                err = error(4090, 'VM "web" is running: stop it first', field="name", kind="conflict")
            else:
                err = error(2003, "root.qcow2 is not what the manifest says", "backup", details, "checksum_mismatch")
            send(conn, answer(request, err=err))

        self.start(refuse)
        with self.assertRaises(self.mod.VmhostdError) as ctx:
            self.mod.revert("web", "s1")
        self.assertEqual((ctx.exception.code, ctx.exception.field), (4090, "name"))
        self.assertIn('vmhostd error 4090 (name): VM "web" is running', str(ctx.exception))
        with self.assertRaises(self.mod.VmhostdError) as ctx:
            self.mod.import_("b1")
        e = ctx.exception
        self.assertEqual((e.code, e.field, e.kind, e.details), (2003, "backup", "checksum_mismatch", details))
        self.assertIn("vmhostd error 2003 (backup): root.qcow2 is not", str(e))

    def test_the_results_are_the_daemons(self):
        listed = [{"name": "s1", "live": False, "consistency": "stopped", "disks": []}]
        exported = {"backup": "web-1", "path": "/b/web-1", "manifest": {"version": 2, "kind": "incremental"}}
        results = {"vm.snapshots": listed, "vm.export": exported}
        self.start(lambda request, conn: send(conn, answer(request, results[request["method"]])))
        self.assertEqual(self.mod.snapshots("web"), listed)
        self.assertEqual(self.mod.export("web", incremental=True), exported)


if __name__ == "__main__":
    unittest.main()
