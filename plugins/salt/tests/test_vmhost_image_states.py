"""vmhost.image_present / vmhost.image_absent, wired to the real execution module, against a fake
vmhostd image store that answers as the daemon does (docs/images.md)."""

import unittest

from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load

SHA = "ab" * 32
OTHER = "cd" * 32


class FakeStore:
    """``image.list``, ``image.import`` and ``image.delete`` over ``images`` (name -> view, with
    the file's real sha256 under ``_content``) and ``uploads`` (source -> sha256 of its bytes)."""

    def __init__(self):
        self.images = {}
        self.uploads = {}

    def methods(self):
        return {"image.list": self.list, "image.import": self.import_, "image.delete": self.delete}

    def view(self, image):
        return {k: v for k, v in image.items() if not k.startswith("_")}

    def list(self, params):
        return [self.view(i) for _, i in sorted(self.images.items())]

    def put(self, name, content, sha256=None, source=None, used_by=()):
        self.images[name] = {
            "name": name,
            "bytes": 512,
            "format": "raw",
            "virtual_size": 512,
            "sha256": sha256,
            "source": source,
            "imported_at": "2026-12-03T10:00:00Z" if sha256 else None,
            "used_by": list(used_by),
            "_content": content,
        }

    def import_(self, params):
        name, want, source = params["name"], params["sha256"].lower(), params.get("source")
        image = self.images.get(name)
        if image is not None:
            recorded = image["sha256"] or image["_content"]
            if recorded != want:
                if image["sha256"] is None and source is None:
                    raise Fail(mismatch(want, image["_content"]))
                raise Fail(
                    error(
                        4093,
                        f'image "{name}" is there with sha256 {recorded}, not {want}: delete it first (VMs using '
                        "it keep overlays over it, so it is never replaced)",
                        field="name",
                        details={"sha256": recorded},
                        kind="image_exists",
                    )
                )
            if image["sha256"] is not None:
                return {"changed": False, "image": self.view(image)}
            image["sha256"] = want
            return {"changed": True, "image": self.view(image)}
        if source is None:
            raise Fail(error(4040, f'no image "{name}" in /images: give a source', field="source", kind="not_found"))
        if self.uploads[source] != want:
            raise Fail(mismatch(want, self.uploads[source]))
        self.put(name, want, sha256=want, source=source)
        return {"changed": True, "image": self.view(self.images[name])}

    def delete(self, params):
        name = params["name"]
        image = self.images.get(name)
        if image and image["used_by"]:
            raise Fail(
                error(
                    4092,
                    f'image "{name}" is the base of VMs {image["used_by"]}: destroy them first',
                    field="name",
                    details={"vms": image["used_by"]},
                    kind="image_in_use",
                )
            )
        return {"changed": self.images.pop(name, None) is not None, "name": name}


def mismatch(want, found):
    return error(
        2003,
        f"upload.raw has sha256 {found}, not {want}",
        field="sha256",
        details={"expected": want, "found": found, "bytes": 512},
        kind="checksum_mismatch",
    )


class ImageStateTest(unittest.TestCase):
    def setUp(self):
        self.store = FakeStore()
        self.store.uploads["upload.raw"] = SHA

    def start(self, test=False):
        self.daemon = ScriptedVmhostd(self.store.methods())
        self.addCleanup(self.daemon.close)
        mod = load("modules", {"__salt__": {"config.get": config_get({"vmhost:socket": self.daemon.path})}})
        salt = {f"vmhost.{fn}": getattr(mod, fn) for fn in ("apply", "image_list", "image_import", "image_delete")}
        self.state = load("states", {"__salt__": salt, "__opts__": {"test": test}, "__pillar__": {}})

    def called(self):
        methods = self.daemon.methods_called()
        self.daemon.requests.clear()
        return methods


class ImagePresent(ImageStateTest):
    def test_imports_once_then_changes_nothing(self):
        self.start()
        ret = self.state.image_present("base.raw", sha256=SHA, source="upload.raw")
        self.assertEqual(
            ret,
            {
                "name": "base.raw",
                "result": True,
                "changes": {
                    "old": None,
                    "new": {"sha256": SHA, "bytes": 512, "format": "raw", "virtual_size": 512, "source": "upload.raw"},
                },
                "comment": f"image base.raw imported from upload.raw (sha256 {SHA})",
            },
        )
        self.assertEqual(self.called(), ["image.import"])
        ret = self.state.image_present("base.raw", sha256=SHA, source="upload.raw")
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(ret["comment"], f"image base.raw is present with sha256 {SHA}")
        self.assertEqual(self.called(), ["image.import"])

    def test_params_sent(self):
        self.start()
        self.state.image_present("base.raw", sha256=SHA, source="upload.raw", timeout_s=90)
        self.state.image_present("base.raw", sha256=SHA)
        sent = [r["params"] for r in self.daemon.requests]
        self.assertEqual(
            sent,
            [
                {"name": "base.raw", "sha256": SHA, "source": "upload.raw", "timeout_s": 90},
                {"name": "base.raw", "sha256": SHA},
            ],
        )

    def test_a_hand_placed_file_is_recorded_where_it_is(self):
        self.store.put("hand.raw", SHA)
        self.start()
        ret = self.state.image_present("hand.raw", sha256=SHA)
        self.assertIs(ret["result"], True)
        self.assertEqual(ret["changes"]["old"], {"sha256": None})
        self.assertEqual((ret["changes"]["new"]["sha256"], ret["changes"]["new"]["source"]), (SHA, None))
        self.assertEqual(ret["comment"], f"image hand.raw (put there by hand) checked and recorded with sha256 {SHA}")
        ret = self.state.image_present("hand.raw", sha256=SHA)
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))

    def test_a_wrong_sha256_fails_with_the_daemons_2003(self):
        self.start()
        ret = self.state.image_present("base.raw", sha256=OTHER, source="upload.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(ret["comment"].startswith("vmhostd error 2003 (sha256): upload.raw has sha256 "), ret)
        self.assertIn(f'"found": "{SHA}"', ret["comment"])
        self.assertEqual(self.store.images, {})

    def test_another_sha256_is_never_replaced(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw")
        self.start()
        ret = self.state.image_present("base.raw", sha256=OTHER, source="other.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(ret["comment"].startswith("vmhostd error 4093 (name): "), ret)
        self.assertIn(SHA, ret["comment"])
        self.assertIn(OTHER, ret["comment"])
        self.assertEqual(self.store.images["base.raw"]["sha256"], SHA)

    def test_no_source_and_no_file_fails_with_the_daemons_4040(self):
        self.start()
        ret = self.state.image_present("none.raw", sha256=SHA)
        self.assertIs(ret["result"], False)
        self.assertTrue(ret["comment"].startswith("vmhostd error 4040 (source): "), ret)

    def test_no_daemon(self):
        salt = load("modules", {"__salt__": {"config.get": config_get({"vmhost:socket": "/nonexistent/v.sock"})}})
        state = load(
            "states",
            {"__salt__": {"vmhost.image_import": salt.image_import}, "__opts__": {"test": False}, "__pillar__": {}},
        )
        ret = state.image_present("base.raw", sha256=SHA, source="upload.raw")
        self.assertIs(ret["result"], False)
        self.assertIn("no socket at /nonexistent/v.sock", ret["comment"])


class ImagePresentTestMode(ImageStateTest):
    def assertOnlyListed(self):
        self.assertEqual(set(self.called()), {"image.list"})
        self.assertEqual(self.daemon.requests, [])

    def test_predicts_an_import_and_imports_nothing(self):
        self.start(test=True)
        ret = self.state.image_present("base.raw", sha256=SHA.upper(), source="upload.raw")
        self.assertEqual(
            ret,
            {
                "name": "base.raw",
                "result": None,
                "changes": {"old": None, "new": {"sha256": SHA, "source": "upload.raw"}},
                "comment": f"image base.raw would be imported from upload.raw (sha256 {SHA})",
            },
        )
        self.assertOnlyListed()
        self.assertEqual(self.store.images, {})

    def test_predicts_no_change_when_listed_with_that_sha256(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw")
        self.start(test=True)
        ret = self.state.image_present("base.raw", sha256=SHA.upper(), source="elsewhere.raw")
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(ret["comment"], f"image base.raw is present with sha256 {SHA}")
        self.assertOnlyListed()

    def test_predicts_the_refusal_of_another_sha256_naming_both(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw")
        self.start(test=True)
        ret = self.state.image_present("base.raw", sha256=OTHER, source="upload.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(ret["comment"].startswith(f"image base.raw is there with sha256 {SHA}, not {OTHER}: "), ret)
        self.assertIn("4093", ret["comment"])
        self.assertOnlyListed()

    def test_predicts_a_record_of_a_hand_placed_file(self):
        self.store.put("hand.raw", SHA)
        self.start(test=True)
        ret = self.state.image_present("hand.raw", sha256=SHA)
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["changes"], {"old": {"sha256": None}, "new": {"sha256": SHA}})
        self.assertIn("would be hashed where it is and recorded", ret["comment"])
        self.assertOnlyListed()
        self.assertIsNone(self.store.images["hand.raw"]["sha256"])

    def test_predicts_the_refusal_without_source_or_file(self):
        self.start(test=True)
        ret = self.state.image_present("none.raw", sha256=SHA)
        self.assertIs(ret["result"], False)
        self.assertIn("no source is given", ret["comment"])
        self.assertOnlyListed()

    def test_a_list_error_fails_the_state(self):
        self.store.methods = lambda: {}
        self.start(test=True)
        ret = self.state.image_present("base.raw", sha256=SHA, source="upload.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["comment"], "vmhostd error -32601: Method not found")


class ImageAbsent(ImageStateTest):
    def test_deletes_then_has_nothing_to_do(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw")
        self.start()
        ret = self.state.image_absent("base.raw")
        self.assertEqual(
            ret,
            {
                "name": "base.raw",
                "result": True,
                "changes": {
                    "old": {"sha256": SHA, "bytes": 512, "format": "raw", "virtual_size": 512, "source": "upload.raw"},
                    "new": None,
                },
                "comment": "image base.raw deleted",
            },
        )
        self.assertEqual(self.called(), ["image.list", "image.delete"])
        self.assertEqual(self.store.images, {})
        ret = self.state.image_absent("base.raw")
        self.assertEqual(
            (ret["result"], ret["changes"], ret["comment"]), (True, {}, "image base.raw is already absent")
        )

    def test_in_use_fails_naming_the_vms(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw", used_by=["web", "db"])
        self.start()
        ret = self.state.image_absent("base.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(ret["changes"], {})
        self.assertTrue(ret["comment"].startswith("image base.raw is the base of VMs web, db, not deleted: "), ret)
        self.assertIn("vmhostd error 4092 (name)", ret["comment"])
        self.assertIn("base.raw", self.store.images)

    def test_test_mode_predicts_from_the_list(self):
        self.store.put("base.raw", SHA, sha256=SHA, source="upload.raw")
        self.store.put("used.raw", OTHER, sha256=OTHER, used_by=["web"])
        self.start(test=True)
        ret = self.state.image_absent("base.raw")
        self.assertIsNone(ret["result"])
        self.assertEqual(ret["changes"]["new"], None)
        self.assertEqual(ret["changes"]["old"]["sha256"], SHA)
        self.assertEqual(ret["comment"], "image base.raw would be deleted")
        ret = self.state.image_absent("used.raw")
        self.assertIs(ret["result"], False)
        self.assertEqual(
            ret["comment"], "image used.raw is the base of VMs web: vmhostd would refuse to delete it (4092)"
        )
        ret = self.state.image_absent("none.raw")
        self.assertEqual((ret["result"], ret["changes"]), (True, {}))
        self.assertEqual(set(self.called()), {"image.list"})
        self.assertEqual(sorted(self.store.images), ["base.raw", "used.raw"])


if __name__ == "__main__":
    unittest.main()
