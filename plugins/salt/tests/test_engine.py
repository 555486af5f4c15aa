"""Unit tests of the vmhost_engine master engine: the Security Onion mapping, change detection,
prune of managed VMs only, per-hypervisor failure isolation (fake LocalClient) and tags."""

import copy
import errno
import json
import logging
import os
import stat
import tempfile
import unittest
from unittest import mock

from vmhost_fakes import load_engine

eng = load_engine("vmhost_engine")
# The failures these tests provoke are logged on purpose; keep the test output readable.
eng.log.setLevel(logging.CRITICAL)

KERNEL = {"kernel": "/boot/vmlinuz", "initrd": "/boot/initrd.img", "cmdline": "console=ttyS0"}
IMAGE = {"image": "so-base.qcow2", "disk_gib": 100}


def config(**over):
    raw = {
        "vms_dir": "/nonexistent",
        "network": "br0",
        "boot": {"default": IMAGE, "roles": {"sensor": KERNEL}},
    }
    raw.update(over)
    return eng.parse_config(raw)


STATIC = {
    "hostname": "sensor1",
    "role": "sensor",
    "network_mode": "static4",
    "ip4": "192.168.1.10/24",
    "gw4": "192.168.1.1",
    "dns4": "192.168.1.2, 192.168.1.3",
    "search4": "example.com",
    "cpu": 4,
    "memory": 8,
    "disk": [],
    "copper": ["1", 2],
    "sfp": ["5"],
}


class MappingTest(unittest.TestCase):
    def test_static_entry_maps_every_field(self):
        spec = eng.map_entry(STATIC, config(), "/x/hv1VMs", 0)
        self.assertEqual(
            spec,
            {
                "name": "sensor1_sensor",
                "role": "sensor",
                "cpu": 4,
                "memory_mib": 8192,
                "state": "running",
                "hardware": {"copper": [1, 2], "sfp": [5]},
                "boot": KERNEL,
                "nics": [
                    {
                        "network": "br0",
                        "ipv4": {
                            "mode": "static",
                            "address": "192.168.1.10/24",
                            "gateway": "192.168.1.1",
                            "dns": ["192.168.1.2", "192.168.1.3"],
                            "search": ["example.com"],
                        },
                    }
                ],
            },
        )

    def test_dhcp_ignores_static_fields_and_default_boot_with_nsm(self):
        entry = {
            "hostname": "Search1",
            "role": "searchnode",
            "network_mode": "dhcp4",
            "ip4": "",
            "gw4": "",
            "dns4": "",
            "search4": "",
            "cpu": "2",
            "memory": "16",
            "nsm_size": 500,
        }
        spec = eng.map_entry(entry, config())
        self.assertEqual(spec["name"], "search1_searchnode")
        self.assertEqual(spec["nics"], [{"network": "br0", "ipv4": {"mode": "dhcp"}}])
        self.assertEqual(spec["cpu"], 2)
        self.assertEqual(spec["memory_mib"], 16384)
        self.assertNotIn("hardware", spec)
        # nsm_size is a data disk of its own, raw and preallocated as SO makes its NSM volumes;
        # the overlay keeps the configured size.
        self.assertEqual(spec["boot"], {"image": "so-base.qcow2", "disk_gib": 100})
        self.assertEqual(
            spec["disks"],
            [{"name": "nsm", "size_gib": 500, "format": "raw", "preallocate": True, "cache": "none", "aio": "native"}],
        )

    def test_nsm_size_ignored_when_disk_is_set(self):
        entry = dict(STATIC, role="heavynode", disk=["3"], nsm_size=500)
        spec = eng.map_entry(entry, config())
        self.assertEqual(spec["boot"], IMAGE)
        self.assertEqual(spec["hardware"]["disk"], [3])
        self.assertNotIn("disks", spec, "the NSM data lives on the passed-through disk")

    def test_powercontrol(self):
        self.assertEqual(eng.map_entry(dict(STATIC, powercontrol="Stop"), config())["state"], "stopped")
        self.assertEqual(eng.map_entry(dict(STATIC, powercontrol="Shutdown"), config())["state"], "stopped")
        self.assertEqual(eng.map_entry(dict(STATIC, powercontrol="Start"), config())["state"], "running")
        self.assertEqual(eng.map_entry(dict(STATIC, powercontrol="Reboot"), config())["state"], "running")

    def test_static_without_gateway_dns_search(self):
        entry = dict(STATIC, gw4="", dns4="", search4=None)
        spec = eng.map_entry(entry, config())
        self.assertEqual(spec["nics"][0]["ipv4"], {"mode": "static", "address": "192.168.1.10/24"})

    def test_bad_fields_name_file_and_field(self):
        cases = [
            ({"hostname": "bad_host"}, "hostname"),
            ({"hostname": 7}, "hostname"),
            ({"role": "manager"}, "role"),
            ({"cpu": "two"}, "cpu"),
            ({"cpu": True}, "cpu"),
            ({"cpu": 0}, "cpu"),
            ({"memory": 1.5}, "memory"),
            ({"network_mode": "static6"}, "network_mode"),
            ({"ip4": "192.168.1.10"}, "ip4"),
            ({"ip4": "300.1.1.1/24"}, "ip4"),
            ({"gw4": "10.0.0.1"}, "gw4"),
            ({"gw4": "192.168.1.10"}, "gw4"),
            ({"dns4": "192.168.1.2,nameserver"}, "dns4"),
            ({"search4": "bad_domain!"}, "search4"),
            ({"sfp": ["x"]}, "sfp[0]"),
            ({"copper": ["1", 1]}, "copper[1]"),
            ({"copper": "1"}, "copper"),
            ({"powercontrol": "Explode"}, "powercontrol"),
            ({"nsm_size": "big"}, "nsm_size"),
        ]
        for change, field in cases:
            with self.subTest(change=change):
                with self.assertRaises(eng.EntryError) as ctx:
                    eng.map_entry(dict(STATIC, **change), config(), "/x/hv1VMs", 3)
                self.assertEqual(ctx.exception.field, field)
                self.assertIn("/x/hv1VMs", str(ctx.exception))
                self.assertIn("entry 3", str(ctx.exception))
                self.assertIn(f"field {field}", str(ctx.exception))
        entry = dict(STATIC)
        del entry["cpu"]
        with self.assertRaises(eng.EntryError) as ctx:
            eng.map_entry(entry, config())
        self.assertEqual(ctx.exception.field, "cpu")

    def test_role_without_boot_source(self):
        cfg = eng.parse_config({"vms_dir": "/x", "network": "br0", "boot": {"roles": {"sensor": KERNEL}}})
        with self.assertRaises(eng.EntryError) as ctx:
            eng.map_entry(dict(STATIC, role="idh"), cfg, "f", 0)
        self.assertEqual(ctx.exception.field, "role")
        self.assertIn("boot.roles.idh", str(ctx.exception))

    def test_map_file_keeps_good_entries(self):
        entries = [
            STATIC,
            dict(STATIC, hostname="sensor2", cpu="x"),
            dict(STATIC, hostname="bad_name"),
            dict(STATIC, hostname="search1", role="searchnode", network_mode="dhcp4"),
            dict(STATIC, hostname="SENSOR1"),
        ]
        specs, errors, protected, complete = eng.map_file(json.dumps(entries), config(), "/d/hv1VMs")
        self.assertEqual([s["name"] for s in specs], ["sensor1_sensor", "search1_searchnode"])
        self.assertEqual([(e.index, e.field) for e in errors], [(1, "cpu"), (2, "hostname"), (4, "hostname")])
        self.assertIn("already defined by entry 0", str(errors[2]))
        self.assertEqual(protected, {"sensor2_sensor", "sensor1_sensor"})
        self.assertFalse(complete)
        specs, errors, protected, complete = eng.map_file(json.dumps(entries[:2]), config(), "f")
        self.assertTrue(complete)

    def test_map_file_rejects_non_arrays(self):
        for text in ("{", '{"hostname": "x"}', "null"):
            with self.assertRaises(eng.EntryError) as ctx:
                eng.map_file(text, config(), "/d/hv1VMs")
            self.assertEqual(ctx.exception.field, "file")
            self.assertIn("/d/hv1VMs", str(ctx.exception))

    def test_config_errors(self):
        for raw in (
            {"network": "br0", "boot": {"default": IMAGE}},
            {"vms_dir": "rel", "network": "br0", "boot": {"default": IMAGE}},
            {"vms_dir": "/d", "boot": {"default": IMAGE}},
            {"vms_dir": "/d", "network": "br0"},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": {"image": "x"}}},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": {"kernel": "rel"}}},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": dict(IMAGE, kernel="/k")}},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": IMAGE}, "prune": "some"},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": IMAGE}, "interval": 0},
            {"vms_dir": "/d", "network": "br0", "boot": {"default": IMAGE}, "colour": 1},
            {"vms_dir": "/d/../etc", "network": "br0", "boot": {"default": IMAGE}},
            {"vms_dir": "/d/./x", "network": "br0", "boot": {"default": IMAGE}},
        ):
            with self.subTest(raw=raw), self.assertRaises(eng.ConfigError):
                eng.parse_config(raw)


class TagTest(unittest.TestCase):
    def test_tags(self):
        self.assertEqual(eng.build_tag("hv1", "sensor1_sensor", "reconciled"), "vmhost/hv1/sensor1_sensor/reconciled")
        self.assertEqual(eng.build_tag("hv.example.com", "_hypervisor", "x"), "vmhost/hv.example.com/_hypervisor/x")
        self.assertEqual(eng.build_tag("a/b", "..", ""), "vmhost/a_b/_/_")
        self.assertEqual(eng.build_tag("h", "x" * 100, "s"), "vmhost/h/" + "x" * 64 + "/s")


class FakeHost:
    """A hypervisor minion with vmhostd, as far as reconcile and destroy go: an edited spec is
    reconfigured in place, a new boot image is a replace that needs ``replace`` (which the engine
    never gives: the fake takes no such argument), so it carries the daemon's 2002."""

    def __init__(self, vms=()):
        self.vms = set(vms)
        self.specs = {}
        self.calls = []
        self.fail_create = set()

    def _change(self, spec):
        """(action, fields, error) for a desired spec of an existing VM."""
        old = self.specs.setdefault(spec["name"], spec)
        fields = sorted(k for k in set(old) | set(spec) if k != "state" and old.get(k) != spec.get(k))
        if not fields:
            return "none", [], None
        if (old.get("boot") or {}).get("image") != (spec.get("boot") or {}).get("image"):
            fields = ["boot.image"]
            err = {
                "code": 2002,
                "message": f'VM "{spec["name"]}": boot.image changes, which needs a new disk and destroys the old '
                "one (boot.image); pass replace: true to do that",
                "data": {"kind": "spec_drift", "field": "spec.boot.image", "details": {"fields": fields}},
            }
            return "replace", fields, err
        return "reconfigure", fields, None

    def reconcile(self, vms, prune, dry_run):
        desired = [s["name"] for s in vms]
        by_name = {s["name"]: s for s in vms}
        extra = sorted(self.vms - set(desired))
        plan, results = [], []
        for name in desired:
            if name in self.vms:
                action, fields, err = self._change(by_name[name])
            else:
                action, fields, err = "create", [], None
            item = {"vm": name, "action": action, "reason": "", "error": err}
            if fields:
                item["fields"] = fields
            if action == "reconfigure":
                item["restart"] = True
            plan.append(item)
        for name in extra:
            plan.append({"vm": name, "action": "destroy" if prune else "none", "reason": "", "error": None})
        if not dry_run:
            for item in plan:
                name, action = item["vm"], item["action"]
                ok = name not in self.fail_create and item["error"] is None
                err = item["error"]
                if ok is False and err is None:
                    err = {"code": 4001, "message": "QEMU failed", "data": {"kind": "x", "field": None}}
                if ok and action in ("create", "reconfigure"):
                    self.vms.add(name)
                    self.specs[name] = by_name[name]
                if ok and action == "destroy":
                    self.vms.discard(name)
                    self.specs.pop(name, None)
                results.append(
                    {"vm": name, "action": action, "ok": ok, "changed": ok and action != "none", "error": err}
                )
        ok = all(r["ok"] for r in results) and all(p["error"] is None for p in plan)
        return {"dry_run": dry_run, "plan": plan, "results": results, "ok": ok}

    def destroy(self, name):
        if name not in self.vms:
            raise RuntimeError(f'vmhostd error 4040 (name): no VM named "{name}"')
        self.vms.discard(name)
        self.specs.pop(name, None)
        return {"changed": True, "vm": None}


class FakeClient:
    """LocalClient.cmd over FakeHosts; a minion id missing from `hosts` is down."""

    def __init__(self, hosts):
        self.hosts = hosts
        self.calls = []
        self.raise_for = set()
        self.garbage_for = {}
        # hyp -> what LocalClient.cmd gives for a targeted minion that did not return.
        self.noanswer_for = {}

    def cmd(self, tgt, fun, kwarg=None, tgt_type="glob", timeout=None, full_return=False):
        assert tgt_type == "list" and full_return and len(tgt) == 1
        hyp = tgt[0]
        self.calls.append((hyp, fun, copy.deepcopy(kwarg)))
        if hyp in self.raise_for:
            raise OSError("publish socket gone")
        if hyp in self.noanswer_for:
            return {hyp: self.noanswer_for[hyp]}
        if hyp in self.garbage_for:
            return {hyp: {"ret": self.garbage_for[hyp], "retcode": 0}}
        host = self.hosts.get(hyp)
        if host is None:
            return {}
        try:
            ret = getattr(host, fun.split(".")[1])(**kwarg)
        except RuntimeError as exc:
            return {hyp: {"ret": f"ERROR: {exc}", "retcode": 1}}
        return {hyp: {"ret": ret, "retcode": 0}}


def entry(host, role="sensor", **kw):
    e = {"hostname": host, "role": role, "network_mode": "dhcp4", "cpu": 1, "memory": 1}
    e.update(kw)
    return e


class EngineTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = os.path.join(self.tmp.name, "vms")
        os.mkdir(self.dir)
        self.cache = os.path.join(self.tmp.name, "cache", "vmhost_engine")
        self.now = 1000.0
        self.events = []
        self.hosts = {"hv1": FakeHost(), "hv2": FakeHost({"manual"})}
        self.client = FakeClient(self.hosts)
        # Accepted minion keys; "down" is accepted but never answers.
        self.accepted = ["hv1", "hv2", "down", "boom", "liar", "bad"]

    def engine(self, **over):
        over.setdefault("minion_id", "{hypervisor}")
        cfg = config(vms_dir=self.dir, interval=300, retry=60, **over)
        engine = eng.Engine(
            cfg,
            self.client,
            lambda data, tag: self.events.append((tag, data)),
            self.cache,
            lambda: self.now,
            accepted=lambda: self.accepted,
        )
        self.addCleanup(engine.close)
        return engine

    def write(self, hyp, entries, mtime=None):
        path = os.path.join(self.dir, f"{hyp}VMs")
        with open(path, "w") as f:
            f.write(entries if isinstance(entries, str) else json.dumps(entries))
        self.now += 1
        os.utime(path, (self.now, mtime or self.now))

    def tags(self):
        out = [t for t, _ in self.events]
        self.events.clear()
        return out

    def test_converges_and_fires_per_vm_results(self):
        self.write("hv1", [entry("a"), entry("b", "searchnode")])
        self.write("hv2", [entry("c")])
        out = self.engine().run_once()
        self.assertEqual(out, {"hv1": "ok", "hv2": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_searchnode"})
        self.assertEqual(self.hosts["hv2"].vms, {"c_sensor", "manual"})
        tags = self.tags()
        for tag in (
            "vmhost/hv1/a_sensor/reconciled",
            "vmhost/hv1/b_searchnode/reconciled",
            "vmhost/hv1/_hypervisor/reconciled",
            "vmhost/hv2/c_sensor/reconciled",
        ):
            self.assertIn(tag, tags)
        # The unmanaged VM on hv2 is neither touched nor reported.
        self.assertFalse([t for t in tags if "manual" in t])
        call = self.client.calls[0]
        self.assertEqual(call[1], "vmhost.reconcile")
        self.assertFalse(call[2]["prune"])
        self.assertEqual([s["name"] for s in call[2]["vms"]], ["a_sensor", "b_searchnode"])

    def test_change_detection_interval_and_retry(self):
        self.write("hv1", [entry("a")])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(engine.run_once(), {"hv1": "skipped"})
        # Same content, new mtime: hashed, still skipped.
        self.write("hv1", [entry("a")])
        self.assertEqual(engine.run_once(), {"hv1": "skipped"})
        # New content, same size and mtime: seen by its hash.
        self.write("hv1", [entry("b")], mtime=self.now)
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        # A restarted engine knows what it applied (cache dir).
        self.assertEqual(self.engine().run_once(), {"hv1": "skipped"})
        # The interval forces a run (drift correction).
        self.now += 301
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(engine.run_once(), {"hv1": "skipped"})
        # A failing host is retried every `retry` seconds, not every poll.
        del self.hosts["hv1"]
        self.write("hv1", [entry("c")])
        self.assertEqual(engine.run_once(), {"hv1": "failed"})
        self.assertEqual(engine.run_once(), {"hv1": "skipped"})
        self.now += 61
        self.hosts["hv1"] = FakeHost()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        # A config change (e.g. another boot image) changes the digest too.
        self.assertEqual(self.engine(network="br1").run_once(), {"hv1": "ok"})

    def test_failures_are_isolated(self):
        self.write("down", [entry("a")])
        self.write("hv1", [entry("b")])
        self.write("bad", "[{")
        self.write("boom", [entry("c")])
        self.write("liar", [entry("d")])
        self.write("hv2", [entry("e")])
        self.client.raise_for.add("boom")
        self.client.garbage_for["liar"] = {"plan": [{"vm": "../etc", "action": "none"}], "results": []}
        out = self.engine().run_once()
        self.assertEqual(
            out, {"bad": "failed", "boom": "failed", "down": "failed", "hv1": "ok", "hv2": "ok", "liar": "failed"}
        )
        self.assertEqual(self.hosts["hv1"].vms, {"b_sensor"})
        self.assertEqual(self.hosts["hv2"].vms, {"e_sensor", "manual"})
        failed = {t: d for t, d in self.events if t.endswith("/_hypervisor/reconcile_failed")}
        self.assertEqual(
            sorted(failed),
            [f"vmhost/{h}/_hypervisor/reconcile_failed" for h in ("bad", "boom", "down", "liar")],
        )
        self.assertIn("did not answer", failed["vmhost/down/_hypervisor/reconcile_failed"]["error"])
        self.assertIn("not valid JSON", failed["vmhost/bad/_hypervisor/reconcile_failed"]["error"])
        self.assertIn("could not be published", failed["vmhost/boom/_hypervisor/reconcile_failed"]["error"])
        self.assertIn("invalid VM", failed["vmhost/liar/_hypervisor/reconcile_failed"]["error"])
        self.assertIn("vmhost/bad/_hypervisor/invalid", [t for t, _ in self.events])

    def test_every_salt_form_of_a_minion_that_did_not_answer(self):
        # Salt 3007's LocalClient.cmd(full_return=True) for an accepted minion that is down:
        # False (cmd fills in targeted ids without a return), a "no_return" entry from
        # get_cli_event_returns, or the id missing altogether.
        forms = {
            "false": False,
            "none": None,
            "failed": {"failed": True},
            "noresponse": {
                "out": "no_return",
                "ret": "Minion did not return. [No response]\nThe minions may not have all finished",
                "retcode": 1,
            },
            "notconnected": {"out": "no_return", "ret": "Minion did not return. [Not connected]", "retcode": 1},
        }
        self.accepted = list(forms) + ["missing"]
        for hyp, answer in forms.items():
            self.client.noanswer_for[hyp] = answer
            self.write(hyp, [entry("a")])
        self.write("missing", [entry("a")])
        out = self.engine().run_once()
        self.assertEqual(out, {h: "failed" for h in self.accepted})
        failed = {t.split("/")[1]: d["error"] for t, d in self.events if t.endswith("/_hypervisor/reconcile_failed")}
        self.assertEqual(sorted(failed), sorted(self.accepted))
        for hyp, error in failed.items():
            self.assertEqual(
                error,
                f"minion {hyp} did not answer vmhost.reconcile within 960 s "
                "(down, key not accepted, or no such minion)",
            )

    def test_bad_entry_fires_invalid_and_others_apply(self):
        self.write("hv1", [entry("a"), entry("b", cpu="many"), entry("c", sfp=["x"])])
        out = self.engine().run_once()
        self.assertEqual(out, {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor"})
        invalid = {t: d for t, d in self.events if t.endswith("/invalid")}
        self.assertEqual(sorted(invalid), ["vmhost/hv1/b_sensor/invalid", "vmhost/hv1/c_sensor/invalid"])
        self.assertEqual(invalid["vmhost/hv1/c_sensor/invalid"]["field"], "sfp[0]")
        self.assertIn("hv1VMs", invalid["vmhost/hv1/b_sensor/invalid"]["error"])

    def test_prune_destroys_only_managed_vms(self):
        self.write("hv2", [entry("a"), entry("b")])
        engine = self.engine()
        engine.run_once()
        self.assertEqual(self.hosts["hv2"].vms, {"a_sensor", "b_sensor", "manual"})
        self.write("hv2", [entry("a")])
        self.events.clear()
        self.assertEqual(engine.run_once(), {"hv2": "ok"})
        self.assertEqual(self.hosts["hv2"].vms, {"a_sensor", "manual"})
        self.assertIn(("hv2", "vmhost.destroy", {"name": "b_sensor"}), self.client.calls)
        self.assertIn("vmhost/hv2/b_sensor/reconciled", self.tags())
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv2"]["managed"], ["a_sensor"])
        # An empty file empties the host of managed VMs, never of others.
        self.write("hv2", [])
        engine.run_once()
        self.assertEqual(self.hosts["hv2"].vms, {"manual"})

    def test_bad_entry_protects_its_vm_from_prune(self):
        self.write("hv1", [entry("a"), entry("b")])
        engine = self.engine()
        engine.run_once()
        self.write("hv1", [entry("a"), entry("b", memory="lots")])
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_sensor"})
        # A bad entry without a usable name stops all destroys on that host.
        self.write("hv1", [entry("Bad_One")])
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_sensor"})
        self.assertFalse([c for c in self.client.calls if c[1] == "vmhost.destroy"])
        # Fixed: both go.
        self.write("hv1", [])
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, set())

    def test_destroy_of_a_vm_already_gone_counts_as_done(self):
        self.write("hv1", [entry("a"), entry("b")])
        engine = self.engine()
        engine.run_once()

        real = self.hosts["hv1"].reconcile

        def reconcile_then_vanish(**kw):
            ret = real(**kw)
            self.hosts["hv1"].vms.discard("b_sensor")  # destroyed by hand meanwhile
            return ret

        self.hosts["hv1"].reconcile = reconcile_then_vanish
        self.write("hv1", [entry("a")])
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a_sensor"])

    def test_prune_all_and_off(self):
        self.write("hv2", [entry("a")])
        self.engine(prune="all").run_once()
        self.assertTrue(self.client.calls[-1][2]["prune"])
        self.assertEqual(self.hosts["hv2"].vms, {"a_sensor"})
        self.write("hv2", [])
        self.engine(prune="off").run_once()
        self.assertEqual(self.hosts["hv2"].vms, {"a_sensor"})
        self.assertFalse([c for c in self.client.calls if c[1] == "vmhost.destroy"])

    def test_failed_vm_is_reported_and_retried(self):
        self.hosts["hv1"].fail_create.add("b_sensor")
        self.write("hv1", [entry("a"), entry("b")])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        failed = [(t, d) for t, d in self.events if t == "vmhost/hv1/b_sensor/reconcile_failed"]
        self.assertEqual(len(failed), 1)
        self.assertEqual(failed[0][1]["error"]["code"], 4001)
        self.assertEqual(failed[0][1]["action"], "create")
        self.assertIn("vmhost/hv1/_hypervisor/reconcile_failed", [t for t, _ in self.events])
        self.hosts["hv1"].fail_create.clear()
        self.assertEqual(engine.run_once(), {"hv1": "skipped"})
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_sensor"})

    def test_an_edited_entry_is_reconfigured_and_never_replaced(self):
        self.write("hv1", [entry("a"), entry("b", "searchnode")])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.events.clear()
        # More memory for a: changed in place, reported with its fields and restart.
        self.write("hv1", [entry("a", memory=2), entry("b", "searchnode")])
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        done = [d for t, d in self.events if t == "vmhost/hv1/a_sensor/reconciled"]
        self.assertEqual(len(done), 1, self.events)
        self.assertEqual(
            {k: done[0][k] for k in ("action", "ok", "changed", "error", "fields", "restart")},
            {
                "action": "reconfigure",
                "ok": True,
                "changed": True,
                "error": None,
                "fields": ["memory_mib"],
                "restart": True,
            },
        )
        self.assertEqual(self.hosts["hv1"].specs["a_sensor"]["memory_mib"], 2048)
        self.assertFalse([t for t, _ in self.events if "b_searchnode" in t], "b is unchanged: no event")
        # Never replace: the engine leaves it out of every call (the daemon's default is false).
        for _, fun, kwarg in self.client.calls:
            if fun == "vmhost.reconcile":
                self.assertNotIn("replace", kwarg)

        # A new image for searchnode (the engine config's boot source): the daemon's 2002 is
        # reported for b, which is left as it is; a stays.
        self.events.clear()
        new_image = {"default": {"image": "so-new.qcow2", "disk_gib": 100}, "roles": {"sensor": KERNEL}}
        engine = self.engine(boot=new_image)
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        failed = [d for t, d in self.events if t == "vmhost/hv1/b_searchnode/reconcile_failed"]
        self.assertEqual(len(failed), 1, self.events)
        self.assertEqual(failed[0]["action"], "replace")
        self.assertEqual(failed[0]["ok"], False)
        self.assertEqual(failed[0]["fields"], ["boot.image"])
        self.assertEqual(
            (failed[0]["error"]["code"], failed[0]["error"]["field"], failed[0]["error"]["kind"]),
            (2002, "spec.boot.image", "spec_drift"),
        )
        self.assertIn("never replaces a VM", failed[0]["hint"])
        self.assertEqual(self.hosts["hv1"].specs["b_searchnode"]["boot"], IMAGE, "b left alone")
        self.assertEqual(self.hosts["hv1"].vms, {"a_sensor", "b_searchnode"})
        summary = [d for t, d in self.events if t == "vmhost/hv1/_hypervisor/reconcile_failed"]
        self.assertEqual((summary[0]["failed"], summary[0]["ok"]), (1, False))
        with open(os.path.join(self.cache, "state.json")) as f:
            self.assertEqual(json.load(f)["hv1"]["managed"], ["a_sensor", "b_searchnode"])
        # Retried after `retry`, and still never replaced.
        self.now += 61
        self.assertEqual(engine.run_once(), {"hv1": "partial"})
        self.assertEqual(self.hosts["hv1"].specs["b_searchnode"]["boot"], IMAGE)

    def test_plan_details_of_a_lying_minion_are_dropped(self):
        self.assertEqual(eng._plan_details({"fields": ["cpu", 3], "restart": "yes"}), {})
        self.assertEqual(eng._plan_details({"fields": ["x" * 500]}), {"fields": ["x" * 100]})
        self.assertEqual(eng._plan_details({"fields": ["f"] * 65, "restart": False}), {"restart": False})

    def test_dry_run_changes_nothing(self):
        self.write("hv2", [entry("a")])
        self.engine(dry_run=True).run_once()
        self.assertTrue(self.client.calls[-1][2]["dry_run"])
        self.assertEqual(self.hosts["hv2"].vms, {"manual"})

    def test_writes_only_its_cache_dir(self):
        self.write("hv1", [entry("a")])
        self.write("down", [entry("a")])
        before = {f: os.path.getmtime(os.path.join(self.dir, f)) for f in os.listdir(self.dir)}
        engine = self.engine()
        engine.run_once()
        self.now += 1000
        engine.run_once()
        after = {f: os.path.getmtime(os.path.join(self.dir, f)) for f in os.listdir(self.dir)}
        self.assertEqual(before, after)
        self.assertEqual(sorted(os.listdir(self.tmp.name)), ["cache", "vms"])
        self.assertEqual(os.listdir(os.path.join(self.tmp.name, "cache")), ["vmhost_engine"])
        self.assertEqual(os.listdir(self.cache), ["state.json"])

    def test_a_symlinked_vm_file_is_refused_and_others_apply(self):
        secret = os.path.join(self.tmp.name, "secret.json")
        with open(secret, "w") as f:
            json.dump([entry("stolen")], f)
        os.symlink(secret, os.path.join(self.dir, "hv2VMs"))
        self.write("hv1", [entry("a")])
        with self.assertLogs(eng.log, "ERROR") as logged:
            out = self.engine().run_once()
        self.assertEqual(out, {"hv1": "ok", "hv2": "failed"})
        self.assertEqual(self.hosts["hv2"].vms, {"manual"}, "nothing was read through the link")
        failed = {t: d for t, d in self.events if t.endswith("/_hypervisor/reconcile_failed")}
        self.assertIn("is a symbolic link: refused", failed["vmhost/hv2/_hypervisor/reconcile_failed"]["error"])
        self.assertTrue(any("symbolic link" in m for m in logged.output), logged.output)

    def test_a_symlink_anywhere_in_vms_dir_is_refused(self):
        # vms_dir's parent is a link to a directory holding a definition file: nothing is read.
        real = os.path.join(self.tmp.name, "real")
        os.makedirs(os.path.join(real, "vms"))
        with open(os.path.join(real, "vms", "hv1VMs"), "w") as f:
            json.dump([entry("stolen")], f)
        os.symlink(real, os.path.join(self.tmp.name, "link"))
        self.dir = os.path.join(self.tmp.name, "link", "vms")
        with self.assertLogs(eng.log, "ERROR") as logged:
            self.assertEqual(self.engine().run_once(), {})
        self.assertEqual(self.client.calls, [], "nothing was read through the link")
        self.assertTrue(any("cannot list" in m for m in logged.output), logged.output)

    def test_vms_dir_is_opened_once_and_a_later_swap_changes_nothing(self):
        self.write("hv1", [entry("a")])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        # The directory moves away and a link to another directory takes its name: the engine
        # goes on with the directory it opened, and never reads through the link.
        moved = os.path.join(self.tmp.name, "moved")
        os.rename(self.dir, moved)
        other = os.path.join(self.tmp.name, "other")
        os.mkdir(other)
        with open(os.path.join(other, "hv2VMs"), "w") as f:
            json.dump([entry("stolen")], f)
        os.symlink(other, self.dir)
        with open(os.path.join(moved, "hv1VMs"), "w") as f:
            json.dump([entry("a"), entry("b")], f)
        self.now += 1
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        self.assertIn("b_sensor", self.hosts["hv1"].vms)
        self.assertNotIn("stolen_sensor", self.hosts["hv2"].vms)

    def test_a_vms_dir_removed_and_made_again_is_opened_again(self):
        self.write("hv1", [entry("a")])
        engine = self.engine()
        self.assertEqual(engine.run_once(), {"hv1": "ok"})
        os.unlink(os.path.join(self.dir, "hv1VMs"))
        os.rmdir(self.dir)
        os.mkdir(self.dir)
        self.write("hv2", [entry("c")])
        self.assertEqual(engine.run_once(), {"hv2": "ok"})
        self.assertIn("c_sensor", self.hosts["hv2"].vms)

    def test_a_fifo_is_refused_without_blocking(self):
        os.mkfifo(os.path.join(self.dir, "hv2VMs"))
        self.write("hv1", [entry("a")])
        self.assertEqual(self.engine().run_once(), {"hv1": "ok", "hv2": "failed"})
        # hv1's worker thread fires its own events meanwhile: look for hv2's, not the last one.
        hv2 = [data for tag, data in self.events if tag == "vmhost/hv2/_hypervisor/reconcile_failed"]
        self.assertEqual(len(hv2), 1, self.events)
        self.assertIn("not a regular file", hv2[0]["error"])

    def test_state_file_is_written_atomically_and_synced(self):
        self.write("hv1", [entry("a")])
        engine = self.engine()
        engine.run_once()
        state = os.path.join(self.cache, "state.json")
        with open(state) as f:
            old = f.read()
        # Every write fsyncs the temp file before the rename and the directory after it.
        synced = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
            real_fsync(fd)

        def replace(src, dst):
            synced.append("rename")
            real_replace(src, dst)

        with mock.patch.object(eng.os, "fsync", fsync), mock.patch.object(eng.os, "replace", replace):
            self.write("hv1", [entry("a"), entry("b")])
            engine.run_once()
        self.assertEqual(synced, ["file", "rename", "dir"])
        with open(state) as f:
            new = f.read()
        self.assertNotEqual(old, new)
        # A write that fails before the rename (a full disk at fsync) leaves the old state whole
        # and no temp file behind.
        self.write("hv1", [entry("a"), entry("b"), entry("c")])
        with mock.patch.object(eng.os, "fsync", side_effect=OSError(errno.ENOSPC, "No space left on device")):
            with self.assertLogs(eng.log, "ERROR"):
                engine.run_once()
        with open(state) as f:
            self.assertEqual(f.read(), new)
        self.assertEqual(os.listdir(self.cache), ["state.json"])
        self.assertEqual(stat.S_IMODE(os.stat(state).st_mode), 0o600)

    def test_ignores_other_files(self):
        self.write("hv1", [entry("a")])
        for name in ("README", ".hv2VMs", "VMs", "a b VMs"):
            with open(os.path.join(self.dir, name), "w") as f:
                f.write("[]")
        self.assertEqual(self.engine().run_once(), {"hv1": "ok"})


if __name__ == "__main__":
    unittest.main()
