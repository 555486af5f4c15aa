"""Test helpers: load the modules from their files as Salt would, and a fake vmhostd socket."""

import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import threading

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "saltext", "vmhost")


def load(kind, dunders):
    """Loads ``SRC/<kind>/vmhost.py`` as a fresh module with the given Salt dunders injected."""
    path = os.path.join(SRC, kind, "vmhost.py")
    spec = importlib.util.spec_from_file_location(f"vmhost_{kind}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in dunders.items():
        setattr(module, key, value)
    return module


def load_engine(name):
    """Loads ``SRC/engines/<name>.py`` as the module ``name``, as Salt's loader would."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SRC, "engines", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def config_get(options):
    """A ``config.get`` that answers from a flat dict keyed like ``vmhost:socket``."""

    def get(key, default=""):
        return options.get(key, default)

    return get


def error(code, message, field=None, details=None, kind="x"):
    return {"code": code, "message": message, "data": {"kind": kind, "field": field, "details": details}}


class FakeVmhostd:
    """A Unix socket served by a thread. ``handler(request, conn)`` answers each request;
    ``on_accept(conn)``, when set, runs before the request is read. Requests are recorded."""

    def __init__(self, handler=None, on_accept=None):
        self.dir = tempfile.mkdtemp(prefix="fakevmh")
        self.path = os.path.join(self.dir, "vmhostd.sock")
        self.handler = handler
        self.on_accept = on_accept
        self.requests = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    if self.on_accept:
                        self.on_accept(conn)
                        continue
                    line = conn.makefile("rb").readline()
                    if not line:
                        continue
                    request = json.loads(line)
                    self.requests.append(request)
                    self.handler(request, conn)
                except OSError:
                    pass  # the client went away (e.g. it refused an oversize reply)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def send(conn, obj):
    conn.sendall(json.dumps(obj).encode() + b"\n")


def answer(request, result=None, err=None):
    reply = {"jsonrpc": "2.0", "id": request["id"]}
    if err is not None:
        reply["error"] = err
    else:
        reply["result"] = result
    return reply


class ScriptedVmhostd(FakeVmhostd):
    """A fake vmhostd answering by method: ``methods[name](params)`` returns a result or raises
    ``Fail(error)``."""

    def __init__(self, methods):
        self.methods = methods
        super().__init__(self._dispatch)

    def _dispatch(self, request, conn):
        fn = self.methods.get(request["method"])
        if fn is None:
            send(conn, answer(request, err={"code": -32601, "message": "Method not found"}))
            return
        try:
            send(conn, answer(request, fn(request.get("params") or {})))
        except Fail as exc:
            send(conn, answer(request, err=exc.error))

    def methods_called(self):
        return [r["method"] for r in self.requests]


class Fail(Exception):
    def __init__(self, error):
        super().__init__(error["message"])
        self.error = error
