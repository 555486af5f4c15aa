"""Unit tests of vmhost_engine as a drop-in for Security Onion's virtual_node_manager: minion_id
targeting, SO's VM names, SO's tracking/.error/.status files and soc/dyanno events, bootstrap
user_data, hypervisors reconciled in parallel, and the guard for names of the earlier engine."""

import concurrent.futures
import json
import os
import tempfile
import threading
import unittest
from collections import namedtuple
from datetime import datetime
from unittest import mock

from test_engine import FakeClient, FakeHost, config, eng, entry

HOURS = 3600


def so_entry(host, role="sensor", **kw):
    """An entry as SOC writes it (indices as strings, a static address)."""
    e = {
        "hostname": host,
        "role": role,
        "network_mode": "dhcp4",
        "ip4": "",
        "gw4": "",
        "dns4": "",
        "search4": "",
        "cpu": 2,
        "memory": 4,
        "disk": [],
        "copper": [],
        "sfp": [],
    }
    e.update(kw)
    return e


def daemon_error(code, message, field=None, details=None, kind="x"):
    return {"code": code, "message": message, "data": {"kind": kind, "field": field, "details": details}}


class ErrHost(FakeHost):
    """A FakeHost whose VMs in ``errors`` fail with the given daemon error (nothing made)."""

    def __init__(self, vms=()):
        super().__init__(vms)
        self.errors = {}

    def reconcile(self, vms, prune, dry_run):
        ret = super().reconcile(vms, prune, dry_run)
        for res in ret["results"]:
            err = self.errors.get(res["vm"])
            if err is not None:
                if res["action"] == "create":
                    self.vms.discard(res["vm"])
                    self.specs.pop(res["vm"], None)
                res.update(ok=False, changed=False, error=err)
                ret["ok"] = False
        return ret


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = os.path.join(self.tmp.name, "vms")
        os.mkdir(self.dir)
        self.cache = os.path.join(self.tmp.name, "cache", "vmhost_engine")
        self.now = 1_700_000_000.0
        self.events = []
        self.hosts = {"hv1": ErrHost(), "hv2": ErrHost()}
        self.client = FakeClient(self.hosts)
        self.accepted = ["hv1", "hv2"]

    def engine(self, client=None, fire=None, owner=None, euid=os.geteuid, **over):
        over.setdefault("minion_id", "{hypervisor}")
        over.setdefault("so_compat", True)
        cfg = config(vms_dir=self.dir, interval=300, retry=60, **over)
        engine = eng.Engine(
            cfg,
            client or self.client,
            fire or (lambda data, tag: self.events.append((tag, data))),
            self.cache,
            lambda: self.now,
            accepted=lambda: self.accepted,
            owner=owner,
            euid=euid,
        )
        self.addCleanup(engine.close)
        return engine

    def write(self, hyp, entries):
        with open(os.path.join(self.dir, f"{hyp}VMs"), "w") as f:
            f.write(json.dumps(entries))

    def so_path(self, hyp, name):
        return os.path.join(self.dir, hyp, name)

    def so_file(self, hyp, name):
        with open(self.so_path(hyp, name)) as f:
            text = f.read()
        obj = json.loads(text)
        self.assertEqual(text, json.dumps(obj, indent=2), "SO writes JSON with indent 2")
        return obj

    def so_events(self):
        return [(t, d) for t, d in self.events if t.startswith("soc/")]


class TargetingTest(Base):
    def test_resolve_one_none_several_exact(self):
        keys = ["hv1_hypervisor", "hv10_hypervisor", "hv2_a", "hv2_b", "hv3"]
        self.assertEqual(eng.resolve_minion("{hypervisor}_*", "hv1", keys), "hv1_hypervisor")
        with self.assertRaises(eng.TargetError) as ctx:
            eng.resolve_minion("{hypervisor}_*", "hv9", keys)
        self.assertEqual(ctx.exception.matches, [])
        self.assertIn("no accepted minion key matches", str(ctx.exception))
        with self.assertRaises(eng.TargetError) as ctx:
            eng.resolve_minion("{hypervisor}_*", "hv2", keys)
        self.assertEqual(ctx.exception.matches, ["hv2_a", "hv2_b"])
        self.assertIn("hv2_a, hv2_b", str(ctx.exception))
        # Without glob characters: one exact id, which still needs an accepted key.
        self.assertEqual(eng.resolve_minion("{hypervisor}", "hv3", keys), "hv3")
        with self.assertRaises(eng.TargetError):
            eng.resolve_minion("{hypervisor}", "hv1", keys)
        self.assertEqual(eng.resolve_minion("{hypervisor}_hyper[v]isor", "hv1", keys), "hv1_hypervisor")

    def test_accepted_minions_reads_the_pki_dir(self):
        pki = os.path.join(self.tmp.name, "pki")
        os.makedirs(os.path.join(pki, "minions"))
        for name in ("hv1_hypervisor", "sensor1", ".hidden"):
            open(os.path.join(pki, "minions", name), "w").close()
        os.makedirs(os.path.join(pki, "minions_pre"))
        open(os.path.join(pki, "minions_pre", "hv2_hypervisor"), "w").close()
        self.assertEqual(sorted(eng.accepted_minions(pki)), ["hv1_hypervisor", "sensor1"])

    def test_engine_targets_the_resolved_id_and_isolates_failures(self):
        self.hosts = {"hv1_hypervisor": ErrHost(), "hv2_a": ErrHost(), "hv2_b": ErrHost()}
        self.client = FakeClient(self.hosts)
        self.accepted = list(self.hosts)
        self.write("hv1", [entry("a")])
        self.write("hv2", [entry("b")])
        self.write("hv3", [entry("c")])
        engine = self.engine(minion_id="{hypervisor}_*", so_compat=False)
        self.assertEqual(engine.run_once(), {"hv1": "ok", "hv2": "failed", "hv3": "failed"})
        self.assertEqual([c[0] for c in self.client.calls], ["hv1_hypervisor"])
        self.assertEqual(self.hosts["hv1_hypervisor"].vms, {"a_sensor"})
        tags = {t: d for t, d in self.events}
        self.assertIn("vmhost/hv1_hypervisor/a_sensor/reconciled", tags)
        self.assertIn("vmhost/hv1_hypervisor/_hypervisor/reconciled", tags)
        several = tags["vmhost/hv2/_hypervisor/reconcile_failed"]
        self.assertEqual(several["matches"], ["hv2_a", "hv2_b"])
        self.assertIn("matches 2 accepted minions", several["error"])
        self.assertEqual(tags["vmhost/hv3/_hypervisor/reconcile_failed"]["matches"], [])
        # Retried after `retry`, not every poll; a key accepted meanwhile runs at once.
        self.events.clear()
        self.assertEqual(engine.run_once(), {"hv1": "skipped", "hv2": "skipped", "hv3": "skipped"})
        self.hosts["hv3_x"] = ErrHost()
        self.accepted.append("hv3_x")
        self.assertEqual(engine.run_once(), {"hv1": "skipped", "hv2": "skipped", "hv3": "ok"})
        self.assertEqual(self.hosts["hv3_x"].vms, {"c_sensor"})

    def test_two_files_resolving_to_one_minion_fail_both(self):
        self.write("hv1", [so_entry("a")])
        self.write("hv2", [so_entry("b")])
        engine = self.engine(minion_id="hv1", so_compat=False)
        self.assertEqual(engine.run_once(), {"hv1": "failed", "hv2": "failed"})
        self.assertEqual(self.client.calls, [])
        self.assertEqual(self.hosts["hv1"].vms, set())
        failed = [d for t, d in self.events if t == "vmhost/hv1/_hypervisor/reconcile_failed"]
        self.assertEqual(len(failed), 2)
        for data in failed:
            other = os.path.join(self.dir, "hv2VMs" if data["file"].endswith("hv1VMs") else "hv1VMs")
            self.assertIn(f"and {other} resolve to the same minion hv1", data["error"])
        # Retried after `retry`, not at every pass.
        self.assertEqual(engine.run_once(), {"hv1": "skipped", "hv2": "skipped"})
        # One file gone: the other runs.
        os.unlink(os.path.join(self.dir, "hv2VMs"))
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor"})

    def test_minion_id_config(self):
        self.assertEqual(config()["minion_id"], "{hypervisor}_*")
        for bad in ("{host}_*", "{}", "{0}", "{hypervisor.upper}", "{hypervisor", "", 7):
            with self.subTest(bad=bad), self.assertRaises(eng.ConfigError):
                config(minion_id=bad)


class NamingTest(unittest.TestCase):
    def test_so_names(self):
        self.assertEqual(eng.map_entry(so_entry("Sensor1"), config())["name"], "sensor1_sensor")
        self.assertEqual(eng.vm_name(so_entry("search-1", "searchnode")), "search-1_searchnode")
        self.assertEqual(eng.old_vm_name("search-1_searchnode"), "search-1-searchnode")
        self.assertIsNone(eng.old_vm_name("manual"))
        for good in ("a_b", "a", "0-x_y"):
            self.assertTrue(eng.VM_NAME_RE.match(good), good)
        for bad in ("_hypervisor", "_entry3", "-a", "A_b", "a" * 64, "a.b"):
            self.assertFalse(eng.VM_NAME_RE.match(bad), bad)
        plan = [{"vm": "a_sensor", "action": "create"}]
        self.assertEqual(eng.check_reconcile_return({"plan": plan, "results": []})[0], plan)
        with self.assertRaises(eng.HypervisorFailure):
            eng.check_reconcile_return({"plan": [{"vm": "_hypervisor", "action": "none"}], "results": []})

    def test_minion_engine_accepts_so_names(self):
        from vmhost_fakes import load_engine  # pylint: disable=import-outside-toplevel

        events = load_engine("vmhost_events")
        message = {
            "jsonrpc": "2.0",
            "method": "events.event",
            "params": {"result": {"vm": "sensor1_sensor", "from": "starting", "to": "running"}},
        }
        tag, data = events.event_to_tag_data("hv1_hypervisor", message)
        self.assertEqual(tag, "vmhost/hv1_hypervisor/sensor1_sensor/running")
        self.assertEqual(data["vm"], "sensor1_sensor")
        message["params"]["result"]["vm"] = "_hypervisor"
        self.assertIsNone(events.event_to_tag_data("hv1", message))


class SoFilesTest(Base):
    def test_create_writes_tracking_and_status_and_fires_so_events(self):
        a = so_entry("a", sfp=["5"], copper=["1", "2"])
        self.write("hv1", [a])
        seen = {}
        real = self.hosts["hv1"].reconcile

        def reconcile(**kw):
            seen["tracking"] = os.path.exists(self.so_path("hv1", "a_sensor"))
            seen["status"] = self.so_file("hv1", "a_sensor.status")["status"]
            return real(**kw)

        self.hosts["hv1"].reconcile = reconcile
        self.assertEqual(self.engine().run_once(), {"hv1": "ok"})
        self.assertEqual(seen, {"tracking": True, "status": "Processing"}, "written before provisioning")
        self.assertEqual(self.so_file("hv1", "a_sensor"), {"config": a})
        self.assertEqual(
            self.so_file("hv1", "a_sensor.status"),
            {"status": "Created Instance", "timestamp": datetime.utcfromtimestamp(self.now).isoformat()},
        )
        self.assertEqual(
            self.so_events(),
            [
                (
                    "soc/dyanno/hypervisor/processing",
                    {"vm_name": "a_sensor", "hypervisor": "hv1", "status": "Processing"},
                ),
                (
                    "soc/dyanno/hypervisor/created instance",
                    {"vm_name": "a_sensor", "hypervisor": "hv1", "status": "Created Instance"},
                ),
            ],
        )
        self.assertEqual(sorted(os.listdir(os.path.join(self.dir, "hv1"))), ["a_sensor", "a_sensor.status"])
        # A hardware change in place is SO's "Hardware Configuration"; an unchanged VM fires nothing.
        self.events.clear()
        self.write("hv1", [dict(a, cpu=4)])
        self.engine().run_once()
        self.assertEqual(
            self.so_events(),
            [
                (
                    "soc/dyanno/hypervisor/hardware configuration",
                    {"vm_name": "a_sensor", "hypervisor": "hv1", "status": "Hardware Configuration"},
                )
            ],
        )
        self.assertEqual(self.so_file("hv1", "a_sensor"), {"config": dict(a, cpu=4)})
        self.events.clear()
        self.now += 301
        self.engine().run_once()
        self.assertEqual(self.so_events(), [])

    def test_error_code_3_and_4_and_removal_after_success(self):
        b, c = so_entry("b", sfp=["5"], copper=["1"], nsm_size=100), so_entry("c")
        self.write("hv1", [b, c])
        self.hosts["hv1"].errors = {
            "b_sensor": daemon_error(3003, "SFP index 5 in use by x_sensor", "spec.hardware.sfp[0]"),
            "c_sensor": daemon_error(4001, "QEMU failed"),
        }
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        stamp = datetime.fromtimestamp(self.now).isoformat()
        self.assertEqual(
            self.so_file("hv1", "b_sensor.error"),
            {
                "config": {k: v for k, v in b.items() if k not in ("cpu", "memory", "sfp", "copper")},
                "status": "error",
                "timestamp": stamp,
                "error_details": {"code": 3, "message": "Hardware validation failure: SFP index 5 in use by x_sensor"},
            },
        )
        self.assertEqual(
            self.so_file("hv1", "c_sensor.error"),
            {
                "config": {k: v for k, v in c.items() if k not in ("cpu", "memory", "sfp", "copper")},
                "status": "error",
                "timestamp": stamp,
                "error_details": {"code": 4, "message": "vmhostd error 4001: QEMU failed"},
            },
        )
        # Nothing was made: no tracking file stays, as after SO's failed provisioning.
        self.assertFalse(os.path.exists(self.so_path("hv1", "b_sensor")))
        self.assertFalse(os.path.exists(self.so_path("hv1", "c_sensor")))
        self.assertEqual(self.so_file("hv1", "b_sensor.status")["status"], "Hardware Configuration Failed")
        self.assertEqual(self.so_file("hv1", "c_sensor.status")["status"], "Processing")
        self.assertIn(
            (
                "soc/dyanno/hypervisor/hardware configuration failed",
                {"vm_name": "b_sensor", "hypervisor": "hv1", "status": "Hardware Configuration Failed"},
            ),
            self.so_events(),
        )
        self.assertFalse([t for t, d in self.so_events() if d["vm_name"] == "c_sensor" and "processing" not in t])
        # Fixed: retried after `retry`, the .error files go, the tracking files come.
        self.hosts["hv1"].errors = {}
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        names = sorted(os.listdir(os.path.join(self.dir, "hv1")))
        self.assertEqual(names, ["b_sensor", "b_sensor.status", "c_sensor", "c_sensor.status"])
        self.assertEqual(self.so_file("hv1", "b_sensor.status")["status"], "Created Instance")

    def test_a_failed_change_of_an_existing_vm_keeps_its_tracking_file(self):
        a = so_entry("a", sfp=["5"], copper=["1"])
        self.write("hv1", [a])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        seen = {}
        real = self.hosts["hv1"].reconcile

        def reconcile(**kw):
            seen["tracking"] = self.so_file("hv1", "a_sensor")
            return real(**kw)

        self.hosts["hv1"].reconcile = reconcile
        edited = dict(a, cpu=8, memory=16)
        self.write("hv1", [edited])
        self.hosts["hv1"].errors = {"a_sensor": daemon_error(3002, "not enough CPUs", "spec.cpu")}
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        # The VM still runs as before: its tracking file claims its old hardware, before and
        # after the refused change; the .error keeps the whole entry that failed.
        self.assertEqual(seen["tracking"], {"config": a})
        self.assertEqual(self.so_file("hv1", "a_sensor"), {"config": a})
        error = self.so_file("hv1", "a_sensor.error")
        self.assertEqual(error["config"], edited)
        self.assertEqual(error["error_details"]["code"], 3)
        # Fixed: the tracking file takes the new entry once applied, the .error goes.
        self.hosts["hv1"].errors = {}
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.so_file("hv1", "a_sensor"), {"config": edited})
        self.assertFalse(os.path.exists(self.so_path("hv1", "a_sensor.error")))

    def test_nsm_disk_full_is_sos_own_status(self):
        self.write("hv1", [so_entry("d", nsm_size=5000)])
        self.hosts["hv1"].errors = {
            "d_sensor": daemon_error(
                3002,
                "not enough disk space",
                "spec.disks",
                {"resource": "disk_gib", "requested": 5000, "available": 10},
            )
        }
        self.engine().run_once()
        self.assertEqual(self.so_file("hv1", "d_sensor.error")["error_details"]["code"], 3)
        self.assertEqual(
            self.so_events()[-1],
            (
                "soc/dyanno/hypervisor/hypervisor nsm disk full",
                {"vm_name": "d_sensor", "hypervisor": "hv1", "status": "Hypervisor NSM Disk Full"},
            ),
        )

    def test_destroy_removes_tracking_and_destroyed_status_expires_after_48h(self):
        self.write("hv1", [so_entry("a"), so_entry("b")])
        engine = self.engine()
        engine.run_once()
        self.events.clear()
        self.write("hv1", [so_entry("a")])
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor"})
        self.assertFalse(os.path.exists(self.so_path("hv1", "b_sensor")))
        destroyed_at = self.now
        self.assertEqual(
            self.so_file("hv1", "b_sensor.status"),
            {"status": "Destroyed Instance", "timestamp": datetime.utcfromtimestamp(destroyed_at).isoformat()},
        )
        self.assertEqual(
            self.so_events(),
            [
                (
                    "soc/dyanno/hypervisor/destroyed instance",
                    {"vm_name": "b_sensor", "hypervisor": "hv1", "status": "Destroyed Instance"},
                )
            ],
        )
        # Other status files, and one without a usable timestamp (its mtime counts).
        old = destroyed_at - 100 * HOURS
        with open(self.so_path("hv1", "x_sensor.status"), "w") as f:
            json.dump({"status": "Destroyed Instance", "timestamp": "garbage"}, f)
        os.utime(self.so_path("hv1", "x_sensor.status"), (old, old))
        with open(self.so_path("hv1", "y_sensor.status"), "w") as f:
            json.dump({"status": "Created Instance", "timestamp": "2000-01-01T00:00:00"}, f)
        self.now = destroyed_at + 48 * HOURS - 1
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertTrue(os.path.exists(self.so_path("hv1", "b_sensor.status")))
        self.assertFalse(os.path.exists(self.so_path("hv1", "x_sensor.status")))
        self.assertTrue(os.path.exists(self.so_path("hv1", "y_sensor.status")))
        self.now = destroyed_at + 48 * HOURS + 1
        self.now += 300
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertFalse(os.path.exists(self.so_path("hv1", "b_sensor.status")))
        self.assertTrue(os.path.exists(self.so_path("hv1", "a_sensor.status")))

    def test_a_failed_vm_dropped_from_the_file_loses_its_error_and_status(self):
        self.write("hv1", [so_entry("a"), so_entry("b")])
        self.hosts["hv1"].errors = {"b_sensor": daemon_error(3001, "no sfp 9")}
        engine = self.engine()
        engine.run_once()
        self.assertTrue(os.path.exists(self.so_path("hv1", "b_sensor.error")))
        self.write("hv1", [so_entry("a")])
        engine.run_once()
        self.assertEqual(sorted(os.listdir(os.path.join(self.dir, "hv1"))), ["a_sensor", "a_sensor.status"])

    def test_a_symlinked_hypervisor_dir_is_refused(self):
        elsewhere = os.path.join(self.tmp.name, "elsewhere")
        os.mkdir(elsewhere)
        os.symlink(elsewhere, os.path.join(self.dir, "hv1"))
        self.write("hv1", [so_entry("a")])
        self.write("hv2", [so_entry("b")])
        self.assertEqual(self.engine().run_once(), {"hv1": "failed", "hv2": "ok"})
        self.assertEqual(os.listdir(elsewhere), [])
        self.assertEqual([c[0] for c in self.client.calls], ["hv2"], "hv1 not reconciled without its SO files")
        failed = dict(self.events)["vmhost/hv1/_hypervisor/reconcile_failed"]
        self.assertIn("symbolic link", failed["error"])

    def test_a_symlink_in_place_of_a_file_is_replaced_not_followed(self):
        target = os.path.join(self.tmp.name, "target")
        with open(target, "w") as f:
            f.write("keep")
        os.mkdir(os.path.join(self.dir, "hv1"))
        os.symlink(target, self.so_path("hv1", "a_sensor"))
        self.write("hv1", [so_entry("a")])
        self.engine().run_once()
        with open(target) as f:
            self.assertEqual(f.read(), "keep")
        self.assertFalse(os.path.islink(self.so_path("hv1", "a_sensor")))
        self.assertEqual(self.so_file("hv1", "a_sensor"), {"config": so_entry("a")})

    def test_writes_are_atomic_and_synced(self):
        self.write("hv1", [so_entry("a")])
        steps = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            steps.append("fsync")
            real_fsync(fd)

        def replace(src, dst, **kw):
            steps.append(("rename", src, dst, "src_dir_fd" in kw))
            real_replace(src, dst, **kw)

        with mock.patch.object(eng.os, "fsync", fsync), mock.patch.object(eng.os, "replace", replace):
            self.engine().run_once()
        renames = [s for s in steps if s != "fsync"]
        self.assertIn(("rename", ".a_sensor.vmhost-tmp", "a_sensor", True), renames)
        for i, step in enumerate(steps):
            if step != "fsync" and step[1].startswith("."):
                self.assertEqual((steps[i - 1], steps[i + 1]), ("fsync", "fsync"), steps)
        self.assertFalse([n for n in os.listdir(os.path.join(self.dir, "hv1")) if n.startswith(".")])

    def test_ownership_socore_or_file_owner_only_as_root(self):
        self.write("hv1", [so_entry("a")])
        chowned = []
        with mock.patch.object(eng.os, "fchown", lambda fd, uid, gid: chowned.append((uid, gid))):
            self.engine(owner=(4242, 4343), euid=lambda: 0).run_once()
        # The directory, the tracking file, the .status file (twice: Processing, then Created).
        self.assertGreaterEqual(len(chowned), 4)
        self.assertEqual(set(chowned), {(4242, 4343)})
        chowned.clear()
        self.write("hv1", [so_entry("a"), so_entry("b")])
        with mock.patch.object(eng.os, "fchown", lambda fd, uid, gid: chowned.append((uid, gid))):
            self.engine(owner=(4242, 4343), euid=lambda: 1000).run_once()
        self.assertEqual(chowned, [], "only root changes owners")

    def test_a_directory_it_did_not_make_keeps_its_owner(self):
        os.mkdir(os.path.join(self.dir, "hv1"))
        self.write("hv1", [so_entry("a")])
        dir_fd = []
        real_open = eng.os.open

        def opened(path, flags, *args, **kw):
            fd = real_open(path, flags, *args, **kw)
            if path == "hv1" and flags & os.O_DIRECTORY:
                dir_fd.append(fd)
            return fd

        chowned = []
        with (
            mock.patch.object(eng.os, "open", opened),
            mock.patch.object(eng.os, "fchown", lambda fd, uid, gid: chowned.append(fd)),
        ):
            self.engine(owner=(4242, 4343), euid=lambda: 0).run_once()
        self.assertEqual(len(dir_fd), 1, dir_fd)
        self.assertTrue(chowned, "the files it wrote are given away")
        self.assertNotIn(dir_fd[0], chowned, "a directory that was there is not")

    @unittest.skipUnless(os.geteuid() == 0, "needs root to give files away")
    def test_ownership_for_real(self):
        self.write("hv1", [so_entry("a")])
        self.engine(owner=(65534, 65534)).run_once()
        for path in (
            os.path.join(self.dir, "hv1"),
            self.so_path("hv1", "a_sensor"),
            self.so_path("hv1", "a_sensor.status"),
        ):
            st = os.stat(path)
            self.assertEqual((st.st_uid, st.st_gid), (65534, 65534), path)

    def test_file_owner_ids(self):
        pw = namedtuple("pw", "pw_uid pw_gid")
        gr = namedtuple("gr", "gr_gid")
        users, groups = {"svc": pw(500, 501)}, {"grp": gr(700)}

        def getpwnam(name):
            return users[name]

        def getgrnam(name):
            return groups[name]

        cfg = config(file_owner="svc:grp")
        self.assertEqual(eng.file_owner_ids(cfg, getpwnam, getgrnam), (500, 700))
        self.assertEqual(eng.file_owner_ids(config(file_owner="12:34"), getpwnam, getgrnam), (12, 34))
        self.assertIsNone(eng.file_owner_ids(config(), getpwnam, getgrnam))
        with self.assertRaises(eng.ConfigError):
            eng.file_owner_ids(config(file_owner="nobody-here:grp"), getpwnam, getgrnam)
        users["socore"] = pw(939, 939)
        self.assertEqual(eng.file_owner_ids(cfg, getpwnam, getgrnam), (939, 939), "socore wins")
        groups["socore"] = gr(940)
        self.assertEqual(eng.file_owner_ids(cfg, getpwnam, getgrnam), (939, 940))
        for bad in ("svc", "a:b:c", 5):
            with self.subTest(bad=bad), self.assertRaises(eng.ConfigError):
                config(file_owner=bad)

    def test_so_compat_default_and_off(self):
        self.assertTrue(config(vms_dir="/opt/so/saltstack/local/salt/hypervisor/hosts/")["so_compat"])
        self.assertFalse(config(vms_dir="/srv/vms")["so_compat"])
        self.write("hv1", [so_entry("a")])
        self.engine(so_compat=False).run_once()
        self.assertEqual(os.listdir(self.dir), ["hv1VMs"])
        self.assertEqual(self.so_events(), [])
        self.engine(so_compat=True, dry_run=True).run_once()
        self.assertEqual(os.listdir(self.dir), ["hv1VMs"], "a dry run writes no SO file")


BOOT = (
    "#cloud-config\nhostname: {hostname}\nsalt_minion:\n  conf: {{master: {master}, id: {vm_name}}}\n"
    "# {hypervisor} {role}\n"
)


class BootstrapTest(Base):
    def test_rendering(self):
        spec = eng.map_entry(so_entry("Sensor1"), config(bootstrap=BOOT, master="so-manager"), "f", 0, "hv1")
        self.assertEqual(
            spec["user_data"],
            "#cloud-config\nhostname: sensor1\nsalt_minion:\n  conf: {master: so-manager, id: sensor1_sensor}\n"
            "# hv1 sensor\n",
        )
        self.assertNotIn("user_data", eng.map_entry(so_entry("a"), config(), "f", 0, "hv1"))

    def test_template_checked_at_parse_time(self):
        for bad in ("{foo}", "{}", "{0}", "{vm_name.__class__}", "{vm_name[0]}", "{vm_name", "}", "{vm_name:{foo}}"):
            with self.subTest(bad=bad), self.assertRaises(eng.ConfigError):
                config(bootstrap=bad, master="m")
        with self.assertRaises(eng.ConfigError):
            config(bootstrap="{vm_name}")  # no master
        self.assertEqual(config(bootstrap="{{}}", master="m")["bootstrap"], "{{}}")

    def test_size_cap(self):
        cap = eng.MAX_USER_DATA
        name = "a_sensor"
        at_cap = config(bootstrap="x" * (cap - len(name)) + "{vm_name}", master="m")
        self.assertEqual(len(eng.map_entry(so_entry("a"), at_cap)["user_data"]), cap)
        over = config(bootstrap="x" * (cap - len(name) + 1) + "{vm_name}", master="m")
        with self.assertRaises(eng.EntryError) as ctx:
            eng.map_entry(so_entry("a"), over, "/d/hv1VMs", 2)
        self.assertEqual(ctx.exception.field, "user_data")
        self.assertIn("65537 bytes", str(ctx.exception))
        specs, errors, _, _ = eng.map_file(json.dumps([so_entry("a"), so_entry("bb")]), over, "f")
        self.assertEqual(([s["name"] for s in specs], [e.name for e in errors]), ([], ["a_sensor", "bb_sensor"]))

    def test_a_request_over_the_daemons_line_limit_fails_the_hypervisor(self):
        # 17 VMs with a bootstrap text just under 64 KiB each: every entry is good, but the one
        # vmhost.reconcile request would be over 1 MiB.
        big = "#cloud-config\n# " + "x" * (60 * 1024) + "\n# {vm_name}\n"
        self.write("hv1", [so_entry(f"s{i}") for i in range(17)])
        self.write("hv2", [so_entry(f"s{i}") for i in range(15)])
        engine = self.engine(bootstrap=big, master="m")
        self.assertEqual(engine.run_once(), {"hv1": "failed", "hv2": "ok"})
        self.assertEqual([c[0] for c in self.client.calls], ["hv2"])
        error = dict(self.events)["vmhost/hv1/_hypervisor/reconcile_failed"]["error"]
        self.assertRegex(error, r"request for hv1 would be \d{7} bytes, above the 1044480 that fit")
        self.assertFalse(os.path.exists(self.so_path("hv1", "s0_sensor")), "nothing written for hv1")

    def test_a_template_change_reruns(self):
        self.write("hv1", [so_entry("a")])
        self.assertEqual(self.engine(bootstrap=BOOT, master="m1", so_compat=False).run_once(), {"hv1": "ok"})
        self.assertEqual(self.engine(bootstrap=BOOT, master="m1", so_compat=False).run_once(), {"hv1": "skipped"})
        self.assertEqual(self.engine(bootstrap=BOOT, master="m2", so_compat=False).run_once(), {"hv1": "ok"})
        self.assertIn("master: m2", self.client.calls[-1][2]["vms"][0]["user_data"])


SCRIPT = "#!/bin/sh\necho master={master} id={vm_name} > /etc/salt/minion.d/vmhost.conf\n"
NO_CLOUD_INIT = {"kernel": "/boot/vmlinuz", "initrd": "/boot/initrd.img", "cloud_init": False}


class ExecHost(ErrHost):
    """An ErrHost whose guests run vmhost.guest_file_push and vmhost.guest_exec: ``booting``
    VMs answer 5001 (no exec server yet), ``failing`` ones run the bootstrap with exit 1 (the
    execution module then returns retcode 1, which the fake client shows as an ERROR)."""

    def __init__(self, vms=()):
        super().__init__(vms)
        self.booting = set()
        self.failing = set()
        self.files = {}
        self.ran = []

    def guest_file_push(self, name, path, content, mode, mkdir):
        if name in self.booting:
            raise RuntimeError("vmhostd error 5001: the guest of VM has no exec server (yet)")
        self.files[(name, path)] = (content, mode, mkdir)
        return {"path": path, "size": len(content), "sha256": "x"}

    def guest_exec(self, name, argv, timeout_s):
        if name in self.booting:
            raise RuntimeError("vmhostd error 5001: the guest of VM has no exec server (yet)")
        self.ran.append((name, argv, timeout_s))
        if name in self.failing:
            raise RuntimeError("{'exit_code': 1, 'stderr': 'no network'}")
        return {"exit_code": 0, "signal": None, "timed_out": False, "duration_ms": 7, "stdout": "", "stderr": ""}


class ExecBootstrapTest(Base):
    """A boot source with cloud_init: false: no user_data (no seed), the bootstrap script pushed
    and run through vm.exec once per VM instead."""

    def setUp(self):
        super().setUp()
        self.hosts["hv1"] = ExecHost()
        self.host = self.hosts["hv1"]

    def exec_engine(self, **over):
        boot = {"default": {"image": "so-base.qcow2", "disk_gib": 10}, "roles": {"sensor": NO_CLOUD_INIT}}
        return self.engine(bootstrap=SCRIPT, master="so-manager", boot=boot, so_compat=False, **over)

    def statuses(self, vm):
        return [t.rsplit("/", 1)[1] for t, _ in self.events if t.startswith(f"vmhost/hv1/{vm}/")]

    def test_config(self):
        boot = {"default": NO_CLOUD_INIT}
        self.assertEqual(config(boot=boot)["boot"]["default"]["cloud_init"], False)
        self.assertNotIn(
            "cloud_init", config(boot={"default": dict(NO_CLOUD_INIT, cloud_init=True)})["boot"]["default"]
        )
        with self.assertRaisesRegex(eng.ConfigError, "must be a script"):
            config(boot=boot, bootstrap=BOOT, master="m")
        with self.assertRaisesRegex(eng.ConfigError, "cloud_init must be true or false"):
            config(boot={"default": dict(NO_CLOUD_INIT, cloud_init="no")})
        with self.assertRaisesRegex(eng.ConfigError, "bootstrap_timeout"):
            config(boot=boot, bootstrap=SCRIPT, master="m", bootstrap_timeout=900)
        with self.assertRaisesRegex(eng.ConfigError, "timeout must be above 150"):
            config(boot=boot, bootstrap=SCRIPT, master="m", timeout=60)
        with self.assertRaisesRegex(eng.ConfigError, "positive integer"):
            config(bootstrap_timeout=0)
        self.assertEqual(config(bootstrap_timeout=30)["bootstrap_timeout"], 30)
        # Without exec bootstraps a short timeout (the end-to-end test's 60 s) stays valid.
        self.assertEqual(config(timeout=60)["bootstrap_timeout"], 600)
        self.assertEqual(config(boot=boot, bootstrap=SCRIPT, master="m", timeout=300)["bootstrap_timeout"], 150)

    def test_mapping_leaves_out_user_data_and_collects_the_script(self):
        cfg = config(boot={"default": IMAGE_BOOT, "roles": {"sensor": NO_CLOUD_INIT}}, bootstrap=SCRIPT, master="m")
        found = {}
        specs, errors, _, _ = eng.map_file(
            json.dumps([so_entry("a"), so_entry("b", role="searchnode")]), cfg, "f", "hv1", None, found
        )
        self.assertEqual(errors, [])
        sensor, search = specs
        self.assertNotIn("user_data", sensor, "no seed for a VM without cloud-init")
        self.assertNotIn("cloud_init", sensor["boot"], "not a vmhostd spec field")
        self.assertEqual(
            search["user_data"], "#!/bin/sh\necho master=m id=b_searchnode > /etc/salt/minion.d/vmhost.conf\n"
        )
        self.assertEqual(found, {"a_sensor": "#!/bin/sh\necho master=m id=a_sensor > /etc/salt/minion.d/vmhost.conf\n"})

    def test_the_script_is_pushed_and_run_once_per_vm(self):
        self.write("hv1", [so_entry("a"), so_entry("b", role="searchnode")])
        engine = self.exec_engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(
            self.host.files,
            {
                ("a_sensor", eng.BOOTSTRAP_PATH): (
                    "#!/bin/sh\necho master=so-manager id=a_sensor > /etc/salt/minion.d/vmhost.conf\n",
                    "0700",
                    True,
                )
            },
        )
        self.assertEqual(self.host.ran, [("a_sensor", [eng.BOOTSTRAP_PATH], 600)])
        self.assertIn("bootstrapped", self.statuses("a_sensor"))
        # The next run (the interval passed) does not run it again, nor does a new engine.
        self.now += 400
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.now += 400
        self.assertEqual(self.exec_engine().run_once(), {"hv1": "ok"})
        self.assertEqual(len(self.host.ran), 1)

    def test_a_booting_guest_is_waited_for_and_a_failure_retried(self):
        self.write("hv1", [so_entry("a")])
        self.host.booting.add("a_sensor")
        engine = self.exec_engine()
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.statuses("a_sensor")[-1], "bootstrap_waiting")
        self.assertEqual(engine.run_once(), {"hv1": "skipped"}, "retried after retry seconds, not at once")
        self.now += 60
        self.host.booting.clear()
        self.host.failing.add("a_sensor")
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.statuses("a_sensor")[-1], "bootstrap_failed")
        self.now += 60
        self.host.failing.clear()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.statuses("a_sensor")[-1], "bootstrapped")
        self.assertEqual(len(self.host.ran), 2)

    def test_stopped_vms_wait_and_a_recreated_vm_runs_it_again(self):
        self.write("hv1", [so_entry("a", powercontrol="Stop")])
        engine = self.exec_engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.host.ran, [], "a stopped VM is not bootstrapped")
        self.write("hv1", [so_entry("a")])
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(len(self.host.ran), 1)
        # Destroyed by hand, then made again by the engine: a new disk, so a new bootstrap.
        self.host.vms.discard("a_sensor")
        self.host.specs.pop("a_sensor")
        self.now += 400
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(len(self.host.ran), 2)

    def test_dry_run_runs_nothing(self):
        self.write("hv1", [so_entry("a")])
        self.assertEqual(self.exec_engine(dry_run=True).run_once(), {"hv1": "ok"})
        self.assertEqual((self.host.files, self.host.ran), ({}, []))


IMAGE_BOOT = {"image": "so-base.qcow2", "disk_gib": 10}


class BlockingClient(FakeClient):
    """A FakeClient whose calls for the minions in ``block`` wait until ``release`` is set."""

    def __init__(self, hosts, block):
        super().__init__(hosts)
        self.block = block
        self.release = threading.Event()
        self.entered = threading.Event()

    def cmd(self, tgt, fun, **kw):
        if tgt[0] in self.block:
            self.entered.set()
            if not self.release.wait(30):
                return {}
        return super().cmd(tgt, fun, **kw)


class ParallelTest(Base):
    def test_a_minion_that_does_not_answer_delays_only_its_own_hypervisor(self):
        client = BlockingClient(self.hosts, {"hv1"})
        self.addCleanup(client.release.set)
        hv2_done = threading.Event()

        def fire(data, tag):
            self.events.append((tag, data))
            if tag == "vmhost/hv2/_hypervisor/reconciled":
                hv2_done.set()

        self.write("hv1", [so_entry("a")])
        self.write("hv2", [so_entry("b")])
        engine = self.engine(client=client, fire=fire, so_compat=False)
        first = engine.run_once(wait=False)
        self.assertEqual(first["hv1"], "running")
        self.assertTrue(client.entered.wait(10))
        self.assertTrue(hv2_done.wait(10), "hv2 reconciled while hv1's minion hangs")
        self.assertEqual(self.hosts["hv2"].vms, {"b_sensor"})
        self.assertIn("vmhost/hv2/b_sensor/reconciled", [t for t, _ in self.events])
        if "hv2" in engine.inflight:
            concurrent.futures.wait([engine.inflight["hv2"]], timeout=10)
        self.now += 1000  # both due again; hv1 is still in flight and is not submitted twice
        second = engine.run_once(wait=False)
        self.assertEqual(second["hv1"], "running")
        self.assertIn(second["hv2"], ("ok", "running"))
        self.assertEqual(len([c for c in client.calls if c[0] == "hv1"]), 0, "hv1's call has not returned")
        self.assertEqual(list(engine.inflight).count("hv1"), 1)
        client.release.set()
        final = engine.run_once(wait=True)
        self.assertEqual(final["hv1"], "ok")
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor"})
        self.assertEqual(len([c for c in client.calls if c[0] == "hv1"]), 1)

    def test_one_client_per_worker_thread_and_runs_overlap(self):
        barrier = threading.Barrier(2, timeout=10)
        made = []

        class Client(FakeClient):
            def cmd(inner, tgt, fun, **kw):  # noqa: N805  pylint: disable=no-self-argument
                if fun == "vmhost.reconcile":
                    barrier.wait()  # both hypervisors' calls are in progress at once
                return FakeClient.cmd(inner, tgt, fun, **kw)

        def factory():
            client = Client(self.hosts)
            made.append((threading.get_ident(), client))
            return client

        self.write("hv1", [so_entry("a")])
        self.write("hv2", [so_entry("b")])
        engine = self.engine(client=factory, so_compat=False, parallel=2)
        self.assertEqual(engine.run_once(), {"hv1": "ok", "hv2": "ok"})
        self.assertEqual(len(made), 2)
        self.assertEqual(len({ident for ident, _ in made}), 2, "each worker thread made its own client")
        self.assertNotEqual(threading.get_ident(), made[0][0])
        # A thread keeps its client.
        engine.run_once()
        self.assertLessEqual(len(made), 2)

    def test_parallel_config(self):
        self.assertEqual(config()["parallel"], 8)
        for bad in (0, 65, "8", True, 1.5):
            with self.subTest(bad=bad), self.assertRaises(eng.ConfigError):
                config(parallel=bad)


class MigrationTest(Base):
    def test_an_old_dash_name_is_neither_destroyed_nor_doubled(self):
        os.makedirs(self.cache)
        with open(os.path.join(self.cache, "state.json"), "w") as f:
            json.dump({"hv1": {"managed": ["a-sensor", "gone-sensor"]}}, f)
        self.hosts["hv1"] = ErrHost({"a-sensor", "gone-sensor"})
        self.client = FakeClient(self.hosts)
        self.write("hv1", [entry("a")])
        engine = self.engine(so_compat=False)
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        # a-sensor kept (its disk too), a_sensor not created beside it; gone-sensor (removed
        # from the file) is pruned as before.
        self.assertEqual(self.hosts["hv1"].vms, {"a-sensor"})
        self.assertEqual([c[2] for c in self.client.calls if c[1] == "vmhost.destroy"], [{"name": "gone-sensor"}])
        self.assertEqual(self.client.calls[0][2]["vms"], [])
        migration = dict(self.events)["vmhost/hv1/a-sensor/migration_needed"]
        self.assertEqual(migration["vm_name"], "a_sensor")
        self.assertIn("migrate by hand", migration["hint"])
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a-sensor"])
        # The operator destroys the old VM: the engine sees it gone at its next run (still held
        # back then: the hold is decided before the call) and creates the new name at the one after.
        self.hosts["hv1"].vms.discard("a-sensor")
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], [])
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor"})
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a_sensor"])

    def held_engine(self, managed, on_host, entries, **over):
        os.makedirs(self.cache, exist_ok=True)
        with open(os.path.join(self.cache, "state.json"), "w") as f:
            json.dump({"hv1": {"managed": managed}}, f)
        self.hosts["hv1"] = ErrHost(on_host)
        self.client = FakeClient(self.hosts)
        self.write("hv1", entries)
        over.setdefault("so_compat", False)
        return self.engine(**over)

    def test_a_bad_entry_holds_its_old_named_vm_too(self):
        engine = self.held_engine(["a-sensor"], {"a-sensor"}, [entry("a", cpu="many")])
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a-sensor"})
        self.assertFalse([c for c in self.client.calls if c[1] == "vmhost.destroy"])
        self.assertIn("vmhost/hv1/a-sensor/migration_needed", [t for t, _ in self.events])
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a-sensor"])

    def test_a_held_new_name_is_not_destroyed_either(self):
        # Both forms managed and on the host: the new name is held back (not in the request),
        # which must not make it an extra to prune.
        engine = self.held_engine(["a-sensor", "a_sensor"], {"a-sensor", "a_sensor"}, [entry("a")])
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a-sensor", "a_sensor"})
        self.assertFalse([c for c in self.client.calls if c[1] == "vmhost.destroy"])
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a-sensor", "a_sensor"])

    def test_prune_all_never_destroys_an_old_named_vm_managed_or_not(self):
        # Managed: held, and prune is not sent (the daemon would destroy it with its disk).
        engine = self.held_engine(["a-sensor"], {"a-sensor", "x_sensor"}, [entry("a")], prune="all")
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a-sensor", "x_sensor"})
        self.assertFalse(self.client.calls[-1][2]["prune"])
        self.assertEqual(self.client.calls[-1][2]["vms"], [])
        # Not managed (the cache lost): found by a dry run first, held the same way.
        self.events.clear()
        engine = self.held_engine([], {"a-sensor", "x_sensor"}, [entry("a"), entry("b")], prune="all")
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a-sensor", "x_sensor", "b_sensor"})
        probe, call = [c[2] for c in self.client.calls if c[1] == "vmhost.reconcile"]
        self.assertEqual((probe["dry_run"], probe["prune"]), (True, True))
        self.assertEqual((call["dry_run"], call["prune"]), (False, False))
        self.assertEqual([s["name"] for s in call["vms"]], ["b_sensor"])
        self.assertIn("vmhost/hv1/a-sensor/migration_needed", [t for t, _ in self.events])
        # No old-form VM on the host: the file is the whole truth again.
        self.hosts["hv1"].vms.discard("a-sensor")
        self.client.calls.clear()
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_sensor"})
        self.assertTrue(self.client.calls[-1][2]["prune"])


if __name__ == "__main__":
    unittest.main()


SENSOR_PERF = {"cpu_policy": "dedicated", "numa": "auto", "hugepages": "1G", "emulator_cpu": True}


class PerformanceTest(Base):
    """``performance`` / ``performance_roles``: placement members SO's file has no fields for."""

    def test_config_shapes(self):
        self.assertEqual((config()["performance"], config()["performance_roles"]), ({}, {}))
        ok = config(performance={"cpu_policy": "shared", "numa": 1}, performance_roles={"sensor": SENSOR_PERF})
        self.assertEqual(ok["performance"], {"cpu_policy": "shared", "numa": 1})
        self.assertEqual(ok["performance_roles"], {"sensor": SENSOR_PERF})
        self.assertEqual(
            config(performance_roles={"sensor": {"numa": None}})["performance_roles"]["sensor"], {"numa": None}
        )
        bad = [
            {"performance": "dedicated"},
            {"performance": {"cpu": 2}},
            {"performance": {"cpu_policy": "pinned"}},
            {"performance": {"numa": "1"}},
            {"performance": {"numa": -1}},
            {"performance": {"numa": True}},
            {"performance": {"numa": None}},
            {"performance": {"hugepages": "2m"}},
            {"performance": {"emulator_cpu": "yes"}},
            {"performance_roles": [SENSOR_PERF]},
            {"performance_roles": {"sensors": SENSOR_PERF}},
            {"performance_roles": {"sensor": {"hugepages": 2}}},
        ]
        for over in bad:
            with self.subTest(over=over), self.assertRaises(eng.ConfigError):
                config(**over)

    def test_the_default_and_a_roles_values_go_into_the_spec(self):
        cfg = config(
            performance={"numa": "none", "hugepages": "2M"},
            performance_roles={"sensor": {"cpu_policy": "dedicated", "numa": "auto", "hugepages": None}},
        )
        sensor = eng.map_entry(so_entry("a", memory=8), cfg, "f", 0, "hv1")
        self.assertEqual(
            {k: sensor.get(k) for k in eng.PERFORMANCE_KEYS},
            {"cpu_policy": "dedicated", "numa": "auto", "hugepages": None, "emulator_cpu": None},
        )
        self.assertNotIn("hugepages", sensor, "a null in the role drops the default's value")
        search = eng.map_entry(so_entry("b", role="searchnode"), cfg, "f", 1, "hv1")
        self.assertEqual((search["numa"], search["hugepages"], search.get("cpu_policy")), ("none", "2M", None))
        plain = eng.map_entry(so_entry("c"), config(), "f", 2, "hv1")
        self.assertFalse(set(eng.PERFORMANCE_KEYS) & set(plain), plain)

    def test_a_changed_default_reconverges_as_a_hardware_configuration(self):
        a = so_entry("a", sfp=["5"])
        self.write("hv1", [a])
        self.assertEqual(self.engine().run_once(), {"hv1": "ok"})
        self.assertNotIn("cpu_policy", self.hosts["hv1"].specs["a_sensor"])
        self.events.clear()
        engine = self.engine(performance_roles={"sensor": SENSOR_PERF})
        self.assertEqual(engine.run_once(), {"hv1": "ok"}, "a config change is a change even with the file as it was")
        spec = self.hosts["hv1"].specs["a_sensor"]
        self.assertEqual({k: spec[k] for k in SENSOR_PERF}, SENSOR_PERF)
        reconciled = dict(self.events)["vmhost/hv1/a_sensor/reconciled"]
        self.assertEqual((reconciled["action"], reconciled["fields"]), ("reconfigure", sorted(SENSOR_PERF)))
        self.assertEqual(
            self.so_events(),
            [
                (
                    "soc/dyanno/hypervisor/hardware configuration",
                    {"vm_name": "a_sensor", "hypervisor": "hv1", "status": "Hardware Configuration"},
                )
            ],
        )
        self.now += 1
        self.assertEqual(self.engine(performance_roles={"sensor": SENSOR_PERF}).run_once(), {"hv1": "skipped"})

    def test_configs_without_it_keep_their_digest(self):
        # The digest as engines before performance computed it: no rerun after an upgrade.
        cfg = config()
        h = eng.hashlib.sha256(b"[]\0")
        keys = ("network", "boot", "prune", "dry_run", "bootstrap", "master", "so_compat")
        relevant = dict({k: cfg.get(k) for k in keys}, minion="hv1")
        h.update(json.dumps(relevant, sort_keys=True).encode())
        self.assertEqual(eng.content_digest(b"[]", cfg, "hv1"), h.hexdigest())
        self.assertNotEqual(eng.content_digest(b"[]", config(performance={"numa": "none"}), "hv1"), h.hexdigest())

    def test_a_host_without_vm_cpus_is_sos_hardware_validation_failure(self):
        self.write("hv1", [so_entry("a")])
        self.hosts["hv1"].errors = {
            "a_sensor": daemon_error(3001, "the host config names no vm_cpus", "spec.cpu_policy", kind="not_in_model")
        }
        self.assertEqual(self.engine(performance_roles={"sensor": SENSOR_PERF}).run_once(), {"hv1": "partial"})
        self.assertEqual(
            self.so_file("hv1", "a_sensor.error")["error_details"],
            {"code": 3, "message": "Hardware validation failure: the host config names no vm_cpus"},
        )
        self.assertEqual(self.so_file("hv1", "a_sensor.status")["status"], "Hardware Configuration Failed")


MONITOR = {"mode": "monitor", "source": "eth1"}


class CaptureTest(Base):
    """``capture_interface`` / ``capture_roles``: a monitor NIC for the VMs of the roles that
    sniff, from the hypervisor's capture interface, unless the entry declares its own."""

    def test_config_shapes(self):
        self.assertEqual((config()["capture_interface"], config()["capture_roles"]), (None, ["sensor", "heavynode"]))
        self.assertEqual(config(capture_interface="bond0.100")["capture_interface"], "bond0.100")
        self.assertEqual(
            config(capture_interface={"hv1": "eth1", "hv2": None})["capture_interface"], {"hv1": "eth1", "hv2": None}
        )
        self.assertEqual(config(capture_roles=["idh"], capture_interface="eth1")["capture_roles"], ["idh"])
        self.assertEqual(config(capture_roles=[])["capture_roles"], [])
        bad = [
            {"capture_interface": ""},
            {"capture_interface": "a-name-over-15-bytes"},
            {"capture_interface": "eth1:0"},
            {"capture_interface": "eth 1"},
            {"capture_interface": "../x"},
            {"capture_interface": ".."},
            {"capture_interface": ["eth1"]},
            {"capture_interface": 1},
            {"capture_interface": {"hv1": ""}},
            {"capture_interface": {"hv1": 7}},
            {"capture_roles": "sensor"},
            {"capture_roles": ["sensors"]},
            {"capture_roles": ["sensor", "sensor"]},
            {"capture_roles": None},
        ]
        for over in bad:
            with self.subTest(over=over), self.assertRaises(eng.ConfigError):
                config(**over)

    def test_the_sniffing_roles_get_a_monitor_nic_after_their_addressed_one(self):
        cfg = config(capture_interface="eth1")
        for role in ("sensor", "heavynode"):
            spec = eng.map_entry(so_entry("a", role=role), cfg, "f", 0, "hv1")
            self.assertEqual(spec["nics"], [{"network": "br0", "ipv4": {"mode": "dhcp"}}, MONITOR], role)
        for role in ("searchnode", "receiver", "idh", "fleet"):
            spec = eng.map_entry(so_entry("a", role=role), cfg, "f", 0, "hv1")
            self.assertEqual(len(spec["nics"]), 1, role)
        plain = eng.map_entry(so_entry("a"), config(), "f", 0, "hv1")
        self.assertEqual(len(plain["nics"]), 1, "no capture_interface, no monitor NIC")

    def test_capture_roles_replace_the_default_roles(self):
        cfg = config(capture_interface="eth1", capture_roles=["idh"])
        self.assertEqual(eng.map_entry(so_entry("a", role="idh"), cfg, "f", 0, "hv1")["nics"][1], MONITOR)
        self.assertEqual(len(eng.map_entry(so_entry("a"), cfg, "f", 0, "hv1")["nics"]), 1)
        self.assertEqual(
            len(eng.map_entry(so_entry("a"), config(capture_interface="eth1", capture_roles=[]))["nics"]), 1
        )

    def test_a_mapping_names_each_hypervisors_interface(self):
        cfg = config(capture_interface={"hv1": "eth1", "hv2": "bond0", "hv3": None})
        self.assertEqual(eng.map_entry(so_entry("a"), cfg, "f", 0, "hv1")["nics"][1], MONITOR)
        self.assertEqual(eng.map_entry(so_entry("a"), cfg, "f", 0, "hv2")["nics"][1]["source"], "bond0")
        for hyp in ("hv3", "hv4"):
            self.assertEqual(len(eng.map_entry(so_entry("a"), cfg, "f", 0, hyp)["nics"]), 1, hyp)

    def test_an_entry_declaring_its_own_capture_interface_wins(self):
        cfg = config(capture_interface="eth1")
        own = eng.map_entry(so_entry("a", capture_interface="eth2"), cfg, "f", 0, "hv1")
        self.assertEqual(own["nics"][1:], [{"mode": "monitor", "source": "eth2"}], "one monitor NIC, its own")
        search = eng.map_entry(so_entry("b", role="searchnode", capture_interface="eth2"), config(), "f", 0, "hv1")
        self.assertEqual(search["nics"][1:], [{"mode": "monitor", "source": "eth2"}], "any role, no default needed")
        none = eng.map_entry(so_entry("c", capture_interface=False), cfg, "f", 0, "hv1")
        self.assertEqual(len(none["nics"]), 1, "false: no monitor NIC")
        for blank in ("", None, "  "):
            spec = eng.map_entry(so_entry("d", capture_interface=blank), cfg, "f", 0, "hv1")
            self.assertEqual(spec["nics"][1:], [MONITOR], f"{blank!r} is SO's empty field: the default")
        for bad in ("eth/1", 5, True, ["eth1"], "x" * 16):
            with self.subTest(bad=bad), self.assertRaises(eng.EntryError) as ctx:
                eng.map_entry(so_entry("e", capture_interface=bad), cfg, "f", 3, "hv1")
            self.assertEqual(ctx.exception.field, "capture_interface")

    def test_configs_without_it_keep_their_digest(self):
        h = eng.hashlib.sha256(b"[]\0")
        keys = ("network", "boot", "prune", "dry_run", "bootstrap", "master", "so_compat")
        base = config()
        relevant = dict({k: base.get(k) for k in keys}, minion="hv1")
        h.update(json.dumps(relevant, sort_keys=True).encode())
        self.assertEqual(eng.content_digest(b"[]", config(capture_roles=["idh"]), "hv1"), h.hexdigest())
        with_it = eng.content_digest(b"[]", config(capture_interface="eth1"), "hv1")
        self.assertNotEqual(with_it, h.hexdigest())
        self.assertNotEqual(
            eng.content_digest(b"[]", config(capture_interface="eth1", capture_roles=["idh"]), "hv1"), with_it
        )

    def test_setting_it_adds_the_nic_to_existing_sensors_in_place(self):
        self.write("hv1", [so_entry("a"), so_entry("b", role="searchnode")])
        self.assertEqual(self.engine().run_once(), {"hv1": "ok"})
        self.events.clear()
        self.now += 1
        self.assertEqual(self.engine(capture_interface="eth1").run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].specs["a_sensor"]["nics"][1:], [MONITOR])
        self.assertEqual(len(self.hosts["hv1"].specs["b_searchnode"]["nics"]), 1)
        reconciled = dict(self.events)["vmhost/hv1/a_sensor/reconciled"]
        self.assertEqual((reconciled["action"], reconciled["fields"]), ("reconfigure", ["nics"]))
        self.assertNotIn("vmhost/hv1/b_searchnode/reconciled", dict(self.events))
        self.now += 1
        self.assertEqual(self.engine(capture_interface="eth1").run_once(), {"hv1": "skipped"})

    def test_a_source_the_hypervisor_does_not_list_is_sos_hardware_validation_failure(self):
        self.write("hv1", [so_entry("a"), so_entry("b", role="searchnode")])
        self.hosts["hv1"].errors = {
            "a_sensor": daemon_error(
                3001, "the host config lists no capture interface eth1", "spec.nics[1].source", kind="not_in_model"
            )
        }
        self.assertEqual(self.engine(capture_interface="eth1").run_once(), {"hv1": "partial"})
        self.assertEqual(
            self.so_file("hv1", "a_sensor.error")["error_details"],
            {"code": 3, "message": "Hardware validation failure: the host config lists no capture interface eth1"},
        )
        self.assertEqual(self.so_file("hv1", "a_sensor.status")["status"], "Hardware Configuration Failed")
        failed = dict(self.events)["vmhost/hv1/a_sensor/reconcile_failed"]
        self.assertEqual((failed["error"]["code"], failed["error"]["field"]), (3001, "spec.nics[1].source"))
        self.assertIn("b_searchnode", self.hosts["hv1"].vms)
