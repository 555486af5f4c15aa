#!/usr/bin/python3
"""Reads a vmhost cloud-init seed with the cloud-init of the tree this runs in (chroot).

Usage (inside a guest tree): check-seed.py SEEDDIR

SEEDDIR holds the seed's files (meta-data, user-data, vendor-data, network-config) and
expect.json: {"present": [strings each renderer's output must contain]}. What is checked:

- user-data (when it is a #cloud-config) and vendor-data pass `cloud-init schema`;
- network-config passes `cloud-init schema --schema-type network-config` where that exists
  (cloud-init 23.4 and later);
- network-config is parsed into cloud-init's network state and rendered by each renderer the
  distributions use (ENI for ifupdown, netplan, systemd-networkd, NetworkManager) into a
  scratch target; every expected string must be in what each one wrote, no warning may be
  logged on the way (cloud-init drops what it cannot parse with a warning, not an error), and
  every command an ifupdown hook line runs must exist in the tree.

Prints one line per check and "seed ok" at the end; exits 1 on the first failure.
"""

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml
from cloudinit.net import network_state


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def schema(path, *extra):
    out = subprocess.run(
        ["cloud-init", "schema", *extra, "--config-file", path], capture_output=True, text=True, check=False
    )
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or "deprecat" in text.lower() or "warning" in text.lower():
        fail(f"cloud-init schema {' '.join(extra)} {os.path.basename(path)}: exit {out.returncode}: {text}")
    print(f"schema {' '.join(extra)} {os.path.basename(path)}: {text.splitlines()[-1] if text else 'ok'}")


def renderers():
    """The renderer classes this cloud-init has, by the names cloud.cfg uses."""
    found = {}
    for name, module in [
        ("eni", "cloudinit.net.eni"),
        ("netplan", "cloudinit.net.netplan"),
        ("networkd", "cloudinit.net.networkd"),
        ("network-manager", "cloudinit.net.network_manager"),
    ]:
        try:
            mod = __import__(module, fromlist=["Renderer"])
        except ImportError:
            continue
        found[name] = mod.Renderer
    return found


def patch_netplan_writer():
    """Where the netplan Python API exists (cloud-init 24.1+ with python3-netplan), cloud-init
    writes through it into the real /etc/netplan, outside the scratch target. Instead the
    rendered YAML goes through netplan's own parser (which refuses what netplan cannot apply)
    and then to the target by cloud-init's fallback writer."""
    from cloudinit.net import netplan as module

    if not hasattr(module, "netplan_api_write_yaml_file"):
        return
    try:
        from netplan.parser import Parser
    except ImportError:
        return

    def parse_then_fallback(content):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(content)
            f.flush()
            try:
                Parser().load_yaml(f.name)
            except Exception as e:  # noqa: BLE001 - netplan's errors have no common base
                fail(f"netplan's parser refused the rendered config: {e}\n{content}")
        print("netplan parser: accepted")
        return False

    module.netplan_api_write_yaml_file = parse_then_fallback


def written(target):
    text = []
    for path in sorted(glob.glob(os.path.join(target, "**"), recursive=True)):
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                text.append(f"--- {os.path.relpath(path, target)}\n{f.read()}")
    return "\n".join(text)


def main():
    seed = sys.argv[1]
    with open(os.path.join(seed, "expect.json"), encoding="utf-8") as f:
        expect = json.load(f)
    for name in ["user-data", "vendor-data"]:
        path = os.path.join(seed, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                first = f.readline()
            if first.startswith("#cloud-config"):
                schema(path)
    helptext = subprocess.run(["cloud-init", "schema", "--help"], capture_output=True, text=True, check=False).stdout
    if "network-config" in helptext:
        schema(os.path.join(seed, "network-config"), "--schema-type", "network-config")

    collect = Collect()
    root = logging.getLogger()
    root.addHandler(collect)
    root.setLevel(logging.DEBUG)
    with open(os.path.join(seed, "network-config"), encoding="utf-8") as f:
        text = f.read()
    for name, cls in renderers().items():
        # A fresh state per renderer: some renderers change the state's dicts as they go.
        try:
            state = network_state.parse_net_config_data(yaml.safe_load(text))
        except Exception as e:  # noqa: BLE001 - whatever cloud-init raises drops the config
            fail(f"parsing network-config: {type(e).__name__}: {e}")
        if collect.records:
            fail(f"parsing network-config logged: {collect.records}")
        with tempfile.TemporaryDirectory() as target:
            config = {"postcmds": False, "netplan_path": "etc/netplan/50-cloud-init.yaml"} if name == "netplan" else None
            renderer = cls(config) if config is not None else cls()
            # netplan's `features` asks the netplan binary, absent from a tree without netplan.
            if name == "netplan":
                renderer._features = []
                patch_netplan_writer()
            renderer.render_network_state(state, target=target)
            if collect.records:
                fail(f"rendering for {name} logged: {collect.records}")
            out = written(target)
            if not out:
                fail(f"{name} wrote nothing")
            # ifupdown runs an interface's hook commands; one the image lacks (cloud-init 22.4
            # renders some routes as `post-up route add`, from net-tools) fails silently there.
            for hook in re.findall(r"^\s*(?:pre-up|up|post-up|down|pre-down|post-down)\s+(\S+)", out, re.M):
                if not shutil.which(hook, path="/usr/sbin:/usr/bin:/sbin:/bin"):
                    fail(f"{name}: the hook command {hook!r} is not in this guest:\n{out}")
            for want in expect["present"]:
                if not re.search(re.escape(want) + r"(?![0-9A-Za-z])", out):
                    fail(f"{name}: {want!r} is not in what it wrote:\n{out}")
            print(f"render {name}: {len(out)} bytes, {len(expect['present'])} expected strings present")
    print("seed ok")


if __name__ == "__main__":
    main()
