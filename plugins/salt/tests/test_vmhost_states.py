"""The vmhost states, wired to the real execution module, against a scripted fake vmhostd."""

import copy
import os
import shutil
import stat
import sys
import tempfile
import unittest

from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load

BOOT = {"kernel": "/srv/vmlinuz"}
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@example.org"
# As vmhostd records an ssh declared without user.
RECORDED_SSH = {"user": "vmhost", "keys": [KEY]}


def view(spec, status="running", pid=100):
    spec = dict(spec)
    spec.setdefault("state", "running")
    return {"name": spec["name"], "spec": spec, "desired_state": spec["state"], "status": status, "pid": pid}


def not_found(params):
    raise Fail(error(4040, f'no VM named "{params["name"]}"', field="name", kind="not_found"))


def plan(action, reason, err=None, vm="web", **extra):
    # prune false: the other VMs of the host are listed as kept, with action none.
    entries = [
        dict({"vm": vm, "action": action, "reason": reason, "error": err}, **extra),
        {"vm": "other", "action": "none", "reason": "not in the desired set; kept (prune is off)", "error": None},
    ]
    return lambda params: {"dry_run": True, "plan": entries, "results": [], "ok": err is None}


IMAGE_DRIFT = error(
    2002,
    'VM "web": boot.image changes, which needs a new disk and destroys the old one (boot.image); '
    "pass replace: true to do that",
    field="spec.boot.image",
    details={"fields": ["boot.image"]},
    kind="spec_drift",
)


def image_plan(params):
    """The daemon's dry run for a boot.image change: a 2002 unless replace is given."""
    err = None if params["replace"] else IMAGE_DRIFT
    entry = {
        "vm": "web",
        "action": "replace",
        "reason": "boot.image changes (a new disk): boot.image",
        "error": err,
        "fields": ["boot.image"],
    }
    return {"dry_run": True, "plan": [entry], "results": [], "ok": err is None}


class StateTest(unittest.TestCase):
    def start(self, methods, test=False):
        self.daemon = ScriptedVmhostd(methods)
        self.addCleanup(self.daemon.close)
        mod = load("modules", {"__salt__": {"config.get": config_get({"vmhost:socket": self.daemon.path})}})
        salt = {f"vmhost.{fn}": getattr(mod, fn) for fn in ("get", "apply", "reconcile", "destroy")}
        self.state = load("states", {"__salt__": salt, "__opts__": {"test": test}, "__pillar__": {}})
        return self.daemon

    def params(self, method):
        return [r["params"] for r in self.daemon.requests if r["method"] == method]

    def assertNothingMutated(self):
        for request in self.daemon.requests:
            self.assertIn(request["method"], ("vm.get", "host.reconcile"))
            if request["method"] == "host.reconcile":
                self.assertEqual((request["params"]["prune"], request["params"]["dry_run"]), (False, True))


class TestMode(StateTest):
    def test_create_is_predicted_by_the_daemons_dry_run(self):
        self.start({"vm.get": not_found, "host.reconcile": plan("create", "not defined on this host")}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(
            ret,
            {
                "name": "web",
                "result": None,
                "changes": {"action": "create", "reason": "not defined on this host"},
                "comment": "VM web would be created (not defined on this host)",
            },
        )
        self.assertNothingMutated()
        sent = self.params("host.reconcile")
        self.assertEqual(
            sent,
            [
                {
                    "vms": [{"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "state": "running"}],
                    "prune": False,
                    "dry_run": True,
                    "replace": False,
                }
            ],
        )

    def test_stop_planned(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start(
            {"vm.get": lambda p: view(spec), "host.reconcile": plan("stop", "desired stopped, is running")}, test=True
        )
        ret = self.state.stopped("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["changes"], {"action": "stop", "reason": "desired stopped, is running"})
        self.assertEqual(self.params("host.reconcile")[0]["vms"][0]["state"], "stopped")
        self.assertNothingMutated()

    def test_up_to_date_reports_no_changes(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "up to date (running)")}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertIn("as declared", ret["comment"])
        self.assertNothingMutated()

    def test_plan_error_fails_with_code_and_field(self):
        err = error(3002, "memory_mib 9999 exceeds the 2304 MiB available", field="spec.memory_mib")
        self.start({"vm.get": not_found, "host.reconcile": plan("create", "not defined on this host", err)}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=9999, boot=BOOT)
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertIn(
            "vmhostd error 3002 (spec.memory_mib): memory_mib 9999 exceeds the 2304 MiB available", ret["comment"]
        )
        self.assertNothingMutated()

    def test_image_change_without_replace_fails_with_the_daemons_2002(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": {"image": "old.qcow2", "disk_gib": 2}}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": image_plan}, test=True)
        new_boot = {"image": "new.qcow2", "disk_gib": 2}
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=new_boot)
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(
            ret["comment"].startswith(
                "VM web would fail to be replaced (new disk): vmhostd error 2002 (spec.boot.image): "
            ),
            ret["comment"],
        )
        self.assertTrue(
            ret["comment"].endswith(
                "; set replace: True to recreate the VM with a new disk (its old disk overlay is deleted)"
            ),
            ret["comment"],
        )
        # With replace the dry run is asked with replace, and predicts the new disk.
        ret = self.state.running("web", replace=True, cpu=1, memory_mib=256, boot=new_boot)
        self.assertIsNone(ret["result"])
        self.assertEqual(
            ret["changes"],
            {"action": "replace", "reason": "boot.image changes (a new disk): boot.image", "fields": ["boot.image"]},
        )
        self.assertEqual(
            ret["comment"], "VM web would be replaced (new disk; the old disk overlay is deleted): boot.image"
        )
        self.assertEqual([p["replace"] for p in self.params("host.reconcile")], [False, True])
        self.assertNothingMutated()

    def test_reconfigure_is_predicted_with_its_fields_and_restart(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        reason = "changed in place, disk kept (restarts): memory_mib"
        self.start(
            {
                "vm.get": lambda p: view(spec),
                "host.reconcile": plan("reconfigure", reason, fields=["memory_mib"], restart=True),
            },
            test=True,
        )
        ret = self.state.running("web", cpu=1, memory_mib=512, boot=BOOT)
        self.assertEqual(
            ret,
            {
                "name": "web",
                "result": None,
                "changes": {"action": "reconfigure", "reason": reason, "fields": ["memory_mib"], "restart": True},
                "comment": "VM web would be reconfigured in place (disk kept): memory_mib; it is restarted",
            },
        )
        # Without replace: a reconfigure never needs it, and the dry run is asked without it.
        self.assertEqual(self.params("host.reconcile")[0]["replace"], False)
        # restart=False: the restart the plan assumes stays pending.
        ret = self.state.running("web", restart=False, cpu=1, memory_mib=512, boot=BOOT)
        self.assertIsNone(ret["result"])
        self.assertEqual((ret["changes"]["restart"], ret["changes"]["pending_restart"]), (False, True))
        self.assertIn("restart pending (restart is False)", ret["comment"])
        self.assertNothingMutated()

    def test_reconfigure_without_restart(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": {"image": "b.qcow2", "disk_gib": 2}}
        reason = "changed in place, disk kept (no restart): boot.disk_gib"
        self.start(
            {
                "vm.get": lambda p: view(spec),
                "host.reconcile": plan("reconfigure", reason, fields=["boot.disk_gib"], restart=False),
            },
            test=True,
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot={"image": "b.qcow2", "disk_gib": 4})
        self.assertEqual(ret["changes"]["restart"], False)
        self.assertEqual(ret["comment"], "VM web would be reconfigured in place (disk kept): boot.disk_gib; no restart")

    def test_a_pending_restart(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        reason = "runs an older spec: restarted to apply it"
        self.start(
            {"vm.get": lambda p: view(spec), "host.reconcile": plan("reconfigure", reason, restart=True)}, test=True
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["comment"], f"VM web would be restarted to apply its pending change ({reason})")
        # restart=False leaves it pending: nothing to do.
        ret = self.state.running("web", restart=False, cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertIn("runs an older spec until its next start", ret["comment"])

    def test_smaller_disk_is_refused_by_the_dry_run(self):
        err = error(2001, "the disk is 4 GiB and is never shrunk", field="spec.boot.disk_gib")
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": {"image": "b.qcow2", "disk_gib": 4}}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("reconfigure", "cannot", err)}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot={"image": "b.qcow2", "disk_gib": 2})
        self.assertIs(ret["result"], False)
        self.assertEqual(
            ret["comment"],
            "VM web would fail to be reconfigured in place (disk kept): "
            "vmhostd error 2001 (spec.boot.disk_gib): the disk is 4 GiB and is never shrunk",
        )

    def test_guest_interfaces_alone_is_a_change(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        gi = [{"name": "d0", "address": "10.9.0.1/24"}]
        self.start(
            {"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "guest interfaces differ")}, test=True
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, guest_interfaces=gi)
        self.assertIsNone(ret["result"])
        self.assertIn("guest_interfaces", ret["comment"])

    def test_ssh_alone_is_a_live_change(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "ssh": RECORDED_SSH}
        reason = "ssh access differs (written live by the exec server)"
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", reason)}, test=True)
        ssh = {"user": "ops", "keys": [KEY]}
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, ssh=ssh)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["changes"], {"action": "ssh", "reason": reason, "live": ["ssh"]})
        self.assertEqual(ret["comment"], "VM web would get its ssh applied live")
        self.assertEqual(self.params("host.reconcile")[0]["vms"][0]["ssh"], ssh)
        self.assertNothingMutated()

    def test_ssh_without_user_is_the_recorded_default_user(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "ssh": RECORDED_SSH}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "up to date (running)")}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, ssh={"keys": [KEY]})
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(ret["comment"], "VM web is as declared (up to date (running))")
        # No ssh declared against a recorded one: a removal, applied live as well.
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "ssh access differs")}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(ret["changes"]["live"], ["ssh"])

    def test_guest_interfaces_and_ssh_of_a_stopped_vm_are_recorded(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "state": "stopped"}
        reason = "guest interfaces differ (applied live by the agent)"
        self.start({"vm.get": lambda p: view(spec, "stopped", None), "host.reconcile": plan("none", reason)}, test=True)
        gi = [{"name": "d0", "address": "10.9.0.1/24"}]
        ret = self.state.stopped("web", cpu=1, memory_mib=256, boot=BOOT, guest_interfaces=gi, ssh={"keys": [KEY]})
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["changes"], {"action": "live", "reason": reason, "live": ["guest_interfaces", "ssh"]})
        self.assertEqual(
            ret["comment"],
            "VM web would get its guest_interfaces and ssh recorded (the guest gets the change at its next start)",
        )

    def test_guest_exec_is_a_reconfigure_without_restart(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        reason = "changed in place, disk kept (no restart): guest_exec"
        self.start(
            {
                "vm.get": lambda p: view(spec),
                "host.reconcile": plan("reconfigure", reason, fields=["guest_exec"], restart=False),
            },
            test=True,
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, guest_exec=False)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["comment"], "VM web would be reconfigured in place (disk kept): guest_exec; no restart")
        self.assertIs(self.params("host.reconcile")[0]["vms"][0]["guest_exec"], False)

    def test_placement_members_go_to_the_dry_run_and_their_change_restarts(self):
        spec = {"name": "web", "cpu": 2, "memory_mib": 2048, "boot": BOOT}
        fields = ["cpu_policy", "emulator_cpu", "hugepages", "nics", "numa"]
        reason = "changed in place, disk kept (restarts): " + ", ".join(fields)
        self.start(
            {
                "vm.get": lambda p: view(spec),
                "host.reconcile": plan("reconfigure", reason, fields=fields, restart=True),
            },
            test=True,
        )
        nics = [{"network": "lan", "queues": 4}]
        ret = self.state.running(
            "web",
            cpu=2,
            memory_mib=2048,
            boot=BOOT,
            cpu_policy="dedicated",
            numa=1,
            hugepages="1G",
            emulator_cpu=True,
            nics=nics,
        )
        self.assertIsNone(ret["result"])
        self.assertEqual(
            ret["comment"], f"VM web would be reconfigured in place (disk kept): {', '.join(fields)}; it is restarted"
        )
        sent = self.params("host.reconcile")[0]["vms"][0]
        self.assertEqual(
            {k: sent.get(k) for k in ("cpu_policy", "numa", "hugepages", "emulator_cpu", "nics")},
            {"cpu_policy": "dedicated", "numa": 1, "hugepages": "1G", "emulator_cpu": True, "nics": nics},
        )
        self.assertNothingMutated()

    def test_placement_defaults_declared_against_a_spec_without_them_are_as_declared(self):
        # vmhostd leaves cpu_policy shared, emulator_cpu false and a NIC's queues 1 out of the
        # recorded spec; its plan says there is nothing to do and the state says so.
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "nics": [{"network": "lan"}]}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "up to date (running)")}, test=True)
        ret = self.state.running(
            "web",
            cpu=1,
            memory_mib=256,
            boot=BOOT,
            cpu_policy="shared",
            emulator_cpu=False,
            nics=[{"network": "lan", "queues": 1}],
        )
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))

    def test_tpm_secure_boot_and_snapshot_defaults_declared_against_a_spec_without_them_are_as_declared(self):
        # vmhostd leaves tpm false, boot.secure_boot false and a disk's snapshot true out of the
        # recorded spec. The state compares nothing itself: the declared values go to the dry
        # run as given, its plan says there is nothing to do, and the state says so.
        uefi = dict(BOOT, firmware="uefi")
        disk = {"name": "data", "size_gib": 1}
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": uefi, "disks": [disk]}
        self.start({"vm.get": lambda p: view(spec), "host.reconcile": plan("none", "up to date (running)")}, test=True)
        ret = self.state.running(
            "web",
            cpu=1,
            memory_mib=256,
            boot=dict(uefi, secure_boot=False),
            disks=[dict(disk, snapshot=True)],
            tpm=False,
        )
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        sent = self.params("host.reconcile")[0]["vms"][0]
        self.assertEqual(
            (sent["tpm"], sent["boot"]["secure_boot"], sent["disks"][0]["snapshot"]),
            (False, False, True),
        )
        self.assertNothingMutated()

    def test_a_placement_refusal_of_the_dry_run_names_code_and_field(self):
        err = error(
            3002,
            "node 0 has 1 free VM CPU, VM web asks for 2",
            field="spec.cpu",
            details={"resource": "cpu", "node": 0, "requested": 2, "available": 1},
            kind="capacity",
        )
        self.start({"vm.get": not_found, "host.reconcile": plan("create", "not on the host", err)}, test=True)
        ret = self.state.running("web", cpu=2, memory_mib=256, boot=BOOT, cpu_policy="dedicated")
        self.assertIs(ret["result"], False)
        self.assertEqual(
            ret["comment"],
            "VM web would fail to be created: vmhostd error 3002 (spec.cpu): "
            "node 0 has 1 free VM CPU, VM web asks for 2",
        )

    def test_capture_and_trunk_members_go_to_the_dry_run_as_given(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "nics": [{"network": "lan"}]}
        self.start(
            {
                "vm.get": lambda p: view(spec),
                "host.reconcile": plan(
                    "reconfigure", "changed in place, disk kept (restarts): nics", fields=["nics"], restart=True
                ),
            },
            test=True,
        )
        nics = [
            {"network": "lan", "vlans": [10, 20]},
            {"network": "lan", "trunk": True},
            {"mode": "monitor", "source": "eth1", "direction": "ingress"},
        ]
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, nics=nics)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["comment"], "VM web would be reconfigured in place (disk kept): nics; it is restarted")
        self.assertEqual(self.params("host.reconcile")[0]["vms"][0]["nics"], nics)
        self.assertNothingMutated()

    def test_a_monitor_source_the_host_does_not_list_fails_the_dry_run_with_its_3001(self):
        err = error(
            3001,
            "the host config lists no capture interface eth9",
            field="spec.nics[0].source",
            kind="not_in_model",
        )
        self.start({"vm.get": not_found, "host.reconcile": plan("create", "not on the host", err)}, test=True)
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, nics=[{"mode": "monitor", "source": "eth9"}])
        self.assertIs(ret["result"], False)
        self.assertEqual(
            ret["comment"],
            "VM web would fail to be created: vmhostd error 3001 (spec.nics[0].source): "
            "the host config lists no capture interface eth9",
        )
        self.assertNothingMutated()

    def test_absent_predicts_destroy_without_destroying(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": lambda p: view(spec)}, test=True)
        ret = self.state.absent("web")
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["comment"], "VM web would be destroyed")
        self.assertNothingMutated()

    def test_daemon_error_in_test_mode(self):
        self.start(
            {"vm.get": lambda p: (_ for _ in ()).throw(Fail(error(1002, "read-only access", field="method")))},
            test=True,
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(ret["result"], False)
        self.assertEqual(ret["comment"], "vmhostd error 1002 (method): read-only access")


class RealRun(StateTest):
    def test_create(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": not_found, "vm.apply": lambda p: {"changed": True, "vm": view(p["spec"], pid=42)}})
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertIs(ret["result"], True)
        self.assertEqual(ret["comment"], "VM web created (running)")
        self.assertEqual(
            ret["changes"],
            {"old": None, "new": {"spec": dict(spec, state="running"), "status": "running", "pid": 42}},
        )
        self.assertEqual(
            self.params("vm.apply"),
            [{"spec": dict(spec, state="running"), "replace": False, "restart": True, "timeout_s": 30}],
        )

    def test_unchanged(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": lambda p: view(spec), "vm.apply": lambda p: {"changed": False, "vm": view(spec)}})
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(
            ret, {"name": "web", "result": True, "changes": {}, "comment": "VM web is as declared (running)"}
        )

    def test_changes_show_only_what_differs(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        stopped = view(dict(spec, state="stopped"), status="stopped", pid=None)
        self.start({"vm.get": lambda p: stopped, "vm.apply": lambda p: {"changed": True, "vm": view(spec, pid=7)}})
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(
            ret["changes"],
            {
                "old": {"status": "stopped", "pid": None, "spec": {"state": "stopped"}},
                "new": {"status": "running", "pid": 7, "spec": {"state": "running"}},
            },
        )
        self.assertEqual(ret["comment"], "VM web updated (running)")

    def test_image_change_fails_with_the_daemons_2002_and_the_hint(self):
        self.start(
            {
                "vm.get": lambda p: view({"name": "web"}),
                "vm.apply": lambda p: (_ for _ in ()).throw(Fail(IMAGE_DRIFT)),
            }
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot={"image": "new.qcow2", "disk_gib": 2})
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(
            ret["comment"].startswith('vmhostd error 2002 (spec.boot.image): VM "web": boot.image changes'),
            ret["comment"],
        )
        self.assertIn("; set replace: True to recreate the VM with a new disk", ret["comment"])
        self.assertEqual(self.params("vm.apply")[0]["replace"], False)

    def test_reconfigured_in_place(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": {"image": "b.qcow2", "disk_gib": 2}}
        changed = dict(spec, memory_mib=512, boot={"image": "b.qcow2", "disk_gib": 3})
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=8)}}
        )
        ret = self.state.running("web", timeout_s=5, **{k: v for k, v in changed.items() if k != "name"})
        self.assertIs(ret["result"], True)
        self.assertEqual(
            ret["comment"], "VM web reconfigured in place (disk kept): boot.disk_gib, memory_mib (running)"
        )
        self.assertEqual(
            ret["changes"],
            {
                "old": {"pid": 7, "spec": {"memory_mib": 256, "boot": {"image": "b.qcow2", "disk_gib": 2}}},
                "new": {"pid": 8, "spec": {"memory_mib": 512, "boot": {"image": "b.qcow2", "disk_gib": 3}}},
            },
        )
        sent = self.params("vm.apply")[0]
        self.assertEqual((sent["replace"], sent["restart"], sent["timeout_s"]), (False, True, 5))

    def test_reconfigured_with_the_restart_pending(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        changed = dict(spec, cpu=2)
        after = dict(view(changed, pid=7), pending_restart=True)
        self.start(
            {
                "vm.get": lambda p: dict(view(spec, pid=7), pending_restart=False),
                "vm.apply": lambda p: {"changed": True, "vm": after},
            }
        )
        ret = self.state.running("web", restart=False, cpu=2, memory_mib=256, boot=BOOT)
        self.assertEqual(
            ret["comment"],
            "VM web reconfigured in place (disk kept): cpu; restart pending (restart is False): "
            "the change applies at its next start (running)",
        )
        self.assertEqual(
            ret["changes"],
            {
                "old": {"pending_restart": False, "spec": {"cpu": 1}},
                "new": {"pending_restart": True, "spec": {"cpu": 2}},
            },
        )
        self.assertEqual(self.params("vm.apply")[0]["restart"], False)

    def test_ssh_alone_applied_live(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "ssh": RECORDED_SSH}
        changed = dict(spec, ssh={"user": "ops", "keys": [KEY]})
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=7)}}
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, ssh={"user": "ops", "keys": [KEY]})
        self.assertIs(ret["result"], True)
        self.assertEqual(ret["comment"], "VM web updated: its ssh applied live (running)")
        self.assertEqual(
            ret["changes"], {"old": {"spec": {"ssh": RECORDED_SSH}}, "new": {"spec": {"ssh": changed["ssh"]}}}
        )
        self.assertEqual(self.params("vm.apply")[0]["spec"]["ssh"], {"user": "ops", "keys": [KEY]})

    def test_guest_interfaces_of_a_stopped_vm_recorded(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "state": "stopped"}
        gi = [{"name": "d0", "address": "10.9.0.1/24"}]
        after = view(dict(spec, guest_interfaces=gi), "stopped", None)
        self.start(
            {"vm.get": lambda p: view(spec, "stopped", None), "vm.apply": lambda p: {"changed": True, "vm": after}}
        )
        ret = self.state.stopped("web", cpu=1, memory_mib=256, boot=BOOT, guest_interfaces=gi)
        self.assertEqual(
            ret["comment"],
            "VM web updated: its guest_interfaces recorded (the guest gets the change at its next start) (stopped)",
        )

    def test_guest_exec_reconfigured_in_place(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        changed = dict(spec, guest_exec=False)
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=7)}}
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, guest_exec=False)
        self.assertEqual(ret["comment"], "VM web reconfigured in place (disk kept): guest_exec (running)")
        self.assertEqual(
            ret["changes"], {"old": {"spec": {"guest_exec": None}}, "new": {"spec": {"guest_exec": False}}}
        )
        self.assertIs(self.params("vm.apply")[0]["spec"]["guest_exec"], False)

    def test_tpm_secure_boot_and_snapshot_defaults_declared_are_as_declared(self):
        uefi = dict(BOOT, firmware="uefi")
        disk = {"name": "data", "size_gib": 1}
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": uefi, "disks": [disk]}
        self.start({"vm.get": lambda p: view(spec), "vm.apply": lambda p: {"changed": False, "vm": view(spec)}})
        ret = self.state.running(
            "web",
            cpu=1,
            memory_mib=256,
            boot=dict(uefi, secure_boot=False),
            disks=[dict(disk, snapshot=True)],
            tpm=False,
        )
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(ret["comment"], "VM web is as declared (running)")
        sent = self.params("vm.apply")[0]["spec"]
        self.assertEqual(
            (sent["tpm"], sent["boot"]["secure_boot"], sent["disks"][0]["snapshot"]),
            (False, False, True),
        )

    def test_tpm_secure_boot_and_an_unsnapshotted_disk_reported_as_an_in_place_change(self):
        uefi = dict(BOOT, firmware="uefi")
        disk = {"name": "data", "size_gib": 1}
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": uefi, "disks": [disk]}
        changed = dict(spec, tpm=True, boot=dict(uefi, secure_boot=True), disks=[dict(disk, snapshot=False)])
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=8)}}
        )
        ret = self.state.running("web", **{k: v for k, v in changed.items() if k != "name"})
        self.assertIs(ret["result"], True)
        # A new secure_boot is no new boot image: in place, the disk kept.
        self.assertEqual(
            ret["comment"], "VM web reconfigured in place (disk kept): boot.secure_boot, disks, tpm (running)"
        )
        self.assertEqual(ret["changes"]["new"]["spec"]["tpm"], True)

    def test_placement_members_sent_and_reported_as_an_in_place_change(self):
        spec = {"name": "web", "cpu": 2, "memory_mib": 2048, "boot": BOOT}
        changed = dict(spec, cpu_policy="dedicated", numa="auto", hugepages="2M")
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=8)}}
        )
        ret = self.state.running("web", **{k: v for k, v in changed.items() if k != "name"})
        self.assertIs(ret["result"], True)
        self.assertEqual(
            ret["comment"], "VM web reconfigured in place (disk kept): cpu_policy, hugepages, numa (running)"
        )
        sent = self.params("vm.apply")[0]["spec"]
        self.assertEqual(
            (sent["cpu_policy"], sent["numa"], sent["hugepages"]),
            ("dedicated", "auto", "2M"),
        )

    def test_dedicated_without_vm_cpus_fails_with_the_daemons_3001(self):
        err = error(3001, "the host config names no vm_cpus", field="spec.cpu_policy", kind="not_in_model")
        self.start({"vm.get": not_found, "vm.apply": lambda p: (_ for _ in ()).throw(Fail(err))})
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, cpu_policy="dedicated", numa="none")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertEqual(ret["comment"], "vmhostd error 3001 (spec.cpu_policy): the host config names no vm_cpus")
        self.assertEqual(self.params("vm.apply")[0]["spec"]["numa"], "none")

    def test_a_monitor_nic_is_sent_as_given_and_reported_as_an_in_place_change(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "nics": [{"network": "lan"}]}
        nics = [{"network": "lan"}, {"mode": "monitor", "source": "eth1", "direction": "both"}]
        changed = dict(spec, nics=nics)
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=8)}}
        )
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, nics=nics)
        self.assertIs(ret["result"], True)
        self.assertEqual(ret["comment"], "VM web reconfigured in place (disk kept): nics (running)")
        self.assertEqual(self.params("vm.apply")[0]["spec"]["nics"], nics)
        self.assertEqual(ret["changes"]["new"]["spec"]["nics"], nics)

    def test_a_monitor_source_missing_on_the_host_fails_with_the_daemons_3001(self):
        err = error(3001, "no interface eth1 on the host", field="spec.nics[1].source", kind="not_in_model")
        self.start({"vm.get": not_found, "vm.apply": lambda p: (_ for _ in ()).throw(Fail(err))})
        nics = [{"network": "lan"}, {"mode": "monitor", "source": "eth1"}]
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT, nics=nics)
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertEqual(ret["comment"], "vmhostd error 3001 (spec.nics[1].source): no interface eth1 on the host")
        self.assertEqual(self.params("vm.apply")[0]["spec"]["nics"], nics)

    def test_replaced_with_a_new_disk(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": {"image": "old.qcow2", "disk_gib": 2}}
        changed = dict(spec, boot={"image": "new.qcow2", "disk_gib": 2})
        self.start(
            {"vm.get": lambda p: view(spec, pid=7), "vm.apply": lambda p: {"changed": True, "vm": view(changed, pid=9)}}
        )
        ret = self.state.running("web", replace=True, cpu=1, memory_mib=256, boot=changed["boot"])
        self.assertEqual(
            ret["comment"], "VM web replaced (new disk; the old disk overlay was deleted): boot.image (running)"
        )
        self.assertEqual(self.params("vm.apply")[0]["replace"], True)

    def test_flags_written_as_text(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": lambda p: view(spec), "vm.apply": lambda p: {"changed": False, "vm": view(spec)}})
        self.state.running("web", replace="False", restart="no", cpu=1, memory_mib=256, boot=BOOT)
        sent = self.params("vm.apply")[0]
        self.assertEqual((sent["replace"], sent["restart"]), (False, False))
        ret = self.state.running("web", replace="perhaps", cpu=1)
        self.assertIs(ret["result"], False)
        self.assertIn("replace must be True or False, not 'perhaps'", ret["comment"])

    def test_bad_timeout_fails_the_state(self):
        self.start({"vm.get": lambda p: view({"name": "web"})})
        ret = self.state.running("web", timeout_s="soon", cpu=1)
        self.assertIs(ret["result"], False)
        self.assertIn("timeout_s must be an integer", ret["comment"])
        self.assertEqual(self.daemon.methods_called(), ["vm.get"])

    def test_no_daemon(self):
        self.start({})
        self.daemon.close()
        ret = self.state.running("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertIs(ret["result"], False)
        self.assertIn("cannot connect to vmhostd", ret["comment"])

    def test_stopped_sends_state_stopped(self):
        self.start({"vm.get": not_found, "vm.apply": lambda p: {"changed": True, "vm": view(p["spec"], "stopped")}})
        ret = self.state.stopped("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertIs(ret["result"], True)
        self.assertEqual(self.params("vm.apply")[0]["spec"]["state"], "stopped")

    def test_present_keeps_the_recorded_desired_state(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "state": "stopped"}
        self.start(
            {"vm.get": lambda p: view(spec, "stopped"), "vm.apply": lambda p: {"changed": False, "vm": view(spec)}}
        )
        self.state.present("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertEqual(self.params("vm.apply")[0]["spec"]["state"], "stopped")

    def test_present_creates_with_the_daemons_default(self):
        self.start({"vm.get": not_found, "vm.apply": lambda p: {"changed": True, "vm": view(p["spec"])}})
        self.state.present("web", cpu=1, memory_mib=256, boot=BOOT)
        self.assertNotIn("state", self.params("vm.apply")[0]["spec"])

    def test_spec_argument_is_merged_and_salt_keys_are_dropped(self):
        self.start({"vm.get": not_found, "vm.apply": lambda p: {"changed": True, "vm": view(p["spec"])}})
        pillar_spec = {"cpu": 4, "memory_mib": 256, "boot": BOOT}
        self.state.running("web", spec=copy.deepcopy(pillar_spec), cpu=1, __env__="base", __sls__="vms")
        self.assertEqual(
            self.params("vm.apply")[0]["spec"],
            {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT, "state": "running"},
        )

    def test_a_different_spec_name_is_refused(self):
        self.start({"vm.get": not_found})
        ret = self.state.running("web", spec={"name": "db", "cpu": 1})
        self.assertIs(ret["result"], False)
        self.assertIn("differs from the state's name", ret["comment"])
        self.assertEqual(self.daemon.requests, [])

    def test_absent_destroys(self):
        spec = {"name": "web", "cpu": 1, "memory_mib": 256, "boot": BOOT}
        self.start({"vm.get": lambda p: view(spec), "vm.destroy": lambda p: {"changed": True, "vm": None}})
        ret = self.state.absent("web")
        self.assertIs(ret["result"], True)
        self.assertEqual(
            ret["changes"],
            {"old": {"spec": dict(spec, state="running"), "status": "running", "pid": 100}, "new": None},
        )
        self.assertEqual(self.params("vm.destroy"), [{"name": "web"}])

    def test_absent_when_already_gone(self):
        self.start({"vm.get": not_found})
        ret = self.state.absent("web")
        self.assertEqual(ret, {"name": "web", "result": True, "changes": {}, "comment": "VM web is already absent"})
        self.assertEqual(self.daemon.methods_called(), ["vm.get"])

    def test_absent_error(self):
        busy = error(4090, 'another operation on VM "web" is in progress', field="name")
        self.start(
            {"vm.get": lambda p: view({"name": "web"}), "vm.destroy": lambda p: (_ for _ in ()).throw(Fail(busy))}
        )
        ret = self.state.absent("web")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["comment"], 'vmhostd error 4090 (name): another operation on VM "web" is in progress')


SO_DEFAULTS = """\
hypervisor:
  model:
    SOSSNNV:
      hardware:
        cpu: 128
        memory: 256
        disk:
          1: pci_0000_c7_00_0
          2: pci_0000_c8_00_0
          3: pci_0000_c9_00_0
          4: pci_0000_ca_00_0
        copper:
        sfp:
          1: pci_0000_41_00_0
          2: pci_0000_41_00_1
          3: pci_0000_42_00_0
          4: pci_0000_42_00_1
    SOS1000:
      hardware:
        cpu: 16
        memory: 64
        disk: null
        copper:
          '1': pci_0000_02_00_0
          2: pci_0000_02_00_1
        sfp:
          '10': pci_0000_03_00_1
          5: pci_0000_03_00_0
          '6': pci_0000_0A_1F_7
"""

# A config with something before, between and after the hardware tables; a multi-line string
# holding a line that looks like a header; comments that end the hardware tables.
CONFIG = """\
sandbox = "best-effort"   # top level
[paths]
state = "/var/lib/vmhost"
[qemu]
cpu_model = \'\'\'
[hardware]
\'\'\'

[hardware]
# old comment
cpu = 4
memory_gib = 8
allow_raw_pci = true
[hardware.copper]
1 = "0000:c8:00.0"

# Networks:
[networks.lan]
bridge = "br-lan"

[hardware.sfp]   # a stray table after networks
9 = "0000:ca:00.0"
# commented = "kept"
[logs]
max_bytes = 262144
"""

SOSSNNV_SECTION = """\
[hardware]
# Written by Salt (vmhost.hardware_from_so) from Security Onion model SOSSNNV; the
# [hardware] tables are replaced at its next run.
cpu = 128
memory_gib = 256
reserved_cpu = 8
reserved_memory_gib = 16
allow_raw_pci = true

[hardware.disk]
1 = "0000:c7:00.0"
2 = "0000:c8:00.0"
3 = "0000:c9:00.0"
4 = "0000:ca:00.0"

[hardware.sfp]
1 = "0000:41:00.0"
2 = "0000:41:00.1"
3 = "0000:42:00.0"
4 = "0000:42:00.1"
"""

# CONFIG with its hardware tables replaced: the blank and comment lines that ended them stay.
CONFIG_SOSSNNV = (
    CONFIG.split("[hardware]\n# old")[0]
    + SOSSNNV_SECTION
    + '\n# Networks:\n[networks.lan]\nbridge = "br-lan"\n\n# commented = "kept"\n[logs]\nmax_bytes = 262144\n'
)

# A stand-in for `vmhostd --config PATH --check-config`: records its argv and the file it was
# shown; refuses when the REFUSE file exists, naming the file as vmhostd does.
FAKE_VMHOSTD = """\
import os, sys
here = os.path.dirname(os.path.abspath(sys.argv[0]))
path = sys.argv[2]
with open(os.path.join(here, "checks.log"), "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
with open(os.path.join(here, "checked.toml"), "w") as copy, open(path) as f:
    copy.write(f.read())
if os.path.exists(os.path.join(here, "REFUSE")):
    print(f"vmhostd: refusing to start: {path}: key `hardware.reserved_cpu`: 8 leaves no CPU for VMs", file=sys.stderr)
    sys.exit(2)
print(f"{path}: OK")
"""


class HardwareFromSo(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="vmhhw")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.etc = os.path.join(self.dir, "etc")
        self.tools = os.path.join(self.dir, "tools")
        os.mkdir(self.etc)
        os.mkdir(self.tools)
        self.config = os.path.join(self.etc, "vmhostd.toml")
        self.write(self.config, CONFIG)
        os.chmod(self.config, 0o640)
        self.defaults = os.path.join(self.dir, "defaults.yaml")
        self.write(self.defaults, SO_DEFAULTS)
        self.vmhostd = os.path.join(self.tools, "vmhostd")
        self.write(self.vmhostd, f"#!{sys.executable}\n" + FAKE_VMHOSTD)
        os.chmod(self.vmhostd, 0o755)
        self.restarts = []
        self.grains = {"sosmodel": "SOSSNNV"}
        self.load(test=False)

    def load(self, test):
        salt = {"service.restart": lambda name: self.restarts.append(name) or True}
        self.state = load("states", {"__salt__": salt, "__opts__": {"test": test}, "__grains__": self.grains})

    def write(self, path, text):
        with open(path, "w") as f:
            f.write(text)

    def read(self, path):
        with open(path) as f:
            return f.read()

    def apply(self, **kwargs):
        args = {"name": self.config, "defaults": self.defaults, "vmhostd": self.vmhostd}
        args.update(kwargs)
        return self.state.hardware_from_so(**args)

    def checks(self):
        path = os.path.join(self.tools, "checks.log")
        return self.read(path).splitlines() if os.path.exists(path) else []

    def assertUntouched(self, ino=None):
        self.assertEqual(self.read(self.config), CONFIG)
        if ino is not None:
            self.assertEqual(os.stat(self.config).st_ino, ino)
        self.assertEqual(os.listdir(self.etc), ["vmhostd.toml"], "no temporary file left")

    def test_replaces_only_the_hardware_tables_checks_and_restarts_once(self):
        before = os.stat(self.config)
        ret = self.apply(restart_cmd=None)
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(self.read(self.config), CONFIG_SOSSNNV)
        self.assertEqual(
            ret["comment"],
            f"{self.config}: [hardware] set to Security Onion model SOSSNNV; service vmhostd restarted",
        )
        self.assertEqual(ret["changes"]["model"], "SOSSNNV")
        self.assertIn("+cpu = 128\n", ret["changes"]["diff"])
        self.assertIn('-9 = "0000:ca:00.0"\n', ret["changes"]["diff"])
        self.assertEqual(self.restarts, ["vmhostd"])
        # Checked before the rename: a candidate in the same directory, with the new text.
        [check] = self.checks()
        flag, candidate, last = check.split(" ")
        self.assertEqual((flag, last, os.path.dirname(candidate)), ("--config", "--check-config", self.etc))
        self.assertNotEqual(candidate, self.config)
        self.assertEqual(self.read(os.path.join(self.tools, "checked.toml")), CONFIG_SOSSNNV)
        # Replaced by a rename (a new inode), mode and owner kept, nothing left behind.
        after = os.stat(self.config)
        self.assertNotEqual(after.st_ino, before.st_ino)
        self.assertEqual(stat.S_IMODE(after.st_mode), 0o640)
        self.assertEqual((after.st_uid, after.st_gid), (before.st_uid, before.st_gid))
        self.assertEqual(os.listdir(self.etc), ["vmhostd.toml"])

        # The same inputs again: nothing to do, no check, no restart.
        ret = self.apply()
        self.assertEqual(
            ret,
            {
                "name": self.config,
                "result": True,
                "changes": {},
                "comment": f"{self.config}: [hardware] is already Security Onion model SOSSNNV",
            },
        )
        self.assertEqual(self.restarts, ["vmhostd"])
        self.assertEqual(len(self.checks()), 1)
        self.assertEqual(os.stat(self.config).st_ino, after.st_ino)

    def test_null_classes_string_indices_numeric_order_and_the_reservation(self):
        self.grains["sosmodel"] = "SOS1000"
        ret = self.apply(reserved_cpu=2, reserved_memory_gib=4, allow_raw_pci=False, restart=False)
        self.assertIs(ret["result"], True, ret)
        self.assertIn("vmhostd not restarted (restart is False)", ret["comment"])
        self.assertEqual(self.restarts, [])
        text = self.read(self.config)
        section = text[text.index("[hardware]\n# Written") : text.index("\n# Networks:")]
        self.assertEqual(
            section,
            "[hardware]\n"
            "# Written by Salt (vmhost.hardware_from_so) from Security Onion model SOS1000; the\n"
            "# [hardware] tables are replaced at its next run.\n"
            "cpu = 16\nmemory_gib = 64\nreserved_cpu = 2\nreserved_memory_gib = 4\nallow_raw_pci = false\n\n"
            '[hardware.copper]\n1 = "0000:02:00.0"\n2 = "0000:02:00.1"\n\n'
            '[hardware.sfp]\n5 = "0000:03:00.0"\n6 = "0000:0a:1f.7"\n10 = "0000:03:00.1"\n',
        )
        self.assertNotIn("[hardware.disk]", text)

    def test_model_argument_overrides_the_grain_and_no_grain_fails(self):
        ret = self.apply(model="SOS1000", restart=False)
        self.assertIn("model SOS1000", ret["comment"])
        self.grains.clear()
        self.write(self.config, CONFIG)
        ret = self.apply()
        self.assertEqual((ret["result"], ret["changes"]), (False, {}))
        self.assertEqual(ret["comment"], "no model: the minion has no sosmodel grain and no model was given")
        self.assertUntouched()

    def test_unknown_model_names_it_and_the_models_available(self):
        ino = os.stat(self.config).st_ino
        self.grains["sosmodel"] = "SOSNOPE"
        ret = self.apply()
        self.assertEqual((ret["result"], ret["changes"]), (False, {}))
        self.assertEqual(ret["comment"], f"model 'SOSNOPE' is not in {self.defaults} (models there: SOS1000, SOSSNNV)")
        self.assertUntouched(ino)
        self.assertEqual((self.checks(), self.restarts), ([], []))

    def test_bad_pci_address_or_index_names_the_key(self):
        cases = [
            ("pci_0000_41_00_0", "pci_0000_41_0_0", "hypervisor.model.SOSSNNV.hardware.sfp.1: 'pci_0000_41_0_0'"),
            ("pci_0000_41_00_0", "pci_0000_41_20_0", "hypervisor.model.SOSSNNV.hardware.sfp.1: 'pci_0000_41_20_0'"),
            ("pci_0000_c7_00_0", "pci_0000_c7_00_8", "hypervisor.model.SOSSNNV.hardware.disk.1: 'pci_0000_c7_00_8'"),
            ("1: pci_0000_41_00_0", "x1: pci_0000_41_00_0", "hypervisor.model.SOSSNNV.hardware.sfp.x1: index 'x1'"),
            ("1: pci_0000_41_00_0", "-1: pci_0000_41_00_0", "hypervisor.model.SOSSNNV.hardware.sfp.-1: index -1"),
            ("cpu: 128", "cpu: many", "hypervisor.model.SOSSNNV.hardware.cpu: 'many' is not an integer"),
            ("memory: 256", "memory: 0", "hypervisor.model.SOSSNNV.hardware.memory: 0 is not an integer"),
        ]
        for old, new, expected in cases:
            with self.subTest(new=new):
                self.write(self.defaults, SO_DEFAULTS.replace(old, new, 1))
                ret = self.apply()
                self.assertIs(ret["result"], False, ret)
                self.assertTrue(ret["comment"].startswith(expected), ret["comment"])
                self.assertUntouched()
        self.assertEqual((self.checks(), self.restarts), ([], []))

    def test_an_index_given_twice_fails(self):
        self.write(self.defaults, SO_DEFAULTS.replace("'6': pci_0000_0A", "'5': pci_0000_0A"))
        ret = self.apply(model="SOS1000")
        self.assertEqual(ret["comment"], "hypervisor.model.SOS1000.hardware.sfp: index 5 is given twice")
        self.assertUntouched()

    def test_unreadable_or_invalid_defaults(self):
        ret = self.apply(defaults=os.path.join(self.dir, "missing.yaml"))
        self.assertIs(ret["result"], False)
        self.assertIn("missing.yaml: No such file or directory", ret["comment"])
        self.write(self.defaults, "hypervisor: [1, 2]\n")
        self.assertIn("has no hypervisor.model mapping", self.apply()["comment"])
        self.write(self.defaults, "hypervisor: {model: {SOSSNNV: x}}\n")
        self.assertIn("hypervisor.model.SOSSNNV.hardware is missing", self.apply()["comment"])
        self.write(self.defaults, "a: !!python/object/apply:os.system ['true']\n")
        self.assertIn("is not valid YAML", self.apply()["comment"])
        self.assertUntouched()

    def test_refused_by_vmhostd_leaves_the_file_and_does_not_restart(self):
        ino = os.stat(self.config).st_ino
        self.write(os.path.join(self.tools, "REFUSE"), "")
        ret = self.apply()
        self.assertEqual((ret["result"], ret["changes"]), (False, {}))
        self.assertEqual(
            ret["comment"],
            "vmhostd refuses the new config (file left as it was): vmhostd: refusing to start: "
            f"{self.config}: key `hardware.reserved_cpu`: 8 leaves no CPU for VMs",
        )
        self.assertUntouched(ino)
        self.assertEqual(self.restarts, [])
        ret = self.apply(vmhostd=os.path.join(self.tools, "absent"))
        self.assertIs(ret["result"], False)
        self.assertIn("cannot run", ret["comment"])
        self.assertUntouched(ino)

    def test_test_mode_shows_the_diff_and_writes_nothing(self):
        ino = os.stat(self.config).st_ino
        self.load(test=True)
        ret = self.apply()
        self.assertIsNone(ret["result"], ret)
        self.assertEqual(
            ret["comment"],
            f"{self.config}: [hardware] would be set to Security Onion model SOSSNNV and vmhostd restarted",
        )
        self.assertEqual(ret["changes"]["model"], "SOSSNNV")
        self.assertIn("+memory_gib = 256\n", ret["changes"]["diff"])
        self.assertTrue(ret["changes"]["diff"].startswith(f"--- {self.config}\n+++ {self.config}\n"))
        self.assertUntouched(ino)
        self.assertEqual(self.restarts, [])
        # The prediction is checked by vmhostd too, on a copy outside the config's directory.
        [check] = self.checks()
        self.assertNotEqual(os.path.dirname(check.split(" ")[1]), self.etc)
        self.write(os.path.join(self.tools, "REFUSE"), "")
        ret = self.apply()
        self.assertIs(ret["result"], False)
        self.assertIn("vmhostd refuses the new config", ret["comment"])
        # Unchanged: True under test=True as well.
        self.load(test=False)
        os.unlink(os.path.join(self.tools, "REFUSE"))
        self.apply(restart=False)
        self.load(test=True)
        ret = self.apply()
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))

    def test_restart_cmd_is_an_argv_run_without_a_shell(self):
        count = os.path.join(self.dir, "restarted")
        script = os.path.join(self.tools, "restart")
        self.write(script, f'#!/bin/sh\necho "$1" >> {count}\n')
        os.chmod(script, 0o755)
        ret = self.apply(restart_cmd=[script, "a b; touch /tmp/x"])
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(ret["changes"]["restart"], f"restarted with {script} a b; touch /tmp/x")
        self.assertEqual(self.read(count), "a b; touch /tmp/x\n")
        self.assertEqual(self.restarts, [], "service.restart is not used")
        # A failing restart command: the file is written, the state fails saying so.
        self.write(script, "#!/bin/sh\necho cannot >&2\nexit 3\n")
        ret = self.apply(model="SOS1000", restart_cmd=[script])
        self.assertIs(ret["result"], False)
        self.assertIn("model SOS1000; but vmhostd was not restarted: restart command", ret["comment"])
        self.assertIn("exited with 3: cannot", ret["comment"])
        self.assertIn("model", ret["changes"])
        os.unlink(os.path.join(self.etc, ".vmhostd.toml.vmhost-restart-pending"))
        # A string is refused before anything is written.
        self.write(self.config, CONFIG)
        ret = self.apply(restart_cmd="systemctl restart vmhostd")
        self.assertIs(ret["result"], False)
        self.assertIn("restart_cmd must be a non-empty list", ret["comment"])
        self.assertUntouched()

    def test_a_failed_restart_stays_pending_and_the_next_run_restarts(self):
        marker = os.path.join(self.etc, ".vmhostd.toml.vmhost-restart-pending")
        seen = []

        def restart(name):
            # The marker is in place, and the file written, when the restart runs.
            seen.append((os.path.exists(marker), self.read(self.config) == CONFIG_SOSSNNV))
            return ok

        self.state.__salt__["service.restart"] = restart
        ok = False
        ret = self.apply()
        self.assertIs(ret["result"], False)
        self.assertTrue(
            ret["comment"].endswith(
                "; but vmhostd was not restarted: service.restart vmhostd failed"
                " (still pending: the next run restarts it)"
            ),
            ret["comment"],
        )
        self.assertEqual(self.read(self.config), CONFIG_SOSSNNV)
        self.assertEqual(seen, [(True, True)])
        self.assertEqual(sorted(os.listdir(self.etc)), [os.path.basename(marker), "vmhostd.toml"])
        pending = (
            f"{self.config}: [hardware] is already Security Onion model SOSSNNV, "
            f"but vmhostd has not been restarted since it was written ({marker})"
        )
        # The file already matches: restart=False and test=True leave the restart pending.
        ret = self.apply(restart=False)
        self.assertEqual(
            (ret["result"], ret["changes"], ret["comment"]), (True, {}, pending + "; not restarted (restart is False)")
        )
        self.load(test=True)
        self.state.__salt__["service.restart"] = restart
        ret = self.apply()
        self.assertEqual(
            (ret["result"], ret["changes"], ret["comment"]),
            (None, {"restart": "pending"}, pending + "; vmhostd would be restarted"),
        )
        self.assertEqual((len(seen), os.path.exists(marker)), (1, True))
        # Still failing: still pending.
        self.load(test=False)
        self.state.__salt__["service.restart"] = restart
        ret = self.apply()
        self.assertIs(ret["result"], False)
        self.assertTrue(ret["comment"].startswith(pending + "; but vmhostd was not restarted"), ret["comment"])
        self.assertTrue(os.path.exists(marker))
        # The restart works: done once, no check, the marker removed; then nothing to do.
        ok = True
        ret = self.apply()
        self.assertEqual(
            (ret["result"], ret["changes"], ret["comment"]),
            (True, {"restart": "service vmhostd restarted"}, pending + "; service vmhostd restarted"),
        )
        self.assertEqual(len(seen), 3)
        self.assertEqual(os.listdir(self.etc), ["vmhostd.toml"])
        self.assertEqual(len(self.checks()), 1)
        ret = self.apply()
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(len(seen), 3)

    def test_no_marker_without_a_restart_or_when_the_write_fails(self):
        ret = self.apply(restart=False)
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(os.listdir(self.etc), ["vmhostd.toml"])
        self.write(self.config, CONFIG)
        self.write(os.path.join(self.tools, "REFUSE"), "")
        self.assertIs(self.apply()["result"], False)
        self.assertUntouched()

    def test_a_file_without_hardware_gets_the_section_appended(self):
        self.write(self.config, '[paths]\nstate = "/x"')
        ret = self.apply(restart=False)
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(
            self.read(self.config),
            '[paths]\nstate = "/x"\n\n' + SOSSNNV_SECTION.replace("allow_raw_pci = true\n", ""),
        )

    def test_an_array_of_tables_with_a_comment_and_lines_inside_arrays_are_kept(self):
        # `[[x]] # c` is a header (not part of the [hardware] table before it), and lines inside
        # a multi-line array (`  [1]`, `  ["hardware"]`) are never headers.
        rest = (
            "[[bridges]] # the LAN\n"
            'name = "br0"\n'
            "matrix = [\n"
            "  [1],\n"
            '  ["hardware"], # ] not closing\n'
            "  [\n"
            "[hardware]\n"
            "  ],\n"
            "]\n"
            "[logs]\n"
            "max_bytes = 1\n"
        )
        self.write(self.config, "[hardware]\ncpu = 4\n" + rest)
        ret = self.apply(restart=False)
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(self.read(self.config), SOSSNNV_SECTION.replace("allow_raw_pci = true\n", "") + rest)
        # A multi-line array inside [hardware] does not end it, and `allow_raw_pci` inside a
        # multi-line string is not the key.
        self.write(
            self.config,
            '[hardware]\nallow_raw_pci = false\nx = [\n  [1]\n]\ny = """\nallow_raw_pci = true\n"""\n' + rest,
        )
        ret = self.apply(restart=False)
        self.assertIs(ret["result"], True, ret)
        self.assertEqual(self.read(self.config), SOSSNNV_SECTION.replace("= true", "= false") + rest)

    def test_a_symlinked_config_is_refused_and_nothing_written(self):
        # A rename would replace the link with a regular file and leave its target stale.
        link = os.path.join(self.dir, "link.toml")
        os.symlink(self.config, link)
        for test in (False, True):
            with self.subTest(test=test):
                self.load(test=test)
                ret = self.apply(name=link)
                self.assertEqual((ret["result"], ret["changes"]), (False, {}))
                self.assertEqual(
                    ret["comment"],
                    f"{link} is a symbolic link (to {self.config}); refusing to replace it: "
                    "give the file's real path as name",
                )
                self.assertTrue(os.path.islink(link))
                self.assertUntouched()
                self.assertEqual((self.checks(), self.restarts), ([], []))

    def test_a_missing_config_fails(self):
        os.unlink(self.config)
        ret = self.apply()
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["comment"], f"cannot read {self.config}: No such file or directory")
        self.assertEqual(os.listdir(self.etc), [])


class Virtual(unittest.TestCase):
    def test_needs_the_execution_module(self):
        state = load("states", {"__salt__": {}, "__opts__": {}})
        self.assertIs(state.__virtual__()[0], False)
        state = load("states", {"__salt__": {"vmhost.apply": None}, "__opts__": {}})
        self.assertEqual(state.__virtual__(), "vmhost")


if __name__ == "__main__":
    unittest.main()
