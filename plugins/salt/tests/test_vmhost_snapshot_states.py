"""vmhost.snapshot_present / vmhost.snapshot_absent, wired to the real execution module, against a
fake vmhostd that keeps snapshots as the daemon does (docs/snapshots.md)."""

import unittest

from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load


class FakeSnapshots:
    """``vm.snapshots``, ``vm.snapshot`` and ``vm.snapshot_delete`` over ``vms`` (VM name -> list
    of snapshot views)."""

    def __init__(self):
        self.vms = {"web": [{"name": "old", "consistency": "stopped"}]}

    def methods(self):
        return {"vm.snapshots": self.list, "vm.snapshot": self.take, "vm.snapshot_delete": self.delete}

    def of(self, params):
        if params["name"] not in self.vms:
            raise Fail(error(4040, f'no VM named "{params["name"]}"', field="name", kind="not_found"))
        return self.vms[params["name"]]

    def list(self, params):
        return list(self.of(params))

    def take(self, params):
        snapshots = self.of(params)
        if params.get("requires") == "frozen":
            raise Fail(error(4094, "would be crash-consistent", field="requires", kind="not_frozen"))
        view = {"name": params["snapshot"], "created_at": "2026-12-06T09:00:00Z", "live": True, "consistency": "frozen"}
        snapshots.append(view)
        return view

    def delete(self, params):
        snapshots = self.of(params)
        kept = [s for s in snapshots if s["name"] != params["snapshot"]]
        changed = len(kept) != len(snapshots)
        snapshots[:] = kept
        return {"changed": changed, "snapshot": params["snapshot"]}


class SnapshotStateTest(unittest.TestCase):
    def start(self, test=False):
        self.fake = FakeSnapshots()
        self.daemon = ScriptedVmhostd(self.fake.methods())
        self.addCleanup(self.daemon.close)
        mod = load("modules", {"__salt__": {"config.get": config_get({"vmhost:socket": self.daemon.path})}})
        salt = {f"vmhost.{fn}": getattr(mod, fn) for fn in ("apply", "snapshots", "snapshot", "snapshot_delete")}
        self.state = load("states", {"__salt__": salt, "__opts__": {"test": test}, "__pillar__": {}})

    def called(self):
        methods = self.daemon.methods_called()
        self.daemon.requests.clear()
        return methods


class SnapshotPresent(SnapshotStateTest):
    def test_takes_it_once(self):
        self.start()
        ret = self.state.snapshot_present("before", vm="web", timeout_s=60)
        self.assertEqual(ret["result"], True, ret)
        self.assertEqual(
            ret["changes"],
            {
                "old": None,
                "new": {"name": "before", "created_at": "2026-12-06T09:00:00Z", "live": True, "consistency": "frozen"},
            },
        )
        self.assertEqual(ret["comment"], "snapshot before of VM web taken (frozen)")
        self.assertEqual(self.daemon.requests[-1]["params"], {"name": "web", "snapshot": "before", "timeout_s": 60})
        self.assertEqual(self.called(), ["vm.snapshots", "vm.snapshot"])
        ret = self.state.snapshot_present("web-before", vm="web", snapshot="before")
        self.assertEqual((ret["result"], ret["changes"], ret["comment"]), (True, {}, "VM web has snapshot before"))
        self.assertEqual(self.called(), ["vm.snapshots"])

    def test_test_mode_predicts_and_sends_nothing_else(self):
        self.start(test=True)
        ret = self.state.snapshot_present("before", vm="web")
        self.assertEqual((ret["result"], ret["changes"]), (None, {"old": None, "new": {"name": "before"}}))
        self.assertEqual(self.called(), ["vm.snapshots"])
        self.assertEqual([s["name"] for s in self.fake.vms["web"]], ["old"])

    def test_refusals_fail_with_the_daemons_code_and_field(self):
        self.start()
        ret = self.state.snapshot_present("live", vm="web", requires="frozen")
        self.assertEqual(ret["result"], False)
        self.assertTrue(ret["comment"].startswith("vmhostd error 4094 (requires): "), ret)
        self.assertEqual(self.daemon.requests[-1]["params"]["requires"], "frozen")
        ret = self.state.snapshot_present("s", vm="gone")
        self.assertEqual(ret["result"], False)
        self.assertTrue(ret["comment"].startswith("vmhostd error 4040 (name): "), ret)


class SnapshotAbsent(SnapshotStateTest):
    def test_deletes_it_once_and_a_missing_vm_has_none(self):
        self.start()
        ret = self.state.snapshot_absent("old", vm="web")
        self.assertEqual((ret["result"], ret["comment"]), (True, "snapshot old of VM web deleted"))
        self.assertEqual(ret["changes"], {"old": {"name": "old", "consistency": "stopped"}, "new": None})
        self.assertEqual(self.called(), ["vm.snapshots", "vm.snapshot_delete"])
        ret = self.state.snapshot_absent("old", vm="web")
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        ret = self.state.snapshot_absent("old", vm="gone")
        self.assertEqual((ret["result"], ret["changes"], ret["comment"]), (True, {}, "VM gone has no snapshot old"))
        self.assertEqual(self.called(), ["vm.snapshots", "vm.snapshots"])

    def test_test_mode_predicts_and_deletes_nothing(self):
        self.start(test=True)
        ret = self.state.snapshot_absent("old", vm="web")
        self.assertEqual((ret["result"], ret["changes"]["new"]), (None, None))
        self.assertEqual(self.called(), ["vm.snapshots"])
        self.assertEqual(len(self.fake.vms["web"]), 1)


if __name__ == "__main__":
    unittest.main()
