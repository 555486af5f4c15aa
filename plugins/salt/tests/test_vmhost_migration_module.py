"""The execution module's migration functions: vmhost.migrate_in, vmhost.migrate, vmhost.move,
vmhost.migrate_settle
(requests sent, argument checks, how long each call waits, daemon errors)."""

import unittest

from salt.exceptions import CommandExecutionError
from vmhost_fakes import FakeVmhostd, answer, config_get, error, load, send

SPEC = {"name": "web", "cpu": 1, "memory_mib": 256, "nics": [{"network": "lan", "mac": "02:00:00:00:00:01"}]}
SECRET = "ab" * 32


class MigrationFunctions(unittest.TestCase):
    def start(self, handler, **options):
        self.daemon = FakeVmhostd(handler)
        self.addCleanup(self.daemon.close)
        opts = {f"vmhost:{k}": v for k, v in dict(options, socket=self.daemon.path).items()}
        self.mod = load("modules", {"__salt__": {"config.get": config_get(opts)}})

    def echo(self, request, conn):
        send(conn, answer(request, {"method": request["method"], "params": request["params"]}))

    def test_requests(self):
        self.start(self.echo)
        cases = [
            (self.mod.migrate_in, (SPEC,), {}, "vm.migrate_in", {"spec": SPEC, "mode": "live"}),
            (
                self.mod.migrate_in,
                ('{"name": "web", "cpu": 1}', "cold"),
                {},
                "vm.migrate_in",
                {"spec": {"name": "web", "cpu": 1}, "mode": "cold"},
            ),
            (
                self.mod.migrate,
                ("web", "10.0.0.2:7070", SECRET),
                {},
                "vm.migrate",
                {"name": "web", "destination": "10.0.0.2:7070", "secret": SECRET},
            ),
            (
                self.mod.migrate,
                ("web", "10.0.0.2:7070", SECRET),
                {"max_downtime_ms": "50", "bandwidth_mib_s": 100, "timeout_s": 60},
                "vm.migrate",
                {
                    "name": "web",
                    "destination": "10.0.0.2:7070",
                    "secret": SECRET,
                    "max_downtime_ms": 50,
                    "bandwidth_mib_s": 100,
                    "timeout_s": 60,
                },
            ),
            (
                self.mod.move,
                ("web", "10.0.0.2:7070", SECRET),
                {},
                "vm.move",
                {"name": "web", "destination": "10.0.0.2:7070", "secret": SECRET, "stop": False},
            ),
            (
                self.mod.move,
                ("web", "10.0.0.2:7070", SECRET),
                {"stop": "True"},
                "vm.move",
                {"name": "web", "destination": "10.0.0.2:7070", "secret": SECRET, "stop": True},
            ),
            (
                self.mod.migrate_settle,
                ("web", "abandoned"),
                {},
                "vm.migrate_settle",
                {"name": "web", "outcome": "abandoned"},
            ),
        ]
        for fn, args, kwargs, method, params in cases:
            with self.subTest(method=method, args=args, kwargs=kwargs):
                self.assertEqual(fn(*args, **kwargs), {"method": method, "params": params})

    def test_bad_arguments_send_nothing(self):
        self.start(self.echo)
        with self.assertRaisesRegex(CommandExecutionError, "mode must be live or cold"):
            self.mod.migrate_in(SPEC, "warm")
        with self.assertRaisesRegex(CommandExecutionError, "spec is not JSON"):
            self.mod.migrate_in("{")
        with self.assertRaisesRegex(CommandExecutionError, "max_downtime_ms must be an integer"):
            self.mod.migrate("web", "a:1", SECRET, max_downtime_ms="soon")
        with self.assertRaisesRegex(CommandExecutionError, "timeout_s must not be negative"):
            self.mod.migrate("web", "a:1", SECRET, timeout_s=-1)
        with self.assertRaisesRegex(CommandExecutionError, "stop must be True or False"):
            self.mod.move("web", "a:1", SECRET, stop="maybe")
        with self.assertRaisesRegex(CommandExecutionError, "outcome must be committed or abandoned"):
            self.mod.migrate_settle("web", "pending")
        self.assertEqual(self.daemon.requests, [])

    def test_waits(self):
        self.start(self.echo, timeout=10, move_timeout=99)
        seen = []
        real = self.mod._call
        self.mod._call = lambda method, params=None, timeout=None: (
            seen.append((method, timeout)) or real(method, params, timeout)
        )
        self.mod.migrate_in(SPEC)
        self.mod.migrate("web", "a:1", SECRET)
        self.mod.migrate("web", "a:1", SECRET, timeout_s=20)
        self.mod.move("web", "a:1", SECRET)
        self.assertEqual(
            seen, [("vm.migrate_in", None), ("vm.migrate", 3610.0), ("vm.migrate", 30.0), ("vm.move", 99.0)]
        )

    def test_daemon_refusals_raise_with_code_and_reason(self):
        def refuse(request, conn):
            send(
                conn,
                answer(
                    request,
                    err=error(
                        4097, "VM web has passthrough devices", details={"reason": "passthrough"}, kind="not_movable"
                    ),
                ),
            )

        self.start(refuse)
        with self.assertRaises(self.mod.VmhostdError) as ctx:
            self.mod.migrate("web", "a:1", SECRET)
        self.assertEqual((ctx.exception.code, ctx.exception.details), (4097, {"reason": "passthrough"}))
        self.assertIn("vmhostd error 4097: VM web has passthrough devices", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
