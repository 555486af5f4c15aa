"""The guest access functions (guest_exec, guest_file_push, guest_file_pull) against a fake
vmhostd: the requests they send, test=True sending nothing, retcodes and the pulled file's checks."""

import base64
import collections
import hashlib
import os
import stat
import tempfile
import unittest

from salt.exceptions import CommandExecutionError
from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load


def b64(data):
    return base64.b64encode(data).decode()


class LoaderContext(collections.UserDict):
    """Like Salt's NamedLoaderContext: dict-like, not a dict."""


class GuestTest(unittest.TestCase):
    def start(self, methods, opts=None):
        self.daemon = ScriptedVmhostd(methods)
        self.addCleanup(self.daemon.close)
        self.context = LoaderContext()
        dunders = {
            "__salt__": {"config.get": config_get({"vmhost:socket": self.daemon.path})},
            "__context__": self.context,
        }
        if opts is not None:
            dunders["__opts__"] = LoaderContext(opts)
        self.mod = load("modules", dunders)
        return self.daemon


EXEC_ANSWER = {
    "exit_code": 0,
    "signal": None,
    "timed_out": False,
    "duration_ms": 3,
    "stdout": "hi\n",
    "stderr": "",
    "stdout_bytes": 3,
    "stderr_bytes": 0,
    "stdout_truncated": False,
    "stderr_truncated": False,
    "encoding": "text",
    "slot": 0,
}


class Exec(GuestTest):
    def test_sends_the_argv_and_options_and_returns_the_answer(self):
        daemon = self.start({"vm.exec": lambda p: EXEC_ANSWER})
        got = self.mod.guest_exec(
            "web", ["sh", "-c", "echo hi"], env={"A": "1"}, cwd="/tmp", stdin="in", timeout_s="5", max_output=10
        )
        self.assertEqual(got, EXEC_ANSWER)
        self.assertEqual(
            daemon.requests[0]["params"],
            {
                "name": "web",
                "argv": ["sh", "-c", "echo hi"],
                "env": ["A=1"],
                "cwd": "/tmp",
                "stdin": b64(b"in"),
                "timeout_s": 5,
                "max_output": 10,
            },
        )
        self.assertNotIn("retcode", self.context, "a command that succeeded leaves the retcode alone")
        self.mod.guest_exec("web", '["true"]', encoding="base64")
        self.assertEqual(
            daemon.requests[1]["params"], {"name": "web", "argv": ["true"], "timeout_s": 60, "encoding": "base64"}
        )

    def test_the_command_s_status_is_the_job_s_retcode(self):
        for answer, status in [
            (dict(EXEC_ANSWER, exit_code=3), 3),
            (dict(EXEC_ANSWER, exit_code=None, signal=15), 143),
            (dict(EXEC_ANSWER, exit_code=None, signal=9, timed_out=True), 124),
        ]:
            with self.subTest(status=status):
                self.start({"vm.exec": lambda p, a=answer: a})
                self.assertEqual(self.mod.guest_exec("web", ["false"]), answer)
                self.assertEqual(self.context["retcode"], status)

    def test_a_string_argv_is_refused_not_split_and_nothing_is_sent(self):
        daemon = self.start({"vm.exec": lambda p: EXEC_ANSWER})
        with self.assertRaisesRegex(CommandExecutionError, "no shell is run unless"):
            self.mod.guest_exec("web", "rm -rf /tmp/x")
        with self.assertRaisesRegex(CommandExecutionError, "non-empty list of strings"):
            self.mod.guest_exec("web", [])
        with self.assertRaisesRegex(CommandExecutionError, "above vm.exec's"):
            self.mod.guest_exec("web", ["cat"], stdin="x" * (1024 * 1024 + 1))
        with self.assertRaisesRegex(CommandExecutionError, "encoding must be"):
            self.mod.guest_exec("web", ["true"], encoding="hex")
        self.assertEqual(daemon.requests, [])

    def test_test_true_reports_what_would_run_and_runs_nothing(self):
        daemon = self.start({"vm.exec": lambda p: EXEC_ANSWER})
        got = self.mod.guest_exec("web", ["reboot"], stdin="secret", test=True)
        self.assertEqual(
            got,
            {
                "test": True,
                "method": "vm.exec",
                "params": {"name": "web", "argv": ["reboot"], "stdin": "<6 bytes>", "timeout_s": 60},
            },
        )
        # A test run (salt-call ... test=True) is test mode too; test=False overrides it.
        self.start({"vm.exec": lambda p: EXEC_ANSWER}, opts={"test": True})
        self.assertTrue(self.mod.guest_exec("web", ["reboot"])["test"])
        self.assertEqual(self.daemon.requests, [])
        self.assertEqual(self.mod.guest_exec("web", ["true"], test=False), EXEC_ANSWER)
        self.assertEqual(daemon.requests, [])

    def test_refusals_raise_with_the_daemon_s_code(self):
        refusal = error(4095, "guest exec is off on this host", field="name", details={"reason": "host"})

        def refuse(params):
            raise Fail(refusal)

        self.start({"vm.exec": refuse})
        with self.assertRaises(CommandExecutionError) as ctx:
            self.mod.guest_exec("web", ["id"])
        self.assertEqual(ctx.exception.code, 4095)
        self.assertEqual(ctx.exception.details, {"reason": "host"})


class Push(GuestTest):
    def test_content_goes_with_its_sha256_and_octal_mode(self):
        daemon = self.start({"vm.file_push": lambda p: {"path": p["path"], "size": 5, "sha256": p.get("sha256")}})
        got = self.mod.guest_file_push("web", "/etc/motd", content="hello", mode=644, owner="app:app", mkdir=True)
        sha = hashlib.sha256(b"hello").hexdigest()
        self.assertEqual(got, {"path": "/etc/motd", "size": 5, "sha256": sha})
        self.assertEqual(
            daemon.requests[0]["params"],
            {
                "name": "web",
                "path": "/etc/motd",
                "mkdir": True,
                "mode": 0o644,
                "owner": "app:app",
                "content": b64(b"hello"),
                "sha256": sha,
            },
        )
        self.mod.guest_file_push("web", "/opt/x.iso", source="isos/x.iso", mode="0600")
        self.assertEqual(
            daemon.requests[1]["params"],
            {"name": "web", "path": "/opt/x.iso", "mkdir": False, "mode": 0o600, "source": "isos/x.iso"},
        )

    def test_bad_arguments_are_refused_before_sending(self):
        daemon = self.start({})
        with self.assertRaisesRegex(CommandExecutionError, "exactly one of content or source"):
            self.mod.guest_file_push("web", "/x")
        with self.assertRaisesRegex(CommandExecutionError, "exactly one of content or source"):
            self.mod.guest_file_push("web", "/x", content="a", source="b")
        with self.assertRaisesRegex(CommandExecutionError, "octal permission bits"):
            self.mod.guest_file_push("web", "/x", content="a", mode="rw-r--r--")
        with self.assertRaisesRegex(CommandExecutionError, "above 7777"):
            self.mod.guest_file_push("web", "/x", content="a", mode="17777")
        with self.assertRaisesRegex(CommandExecutionError, "files_dir"):
            self.mod.guest_file_push("web", "/x", content=b"\0" * (768 * 1024 + 1))
        self.assertEqual(daemon.requests, [])

    def test_test_true_shows_the_size_not_the_content(self):
        daemon = self.start({})
        got = self.mod.guest_file_push("web", "/etc/key", content="secret", test=True)
        self.assertEqual(got["params"]["content"], "<6 bytes>")
        self.assertEqual(got["params"]["sha256"], hashlib.sha256(b"secret").hexdigest())
        self.assertEqual(daemon.requests, [])


class Pull(GuestTest):
    def answer(self, data, **over):
        out = {"path": "/etc/x", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "mode": 0o4755}
        out["content"] = b64(data)
        out.update(over)
        return out

    def test_returns_the_checked_answer_or_writes_dest(self):
        data = b"\x00binary\xffdata"
        daemon = self.start({"vm.file_pull": lambda p: self.answer(data)})
        self.assertEqual(self.mod.guest_file_pull("web", "/etc/x", max_bytes=100), self.answer(data))
        self.assertEqual(daemon.requests[0]["params"], {"name": "web", "path": "/etc/x", "max_bytes": 100})
        with tempfile.TemporaryDirectory() as d:
            dest = os.path.join(d, "copy")
            got = self.mod.guest_file_pull("web", "/etc/x", dest=dest)
            self.assertNotIn("content", got)
            self.assertEqual(got["dest"], dest)
            with open(dest, "rb") as f:
                self.assertEqual(f.read(), data)
            mode = stat.S_IMODE(os.stat(dest).st_mode)
            self.assertEqual(mode & 0o7000, 0, "the guest's set-id bits never reach the minion")
            self.assertEqual(os.listdir(d), ["copy"], "no temp file left")

    def test_content_that_does_not_match_is_refused_and_nothing_written(self):
        data = b"hello"
        for bad in [
            {"sha256": hashlib.sha256(b"other").hexdigest()},
            {"size": 6},
            {"content": "aGVsbG8"},
        ]:
            with self.subTest(bad=bad), tempfile.TemporaryDirectory() as d:
                self.start({"vm.file_pull": lambda p, b=bad: self.answer(data, **b)})
                dest = os.path.join(d, "copy")
                with self.assertRaises(CommandExecutionError):
                    self.mod.guest_file_pull("web", "/etc/x", dest=dest)
                self.assertEqual(os.listdir(d), [])

    def test_test_true_and_a_relative_dest(self):
        daemon = self.start({})
        got = self.mod.guest_file_pull("web", "/etc/x", dest="/tmp/y", test=True)
        self.assertEqual(
            got, {"test": True, "method": "vm.file_pull", "params": {"name": "web", "path": "/etc/x"}, "dest": "/tmp/y"}
        )
        with self.assertRaisesRegex(CommandExecutionError, "absolute"):
            self.mod.guest_file_pull("web", "/etc/x", dest="rel/y")
        self.assertEqual(daemon.requests, [])


if __name__ == "__main__":
    unittest.main()
