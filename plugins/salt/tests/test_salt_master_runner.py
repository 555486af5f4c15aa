"""The runner through real Salt: a salt-master and three salt-minions (Salt 3007 from
target/salt-venv, on loopback in a temp dir), each minion's ``vmhost`` execution module
(``module_dirs``) pointed at its own fake vmhostd served by this test. ``salt-run`` then asks
the real minions through the master's LocalClient: ``vmhost.place``, ``vmhost.evacuate
dry_run=True`` (nothing sent but reads) and ``vmhost.migrate`` (the fake vmhostds move the VM
as vm.migrate_in plus vm.migrate would). Real migrations between real vmhostds are
tests/tests/migration.rs's and the three-host evacuation's."""

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

from fleet_fakes import Fleet, Host, spec, view
from vmhost_fakes import SRC

BIN = os.path.dirname(sys.executable)
WAIT = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(os.access(os.path.join(BIN, "salt-master"), os.X_OK), "salt-master missing: run tests/setup.sh")
class RealMasterAndMinions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="vmhost-salt-master")
        cls.procs = []
        cls.hv1 = Host("hv1", memory_mib=8192)
        cls.hv2 = Host("hv2", memory_mib=16384)
        cls.hv3 = Host("hv3", memory_mib=4096)
        cls.hv1.add(view(spec("s1", role="sensor", memory_mib=3000)))
        cls.hv1.add(view(spec("s2", role="sensor", memory_mib=2000)))
        cls.hv1.add(view(spec("db", memory_mib=1000), status="stopped"))
        cls.hv2.add(view(spec("s3", role="sensor")))
        cls.fleet = Fleet(cls.hv1, cls.hv2, cls.hv3)
        publish, ret = free_port(), free_port()
        user = getpass.getuser()
        master = os.path.join(cls.dir, "master")
        os.makedirs(master)
        cls.master_conf = master
        with open(os.path.join(master, "master"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "root_dir": os.path.join(cls.dir, "master-root"),
                    "interface": "127.0.0.1",
                    "publish_port": publish,
                    "ret_port": ret,
                    "auto_accept": True,
                    "user": user,
                    "runner_dirs": [os.path.abspath(os.path.join(SRC, "runners"))],
                    "vmhost_runner": {"hosts": "hv*", "timeout": 30},
                    "log_level": "warning",
                },
                f,
            )
        cls.start("salt-master", "-c", master)
        for name, daemon in cls.fleet.daemons.items():
            conf = os.path.join(cls.dir, name)
            os.makedirs(conf)
            with open(os.path.join(conf, "minion"), "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "id": name,
                        "master": "127.0.0.1",
                        "master_port": ret,
                        "publish_port": publish,
                        "root_dir": os.path.join(cls.dir, f"{name}-root"),
                        "user": user,
                        "module_dirs": [os.path.abspath(os.path.join(SRC, "modules"))],
                        "vmhost": {"socket": daemon.path, "timeout": 30},
                        "log_level": "warning",
                    },
                    f,
                )
            cls.start("salt-minion", "-c", conf)
        deadline = time.monotonic() + WAIT
        while True:
            out = cls.salt("hv*", "test.ping")
            if sorted(k for k, v in out.items() if v is True) == ["hv1", "hv2", "hv3"]:
                break
            if time.monotonic() > deadline:
                cls.tearDownClass()
                raise AssertionError(f"the three minions did not answer test.ping within {WAIT} s: {out}")
            time.sleep(1)

    @classmethod
    def start(cls, binary, *args):
        log = open(os.path.join(cls.dir, f"{binary}-{len(cls.procs)}.log"), "wb")
        proc = subprocess.Popen(
            [os.path.join(BIN, binary), *args], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
        cls.procs.append((proc, log))

    @classmethod
    def tearDownClass(cls):
        for proc, _ in cls.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc, log in cls.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()
        cls.procs = []
        cls.fleet.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def salt(cls, target, *args):
        proc = subprocess.run(
            [os.path.join(BIN, "salt"), "-c", cls.master_conf, "--out=json", "--static", "-t", "10", target, *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        try:
            return json.loads(proc.stdout or "{}")
        except ValueError:
            return {}

    def salt_run(self, *args):
        proc = subprocess.run(
            [os.path.join(BIN, "salt-run"), "-c", self.master_conf, "--out=json", *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        try:
            return proc.returncode, json.loads(proc.stdout)
        except ValueError:
            self.fail(f"salt-run printed no JSON (rc {proc.returncode}): {proc.stdout}\n{proc.stderr}")

    def mutations(self):
        return self.fleet.calls("vm.migrate_in", "vm.migrate", "vm.move")

    def test_1_place_asks_the_real_minions(self):
        rc, out = self.salt_run(
            "vmhost.place",
            'spec={"name": "s4", "role": "sensor", "cpu": 1, "memory_mib": 512, '
            '"boot": {"image": "base.qcow2", "disk_gib": 2}, "nics": [{"network": "lan"}]}',
        )
        self.assertEqual(rc, 0, out)
        self.assertEqual((out["host"], out["key"]), ("hv3", "sensor"))
        self.assertEqual([r["host"] for r in out["ranking"]], ["hv3", "hv2", "hv1"])
        self.assertEqual(out["skipped"], {})

    def test_2_evacuate_dry_run_sends_only_reads(self):
        rc, out = self.salt_run("vmhost.evacuate", "host=hv1", "dry_run=True")
        self.assertEqual(rc, 0, out)
        self.assertEqual(
            [(m["vm"], m["to"], m["mode"]) for m in out["plan"]["moves"]],
            [("s1", "hv3", "live"), ("s2", "hv2", "live"), ("db", "hv2", "cold")],
        )
        self.assertEqual(self.mutations(), [])
        self.assertEqual(sorted(self.hv1.vms), ["db", "s1", "s2"])

    def test_3_migrate_drives_both_minions(self):
        rc, out = self.salt_run("vmhost.migrate", "vm=s1", "to=hv3")
        self.assertEqual(rc, 0, out)
        self.assertEqual((out["from"], out["to"], out["mode"]), ("hv1", "hv3", "live"))
        self.assertEqual(out["outcome"]["downtime_ms"], 100)
        self.assertEqual(self.mutations(), [("hv3", "vm.migrate_in"), ("hv1", "vm.migrate")])
        self.assertIn("s1", self.hv3.vms)
        self.assertNotIn("s1", self.hv1.vms)
        rc, out = self.salt_run("vmhost.migrate", "vm=s2", "to=hv3")
        self.assertEqual(rc, 1, out)
        self.assertIn("memory: 2000 MiB needed", out["error"])


if __name__ == "__main__":
    unittest.main()
