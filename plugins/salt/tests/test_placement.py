"""The pure placement module: host views from minions' answers, every rule of misfits, place's
ranking (anti-affinity, free memory, name), movability, the migration spec and evacuation
plans."""

import copy
import importlib.util
import json
import os
import unittest
import zlib

from vmhost_fakes import SRC

_spec = importlib.util.spec_from_file_location("placement_under_test", os.path.join(SRC, "placement.py"))
placement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(placement)

GIB = 1024**3


def info(cpu=8, memory=8192, free_gib=500, overcommit=1.0, hardware=(), networks=None, capture=(), **extra):
    out = {
        "cpu": {"total": cpu, "reserved": 0, "allocated": 0, "available": cpu},
        "memory_mib": {"total": memory, "reserved": 0, "allocated": 0, "available": memory},
        "storage": {"total_bytes": 0, "free_bytes": free_gib * GIB, "provisioned_bytes": 0, "overcommit": overcommit},
        "hardware": list(hardware),
        "networks": networks if networks is not None else [{"name": "lan", "ready": True, "nics": []}],
        "capture": list(capture),
        "kept_disks": [],
        "numa": [],
        "cpus": {"vm_cpus": None},
    }
    out.update(extra)
    return out


def dev(cls, index, holder=None, present=True, pci=None):
    return {"class": cls, "index": index, "pci": pci or f"0000:0{index}:00.0", "holder": holder, "present": present}


def spec(name, cpu=1, memory_mib=512, role=None, nics=("lan",), **extra):
    out = {"name": name, "cpu": cpu, "memory_mib": memory_mib, "boot": {"image": "base.qcow2", "disk_gib": 2}}
    if role:
        out["role"] = role
    out["nics"] = [{"network": n} for n in nics]
    out.update(extra)
    return out


def vmview(s, status="running", **extra):
    n = zlib.crc32(s["name"].encode()) % 256
    out = {
        "name": s["name"],
        "spec": s,
        "status": status,
        "nics": [{"mac": f"02:00:00:00:{n:02x}:{i:02x}"} for i in range(len(s["nics"]))],
    }
    out.update(extra)
    return out


def host(name, vms=(), images=("base.qcow2",), **kw):
    return placement.host_view(
        name, info(**kw), list(vms), [{"name": i} for i in images] if images is not None else None
    )


class HostView(unittest.TestCase):
    def test_reads_capacity_hardware_networks_capture_images(self):
        h = placement.host_view(
            "hv1",
            info(
                cpu=4,
                memory=2048,
                hardware=[dev("sfp", 5, holder="s1"), {"class": "gpu", "index": 1}],
                networks=[
                    {
                        "name": "lan",
                        "ready": True,
                        "vlan_filtering": True,
                        "nics": [{"vm": "a", "nic": 0, "mac": "02:AA:00:00:00:01", "address": "10.0.0.5/24"}],
                    }
                ],
                capture=[{"interface": "eth1", "present": True}],
                kept_disks=[{"vm": "old", "name": "data"}],
                numa=[
                    {"node": 0, "hugepages": {"2M": {"total": 10, "free": 4}}},
                    {"node": 1, "hugepages": {"2M": {"free": 3}}},
                ],
                cpus={"vm_cpus": "2-7", "shared_pool": "4-7"},
            ),
            [{"name": "a", "spec": {}}, "junk"],
            [{"name": "base.qcow2"}],
        )
        self.assertEqual((h["cpu_free"], h["memory_free"], h["disk_free"]), (4, 2048, 500 * GIB))
        self.assertEqual(list(h["hardware"]), [("sfp", 5)])
        self.assertEqual(h["hardware"][("sfp", 5)]["holder"], "s1")
        self.assertEqual(h["networks"]["lan"]["macs"], {"02:aa:00:00:00:01"})
        self.assertEqual(h["networks"]["lan"]["addresses"], {"10.0.0.5"})
        self.assertTrue(h["networks"]["lan"]["vlan_filtering"])
        self.assertEqual(h["capture"], {"eth1": True})
        self.assertEqual(h["kept"], {"old"})
        self.assertEqual(h["hugepages_free"], {"2M": 7})
        self.assertEqual(h["dedicated_free"], 4)
        self.assertEqual(h["images"], {"base.qcow2"})
        self.assertEqual([v["name"] for v in h["vms"]], ["a"])

    def test_no_vm_cpus_means_no_dedicated_cpus_and_unknown_images_are_not_checked(self):
        h = placement.host_view("hv1", info(), [], None)
        self.assertIsNone(h["dedicated_free"])
        self.assertIsNone(h["images"])
        self.assertEqual(placement.misfits(spec("a", boot={"image": "other.qcow2", "disk_gib": 1}), h), [])

    def test_bad_answers_raise(self):
        with self.assertRaises(placement.PlacementError):
            placement.host_view("hv1", "ERROR", [], None)
        with self.assertRaises(placement.PlacementError):
            placement.host_view("hv1", {"cpu": {}}, [], None)
        with self.assertRaises(placement.PlacementError):
            placement.host_view("hv1", info(), {"not": "a list"}, None)

    def test_cpulist(self):
        self.assertEqual(placement._cpulist("0-3,8"), {0, 1, 2, 3, 8})
        self.assertEqual(placement._cpulist(""), set())
        self.assertEqual(placement._cpulist(None), set())
        self.assertEqual(placement._cpulist("x-1"), set())


API_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs", "api.md")


def api_example(heading):
    """The first JSON example under ``heading`` in docs/api.md (answers of a real vmhostd, see
    "How the examples were made" there)."""
    with open(API_MD, encoding="utf-8") as f:
        text = f.read()
    start = text.index("```json", text.index(heading + "\n")) + len("```json")
    return json.loads(text[start : text.index("```", start)])["result"]


class RealAnswers(unittest.TestCase):
    """host.info and vm.list as docs/api.md shows a real vmhostd's answers."""

    def test_the_documented_answers_read_and_plan(self):
        src = placement.host_view("hv1", api_example("### host.info"), api_example("### vm.list"), None)
        self.assertEqual((src["cpu_free"], src["memory_free"]), (0, 2176))
        self.assertEqual(src["hardware"][("sfp", 5)]["holder"], "sensor1")
        self.assertEqual(src["networks"]["lan"]["macs"], {"86:db:e8:65:36:be"})
        self.assertEqual(src["networks"]["lan"]["addresses"], {"10.0.0.5"})
        self.assertEqual(sorted(v["name"] for v in src["vms"]), ["search1", "sensor1"])
        free = [
            dev("disk", 1, pci="0000:c7:00.0"),
            dev("sfp", 5, pci="0000:ca:00.0"),
            dev("sfp", 6, pci="0000:ca:00.1"),
        ]
        dst = host("hv2", hardware=free)
        plan = placement.evacuate_plan("hv1", [src, dst])
        self.assertEqual(
            plan["moves"],
            [{"vm": "sensor1", "to": "hv2", "mode": "cold", "stop": True, "status": "running", "sharing": []}],
        )
        self.assertEqual(
            plan["unmovable"], [{"vm": "search1", "reason": "status dead: only a running or stopped VM moves"}]
        )
        self.assertEqual(dst["hardware"][("sfp", 5)]["holder"], None)  # the plan books on a copy


class Demand(unittest.TestCase):
    def test_everything_a_spec_takes(self):
        s = spec(
            "a",
            cpu=2,
            memory_mib=1000,
            cpu_policy="dedicated",
            emulator_cpu=True,
            hugepages="2M",
            disks=[{"name": "d", "size_gib": 10, "preallocate": True}, {"name": "e", "size_gib": 5}],
            hardware={"sfp": [5], "disk": [1]},
            pci=["ca:00.0"],
        )
        s["nics"] = [
            {"network": "lan", "mac": "02:AB:00:00:00:01", "ipv4": {"mode": "static", "address": "10.0.0.9/24"}},
            {"network": "dmz", "vlan": 5},
            {"network": "lan", "ipv4": {"mode": "dhcp"}},
            {"mode": "monitor", "source": "eth1"},
        ]
        d = placement.demand(s)
        self.assertEqual(d["cpu"], 2)
        self.assertEqual(d["dedicated"], 3)
        self.assertEqual(d["hugepages"], ("2M", 500))
        self.assertEqual(d["disk_bytes"], 17 * GIB)
        self.assertEqual(d["prealloc_bytes"], 10 * GIB)
        self.assertEqual(d["networks"], ["lan", "dmz", "lan"])
        self.assertEqual(d["vlans"], ["dmz"])
        self.assertEqual(d["capture"], ["eth1"])
        self.assertEqual(d["macs"], [("lan", "02:ab:00:00:00:01")])
        self.assertEqual(d["addresses"], [("lan", "10.0.0.9")])
        self.assertEqual(d["hardware"], [("disk", 1), ("sfp", 5)])
        self.assertEqual(d["pci"], ["ca:00.0"])
        self.assertEqual(d["image"], "base.qcow2")

    def test_kernel_boot_takes_no_disk_and_no_image(self):
        d = placement.demand({"name": "k", "cpu": 1, "memory_mib": 64, "boot": {"kernel": "/boot/vmlinuz"}})
        self.assertEqual((d["disk_bytes"], d["image"]), (0, None))

    def test_a_spec_without_a_name_is_refused(self):
        for bad in (None, "x", {"cpu": 1}):
            with self.assertRaises(placement.PlacementError):
                placement.demand(bad)

    def test_passthrough(self):
        self.assertFalse(placement.passthrough(spec("a")))
        self.assertFalse(placement.passthrough(spec("a", hardware={"sfp": []})))
        self.assertTrue(placement.passthrough(spec("a", hardware={"sfp": [5]})))
        self.assertTrue(placement.passthrough(spec("a", pci=["0000:ca:00.0"])))


class Misfits(unittest.TestCase):
    def check(self, s, h, expected):
        reasons = placement.misfits(s, h)
        if not expected:
            self.assertEqual(reasons, [])
        for text in expected:
            self.assertTrue(any(text in r for r in reasons), (text, reasons))

    def test_fits(self):
        self.check(spec("a"), host("hv1"), [])

    def test_name_taken_and_kept_disks(self):
        self.check(spec("a"), host("hv1", vms=[vmview(spec("a"))]), ["a VM named a exists there"])
        h = placement.host_view("hv1", info(kept_disks=[{"vm": "a", "name": "data"}]), [], None)
        self.check(spec("a"), h, ["kept data disks of a VM named a"])

    def test_cpu_memory(self):
        self.check(spec("a", cpu=9), host("hv1"), ["cpu: 9 needed, 8 free"])
        self.check(spec("a", memory_mib=9000), host("hv1"), ["memory: 9000 MiB needed, 8192 MiB free"])
        self.check(spec("a", cpu=8, memory_mib=8192), host("hv1"), [])

    def test_disk_with_overcommit_and_preallocation(self):
        big = spec("a", disks=[{"name": "d", "size_gib": 600}])
        self.check(big, host("hv1", free_gib=500), ["disk: 602 GiB needed"])
        self.check(big, host("hv1", free_gib=500, overcommit=2.0), [])
        pre = spec("a", disks=[{"name": "d", "size_gib": 460, "preallocate": True}])
        self.check(pre, host("hv1", free_gib=500, overcommit=2.0), ["460 GiB preallocated needed"])
        ok = spec("a", disks=[{"name": "d", "size_gib": 440, "preallocate": True}])
        self.check(ok, host("hv1", free_gib=500), [])

    def test_dedicated_cpus_and_hugepages(self):
        ded = spec("a", cpu=2, cpu_policy="dedicated", emulator_cpu=True)
        self.check(ded, host("hv1"), ["the host has no [hardware] vm_cpus"])
        h = placement.host_view("hv1", info(cpus={"vm_cpus": "2-7", "shared_pool": "6-7"}), [], None)
        self.check(ded, h, ["dedicated CPUs: 3 needed, 2 free"])
        h = placement.host_view("hv1", info(cpus={"vm_cpus": "2-7", "shared_pool": "5-7"}), [], None)
        self.check(ded, h, [])
        huge = spec("a", memory_mib=2048, hugepages="1G")
        self.check(huge, host("hv1"), ["hugepages 1G: 2 needed, 0 free"])
        h = placement.host_view("hv1", info(numa=[{"hugepages": {"1G": {"free": 2}}}]), [], None)
        self.check(huge, h, [])

    def test_networks(self):
        self.check(spec("a", nics=("dmz",)), host("hv1"), ["network dmz: not configured there"])
        h = host("hv1", networks=[{"name": "lan", "ready": False, "nics": []}])
        self.check(spec("a"), h, ["network lan: not ready there"])
        s = spec("a")
        s["nics"][0]["vlans"] = [10]
        self.check(s, host("hv1"), ["no vlan_filtering there"])
        self.check(s, host("hv1", networks=[{"name": "lan", "vlan_filtering": True, "nics": []}]), [])

    def test_mac_and_address_collisions(self):
        taken = [{"name": "lan", "nics": [{"mac": "02:00:00:00:00:01", "address": "10.0.0.5/24"}]}]
        s = spec("a")
        s["nics"][0].update({"mac": "02:00:00:00:00:01", "ipv4": {"mode": "static", "address": "10.0.0.5/24"}})
        self.check(s, host("hv1", networks=taken), ["MAC 02:00:00:00:00:01 is taken", "address 10.0.0.5 is taken"])
        s["nics"][0].update({"mac": "02:00:00:00:00:02", "ipv4": {"mode": "static", "address": "10.0.0.6/24"}})
        self.check(s, host("hv1", networks=taken), [])

    def test_capture_interfaces(self):
        s = spec("a", nics=())
        s["nics"] = [{"mode": "monitor", "source": "eth1"}]
        self.check(s, host("hv1"), ["capture interface eth1: not in [capture] interfaces"])
        self.check(
            s, host("hv1", capture=[{"interface": "eth1", "present": False}]), ["capture interface eth1: absent"]
        )
        self.check(s, host("hv1", capture=[{"interface": "eth1", "present": True}]), [])

    def test_image(self):
        self.check(spec("a"), host("hv1", images=("other.qcow2",)), ["image base.qcow2: not there"])

    def test_hardware_same_class_and_index_free_and_present(self):
        s = spec("a", hardware={"sfp": [5]})
        self.check(s, host("hv1"), ["hardware sfp 5: not in the hardware model"])
        self.check(s, host("hv1", hardware=[dev("copper", 5)]), ["hardware sfp 5: not in the hardware model"])
        self.check(s, host("hv1", hardware=[dev("sfp", 5, present=False)]), ["hardware sfp 5: not present"])
        self.check(s, host("hv1", hardware=[dev("sfp", 5, holder="b")]), ["hardware sfp 5: held by b"])
        self.check(s, host("hv1", hardware=[dev("sfp", 5, holder="a")]), [])
        self.check(s, host("hv1", hardware=[dev("sfp", 5)]), [])

    def test_raw_pci_only_when_the_model_lists_it_free(self):
        for address in ("0000:ca:00.0", "ca:00.0", "pci_0000_ca_00_0"):
            s = spec("a", pci=[address])
            self.check(s, host("hv1"), ["not in the hardware model there"])
            self.check(s, host("hv1", hardware=[dev("sfp", 1, pci="0000:ca:00.0")]), [])
            self.check(s, host("hv1", hardware=[dev("sfp", 1, pci="0000:ca:00.0", holder="b")]), ["held by b"])
            self.check(s, host("hv1", hardware=[dev("sfp", 1, pci="0000:ca:00.0", present=False)]), ["not present"])

    def test_every_reason_is_listed(self):
        s = spec("a", cpu=99, memory_mib=99999, nics=("dmz",))
        self.assertEqual(len(placement.misfits(s, host("hv1", images=()))), 4)


class Place(unittest.TestCase):
    def test_most_free_memory_then_name(self):
        hosts = [host("hv2", memory=4096), host("hv1", memory=8192), host("hv0", memory=4096)]
        got = placement.place(spec("a"), hosts)
        self.assertEqual(got["host"], "hv1")
        self.assertEqual([r["host"] for r in got["ranking"]], ["hv1", "hv0", "hv2"])
        self.assertEqual(got["refused"], {})

    def test_anti_affinity_beats_free_memory(self):
        web = spec("w1", role="web")
        hosts = [host("big", memory=16384, vms=[vmview(web)]), host("small", memory=2048)]
        got = placement.place(spec("w2", role="web"), hosts)
        self.assertEqual((got["host"], got["key"], got["sharing"]), ("small", "web", []))
        self.assertEqual(got["ranking"][1], {"host": "big", "sharing": ["w1"], "memory_free": 16384})

    def test_anti_affinity_gives_way_when_no_other_host_has_room(self):
        web = spec("w1", role="web")
        hosts = [host("big", memory=16384, vms=[vmview(web)]), host("small", memory=256)]
        got = placement.place(spec("w2", role="web"), hosts)
        self.assertEqual((got["host"], got["sharing"]), ("big", ["w1"]))
        self.assertIn("small", got["refused"])

    def test_anti_affinity_member_is_configurable_or_off(self):
        a = spec("w1", role="web", restart_policy="always")
        hosts = [host("big", memory=16384, vms=[vmview(a)]), host("small", memory=2048)]
        self.assertEqual(placement.place(spec("w2", role="web"), hosts, anti_affinity="")["host"], "big")
        self.assertEqual(placement.place(spec("w2", role="db"), hosts)["host"], "big")
        got = placement.place(spec("w2", restart_policy="always"), hosts, anti_affinity="restart_policy")
        self.assertEqual(got["host"], "small")
        self.assertIsNone(placement.place(spec("w2"), hosts)["key"])

    def test_no_host_fits(self):
        got = placement.place(spec("a", cpu=64), [host("hv1"), host("hv2")])
        self.assertIsNone(got["host"])
        self.assertEqual(sorted(got["refused"]), ["hv1", "hv2"])
        self.assertEqual(got["ranking"], [])

    def test_exclude(self):
        got = placement.place(spec("a"), [host("hv1", memory=9999), host("hv2")], exclude=("hv1",))
        self.assertEqual(got["host"], "hv2")
        self.assertNotIn("hv1", got["refused"])

    def test_the_inputs_are_not_changed(self):
        hosts = [host("hv1")]
        before = copy.deepcopy(hosts)
        placement.place(spec("a"), hosts)
        self.assertEqual(hosts, before)


class Movability(unittest.TestCase):
    def test_each_status(self):
        self.assertEqual(placement.movability(vmview(spec("a"))), {"mode": "live", "stop": False})
        self.assertEqual(placement.movability(vmview(spec("a"), "stopped")), {"mode": "cold", "stop": False})
        pt = spec("a", hardware={"sfp": [5]})
        self.assertEqual(placement.movability(vmview(pt)), {"mode": "cold", "stop": True})
        self.assertEqual(placement.movability(vmview(pt, "stopped")), {"mode": "cold", "stop": False})
        for status in ("failed", "dead", "creating", "starting", "stopping", "destroying", "migrating", "incoming"):
            got = placement.movability(vmview(spec("a"), status))
            self.assertIsNone(got["mode"])
            self.assertIn(f"status {status}", got["reason"])
        got = placement.movability(vmview(spec("a"), pending_restart=True))
        self.assertIsNone(got["mode"])
        self.assertIn("pending_restart", got["reason"])


class MigrationSpec(unittest.TestCase):
    def test_bridge_nics_get_the_source_macs_monitor_nics_none(self):
        s = spec("a", nics=("lan", "dmz"))
        s["nics"].append({"mode": "monitor", "source": "eth1"})
        s["nics"][1]["mac"] = "02:11:11:11:11:11"
        v = {"name": "a", "spec": s, "nics": [{"mac": "02:00:00:00:00:01"}, {"mac": "02:99:99:99:99:99"}, {"mac": "x"}]}
        out = placement.migration_spec(v)
        self.assertEqual(out["nics"][0]["mac"], "02:00:00:00:00:01")
        self.assertEqual(out["nics"][1]["mac"], "02:11:11:11:11:11")
        self.assertNotIn("mac", out["nics"][2])
        self.assertNotIn("mac", s["nics"][0])  # the view is not changed

    def test_a_nic_without_a_mac_in_the_view_is_refused(self):
        with self.assertRaises(placement.PlacementError):
            placement.migration_spec({"name": "a", "spec": spec("a"), "nics": []})


class Evacuate(unittest.TestCase):
    def test_largest_first_each_move_takes_its_share(self):
        big, mid, small = spec("big", memory_mib=3000), spec("mid", memory_mib=2000), spec("small", memory_mib=1000)
        hosts = [
            host("src", vms=[vmview(small), vmview(big), vmview(mid)]),
            host("a", memory=4500),
            host("b", memory=3400),
        ]
        before = copy.deepcopy(hosts)
        plan = placement.evacuate_plan("src", hosts)
        self.assertEqual(
            [(m["vm"], m["to"], m["mode"]) for m in plan["moves"]],
            [("big", "a", "live"), ("mid", "b", "live"), ("small", "a", "live")],
        )
        self.assertEqual((plan["unmovable"], plan["unplaced"]), ([], []))
        self.assertEqual(hosts, before)

    def test_what_does_not_fit_is_unplaced_with_reasons(self):
        hosts = [
            host("src", vms=[vmview(spec("x", memory_mib=3000)), vmview(spec("y", memory_mib=3000))]),
            host("a", memory=4000),
        ]
        plan = placement.evacuate_plan("src", hosts)
        self.assertEqual([m["vm"] for m in plan["moves"]], ["x"])
        self.assertEqual(plan["unplaced"][0]["vm"], "y")
        self.assertIn("memory: 3000 MiB needed, 1000 MiB free", plan["unplaced"][0]["refused"]["a"][0])

    def test_unmovable_by_status(self):
        hosts = [host("src", vms=[vmview(spec("x"), "failed"), vmview(spec("y"), "stopped")]), host("a")]
        plan = placement.evacuate_plan("src", hosts)
        self.assertEqual(
            plan["unmovable"], [{"vm": "x", "reason": "status failed: only a running or stopped VM moves"}]
        )
        self.assertEqual(plan["moves"][0]["vm"], "y")
        self.assertEqual((plan["moves"][0]["mode"], plan["moves"][0]["stop"]), ("cold", False))

    def test_passthrough_goes_cold_only_where_the_same_device_is_free_and_holds_it(self):
        p1 = spec("p1", hardware={"sfp": [5]}, memory_mib=100)
        p2 = spec("p2", hardware={"sfp": [5]}, memory_mib=50)
        hosts = [
            host("src", vms=[vmview(p1), vmview(p2, "stopped")], hardware=[dev("sfp", 5, holder="p1")]),
            host("a", memory=16000, hardware=[dev("sfp", 6)]),
            host("b", memory=1000, hardware=[dev("sfp", 5)]),
        ]
        plan = placement.evacuate_plan("src", hosts)
        self.assertEqual(
            plan["moves"], [{"vm": "p1", "to": "b", "mode": "cold", "stop": True, "status": "running", "sharing": []}]
        )
        self.assertEqual(plan["unplaced"][0]["vm"], "p2")
        self.assertIn("held by p1", " ".join(plan["unplaced"][0]["refused"]["b"]))
        self.assertIn("not in the hardware model", " ".join(plan["unplaced"][0]["refused"]["a"]))

    def test_anti_affinity_spreads_a_role(self):
        vms = [vmview(spec(f"s{i}", role="sensor")) for i in range(3)]
        hosts = [host("src", vms=vms), host("a", memory=9000), host("b", memory=8000), host("c", memory=7000)]
        plan = placement.evacuate_plan("src", hosts)
        self.assertEqual(sorted(m["to"] for m in plan["moves"]), ["a", "b", "c"])
        self.assertTrue(all(m["sharing"] == [] for m in plan["moves"]))
        # Two hosts for three: the third shares, and says with whom.
        plan = placement.evacuate_plan("src", hosts[:3])
        self.assertEqual([len(m["sharing"]) for m in plan["moves"]], [0, 0, 1])

    def test_planned_macs_count(self):
        s1, s2 = spec("x"), spec("y")
        v1, v2 = vmview(s1), vmview(s2)
        v2["nics"][0]["mac"] = v1["nics"][0]["mac"]  # cannot happen on one host; shows the booking
        plan = placement.evacuate_plan("src", [host("src", vms=[v1, v2]), host("a")])
        self.assertEqual(len(plan["moves"]), 1)
        self.assertIn("is taken there", plan["unplaced"][0]["refused"]["a"][0])

    def test_barred_hosts_are_left_out_with_their_reason(self):
        hosts = [host("src", vms=[vmview(spec("x")), vmview(spec("y"))]), host("a", memory=9000), host("b")]
        plan = placement.evacuate_plan(
            "src", hosts, barred={"x": {"a": "no file"}, "y": {"a": "no file", "b": "no file"}}
        )
        self.assertEqual([(m["vm"], m["to"]) for m in plan["moves"]], [("x", "b")])
        self.assertEqual(
            plan["unplaced"], [{"vm": "y", "mode": "live", "refused": {"a": ["no file"], "b": ["no file"]}}]
        )

    def test_unknown_host(self):
        with self.assertRaises(placement.PlacementError):
            placement.evacuate_plan("nope", [host("a")])

    def test_a_vm_without_macs_is_unmovable(self):
        v = vmview(spec("x"))
        v["nics"] = []
        plan = placement.evacuate_plan("src", [host("src", vms=[v]), host("a")])
        self.assertIn("NIC 0 has no MAC", plan["unmovable"][0]["reason"])


if __name__ == "__main__":
    unittest.main()
