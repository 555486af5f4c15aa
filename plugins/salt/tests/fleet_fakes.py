"""Test helpers for the runner: fake hypervisors (a fake vmhostd each, moving VMs between them
as vm.migrate_in + vm.migrate/vm.move would) and a fake LocalClient that runs the real
execution module against them, answering as Salt 3007's ``cmd(..., full_return=True)``."""

import copy
import fnmatch
import os
import zlib

from salt.exceptions import CommandExecutionError
from vmhost_fakes import Fail, ScriptedVmhostd, config_get, error, load

GIB = 1024**3


def spec(name, cpu=1, memory_mib=512, role=None, nics=("lan",), hardware=None, image="base.qcow2", **extra):
    out = {"name": name, "cpu": cpu, "memory_mib": memory_mib, "boot": {"image": image, "disk_gib": 2}}
    if role:
        out["role"] = role
    out["nics"] = [{"network": n} for n in nics]
    if hardware:
        out["hardware"] = hardware
    out.update(extra)
    return out


def view(spec_, status="running", macs=None, **extra):
    n = zlib.crc32(spec_["name"].encode()) % 256
    macs = macs or [f"02:00:00:00:{n:02x}:{i:02x}" for i in range(len(spec_["nics"]))]
    out = {"name": spec_["name"], "spec": spec_, "status": status, "nics": [{"mac": m} for m in macs]}
    out.update(extra)
    return out


class Host:
    """One fake hypervisor: its VMs (views), capacity, hardware model, networks, images."""

    def __init__(
        self, name, cpu=8, memory_mib=8192, disk_gib=500, networks=("lan",), hardware=(), images=("base.qcow2",)
    ):
        self.name = name
        self.cpu, self.memory = cpu, memory_mib
        self.disk = disk_gib * GIB
        self.networks = list(networks)
        self.hardware = [dict(h) for h in hardware]
        self.images = list(images)
        self.vms = {}
        self.prepared = {}
        self.refuse = {}  # method -> error, to make a call fail
        self.address = f"{name}.example:7070"

    def add(self, v):
        self.vms[v["name"]] = copy.deepcopy(v)
        for cls, indices in (v["spec"].get("hardware") or {}).items():
            for h in self.hardware:
                if h["class"] == cls and h["index"] in indices:
                    h["holder"] = v["name"]

    def remove(self, name):
        self.vms.pop(name)
        for h in self.hardware:
            if h["holder"] == name:
                h["holder"] = None

    def info(self):
        used_cpu = sum(v["spec"]["cpu"] for v in self.vms.values())
        used_mem = sum(v["spec"]["memory_mib"] for v in self.vms.values())
        nets = []
        for n in self.networks:
            nics = []
            for v in self.vms.values():
                for i, nic in enumerate(v["spec"].get("nics") or []):
                    if nic.get("network") == n:
                        nics.append({"vm": v["name"], "nic": i, "mac": v["nics"][i]["mac"], "address": None})
            nets.append({"name": n, "ready": True, "vlan_filtering": False, "nics": nics})
        return {
            "cpu": {"total": self.cpu, "reserved": 0, "allocated": used_cpu, "available": self.cpu - used_cpu},
            "memory_mib": {
                "total": self.memory,
                "reserved": 0,
                "allocated": used_mem,
                "available": self.memory - used_mem,
            },
            "storage": {"total_bytes": self.disk, "free_bytes": self.disk, "provisioned_bytes": 0, "overcommit": 1.0},
            "hardware": copy.deepcopy(self.hardware),
            "networks": nets,
            "capture": [],
            "kept_disks": [],
            "numa": [],
            "cpus": {"vm_cpus": None},
        }


class Fleet:
    """Fake hypervisors joined by a fake migration network: ``vm.migrate_in`` on one prepares,
    ``vm.migrate``/``vm.move`` on another sends to the prepared address with its secret."""

    def __init__(self, *hosts):
        self.hosts = {h.name: h for h in hosts}
        self.daemons = {}
        self.log = []  # (host, method, params)
        for h in hosts:
            self.daemons[h.name] = ScriptedVmhostd(self._methods(h))

    def close(self):
        for d in self.daemons.values():
            d.close()

    def _methods(self, host):
        def logged(method, fn):
            def call(params):
                self.log.append((host.name, method, copy.deepcopy(params)))
                if method in host.refuse:
                    raise Fail(host.refuse[method])
                return fn(params)

            return call

        def get(params):
            if params["name"] not in host.vms:
                raise Fail(error(4040, f"no VM {params['name']}"))
            return host.vms[params["name"]]

        def migrate_in(params):
            s = params["spec"]
            if s["name"] in host.vms:
                raise Fail(error(3003, "exists"))
            secret = os.urandom(32).hex()
            host.prepared[s["name"]] = {"spec": s, "mode": params.get("mode", "live"), "secret": secret}
            return {"name": s["name"], "address": host.address, "secret": secret, "expires_in_s": 300}

        def send(kind):
            def fn(params):
                name = params["name"]
                if name not in host.vms:
                    raise Fail(error(4040, f"no VM {name}"))
                dest = next((h for h in self.hosts.values() if h.address == params["destination"]), None)
                prep = dest.prepared.get(name) if dest else None
                if prep is None or prep["secret"] != params["secret"]:
                    raise Fail(error(4001, "refused by the destination", details={"step": "connect"}))
                if (kind == "migrate") != (prep["mode"] == "live"):
                    raise Fail(error(4001, "mode mismatch"))
                source_view = host.vms[name]
                moved = copy.deepcopy(source_view)
                moved["spec"] = prep["spec"]
                if kind == "move" and not params.get("stop") and source_view["status"] == "running":
                    raise Fail(error(4097, "running", details={"reason": "status"}))
                host.remove(name)
                dest.prepared.pop(name)
                dest.add(moved)
                return {
                    "name": name,
                    "destination": params["destination"],
                    "mode": "live" if kind == "migrate" else "cold",
                    "total_ms": 1000,
                    "downtime_ms": 100 if kind == "migrate" else 0,
                    "ram_bytes": 0,
                    "disk_bytes": 0,
                }

            return fn

        methods = {
            "host.info": lambda p: host.info(),
            "vm.list": lambda p: [host.vms[n] for n in sorted(host.vms)],
            "vm.get": get,
            "image.list": lambda p: [{"name": i} for i in host.images],
            "vm.migrate_in": migrate_in,
            "vm.migrate": send("migrate"),
            "vm.move": send("move"),
        }
        return {m: logged(m, fn) for m, fn in methods.items()}

    def calls(self, *methods):
        return [(h, m) for h, m, _ in self.log if not methods or m in methods]


class LocalClient:
    """Salt's LocalClient as the runner uses it: ``cmd(tgt, fun, kwarg=, tgt_type=, timeout=,
    full_return=True)``, each minion's function run by the real execution module against its
    fake vmhostd. ``others`` are minions without vmhostd (they answer that vmhost.* is not
    available); ``silent`` minions do not answer."""

    def __init__(self, fleet, others=(), silent=()):
        self.fleet = fleet
        self.others = list(others)
        self.silent = set(silent)
        self.mods = {
            name: load("modules", {"__salt__": {"config.get": config_get({"vmhost:socket": d.path})}})
            for name, d in fleet.daemons.items()
        }
        self.published = []

    def cmd(self, tgt, fun, arg=(), kwarg=None, tgt_type="glob", timeout=None, full_return=False):
        self.published.append((tgt, fun, tgt_type, timeout))
        everyone = sorted(list(self.mods) + self.others)
        if tgt_type == "list":
            minions = [m for m in tgt if m in everyone]
        else:
            minions = [m for m in everyone if fnmatch.fnmatchcase(m, tgt)]
        out = {}
        for m in minions:
            if m in self.silent:
                out[m] = False
                continue
            if m not in self.mods:
                out[m] = {"ret": f"'{fun}' is not available.", "retcode": 254}
                continue
            short = fun.split(".", 1)[1]
            fn = getattr(self.mods[m], {"list": "list_"}.get(short, short))
            try:
                out[m] = {"ret": fn(*arg, **(kwarg or {})), "retcode": 0}
            except CommandExecutionError as exc:
                out[m] = {"ret": f"ERROR: {exc}", "retcode": 1}
        return out
