"""
vmhost_engine: a Salt **master** engine that converges hypervisor minions to per-hypervisor VM
definition files (Security Onion's ``<hypervisor>VMs`` JSON format) through ``vmhost.reconcile``.

Single file, Python stdlib plus salt only, so it works both from the installed extension and when
copied to ``salt://_engines/``. See docs/salt-engine.md for the configuration, the mapping of
the file format onto vmhostd's VM spec, what prune does, the events and the threat model.

An edited entry is changed in place by vmhostd, keeping the VM's disk (plan action
``reconfigure``). The engine never replaces a VM: an entry whose boot image changed gets the
daemon's 2002, is reported as ``reconcile_failed`` and its VM is left alone.

Master config::

    engines:
      - vmhost_engine:
          vms_dir: /opt/so/saltstack/local/salt/hypervisor/hosts
          network: br0
          boot:
            default: {image: so-base.qcow2, disk_gib: 220}
            roles:
              sensor: {image: so-sensor.qcow2, disk_gib: 300}
"""

import errno
import hashlib
import ipaddress
import json
import logging
import os
import re
import stat
import time

log = logging.getLogger(__name__)

TAG_PREFIX = "vmhost"
# Pseudo VM name for events about a whole hypervisor. VM names never contain "_".
HYPERVISOR_TAG = "_hypervisor"
SO_ROLES = ("searchnode", "sensor", "receiver", "idh", "heavynode", "fleet")
HARDWARE_CLASSES = ("disk", "copper", "sfp")
PRUNE_MODES = ("managed", "all", "off")
# Largest definition file read; anything bigger is refused as a bad file.
MAX_FILE_BYTES = 1024 * 1024
VM_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
DOMAIN_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
TAG_PART_RE = re.compile(r"[^A-Za-z0-9._-]")
RESULT_ACTIONS = ("create", "reconfigure", "replace", "start", "stop", "none", "destroy")
# vmhostd's code for a change that needs a new disk (a new boot.image): the engine never allows
# that (it calls host.reconcile without replace), so the VM is reported and left alone.
SPEC_DRIFT = 2002
REPLACE_HINT = (
    "the engine never replaces a VM (a new boot image means a new disk and the old one deleted); "
    "the VM is left as it is: restore its boot source in the engine config, or destroy the VM "
    "by hand (salt HYPERVISOR vmhost.destroy NAME) to have it created again from the new image"
)
STATE_FILE = "state.json"

__virtualname__ = "vmhost_engine"


def __virtual__():
    return True


# ---------------------------------------------------------------------------------------------
# Tags
# ---------------------------------------------------------------------------------------------


def tag_part(value):
    """One path component of a tag: characters outside ``[A-Za-z0-9._-]`` become ``_``, at
    most 64 characters, never empty, never ``.`` or ``..``."""
    text = TAG_PART_RE.sub("_", str(value))[:64]
    if text in ("", ".", ".."):
        text = "_"
    return text


def build_tag(hypervisor, vm, status):
    """``vmhost/<hypervisor>/<vm>/<status>``, each component sanitised by :func:`tag_part`."""
    return "/".join((TAG_PREFIX, tag_part(hypervisor), tag_part(vm), tag_part(status)))


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """The engine configuration is unusable."""


def _check_boot(boot, where):
    if not isinstance(boot, dict):
        raise ConfigError(f"{where} must be a mapping")
    if "image" in boot and "kernel" in boot:
        raise ConfigError(f"{where}: give either image or kernel, not both")
    if "image" in boot:
        extra = set(boot) - {"image", "disk_gib"}
        if extra:
            raise ConfigError(f"{where}: unknown keys with image: {sorted(extra)}")
        if not isinstance(boot["image"], str) or not boot["image"]:
            raise ConfigError(f"{where}.image must be a file name")
        disk = boot.get("disk_gib")
        if isinstance(disk, bool) or not isinstance(disk, int) or disk < 1:
            raise ConfigError(f"{where}.disk_gib must be a positive integer")
        return {"image": boot["image"], "disk_gib": disk}
    if "kernel" in boot:
        extra = set(boot) - {"kernel", "initrd", "cmdline"}
        if extra:
            raise ConfigError(f"{where}: unknown keys with kernel: {sorted(extra)}")
        out = {}
        for key in ("kernel", "initrd", "cmdline"):
            if key in boot and boot[key] is not None:
                if not isinstance(boot[key], str) or not boot[key]:
                    raise ConfigError(f"{where}.{key} must be a non-empty string")
                out[key] = boot[key]
        if not out["kernel"].startswith("/"):
            raise ConfigError(f"{where}.kernel must be an absolute path")
        return out
    raise ConfigError(f"{where} needs image (with disk_gib) or kernel")


def _positive(kwargs, key, default):
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number of seconds")
    return value


def parse_config(kwargs):
    """Checks and normalises the engine's config (the keyword arguments of ``start``)."""
    known = {
        "vms_dir",
        "suffix",
        "network",
        "boot",
        "interval",
        "poll",
        "retry",
        "timeout",
        "prune",
        "dry_run",
    }
    unknown = set(kwargs) - known
    if unknown:
        raise ConfigError(f"unknown engine config keys: {sorted(unknown)}")
    vms_dir = kwargs.get("vms_dir")
    if not isinstance(vms_dir, str) or not os.path.isabs(vms_dir):
        raise ConfigError("vms_dir must be an absolute directory path")
    suffix = kwargs.get("suffix", "VMs")
    if not isinstance(suffix, str) or not suffix:
        raise ConfigError("suffix must be a non-empty string")
    network = kwargs.get("network")
    if not isinstance(network, str) or not network:
        raise ConfigError("network (the vmhostd network the VMs' NIC joins) is required")
    boot = kwargs.get("boot") or {}
    if not isinstance(boot, dict):
        raise ConfigError("boot must be a mapping with default and/or roles")
    extra = set(boot) - {"default", "roles"}
    if extra:
        raise ConfigError(f"boot: unknown keys {sorted(extra)} (use default and roles)")
    default = _check_boot(boot["default"], "boot.default") if boot.get("default") else None
    roles = {}
    for role, rboot in (boot.get("roles") or {}).items():
        roles[str(role)] = _check_boot(rboot, f"boot.roles.{role}")
    if default is None and not roles:
        raise ConfigError("boot needs a default or at least one role")
    prune = kwargs.get("prune", "managed")
    if prune is True:
        prune = "managed"
    elif prune is False:
        prune = "off"
    if prune not in PRUNE_MODES:
        raise ConfigError(f"prune must be one of {', '.join(PRUNE_MODES)}")
    return {
        "vms_dir": vms_dir,
        "suffix": suffix,
        "network": network,
        "boot": {"default": default, "roles": roles},
        "interval": _positive(kwargs, "interval", 300),
        "poll": _positive(kwargs, "poll", 10),
        "retry": _positive(kwargs, "retry", 60),
        "timeout": _positive(kwargs, "timeout", 960),
        "prune": prune,
        "dry_run": bool(kwargs.get("dry_run", False)),
    }


# ---------------------------------------------------------------------------------------------
# Mapping: Security Onion entry -> vmhostd spec (pure)
# ---------------------------------------------------------------------------------------------


class EntryError(ValueError):
    """A bad entry of a definition file; names the file, the entry and the field."""

    def __init__(self, source, index, field, message, name=None):
        self.source = source
        self.index = index
        self.field = field
        self.name = name
        self.message = message
        who = f"entry {index}" + (f" ({name})" if name else "")
        super().__init__(f"{source}: {who}: field {field}: {message}")


class _Bad(Exception):
    """Internal: (field, message) of a bad entry, turned into an EntryError by map_entry."""


def _int(value, field):
    """An integer given as int or as a string of digits (SO files mix both)."""
    if isinstance(value, bool):
        raise _Bad(field, f"must be an integer, not {json.dumps(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d{1,9}\s*", value):
        return int(value)
    raise _Bad(field, f"must be an integer, not {json.dumps(value)[:40]}")


def _blank(value):
    return value is None or (isinstance(value, str) and not value.strip())


def vm_name(entry):
    """The vmhostd VM name of an entry, ``<hostname>-<role>`` (SO's ``<hostname>_<role>``,
    with ``-`` because vmhostd names allow no ``_``), or None when it cannot be derived."""
    if not isinstance(entry, dict):
        return None
    host, role = entry.get("hostname"), entry.get("role")
    if not isinstance(host, str) or not isinstance(role, str):
        return None
    name = f"{host.strip().lower()}-{role}"
    if not HOSTNAME_RE.match(host.strip().lower()) or role not in SO_ROLES:
        return None
    return name if VM_NAME_RE.match(name) else None


def _ipv4(entry, network):
    mode = entry.get("network_mode")
    if mode == "dhcp4":
        return {"network": network, "ipv4": {"mode": "dhcp"}}
    if mode != "static4":
        raise _Bad("network_mode", f"must be static4 or dhcp4, not {json.dumps(mode)}")
    ip4 = entry.get("ip4")
    if _blank(ip4) or not isinstance(ip4, str):
        raise _Bad("ip4", "required with static4 (CIDR, e.g. 192.168.1.10/24)")
    if "/" not in ip4:
        raise _Bad("ip4", f"{ip4!r} needs a prefix length (CIDR, e.g. 192.168.1.10/24)")
    try:
        iface = ipaddress.IPv4Interface(ip4.strip())
    except ValueError as exc:
        raise _Bad("ip4", f"{ip4!r} is not an IPv4 address/prefix: {exc}") from None
    ipv4 = {"mode": "static", "address": ip4.strip()}
    gw4 = entry.get("gw4")
    if not _blank(gw4):
        try:
            gateway = ipaddress.IPv4Address(str(gw4).strip())
        except ValueError:
            raise _Bad("gw4", f"{gw4!r} is not an IPv4 address") from None
        if gateway not in iface.network or gateway == iface.ip:
            raise _Bad("gw4", f"{gateway} is not another host of {iface.network}")
        ipv4["gateway"] = str(gateway)
    dns4 = entry.get("dns4")
    if not _blank(dns4):
        items = dns4.split(",") if isinstance(dns4, str) else dns4
        if not isinstance(items, list):
            raise _Bad("dns4", "must be a comma-separated string of IPv4 addresses")
        servers = []
        for item in items:
            text = str(item).strip()
            if not text:
                continue
            try:
                servers.append(str(ipaddress.IPv4Address(text)))
            except ValueError:
                raise _Bad("dns4", f"{text!r} is not an IPv4 address") from None
        if servers:
            ipv4["dns"] = servers
    search4 = entry.get("search4")
    if not _blank(search4):
        items = re.split(r"[,\s]+", search4) if isinstance(search4, str) else search4
        if not isinstance(items, list):
            raise _Bad("search4", "must be a domain name (or several, comma-separated)")
        domains = []
        for item in items:
            text = str(item).strip()
            if not text:
                continue
            if not DOMAIN_RE.match(text):
                raise _Bad("search4", f"{text!r} is not a domain name")
            domains.append(text)
        if domains:
            ipv4["search"] = domains
    return {"network": network, "ipv4": ipv4}


def _indices(entry, cls):
    raw = entry.get(cls)
    if _blank(raw):
        return []
    if not isinstance(raw, list):
        raise _Bad(cls, f"must be an array of indices, not {json.dumps(raw)[:40]}")
    out = []
    for i, item in enumerate(raw):
        index = _int(item, f"{cls}[{i}]")
        if index in out:
            raise _Bad(f"{cls}[{i}]", f"index {index} is listed twice")
        out.append(index)
    return out


def map_entry(entry, config, source="<file>", index=0):
    """Maps one Security Onion VM entry onto a vmhostd VM spec.

    ``config`` is the result of :func:`parse_config` (only ``network`` and ``boot`` are used).
    Raises :class:`EntryError` naming the file, entry and field for anything unusable.
    """
    name = vm_name(entry)
    try:
        if not isinstance(entry, dict):
            raise _Bad("entry", "must be a JSON object")
        host = entry.get("hostname")
        if not isinstance(host, str) or not HOSTNAME_RE.match(host.strip().lower()):
            raise _Bad("hostname", f"{json.dumps(host)[:70]} is not a hostname (letters, digits, -)")
        role = entry.get("role")
        if role not in SO_ROLES:
            raise _Bad("role", f"{json.dumps(role)[:40]} is not one of {', '.join(SO_ROLES)}")
        if name is None:
            raise _Bad("hostname", "hostname and role make a VM name over 63 characters")
        spec = {"name": name, "role": role}
        for key in ("cpu", "memory"):
            if key not in entry:
                raise _Bad(key, "is required")
            value = _int(entry[key], key)
            if value < 1:
                raise _Bad(key, f"must be at least 1, not {value}")
            if key == "cpu":
                spec["cpu"] = value
            else:
                spec["memory_mib"] = value * 1024
        state = "running"
        power = entry.get("powercontrol")
        if not _blank(power):
            if power in ("Stop", "Shutdown"):
                state = "stopped"
            elif power in ("Reboot", "Reset"):
                # One-shot operations have no declarative meaning: this engine never edits the
                # file to consume them, so doing them would repeat at every run.
                log.warning(
                    "vmhost_engine: %s: entry %s: powercontrol %s ignored (use vmhost.restart)",
                    source,
                    index,
                    power,
                )
            elif power != "Start":
                raise _Bad("powercontrol", f"{json.dumps(power)[:40]} is not Start, Reboot, Shutdown, Reset or Stop")
        spec["state"] = state
        hardware = {}
        for cls in HARDWARE_CLASSES:
            indices = _indices(entry, cls)
            if indices:
                hardware[cls] = indices
        if hardware:
            spec["hardware"] = hardware
        nsm = 0
        if not _blank(entry.get("nsm_size")):
            nsm = _int(entry["nsm_size"], "nsm_size")
        boot = config["boot"]["roles"].get(role) or config["boot"]["default"]
        if boot is None:
            raise _Bad(
                "role",
                f"no boot source configured for role {role} (set boot.roles.{role} "
                "or boot.default in the engine config)",
            )
        spec["boot"] = dict(boot)
        if nsm > 0 and "disk" not in hardware:
            # Security Onion's NSM volume: a raw, fully preallocated data disk, virtio-blk with
            # cache=none and io=native, the guest's disk right after the OS disk.
            spec["disks"] = [
                {"name": "nsm", "size_gib": nsm, "format": "raw", "preallocate": True, "cache": "none", "aio": "native"}
            ]
        spec["nics"] = [_ipv4(entry, config["network"])]
    except _Bad as exc:
        field, message = exc.args
        raise EntryError(source, index, field, message, name) from None
    return spec


def map_file(text, config, source="<file>"):
    """Maps a whole ``<hypervisor>VMs`` file.

    Returns ``(specs, errors, protected, complete)``: the specs of the good entries in file
    order, an :class:`EntryError` per bad entry, the VM names of bad entries whose name could
    still be derived (they must not be pruned), and whether every bad entry had such a name.
    A file that is not a JSON array raises :class:`EntryError` (index ``None``, field ``file``).
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise EntryError(source, None, "file", f"not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise EntryError(source, None, "file", "must be a JSON array of VM entries")
    specs, errors, protected, complete, seen = [], [], set(), True, {}
    for index, entry in enumerate(data):
        try:
            spec = map_entry(entry, config, source, index)
            if spec["name"] in seen:
                raise EntryError(
                    source,
                    index,
                    "hostname",
                    f"VM {spec['name']} is already defined by entry {seen[spec['name']]}",
                    spec["name"],
                )
        except EntryError as exc:
            errors.append(exc)
            if exc.name:
                protected.add(exc.name)
            else:
                complete = False
            continue
        seen[spec["name"]] = index
        specs.append(spec)
    return specs, errors, protected, complete


# ---------------------------------------------------------------------------------------------
# Minion returns (not trusted blindly)
# ---------------------------------------------------------------------------------------------


class HypervisorFailure(Exception):
    """A whole hypervisor could not be reconciled this round."""


def check_reconcile_return(ret):
    """Validates the shape of a ``vmhost.reconcile`` return; returns its results list.
    Raises HypervisorFailure describing what is wrong."""
    if not isinstance(ret, dict):
        raise HypervisorFailure(f"not a reconcile report: {str(ret)[:300]}")
    plan, results = ret.get("plan"), ret.get("results")
    if not isinstance(plan, list) or not isinstance(results, list):
        raise HypervisorFailure("reconcile report without plan/results lists")
    for item in plan + results:
        if not isinstance(item, dict):
            raise HypervisorFailure("reconcile report with a non-object entry")
        if not isinstance(item.get("vm"), str) or not VM_NAME_RE.match(item["vm"]):
            raise HypervisorFailure(f"reconcile report names an invalid VM {str(item.get('vm'))[:70]!r}")
        if item.get("action") not in RESULT_ACTIONS:
            raise HypervisorFailure(f"reconcile report with unknown action {str(item.get('action'))[:30]!r}")
    for item in results:
        if not isinstance(item.get("ok"), bool):
            raise HypervisorFailure("reconcile result without a boolean ok")
    return plan, results


def _plan_details(entry):
    """``fields`` (dotted spec paths) and ``restart`` of a ``reconfigure`` or ``replace`` plan
    entry, for the events; anything not of the expected shape is left out."""
    out = {}
    fields = entry.get("fields")
    if isinstance(fields, list) and len(fields) <= 64 and all(isinstance(f, str) for f in fields):
        out["fields"] = [f[:100] for f in fields]
    if isinstance(entry.get("restart"), bool):
        out["restart"] = entry["restart"]
    return out


def _error_code(error):
    return error.get("code") if isinstance(error, dict) else None


def _short_error(error):
    if isinstance(error, dict):
        out = {k: error.get(k) for k in ("code", "message") if k in error}
        data = error.get("data")
        if isinstance(data, dict):
            out["kind"] = data.get("kind")
            out["field"] = data.get("field")
        if isinstance(out.get("message"), str):
            out["message"] = out["message"][:1000]
        return out
    return None if error is None else str(error)[:1000]


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


def content_digest(content, config):
    """sha256 over the file's bytes and the parts of the config that shape the specs."""
    h = hashlib.sha256()
    h.update(content)
    h.update(b"\0")
    relevant = {k: config[k] for k in ("network", "boot", "prune", "dry_run")}
    h.update(json.dumps(relevant, sort_keys=True).encode())
    return h.hexdigest()


class Engine:
    """One engine instance. ``client`` has LocalClient's ``cmd``; ``fire(data, tag)`` puts an
    event on the master bus; ``cachedir`` is the engine's own directory (state file only)."""

    def __init__(self, config, client, fire, cachedir, clock=time.time):
        self.config = config
        self.client = client
        self.fire_event = fire
        self.cachedir = cachedir
        self.clock = clock
        self.state = self._load_state()

    # -- state --------------------------------------------------------------------------------

    def _state_path(self):
        return os.path.join(self.cachedir, STATE_FILE)

    def _load_state(self):
        try:
            with open(self._state_path(), encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error("vmhost_engine: ignoring unreadable state %s: %s", self._state_path(), exc)
            return {}
        if not isinstance(data, dict):
            return {}
        out = {}
        for hyp, rec in data.items():
            if isinstance(rec, dict):
                managed = rec.get("managed")
                rec["managed"] = sorted(
                    n
                    for n in (managed if isinstance(managed, list) else [])
                    if isinstance(n, str) and VM_NAME_RE.match(n)
                )
                out[hyp] = rec
        return out

    def _save_state(self):
        """Writes the state so that a crash or power loss leaves the old file or the new one,
        never a torn or empty one: a temp file written and fsynced, renamed over the state
        file, then the directory fsynced so the rename itself is on disk. The temp file is
        removed when any step fails (the old state stays)."""
        os.makedirs(self.cachedir, mode=0o700, exist_ok=True)
        path = self._state_path()
        tmp = path + ".tmp"
        data = json.dumps(self.state, sort_keys=True, indent=1).encode("utf-8")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(self.cachedir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _fire(self, hypervisor, vm, status, data):
        body = dict(data, hypervisor=hypervisor, vm=vm, status=status, source="vmhost_engine")
        try:
            self.fire_event(body, build_tag(hypervisor, vm, status))
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            log.error("vmhost_engine: cannot fire event for %s/%s: %s", hypervisor, vm, exc)

    # -- scanning -----------------------------------------------------------------------------

    def scan(self):
        """Definition files in ``vms_dir``: ``{hypervisor: path}``."""
        suffix = self.config["suffix"]
        try:
            names = os.listdir(self.config["vms_dir"])
        except OSError as exc:
            log.error("vmhost_engine: cannot list %s: %s", self.config["vms_dir"], exc)
            return {}
        out = {}
        for fname in sorted(names):
            if not fname.endswith(suffix) or fname.startswith("."):
                continue
            hyp = fname[: -len(suffix)]
            if not hyp or tag_part(hyp) != hyp:
                log.warning("vmhost_engine: ignoring %s: not <minion id>%s", fname, suffix)
                continue
            out[hyp] = os.path.join(self.config["vms_dir"], fname)
        return out

    def _read(self, path):
        """Opens ``path`` without following a symbolic link (O_NOFOLLOW; O_NONBLOCK so that a
        FIFO cannot stall the engine) and checks what was opened (fstat), not what a path
        named a moment before: a link swapped in cannot make the engine read another file."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise HypervisorFailure(
                    f"{path} is a symbolic link: refused (VM files are read as regular files, never through a link)"
                ) from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise HypervisorFailure(f"{path} is not a regular file")
            if st.st_size > MAX_FILE_BYTES:
                raise HypervisorFailure(f"{path} is larger than {MAX_FILE_BYTES} bytes")
            content = f.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise HypervisorFailure(f"{path} is larger than {MAX_FILE_BYTES} bytes")
        return st, content

    def due(self, hypervisor, digest, now):
        """Whether a hypervisor needs a run: its content changed since the last successful
        run (retried every ``retry`` s while it keeps failing), or ``interval`` passed."""
        rec = self.state.get(hypervisor) or {}
        if rec.get("applied") != digest:
            if rec.get("attempted") != digest:
                return True
            return now - rec.get("last_attempt", 0) >= self.config["retry"]
        return now - rec.get("last_success", 0) >= self.config["interval"]

    def run_once(self):
        """One pass over every definition file. Returns ``{hypervisor: outcome}`` with outcome
        ``skipped``, ``ok``, ``partial`` (some entries bad or failed) or ``failed``."""
        outcomes = {}
        for hyp, path in self.scan().items():
            now = self.clock()
            try:
                outcomes[hyp] = self._maybe_run(hyp, path, now)
            except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
                # One hypervisor's failure never stops the others.
                log.error("vmhost_engine: %s: %s", hyp, exc)
                rec = self.state.setdefault(hyp, {"managed": []})
                rec["last_attempt"] = now
                rec["last_error"] = str(exc)[:2000]
                self._fire(hyp, HYPERVISOR_TAG, "reconcile_failed", {"file": path, "error": str(exc)[:2000]})
                outcomes[hyp] = "failed"
            try:
                self._save_state()
            except OSError as exc:
                log.error("vmhost_engine: cannot write %s: %s", self._state_path(), exc)
        return outcomes

    def _maybe_run(self, hyp, path, now):
        # Files are small: hash the content at every poll instead of trusting mtime, which
        # misses an edit within the file system's timestamp granularity.
        try:
            _, content = self._read(path)
        except OSError as exc:
            raise HypervisorFailure(f"cannot read {path}: {exc}") from None
        digest = content_digest(content, self.config)
        if not self.due(hyp, digest, now):
            return "skipped"
        rec = self.state.setdefault(hyp, {"managed": []})
        rec["attempted"] = digest
        rec["last_attempt"] = now
        ok = self.reconcile(hyp, path, content)
        if ok:
            rec["applied"] = digest
            rec["last_success"] = now
            rec.pop("last_error", None)
            return "ok"
        return "partial"

    def reconcile(self, hyp, path, content):
        """Maps the file and drives one hypervisor. True when everything succeeded."""
        rec = self.state.setdefault(hyp, {"managed": []})
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise HypervisorFailure(f"{path}: not UTF-8") from None
        try:
            specs, errors, protected, complete = map_file(text, self.config, path)
        except EntryError as exc:
            self._fire(hyp, HYPERVISOR_TAG, "invalid", {"file": path, "field": exc.field, "error": str(exc)})
            raise HypervisorFailure(str(exc)) from None
        for err in errors:
            log.error("vmhost_engine: %s", err)
            self._fire(
                hyp,
                err.name or f"_entry{err.index}",
                "invalid",
                {
                    "file": path,
                    "index": err.index,
                    "field": err.field,
                    "error": str(err),
                },
            )
        prune = self.config["prune"]
        dry = self.config["dry_run"]
        # Never with replace: an edited entry is changed in place (its disk kept), and an entry
        # whose boot image changed gets the daemon's 2002 and is left alone (see REPLACE_HINT).
        # replace is left out rather than sent as false: the daemon's default, and a minion with
        # an older execution module still accepts the call.
        ret = self._call(
            hyp,
            "vmhost.reconcile",
            {
                "vms": specs,
                "prune": prune == "all" and complete and not errors,
                "dry_run": dry,
            },
        )
        plan, results = check_reconcile_return(ret)
        desired = {s["name"] for s in specs}
        managed = set(rec.get("managed", []))
        all_ok = not errors and bool(ret.get("ok", False))
        planned = {p["vm"]: p for p in plan}
        for res in results:
            name = res["vm"]
            if name not in desired and res["action"] != "destroy":
                continue
            if res["ok"] and not res.get("changed"):
                continue
            status = "reconciled" if res["ok"] else "reconcile_failed"
            data = {
                "action": res["action"],
                "ok": res["ok"],
                "changed": bool(res.get("changed")),
                "error": _short_error(res.get("error")),
                "dry_run": dry,
            }
            data.update(_plan_details(planned.get(name, {})))
            if not res["ok"] and _error_code(res.get("error")) == SPEC_DRIFT:
                # A new boot.image: the daemon left the VM alone because replace was not given.
                data["hint"] = REPLACE_HINT
                log.warning("vmhost_engine: %s: VM %s not replaced: %s", hyp, name, REPLACE_HINT)
            self._fire(hyp, name, status, data)
        if not results and dry:
            for item in plan:
                if item["vm"] in desired and item.get("error"):
                    all_ok = False
        on_host_extra = {p["vm"] for p in plan if p["vm"] not in desired}
        destroyed = {r["vm"] for r in results if r["action"] == "destroy" and r["ok"]}
        if prune == "managed":
            doomed = sorted((managed & on_host_extra) - protected)
            if doomed and not complete:
                log.error(
                    "vmhost_engine: %s: not pruning %s: a bad entry in %s has no usable name",
                    hyp,
                    ", ".join(doomed),
                    path,
                )
                all_ok = False
                doomed = []
            for name in doomed:
                if dry:
                    self._fire(
                        hyp, name, "reconciled", {"action": "destroy", "ok": True, "changed": False, "dry_run": True}
                    )
                    continue
                try:
                    self._call(hyp, "vmhost.destroy", {"name": name})
                except HypervisorFailure as exc:
                    if "vmhostd error 4040" in str(exc):
                        # Gone already (destroyed by hand meanwhile): what we wanted.
                        destroyed.add(name)
                        continue
                    all_ok = False
                    self._fire(
                        hyp,
                        name,
                        "reconcile_failed",
                        {
                            "action": "destroy",
                            "ok": False,
                            "changed": False,
                            "error": str(exc)[:1000],
                            "dry_run": False,
                        },
                    )
                    continue
                destroyed.add(name)
                self._fire(
                    hyp,
                    name,
                    "reconciled",
                    {
                        "action": "destroy",
                        "ok": True,
                        "changed": True,
                        "error": None,
                        "dry_run": False,
                    },
                )
        if not dry:
            # A VM stays managed until it is seen gone; bad entries keep their VMs managed.
            keep = (managed & (on_host_extra | protected)) - destroyed
            rec["managed"] = sorted(desired | keep)
        summary = {
            "file": path,
            "ok": all_ok,
            "dry_run": dry,
            "vms": len(specs),
            "invalid": len(errors),
            "failed": sum(1 for r in results if not r["ok"]),
            "changed": sum(1 for r in results if r.get("changed")),
            "destroyed": sorted(destroyed),
        }
        self._fire(hyp, HYPERVISOR_TAG, "reconciled" if all_ok else "reconcile_failed", summary)
        log.info("vmhost_engine: %s: %s", hyp, summary)
        return all_ok

    def _call(self, hyp, fun, kwarg):
        try:
            ret = self.client.cmd(
                [hyp],
                fun,
                kwarg=kwarg,
                tgt_type="list",
                timeout=self.config["timeout"],
                full_return=True,
            )
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            raise HypervisorFailure(f"{fun} on {hyp} could not be published: {exc}") from None
        if not isinstance(ret, dict) or hyp not in ret:
            raise HypervisorFailure(
                f"minion {hyp} did not answer {fun} within {self.config['timeout']} s "
                "(down, key not accepted, or no such minion)"
            )
        answer = ret[hyp]
        if isinstance(answer, dict) and "ret" in answer:
            retcode, body = answer.get("retcode", 0), answer["ret"]
        else:
            retcode, body = 0, answer
        if retcode not in (0, None) or (isinstance(body, str) and body.startswith("ERROR")):
            raise HypervisorFailure(f"{fun} failed on {hyp}: {str(body)[:1000]}")
        return body


def start(**kwargs):
    """Engine entry point (salt calls it in its own process on the master)."""
    import salt.client  # pylint: disable=import-outside-toplevel
    import salt.utils.event  # pylint: disable=import-outside-toplevel

    opts = __opts__  # noqa: F821  pylint: disable=undefined-variable
    try:
        config = parse_config(kwargs)
    except ConfigError as exc:
        # Returning would make salt's process manager restart the engine at once, forever:
        # stay idle instead and repeat the complaint now and then.
        while True:
            log.error("vmhost_engine: bad configuration, engine idle until fixed: %s", exc)
            time.sleep(3600)
    cachedir = os.path.join(opts["cachedir"], "vmhost_engine")
    client = salt.client.LocalClient(mopts=opts)
    bus = salt.utils.event.get_master_event(opts, opts["sock_dir"], listen=False)
    engine = Engine(config, client, bus.fire_event, cachedir)
    log.info("vmhost_engine: watching %s every %s s", config["vms_dir"], config["poll"])
    while True:
        try:
            engine.run_once()
        except Exception:  # pylint: disable=broad-except
            log.exception("vmhost_engine: pass failed")
        time.sleep(config["poll"])
