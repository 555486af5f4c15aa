"""The vmhost runner against fake hypervisors: the real execution module on each fake minion
talks to a fake vmhostd, and the fake vmhostds move VMs between them as vm.migrate_in plus
vm.migrate / vm.move would. Covers migrate (live, cold, passthrough, refusals, source lookup),
evacuate (dry run and real), place, fleet snapshots, and Security Onion's VMs files."""

import json
import os
import shutil
import tempfile
import unittest

from fleet_fakes import Fail, Fleet, Host, LocalClient, spec, view
from vmhost_fakes import error, load, load_engine


def sfp(index, holder=None):
    return {
        "class": "sfp",
        "index": index,
        "pci": f"0000:ca:00.{index}",
        "holder": holder,
        "present": True,
        "driver": None,
    }


class RunnerTest(unittest.TestCase):
    def setUp(self):
        self.hv1 = Host("hv1", memory_mib=8192, hardware=[sfp(5)])
        self.hv2 = Host("hv2", memory_mib=16384, hardware=[sfp(5)])
        self.hv3 = Host("hv3", memory_mib=4096)
        self.fleet = Fleet(self.hv1, self.hv2, self.hv3)
        self.addCleanup(self.fleet.close)
        self.client = LocalClient(self.fleet, others=["master-minion"])
        self.opts = {}
        self.context = {}
        self.runner = self.load()

    def load(self):
        runner = load("runners", {"__opts__": self.opts, "__context__": self.context})
        runner._local_client = lambda: self.client
        return runner

    def mutations(self):
        return self.fleet.calls("vm.migrate_in", "vm.migrate", "vm.move")


class Migrate(RunnerTest):
    def test_live_migration_finds_the_source_and_pins_the_macs(self):
        self.hv1.add(view(spec("web", role="web")))
        ret = self.runner.migrate(vm="web", to="hv2")
        self.assertTrue(ret["result"], ret)
        self.assertEqual((ret["from"], ret["to"], ret["mode"], ret["stop"]), ("hv1", "hv2", "live", False))
        self.assertEqual(ret["outcome"]["downtime_ms"], 100)
        self.assertEqual(self.mutations(), [("hv2", "vm.migrate_in"), ("hv1", "vm.migrate")])
        # Finding the source asks every minion's vm.list, nothing more; the rest goes to the two.
        self.assertEqual(self.client.published[0][:3], ("*", "vmhost.list", "glob"))
        self.assertTrue(all(p[2] == "list" for p in self.client.published[1:]), self.client.published)
        migrate_in = next(p for h, m, p in self.fleet.log if m == "vm.migrate_in")
        self.assertEqual(migrate_in["mode"], "live")
        self.assertEqual(migrate_in["spec"]["nics"][0]["mac"], self.hv2.vms["web"]["nics"][0]["mac"])
        migrate = next(p for h, m, p in self.fleet.log if m == "vm.migrate")
        self.assertEqual(migrate["destination"], "hv2.example:7070")
        self.assertEqual(len(migrate["secret"]), 64)
        self.assertNotIn("web", self.hv1.vms)
        self.assertIn("web", self.hv2.vms)
        self.assertNotIn("retcode", self.context)

    def test_live_options_reach_vm_migrate(self):
        self.hv1.add(view(spec("web")))
        ret = self.runner.migrate(
            vm="web", to="hv2", source="hv1", max_downtime_ms=50, bandwidth_mib_s=100, timeout_s=60
        )
        self.assertTrue(ret["result"], ret)
        migrate = next(p for h, m, p in self.fleet.log if m == "vm.migrate")
        self.assertEqual((migrate["max_downtime_ms"], migrate["bandwidth_mib_s"], migrate["timeout_s"]), (50, 100, 60))
        # With source given, the fleet is not asked who has it.
        self.assertNotIn(("*", "vmhost.list", "glob"), [p[:3] for p in self.client.published])

    def test_stopped_vm_moves_cold(self):
        self.hv1.add(view(spec("db"), status="stopped"))
        ret = self.runner.migrate(vm="db", to="hv2")
        self.assertTrue(ret["result"], ret)
        self.assertEqual((ret["mode"], ret["stop"]), ("cold", False))
        self.assertEqual(self.mutations(), [("hv2", "vm.migrate_in"), ("hv1", "vm.move")])
        move = next(p for h, m, p in self.fleet.log if m == "vm.move")
        self.assertFalse(move["stop"])

    def test_running_passthrough_vm_moves_cold_with_stop(self):
        self.hv1.add(view(spec("sensor", hardware={"sfp": [5]})))
        ret = self.runner.migrate(vm="sensor", to="hv2")
        self.assertTrue(ret["result"], ret)
        self.assertEqual((ret["mode"], ret["stop"]), ("cold", True))
        self.assertEqual(next(p for h, m, p in self.fleet.log if m == "vm.migrate_in")["mode"], "cold")
        self.assertTrue(next(p for h, m, p in self.fleet.log if m == "vm.move")["stop"])
        self.assertEqual(self.hv2.hardware[0]["holder"], "sensor")

    def test_a_destination_without_the_device_is_refused_before_anything(self):
        self.hv1.add(view(spec("sensor", hardware={"sfp": [5]})))
        ret = self.runner.migrate(vm="sensor", to="hv3")
        self.assertFalse(ret["result"])
        self.assertIn("hardware sfp 5: not in the hardware model there", ret["error"])
        self.assertEqual(self.mutations(), [])
        self.assertEqual((self.context["retcode"], ret["retcode"]), (1, 1))

    def test_a_destination_without_room_network_or_image_is_refused(self):
        self.hv1.add(view(spec("big", memory_mib=6000, nics=("lan", "dmz"), image="new.qcow2")))
        ret = self.runner.migrate(vm="big", to="hv3")
        self.assertFalse(ret["result"])
        for text in ("memory: 6000 MiB needed", "network dmz: not configured", "image new.qcow2: not there"):
            self.assertIn(text, ret["error"])
        self.assertEqual(self.mutations(), [])

    def test_check_false_leaves_it_to_the_destination(self):
        self.hv1.add(view(spec("web")))
        self.hv3.refuse["vm.migrate_in"] = error(3002, "not enough memory", field="spec.memory_mib")
        ret = self.runner.migrate(vm="web", to="hv3", check=False)
        self.assertFalse(ret["result"])
        self.assertIn("vmhostd error 3002 (spec.memory_mib): not enough memory", ret["error"])
        self.assertEqual(self.mutations(), [("hv3", "vm.migrate_in")])
        self.assertIn("web", self.hv1.vms)

    def test_a_failing_source_leaves_the_vm_where_it_was(self):
        self.hv1.add(view(spec("web")))
        self.hv1.refuse["vm.migrate"] = error(4097, "not movable", details={"reason": "pending_change"})
        ret = self.runner.migrate(vm="web", to="hv2")
        self.assertFalse(ret["result"])
        self.assertIn("4097", ret["error"])
        self.assertIn("web", self.hv1.vms)
        self.assertEqual(ret["from"], "hv1")

    def test_statuses_that_cannot_move(self):
        self.hv1.add(view(spec("x"), status="failed"))
        self.hv1.add(view(spec("y"), pending_restart=True))
        for vm, text in (("x", "status failed"), ("y", "pending_restart")):
            ret = self.runner.migrate(vm=vm, to="hv2")
            self.assertFalse(ret["result"])
            self.assertIn(text, ret["error"])
        self.assertEqual(self.mutations(), [])

    def test_unknown_ambiguous_and_same_host(self):
        ret = self.runner.migrate(vm="ghost", to="hv2")
        self.assertIn("no hypervisor among * has a VM ghost", ret["error"])
        self.hv1.add(view(spec("twin")))
        self.hv3.add(view(spec("twin")))
        ret = self.runner.migrate(vm="twin", to="hv2")
        self.assertIn("twin is on hv1, hv3: give source=", ret["error"])
        ret = self.runner.migrate(vm="twin", to="hv1", source="hv1")
        self.assertIn("on hv1 already", ret["error"])
        self.assertEqual(self.mutations(), [])

    def test_a_silent_destination(self):
        self.hv1.add(view(spec("web")))
        self.client.silent.add("hv2")
        ret = self.runner.migrate(vm="web", to="hv2")
        self.assertFalse(ret["result"])
        self.assertIn("minion hv2 did not answer vmhost.info", ret["error"])

    def test_hosts_target_from_the_master_config(self):
        self.opts["vmhost_runner"] = {"hosts": "hv[12]", "timeout": 7}
        self.hv3.add(view(spec("web")))
        ret = self.runner.migrate(vm="web", to="hv2")
        self.assertIn("no hypervisor among hv[12] has a VM web", ret["error"])
        self.assertEqual(self.client.published[0][3], 7)


class Place(RunnerTest):
    def test_place_answers_the_minion_and_skips_non_hypervisors(self):
        self.hv2.add(view(spec("w1", role="web")))
        ret = self.runner.place(spec=json.dumps(spec("w2", role="web")))
        self.assertTrue(ret["result"], ret)
        self.assertEqual(ret["host"], "hv1")  # hv2 has more memory but a web VM
        self.assertEqual([r["host"] for r in ret["ranking"]], ["hv1", "hv3", "hv2"])
        self.assertIn("master-minion", ret["skipped"])
        self.assertEqual(self.mutations(), [])

    def test_no_host_fits(self):
        ret = self.runner.place(spec=spec("huge", memory_mib=10**6))
        self.assertFalse(ret["result"])
        self.assertIsNone(ret["host"])
        self.assertEqual(sorted(ret["refused"]), ["hv1", "hv2", "hv3"])
        self.assertEqual(self.context["retcode"], 1)

    def test_bad_spec(self):
        self.assertIn("spec is not JSON", self.runner.place(spec="{")["error"])
        self.assertIn("a dict with a name", self.runner.place(spec=[1])["error"])

    def test_a_saved_snapshot_plans_without_the_minions(self):
        self.hv2.add(view(spec("w1", role="web")))
        snap = self.runner.fleet()
        self.assertEqual(sorted(snap["hosts"]), ["hv1", "hv2", "hv3"])
        path = os.path.join(tempfile.mkdtemp(), "fleet.json")
        self.addCleanup(shutil.rmtree, os.path.dirname(path))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(snap, f)
        published = len(self.client.published)
        ret = self.runner.place(spec=spec("w2", role="web"), fleet=path)
        self.assertEqual(ret["host"], "hv1")
        self.assertEqual(len(self.client.published), published)
        with open(path, "w", encoding="utf-8") as f:
            json.dump([], f)
        self.assertIn("not a fleet snapshot", self.runner.place(spec=spec("a"), fleet=path)["error"])


class Evacuate(RunnerTest):
    def setUp(self):
        super().setUp()
        self.hv1.add(view(spec("s1", role="sensor", memory_mib=3000)))
        self.hv1.add(view(spec("s2", role="sensor", memory_mib=2000)))
        self.hv1.add(view(spec("db", memory_mib=1000), status="stopped"))
        self.hv1.add(view(spec("pt", hardware={"sfp": [5]}, memory_mib=500)))
        self.hv1.add(view(spec("broken"), status="failed"))

    def test_dry_run_plans_and_moves_nothing(self):
        ret = self.runner.evacuate(host="hv1", dry_run=True)
        plan = ret["plan"]
        self.assertEqual(
            [(m["vm"], m["to"], m["mode"], m["stop"]) for m in plan["moves"]],
            [
                ("s1", "hv2", "live", False),
                ("s2", "hv3", "live", False),
                ("db", "hv2", "cold", False),
                ("pt", "hv2", "cold", True),
            ],
        )
        self.assertEqual(
            plan["unmovable"], [{"vm": "broken", "reason": "status failed: only a running or stopped VM moves"}]
        )
        self.assertFalse(ret["result"])  # broken stays
        self.assertTrue(ret["dry_run"])
        self.assertEqual(self.mutations(), [])
        self.assertEqual(len(self.hv1.vms), 5)

    def test_real_run_moves_as_planned_and_reports(self):
        self.hv1.remove("broken")
        ret = self.runner.evacuate(host="hv1")
        self.assertTrue(ret["result"], ret)
        self.assertEqual(
            [(d["vm"], d["to"], d["mode"]) for d in ret["done"]],
            [(m["vm"], m["to"], m["mode"]) for m in ret["plan"]["moves"]],
        )
        self.assertEqual(self.hv1.vms, {})
        self.assertEqual(sorted(self.hv2.vms), ["db", "pt", "s1"])
        self.assertEqual(sorted(self.hv3.vms), ["s2"])

    def test_a_failed_move_does_not_stop_the_others(self):
        self.hv1.remove("broken")
        self.hv3.refuse["vm.migrate_in"] = error(3001, "no migration port", field="migration.listen")
        ret = self.runner.evacuate(host="hv1")
        self.assertFalse(ret["result"])
        self.assertEqual([f["vm"] for f in ret["failed"]], ["s2"])
        self.assertIn("migration.listen", ret["failed"][0]["error"])
        self.assertEqual(sorted(self.hv1.vms), ["s2"])
        self.assertEqual(sorted(self.hv2.vms), ["db", "pt", "s1"])

    def test_a_snapshot_only_plans(self):
        ret = self.runner.evacuate(host="hv1", fleet="/nonexistent.json")
        self.assertIn("fleet=PATH only plans", ret["error"])

    def test_unknown_host(self):
        self.assertIn("nope: no answer from that host", self.runner.evacuate(host="nope", dry_run=True)["error"])


def so_entry(hostname, role="sensor", **extra):
    out = {"hostname": hostname, "role": role, "cpu": 1, "memory": 1, "network_mode": "dhcp4"}
    out.update(extra)
    return out


class SecurityOnion(RunnerTest):
    """A VM of SO's VMs files: held while it moves, its entry moved to the destination's file,
    and the engine leaving a held VM alone."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        self.vms_dir = os.path.join(self.dir, "vms")
        os.mkdir(self.vms_dir)
        pki = os.path.join(self.dir, "pki")
        os.makedirs(os.path.join(pki, "minions"))
        for m in ("hv1_a1", "hv2_b2", "hv3_c3"):
            open(os.path.join(pki, "minions", m), "w").close()
        self.opts.update(
            {
                "pki_dir": pki,
                "engines": [{"vmhost_engine": {"vms_dir": self.vms_dir, "so_compat": True, "network": "lan"}}],
            }
        )
        # The fake hosts go by their minion ids here.
        for host, minion in ((self.hv1, "hv1_a1"), (self.hv2, "hv2_b2"), (self.hv3, "hv3_c3")):
            self.fleet.hosts[minion] = self.fleet.hosts.pop(host.name)
            self.fleet.daemons[minion] = self.fleet.daemons.pop(host.name)
            self.client.mods[minion] = self.client.mods.pop(host.name)
            host.name = minion
        self.write("hv1", [so_entry("keep"), so_entry("mover")])
        self.write("hv2", [so_entry("other", role="searchnode")])
        self.hv1.add(view(spec("mover_sensor", role="sensor")))
        self.hv1.add(view(spec("keep_sensor", role="sensor")))

    def write(self, hyp, entries):
        with open(os.path.join(self.vms_dir, f"{hyp}VMs"), "w", encoding="utf-8") as f:
            json.dump(entries, f)

    def read(self, hyp):
        with open(os.path.join(self.vms_dir, f"{hyp}VMs"), encoding="utf-8") as f:
            return json.load(f)

    def test_the_entry_moves_to_the_destination_file_and_the_hold_goes(self):
        os.chmod(os.path.join(self.vms_dir, "hv2VMs"), 0o640)
        ret = self.runner.migrate(vm="mover_sensor", to="hv2_b2")
        self.assertTrue(ret["result"], ret)
        self.assertEqual(ret["so"], {"from": "hv1VMs", "to": "hv2VMs"})
        self.assertEqual([e["hostname"] for e in self.read("hv1")], ["keep"])
        self.assertEqual([e["hostname"] for e in self.read("hv2")], ["other", "mover"])
        self.assertEqual(os.stat(os.path.join(self.vms_dir, "hv2VMs")).st_mode & 0o777, 0o640)
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))
        self.assertEqual(sorted(os.listdir(self.vms_dir)), ["hv1VMs", "hv2VMs"])

    def test_the_hold_stands_while_the_vm_moves(self):
        seen = {}
        send = self.fleet.daemons["hv1_a1"].methods["vm.migrate"]

        def spy(params):
            with open(os.path.join(self.vms_dir, ".vmhost-moves.json"), encoding="utf-8") as f:
                seen.update(json.load(f))
            return send(params)

        self.fleet.daemons["hv1_a1"].methods["vm.migrate"] = spy
        self.assertTrue(self.runner.migrate(vm="mover_sensor", to="hv2_b2")["result"])
        self.assertEqual((seen["mover_sensor"]["from"], seen["mover_sensor"]["to"]), ("hv1_a1", "hv2_b2"))

    def test_a_failed_move_keeps_the_entry_and_lifts_the_hold(self):
        self.hv1.refuse["vm.migrate"] = error(4001, "broke", details={"step": "migrate"})
        ret = self.runner.migrate(vm="mover_sensor", to="hv2_b2")
        self.assertFalse(ret["result"])
        self.assertEqual([e["hostname"] for e in self.read("hv1")], ["keep", "mover"])
        self.assertEqual([e["hostname"] for e in self.read("hv2")], ["other"])
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))

    def test_a_move_that_commits_after_its_error_moves_the_entry(self):
        # The source's answer is an error, yet the VM ended on the destination (the daemons
        # settled an unknown outcome): the entry follows the VM and the hold goes.
        send = self.fleet.daemons["hv1_a1"].methods["vm.migrate"]

        def late(params):
            send(params)
            raise Fail(error(4001, "the destination's answer is unknown", details={"step": "commit"}))

        self.fleet.daemons["hv1_a1"].methods["vm.migrate"] = late
        self.assertFalse(self.runner.migrate(vm="mover_sensor", to="hv2_b2")["result"])
        self.assertEqual([e["hostname"] for e in self.read("hv1")], ["keep"])
        self.assertEqual([e["hostname"] for e in self.read("hv2")], ["other", "mover"])
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))

    def test_an_unknown_outcome_keeps_the_hold(self):
        # The source keeps the paused guest, recorded failed, while the destination cannot be
        # asked: nobody knows where the VM will run, so the engine must leave it alone.
        def unknown(params):
            self.hv1.vms[params["name"]].update(
                {"status": "failed", "migration": {"role": "outgoing", "phase": "committing", "peer": "x"}}
            )
            raise Fail(error(4001, "the destination's answer is unknown", details={"step": "commit"}))

        self.fleet.daemons["hv1_a1"].methods["vm.migrate"] = unknown
        self.assertFalse(self.runner.migrate(vm="mover_sensor", to="hv2_b2")["result"])
        self.assertEqual([e["hostname"] for e in self.read("hv1")], ["keep", "mover"])
        with open(os.path.join(self.vms_dir, ".vmhost-moves.json"), encoding="utf-8") as f:
            self.assertIn("mover_sensor", json.load(f))

    def test_a_symlinked_vms_file_is_refused_before_anything(self):
        real = os.path.join(self.dir, "elsewhere")
        os.rename(os.path.join(self.vms_dir, "hv1VMs"), real)
        os.symlink(real, os.path.join(self.vms_dir, "hv1VMs"))
        ret = self.runner.migrate(vm="mover_sensor", to="hv2_b2")
        self.assertFalse(ret["result"])
        self.assertIn("Too many levels of symbolic links", ret["error"])
        self.assertEqual(self.mutations(), [])
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))
        self.assertTrue(os.path.islink(os.path.join(self.vms_dir, "hv1VMs")))

    def test_holds_are_rewritten_under_an_flock_of_vms_dir(self):
        import fcntl
        import threading

        fd = os.open(self.vms_dir, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = threading.Event()
        result = {}

        def move():
            result.update(self.runner.migrate(vm="mover_sensor", to="hv2_b2"))
            done.set()

        threading.Thread(target=move, daemon=True).start()
        # Another runner holds the lock: no hold written, nothing sent yet.
        self.assertFalse(done.wait(0.5))
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))
        self.assertEqual(self.mutations(), [])
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.assertTrue(done.wait(30))
        self.assertTrue(result["result"], result)

    def test_no_file_for_the_destination_is_refused_before_anything(self):
        ret = self.runner.migrate(vm="mover_sensor", to="hv3_c3")
        self.assertFalse(ret["result"])
        self.assertIn("no VMs file drives hv3_c3", ret["error"])
        self.assertEqual(self.mutations(), [])

    def test_a_vm_held_already_is_refused_and_release_lifts_it(self):
        with open(os.path.join(self.vms_dir, ".vmhost-moves.json"), "w", encoding="utf-8") as f:
            json.dump({"mover_sensor": {"from": "hv1_a1", "to": "hv2_b2", "since": 1}}, f)
        ret = self.runner.migrate(vm="mover_sensor", to="hv2_b2")
        self.assertIn("held already", ret["error"])
        self.assertEqual(self.mutations(), [])
        self.assertEqual(self.runner.release(vm="mover_sensor"), {"result": True, "released": True})
        self.assertEqual(self.runner.release(vm="mover_sensor"), {"result": True, "released": False})
        self.assertFalse(os.path.exists(os.path.join(self.vms_dir, ".vmhost-moves.json")))

    def test_a_vm_in_no_file_moves_without_touching_them(self):
        self.hv1.add(view(spec("adhoc")))
        before = (self.read("hv1"), self.read("hv2"))
        ret = self.runner.migrate(vm="adhoc", to="hv2_b2")
        self.assertTrue(ret["result"], ret)
        self.assertNotIn("so", ret)
        self.assertEqual((self.read("hv1"), self.read("hv2")), before)

    def test_so_false_leaves_the_files(self):
        ret = self.runner.migrate(vm="mover_sensor", to="hv2_b2", so=False)
        self.assertTrue(ret["result"], ret)
        self.assertEqual([e["hostname"] for e in self.read("hv1")], ["keep", "mover"])

    def test_evacuate_moves_the_entries(self):
        ret = self.runner.evacuate(host="hv1_a1")
        self.assertTrue(ret["result"], ret)
        self.assertEqual(self.read("hv1"), [])
        self.assertEqual(sorted(e["hostname"] for e in self.read("hv2")), ["keep", "mover", "other"])

    def test_evacuate_never_plans_an_so_vm_onto_a_host_without_a_file(self):
        self.hv2.memory = 256  # only hv3 (no VMs file) has room for them
        ret = self.runner.evacuate(host="hv1_a1", dry_run=True)
        self.assertEqual(ret["plan"]["moves"], [])
        reasons = ret["plan"]["unplaced"][0]["refused"]
        self.assertIn("no Security Onion VMs file drives it", reasons["hv3_c3"][0])
        self.assertIn("memory", reasons["hv2_b2"][0])
        self.assertEqual(self.mutations(), [])

    def test_the_engine_leaves_a_held_vm_alone(self):
        engine_mod = load_engine("vmhost_engine")
        calls = []

        class Client:
            def cmd(self, tgt, fun, kwarg=None, **kw):
                calls.append(kwarg)
                vms = [{"vm": s["name"], "action": "none"} for s in kwarg["vms"]]
                return {
                    tgt[0]: {
                        "ret": {"plan": vms, "results": [dict(v, ok=True, changed=False) for v in vms], "ok": True},
                        "retcode": 0,
                    }
                }

        config = engine_mod.parse_config(
            {
                "vms_dir": self.vms_dir,
                "network": "lan",
                "boot": {"default": {"image": "b.qcow2", "disk_gib": 10}},
                "so_compat": False,
                "prune": "all",
            }
        )
        engine = engine_mod.Engine(
            config, Client(), lambda *a: None, os.path.join(self.dir, "cache"), accepted=lambda: ["hv1_a1", "hv2_b2"]
        )
        self.addCleanup(engine.close)
        with open(os.path.join(self.vms_dir, ".vmhost-moves.json"), "w", encoding="utf-8") as f:
            json.dump({"mover_sensor": {"from": "hv1_a1", "to": "hv2_b2", "since": 1}}, f)
        outcomes = engine.run_once()
        self.assertEqual(outcomes["hv1"], "partial")
        hv1_call = next(c for c in calls if not c["dry_run"] and any(s["name"] == "keep_sensor" for s in c["vms"]))
        self.assertEqual([s["name"] for s in hv1_call["vms"]], ["keep_sensor"])
        self.assertFalse(hv1_call["prune"])  # prune all would destroy the held VM
        # The hold lifted, the next round applies the file whole again.
        os.unlink(os.path.join(self.vms_dir, ".vmhost-moves.json"))
        calls.clear()
        engine.state["hv1"]["last_attempt"] = 0
        engine.run_once()
        hv1_call = next(c for c in calls if not c["dry_run"] and any(s["name"] == "keep_sensor" for s in c["vms"]))
        self.assertEqual(sorted(s["name"] for s in hv1_call["vms"]), ["keep_sensor", "mover_sensor"])
        self.assertTrue(hv1_call["prune"])

    def test_the_engine_skips_a_round_when_the_holds_file_is_unreadable(self):
        engine_mod = load_engine("vmhost_engine")
        with open(os.path.join(self.vms_dir, ".vmhost-moves.json"), "w", encoding="utf-8") as f:
            f.write("[1]")
        fd = os.open(self.vms_dir, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        with self.assertRaises(OSError):
            engine_mod.read_holds(fd)


if __name__ == "__main__":
    unittest.main()
