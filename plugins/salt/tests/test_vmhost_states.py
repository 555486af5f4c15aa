"""The vmhost states, wired to the real execution module, against a scripted fake vmhostd."""

import copy
import unittest

from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load

BOOT = {"kernel": "/srv/vmlinuz"}


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


class Virtual(unittest.TestCase):
    def test_needs_the_execution_module(self):
        state = load("states", {"__salt__": {}, "__opts__": {}})
        self.assertIs(state.__virtual__()[0], False)
        state = load("states", {"__salt__": {"vmhost.apply": None}, "__opts__": {}})
        self.assertEqual(state.__virtual__(), "vmhost")


if __name__ == "__main__":
    unittest.main()
