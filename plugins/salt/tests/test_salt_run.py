"""The runner loaded by a real ``salt-run`` (Salt 3007 from target/salt-venv), masterless: a
master config naming the runner's directory in ``runner_dirs`` (what the installed
extension's ``runner_dirs`` entry point gives Salt), planning from a fleet snapshot that the
runner itself gathered from fake minions (the real execution module against fake vmhostds)."""

import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import tomllib
from fleet_fakes import Fleet, Host, LocalClient, spec, view
from vmhost_fakes import SRC, load

SALT_RUN = os.path.join(os.path.dirname(sys.executable), "salt-run")


@unittest.skipUnless(os.access(SALT_RUN, os.X_OK), f"{SALT_RUN} missing: run tests/setup.sh")
class SaltRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="vmhost-salt-run")
        conf = os.path.join(cls.dir, "conf")
        os.mkdir(conf)
        with open(os.path.join(conf, "master"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "root_dir": os.path.join(cls.dir, "root"),
                    "user": getpass.getuser(),
                    "runner_dirs": [os.path.abspath(os.path.join(SRC, "runners"))],
                    "log_level": "warning",
                },
                f,
            )
        cls.conf = conf
        # The snapshot: what three fake minions' vmhostds answer, gathered by the runner.
        hv1, hv2, hv3 = Host("hv1", memory_mib=8192), Host("hv2", memory_mib=16384), Host("hv3", memory_mib=4096)
        hv1.add(view(spec("s1", role="sensor", memory_mib=3000)))
        hv1.add(view(spec("s2", role="sensor", memory_mib=2000)))
        hv1.add(view(spec("db", memory_mib=1000), status="stopped"))
        hv2.add(view(spec("s3", role="sensor")))
        fleet = Fleet(hv1, hv2, hv3)
        try:
            runner = load("runners", {"__opts__": {}, "__context__": {}})
            runner._local_client = lambda: LocalClient(fleet)
            snapshot = runner.fleet()
        finally:
            fleet.close()
        cls.snapshot = os.path.join(cls.dir, "fleet.json")
        with open(cls.snapshot, "w", encoding="utf-8") as f:
            json.dump(snapshot, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def salt_run(self, *args, conf=None, env=None):
        proc = subprocess.run(
            [SALT_RUN, "-c", conf or self.conf, "--out=json", *args, f"fleet={self.snapshot}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        try:
            out = json.loads(proc.stdout)
        except ValueError:
            self.fail(f"salt-run printed no JSON (rc {proc.returncode}): {proc.stdout}\n{proc.stderr}")
        return proc.returncode, out

    def test_place_runs_through_salt_run(self):
        rc, out = self.salt_run(
            "vmhost.place",
            'spec={"name": "s4", "role": "sensor", "cpu": 1, "memory_mib": 512, '
            '"boot": {"image": "base.qcow2", "disk_gib": 2}, "nics": [{"network": "lan"}]}',
        )
        self.assertEqual(rc, 0, out)
        # hv2 has the most free memory but a sensor, hv1 two: hv3.
        self.assertEqual((out["result"], out["host"], out["key"]), (True, "hv3", "sensor"))
        self.assertEqual([r["host"] for r in out["ranking"]], ["hv3", "hv2", "hv1"])

    def test_place_without_a_fit_fails_the_job(self):
        rc, out = self.salt_run(
            "vmhost.place",
            'spec={"name": "big", "cpu": 64, "memory_mib": 512, "boot": {"image": "base.qcow2", "disk_gib": 2}}',
        )
        self.assertEqual(rc, 1, out)
        self.assertEqual(out["result"], False)
        self.assertEqual(sorted(out["refused"]), ["hv1", "hv2", "hv3"])

    def test_evacuate_dry_run_runs_through_salt_run(self):
        rc, out = self.salt_run("vmhost.evacuate", "host=hv1", "dry_run=True")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out["dry_run"], True)
        self.assertEqual(
            [(m["vm"], m["to"], m["mode"]) for m in out["plan"]["moves"]],
            [("s1", "hv3", "live"), ("s2", "hv2", "live"), ("db", "hv2", "cold")],
        )
        self.assertEqual(out["done"], [])

    def test_evacuate_for_real_from_a_snapshot_is_refused(self):
        rc, out = self.salt_run("vmhost.evacuate", "host=hv1")
        self.assertEqual(rc, 1, out)
        self.assertIn("fleet=PATH only plans", out["error"])

    def test_the_installed_extensions_entry_point_gives_salt_the_runner(self):
        """No runner_dirs in the config: Salt finds the runner through the ``runner_dirs``
        entry point of pyproject.toml, as for an installed extension. The extension is
        "installed" by a dist-info with pyproject's entry points beside src/ on PYTHONPATH
        (the shared venv is not touched)."""
        with open(os.path.join(SRC, "..", "..", "..", "pyproject.toml"), "rb") as f:
            points = tomllib.load(f)["project"]["entry-points"]["salt.loader"]
        self.assertEqual(points["runner_dirs"], "saltext.vmhost.loader:get_runner_dirs")
        site = os.path.join(self.dir, "site")
        info = os.path.join(site, "saltext.vmhost-0.1.0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
            f.write("Metadata-Version: 2.1\nName: saltext.vmhost\nVersion: 0.1.0\n")
        with open(os.path.join(info, "entry_points.txt"), "w", encoding="utf-8") as f:
            f.write("[salt.loader]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
        conf = os.path.join(self.dir, "conf-ep")
        os.mkdir(conf)
        with open(os.path.join(conf, "master"), "w", encoding="utf-8") as f:
            json.dump(
                {"root_dir": os.path.join(self.dir, "root-ep"), "user": getpass.getuser(), "log_level": "warning"}, f
            )
        src = os.path.abspath(os.path.join(SRC, "..", ".."))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, src]))
        rc, out = self.salt_run("vmhost.evacuate", "host=hv1", "dry_run=True", conf=conf, env=env)
        self.assertEqual(rc, 0, out)
        self.assertEqual([m["vm"] for m in out["plan"]["moves"]], ["s1", "s2", "db"])
        # Without the entry point Salt has no such runner: the test above is not vacuous.
        rc, out = self.salt_run("vmhost.evacuate", "host=hv1", "dry_run=True", conf=conf)
        self.assertIn("is not available", json.dumps(out))


if __name__ == "__main__":
    unittest.main()
