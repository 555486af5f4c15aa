"""
vmhost_engine: a Salt **master** engine that converges hypervisor minions to per-hypervisor VM
definition files (Security Onion's ``<hypervisor>VMs`` JSON format) through ``vmhost.reconcile``.

Single file, Python stdlib plus salt only, so it works both from the installed extension and when
copied to ``salt://_engines/``. See docs/salt-engine.md for the configuration, the mapping of
the file format onto vmhostd's VM spec, what prune does, the events and the threat model.

An edited entry is changed in place by vmhostd, keeping the VM's disk (plan action
``reconfigure``). The engine never replaces a VM: an entry whose boot image changed gets the
daemon's 2002, is reported as ``reconcile_failed`` and its VM is left alone.

A drop-in for Security Onion's virtual_node_manager: VMs named ``<hostname>_<role>``, the file
``<hypervisor>VMs`` driving the one accepted minion ``minion_id`` names (default
``{hypervisor}_*``), SO's tracking/.error/.status files and ``soc/dyanno/hypervisor/<status>``
events with ``so_compat``, an optional cloud-init ``bootstrap`` per VM (run through vmhostd's
``vm.exec`` instead for VMs whose boot says ``cloud_init: false``), and hypervisors reconciled
concurrently (``parallel`` worker threads, one LocalClient each).

Master config::

    engines:
      - vmhost_engine:
          vms_dir: /opt/so/saltstack/local/salt/hypervisor/hosts
          network: br0
          boot:
            default: {image: so-base.qcow2, disk_gib: 220}
            roles:
              sensor: {image: so-sensor.qcow2, disk_gib: 300}
          performance_roles:
            sensor: {cpu_policy: dedicated, numa: auto, hugepages: 1G}
          capture_interface: eth1        # sensors and heavy nodes get a monitor NIC of it
"""

import concurrent.futures
import errno
import fnmatch
import hashlib
import ipaddress
import json
import logging
import os
import re
import stat
import string
import threading
import time
from datetime import datetime, timezone

log = logging.getLogger(__name__)

TAG_PREFIX = "vmhost"
# Pseudo VM names for events about a whole hypervisor (and bad entries, "_entryN"). VM names
# never start with "_", so they cannot collide.
HYPERVISOR_TAG = "_hypervisor"
SO_ROLES = ("searchnode", "sensor", "receiver", "idh", "heavynode", "fleet")
HARDWARE_CLASSES = ("disk", "copper", "sfp")
PRUNE_MODES = ("managed", "all", "off")
# Largest definition file read; anything bigger is refused as a bad file.
MAX_FILE_BYTES = 1024 * 1024
# vmhostd's VM name rule: 1-63 characters, first [a-z0-9], then [a-z0-9_-].
VM_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
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
# In vms_dir: the VMs the vmhost runner is moving (runners/vmhost.py), left alone meanwhile. A
# dot file, so never read as a hypervisor's file.
HOLDS_FILE = ".vmhost-moves.json"
MIGRATE_HINT = (
    "this VM was made by an earlier vmhost_engine, which named VMs <hostname>-<role>; the engine "
    "now names them <hostname>_<role> as Security Onion does. It neither destroys the old VM nor "
    "creates the new name while the old one is managed: migrate by hand (see docs/salt-engine.md, "
    "upgrade notes), e.g. destroy the old VM (salt HYPERVISOR vmhost.destroy OLD, which deletes its "
    "disk) and the engine creates the new name at its next run"
)
# Characters that make a minion_id template a glob; without them it is one exact minion id.
GLOB_CHARS = frozenset("*?[")
# What the daemon accepts as a spec's user_data.
MAX_USER_DATA = 64 * 1024
BOOTSTRAP_KEYS = ("vm_name", "hypervisor", "master", "hostname", "role")
# Where the bootstrap of a VM without cloud-init is written in the guest and run from (not
# /run or /tmp: often mounted noexec).
BOOTSTRAP_PATH = "/var/lib/vmhost/bootstrap"
# Seconds vmhost.guest_exec on the minion waits past the command's own timeout (vmhost:timeout,
# default 120, plus the daemon's 10 s), which the engine's LocalClient timeout must cover too.
BOOTSTRAP_MARGIN = 150
DEFAULT_BOOTSTRAP_TIMEOUT = 600
# vmhostd's "cannot reach the guest's exec server" (not booted yet, no exec server): the
# bootstrap waits for a later run.
EXEC_UNREACHABLE = 5001
# vmhostd reads a request line of at most 1 MiB; all of a hypervisor's specs go in one
# vmhost.reconcile request, so their JSON (as the execution module sends it) must fit, with a
# margin for the JSON-RPC envelope.
MAX_REQUEST_LINE = 1024 * 1024
REQUEST_MARGIN = 4 * 1024

# Security Onion compatibility (so_compat): its files under <vms_dir>/<hypervisor>/ and its
# status events. See docs/salt-engine.md#security-onions-files-and-status-events.
SO_VMS_DIR = "/opt/so/saltstack/local/salt/hypervisor/hosts"
SO_OWNER = "socore"
SO_EVENT_PREFIX = "soc/dyanno/hypervisor/"
SO_PROCESSING = "Processing"
SO_CREATED = "Created Instance"
SO_HARDWARE = "Hardware Configuration"
SO_HARDWARE_FAILED = "Hardware Configuration Failed"
SO_DISK_FULL = "Hypervisor NSM Disk Full"
SO_DESTROYED = "Destroyed Instance"
# SO's error codes in <vm>.error: 3 hardware validation, 4 provisioning failed.
SO_HARDWARE_CODE = 3
SO_PROVISION_CODE = 4
# SO drops these from the config it copies into a .error file (a failed VM claims no resources).
SO_ERROR_DROPPED = ("cpu", "memory", "sfp", "copper")
# A "Destroyed Instance" .status file is deleted after this many seconds (SO: 48 hours).
SO_DESTROYED_KEEP = 48 * 3600
# Spec fields whose change in place SO calls "Hardware Configuration" (where the VM's CPUs and
# memory sit is part of it).
HARDWARE_FIELDS = ("cpu", "memory_mib", "hardware", "pci", "disks", "cpu_policy", "numa", "hugepages", "emulator_cpu")
# The placement members the engine config's ``performance`` and ``performance_roles`` may set:
# vmhostd spec members of the same names (docs/api.md). SO's VMs file has no such fields, so the
# engine config is where a hypervisor's sensors get dedicated CPUs, NUMA placement and hugepages.
PERFORMANCE_KEYS = ("cpu_policy", "numa", "hugepages", "emulator_cpu")
CPU_POLICIES = ("shared", "dedicated")
NUMA_WORDS = ("auto", "spread", "none")
HUGEPAGE_SIZES = ("2M", "1G")
# The SO roles that sniff traffic (a sensor; a heavy node is a sensor and a search node in one):
# with ``capture_interface`` set, their VMs get a monitor NIC of it unless ``capture_roles``
# says otherwise. The other roles (search node, receiver, IDH, fleet) take no copy of the wire.
CAPTURE_ROLES = ("sensor", "heavynode")

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
    cloud_init = boot.get("cloud_init", True)
    if not isinstance(cloud_init, bool):
        raise ConfigError(f"{where}.cloud_init must be true or false")
    # A guest that does not run cloud-init gets its bootstrap through vm.exec instead.
    no_cloud_init = {} if cloud_init else {"cloud_init": False}
    if "image" in boot:
        extra = set(boot) - {"image", "disk_gib", "cloud_init"}
        if extra:
            raise ConfigError(f"{where}: unknown keys with image: {sorted(extra)}")
        if not isinstance(boot["image"], str) or not boot["image"]:
            raise ConfigError(f"{where}.image must be a file name")
        disk = boot.get("disk_gib")
        if isinstance(disk, bool) or not isinstance(disk, int) or disk < 1:
            raise ConfigError(f"{where}.disk_gib must be a positive integer")
        return {"image": boot["image"], "disk_gib": disk, **no_cloud_init}
    if "kernel" in boot:
        extra = set(boot) - {"kernel", "initrd", "cmdline", "cloud_init"}
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
        return {**out, **no_cloud_init}
    raise ConfigError(f"{where} needs image (with disk_gib) or kernel")


def _check_performance(value, where, role=False):
    """A ``performance`` mapping: the values of :data:`PERFORMANCE_KEYS` as vmhostd takes them
    (their shape only; whether the host can give them is the daemon's to say, per VM). In a
    role's mapping (``role``) a null removes the default's value for that role."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of {', '.join(PERFORMANCE_KEYS)}")
    extra = set(value) - set(PERFORMANCE_KEYS)
    if extra:
        raise ConfigError(f"{where}: unknown keys {sorted(extra)} (known: {', '.join(PERFORMANCE_KEYS)})")
    out = {}
    for key, item in value.items():
        if item is None and role:
            out[key] = None
        elif key == "cpu_policy" and item not in CPU_POLICIES:
            raise ConfigError(f"{where}.cpu_policy must be one of {', '.join(CPU_POLICIES)}")
        elif (
            key == "numa"
            and item not in NUMA_WORDS
            and (isinstance(item, bool) or not isinstance(item, int) or item < 0)
        ):
            raise ConfigError(f"{where}.numa must be one of {', '.join(NUMA_WORDS)} or a NUMA node number")
        elif key == "hugepages" and item not in HUGEPAGE_SIZES:
            raise ConfigError(f"{where}.hugepages must be one of {', '.join(HUGEPAGE_SIZES)}")
        elif key == "emulator_cpu" and not isinstance(item, bool):
            raise ConfigError(f"{where}.emulator_cpu must be true or false")
        else:
            out[key] = item
    return out


def performance_for(config, role):
    """The placement members of a VM of ``role``: ``performance`` with the role's
    ``performance_roles`` entry put over it key by key (a null there drops the key)."""
    merged = dict(config.get("performance") or {})
    merged.update((config.get("performance_roles") or {}).get(role) or {})
    return {k: v for k, v in merged.items() if v is not None}


def is_ifname(name):
    """vmhostd's rule for a host interface name (its ``[capture] interfaces``): 1-15 bytes of
    printable ASCII without ``/`` and ``:``, not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode()) <= 15
        and name not in (".", "..")
        and all(0x21 <= ord(c) <= 0x7E and c not in "/:" for c in name)
    )


def _check_capture_interface(value):
    """``capture_interface``: one host interface name for every hypervisor, or a mapping of
    hypervisor (the file prefix) to a name, or null for none there. Returns a name, a dict, or
    None."""
    if value is None:
        return None
    if isinstance(value, str):
        if not is_ifname(value):
            raise ConfigError(f"capture_interface: {value!r} is not an interface name")
        return value
    if not isinstance(value, dict):
        raise ConfigError("capture_interface must be an interface name or a mapping of hypervisor to one")
    out = {}
    for hyp, name in value.items():
        if not isinstance(hyp, str) or not hyp:
            raise ConfigError("capture_interface: a hypervisor must be a non-empty string")
        if name is not None and not is_ifname(name):
            raise ConfigError(f"capture_interface.{hyp}: {name!r} is not an interface name")
        out[hyp] = name
    return out


def _check_capture_roles(value):
    """``capture_roles``: a list of SO roles (each once), whose VMs get the capture NIC."""
    if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
        raise ConfigError(f"capture_roles must be a list of roles ({', '.join(SO_ROLES)})")
    for role in value:
        if role not in SO_ROLES:
            raise ConfigError(f"capture_roles: {role!r} is not one of {', '.join(SO_ROLES)}")
    if len(set(value)) != len(value):
        raise ConfigError("capture_roles: a role is listed twice")
    return list(value)


def capture_source(entry, config, role, hypervisor):
    """The host interface the monitor NIC of a VM copies, or None for no monitor NIC. An
    entry's own ``capture_interface`` (vmhost's addition to SO's format) wins: a name is its
    source whatever the role, ``false`` means none; blank or absent leaves it to the config's
    ``capture_interface`` (the hypervisor's, when a mapping) for the roles of
    ``capture_roles``."""
    own = entry.get("capture_interface")
    if own is False:
        return None
    if not _blank(own):
        if not is_ifname(own):
            raise _Bad("capture_interface", f"{json.dumps(own)[:40]} is not an interface name (or false for none)")
        return own
    default = config.get("capture_interface")
    if isinstance(default, dict):
        default = default.get(hypervisor)
    if default is None or role not in (config.get("capture_roles") or ()):
        return None
    return default


def _positive(kwargs, key, default):
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number of seconds")
    return value


class _Strict(dict):
    """The values of a template: a placeholder without a value is an error, never empty."""

    def __missing__(self, key):
        raise KeyError(key)


def render(template, values):
    """``template.format_map`` over exactly ``values``."""
    return template.format_map(_Strict(values))


def _check_template(template, allowed, key):
    """Validates a ``str.format`` template once: only the named placeholders in ``allowed``, no
    positional ``{}``, no attribute or index access; literal braces are written ``{{`` ``}}``."""
    if not isinstance(template, str) or not template:
        raise ConfigError(f"{key} must be a non-empty string")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        for field in fields:
            if field not in allowed:
                raise ConfigError(
                    f"{key}: unknown placeholder {{{field}}} (known: {', '.join(allowed)}; "
                    "write {{ and }} for a literal brace)"
                )
        render(template, {k: "x" for k in allowed})
    except (ValueError, KeyError, IndexError) as exc:
        raise ConfigError(f"{key}: not a valid template ({exc}); write {{{{ and }}}} for a literal brace") from None


def parse_config(kwargs, default_master=None):
    """Checks and normalises the engine's config (the keyword arguments of ``start``).
    ``default_master`` is the value of ``master`` when the config has none."""
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
        "minion_id",
        "so_compat",
        "file_owner",
        "bootstrap",
        "master",
        "parallel",
        "bootstrap_timeout",
        "performance",
        "performance_roles",
        "capture_interface",
        "capture_roles",
    }
    unknown = set(kwargs) - known
    if unknown:
        raise ConfigError(f"unknown engine config keys: {sorted(unknown)}")
    vms_dir = kwargs.get("vms_dir")
    if not isinstance(vms_dir, str) or not os.path.isabs(vms_dir):
        raise ConfigError("vms_dir must be an absolute directory path")
    if any(part in (".", "..") for part in vms_dir.split("/")):
        raise ConfigError("vms_dir must not contain . or .. components (it is opened without following links)")
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
    minion_id = kwargs.get("minion_id", "{hypervisor}_*")
    _check_template(minion_id, ("hypervisor",), "minion_id")
    so_compat = kwargs.get("so_compat", os.path.normpath(vms_dir) == SO_VMS_DIR)
    if not isinstance(so_compat, bool):
        raise ConfigError("so_compat must be true or false")
    file_owner = kwargs.get("file_owner")
    if file_owner is not None and (
        not isinstance(file_owner, str) or not re.fullmatch(r"[A-Za-z0-9._-]+:[A-Za-z0-9._-]+", file_owner)
    ):
        raise ConfigError('file_owner must be "user:group"')
    bootstrap = kwargs.get("bootstrap")
    if bootstrap is not None:
        _check_template(bootstrap, BOOTSTRAP_KEYS, "bootstrap")
    master = kwargs.get("master", default_master)
    if master is not None and (not isinstance(master, str) or not master.strip()):
        raise ConfigError("master must be a host name or address")
    if bootstrap is not None and master is None:
        raise ConfigError("bootstrap needs master (the address the guests' salt-minion connects to)")
    timeout = _positive(kwargs, "timeout", 960)
    bootstrap_timeout = kwargs.get("bootstrap_timeout")
    if bootstrap_timeout is not None and (
        isinstance(bootstrap_timeout, bool) or not isinstance(bootstrap_timeout, int) or bootstrap_timeout < 1
    ):
        raise ConfigError("bootstrap_timeout must be a positive integer number of seconds")
    boots = ([default] if default else []) + list(roles.values())
    if bootstrap is not None and any(b.get("cloud_init") is False for b in boots):
        if not bootstrap.startswith("#!"):
            raise ConfigError(
                "bootstrap must be a script (its first line #!, which cloud-init runs too) when a boot "
                "source has cloud_init: false: such VMs run it through vm.exec"
            )
        # The minion's vmhost.guest_exec waits the bootstrap's timeout plus BOOTSTRAP_MARGIN;
        # the engine's wait for the minion (timeout) must cover that.
        limit = int(timeout - BOOTSTRAP_MARGIN)
        if limit < 1:
            raise ConfigError(
                f"timeout must be above {BOOTSTRAP_MARGIN} s when a boot source has cloud_init: false "
                "(the bootstrap runs within it)"
            )
        if bootstrap_timeout is None:
            bootstrap_timeout = min(DEFAULT_BOOTSTRAP_TIMEOUT, limit)
        elif bootstrap_timeout > limit:
            raise ConfigError(f"bootstrap_timeout must be at most timeout - {BOOTSTRAP_MARGIN} ({limit}) seconds")
    if bootstrap_timeout is None:
        bootstrap_timeout = DEFAULT_BOOTSTRAP_TIMEOUT
    parallel = kwargs.get("parallel", 8)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 64:
        raise ConfigError("parallel must be an integer from 1 to 64")
    performance = _check_performance(kwargs.get("performance"), "performance")
    performance_roles = kwargs.get("performance_roles") or {}
    if not isinstance(performance_roles, dict):
        raise ConfigError("performance_roles must be a mapping of role to a performance mapping")
    for role in performance_roles:
        if role not in SO_ROLES:
            # A misspelt role would silently leave its VMs on the default.
            raise ConfigError(f"performance_roles: {role!r} is not one of {', '.join(SO_ROLES)}")
    performance_roles = {
        role: _check_performance(value, f"performance_roles.{role}", role=True)
        for role, value in performance_roles.items()
    }
    capture_interface = _check_capture_interface(kwargs.get("capture_interface"))
    capture_roles = _check_capture_roles(kwargs.get("capture_roles", list(CAPTURE_ROLES)))
    return {
        "vms_dir": vms_dir,
        "suffix": suffix,
        "network": network,
        "boot": {"default": default, "roles": roles},
        "interval": _positive(kwargs, "interval", 300),
        "poll": _positive(kwargs, "poll", 10),
        "retry": _positive(kwargs, "retry", 60),
        "timeout": timeout,
        "bootstrap_timeout": bootstrap_timeout,
        "prune": prune,
        "dry_run": bool(kwargs.get("dry_run", False)),
        "minion_id": minion_id,
        "so_compat": so_compat,
        "file_owner": file_owner,
        "bootstrap": bootstrap,
        "master": master.strip() if master else None,
        "parallel": parallel,
        "performance": performance,
        "performance_roles": performance_roles,
        "capture_interface": capture_interface,
        "capture_roles": capture_roles,
    }


def file_owner_ids(config, getpwnam=None, getgrnam=None):
    """``(uid, gid)`` for the files written under ``vms_dir``: ``socore`` (user, and its group,
    else the user's primary group) when that user exists, else the config's ``file_owner``,
    else None (files keep the engine's user). Raises ConfigError for an unknown file_owner."""
    import grp  # pylint: disable=import-outside-toplevel
    import pwd  # pylint: disable=import-outside-toplevel

    getpwnam = getpwnam or pwd.getpwnam
    getgrnam = getgrnam or grp.getgrnam
    try:
        user = getpwnam(SO_OWNER)
    except KeyError:
        user = None
    if user is not None:
        try:
            return user.pw_uid, getgrnam(SO_OWNER).gr_gid
        except KeyError:
            return user.pw_uid, user.pw_gid
    if not config.get("file_owner"):
        return None
    uname, gname = config["file_owner"].split(":")
    try:
        uid = int(uname) if uname.isdigit() else getpwnam(uname).pw_uid
        gid = int(gname) if gname.isdigit() else getgrnam(gname).gr_gid
    except KeyError as exc:
        raise ConfigError(f"file_owner {config['file_owner']}: no such user or group {exc}") from None
    return uid, gid


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
    """The vmhostd VM name of an entry, ``<hostname>_<role>`` as Security Onion names it
    (hostname lower-cased), or None when it cannot be derived. A hostname has no ``_``, so the
    name splits back at its last ``_``."""
    if not isinstance(entry, dict):
        return None
    host, role = entry.get("hostname"), entry.get("role")
    if not isinstance(host, str) or not isinstance(role, str):
        return None
    name = f"{host.strip().lower()}_{role}"
    if not HOSTNAME_RE.match(host.strip().lower()) or role not in SO_ROLES:
        return None
    return name if VM_NAME_RE.match(name) else None


def old_vm_name(name):
    """The name an earlier vmhost_engine gave the VM now named ``name`` (``<hostname>-<role>``
    for ``<hostname>_<role>``), or None when ``name`` is not of that form."""
    host, sep, role = name.rpartition("_")
    if not sep or role not in SO_ROLES or not HOSTNAME_RE.match(host):
        return None
    return f"{host}-{role}"


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


def map_entry(entry, config, source="<file>", index=0, hypervisor="", exec_bootstraps=None):
    """Maps one Security Onion VM entry onto a vmhostd VM spec.

    ``config`` is the result of :func:`parse_config` (``network``, ``boot``, ``bootstrap``,
    ``master``, ``performance``, ``performance_roles``, ``capture_interface`` and
    ``capture_roles`` are used); ``hypervisor`` (the file's prefix) goes into the bootstrap
    text and picks its ``capture_interface`` from a mapping.
    The rendered bootstrap is the spec's ``user_data``, except for a boot source with
    ``cloud_init: false``: then it goes into ``exec_bootstraps`` (a dict, ``{name: text}``)
    when given, to be run through vm.exec, and the spec has no ``user_data`` (no seed).
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
        spec.update(performance_for(config, role))
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
        spec["boot"] = {k: v for k, v in boot.items() if k != "cloud_init"}
        if nsm > 0 and "disk" not in hardware:
            # Security Onion's NSM volume: a raw, fully preallocated data disk, virtio-blk with
            # cache=none and io=native, the guest's disk right after the OS disk.
            spec["disks"] = [
                {"name": "nsm", "size_gib": nsm, "format": "raw", "preallocate": True, "cache": "none", "aio": "native"}
            ]
        spec["nics"] = [_ipv4(entry, config["network"])]
        source = capture_source(entry, config, role, hypervisor)
        if source is not None:
            # After the addressed NIC, so the guest's first NIC stays the one it is reached on.
            spec["nics"].append({"mode": "monitor", "source": source})
        if config.get("bootstrap"):
            text = render(
                config["bootstrap"],
                {
                    "vm_name": name,
                    "hypervisor": hypervisor,
                    "master": config["master"],
                    "hostname": host.strip().lower(),
                    "role": role,
                },
            )
            size = len(text.encode("utf-8"))
            if size > MAX_USER_DATA:
                raise _Bad("user_data", f"the rendered bootstrap is {size} bytes, above {MAX_USER_DATA}")
            if boot.get("cloud_init") is False:
                if exec_bootstraps is not None:
                    exec_bootstraps[name] = text
            else:
                spec["user_data"] = text
    except _Bad as exc:
        field, message = exc.args
        raise EntryError(source, index, field, message, name) from None
    return spec


def map_file(text, config, source="<file>", hypervisor="", raw=None, exec_bootstraps=None):
    """Maps a whole ``<hypervisor>VMs`` file.

    Returns ``(specs, errors, protected, complete)``: the specs of the good entries in file
    order, an :class:`EntryError` per bad entry, the VM names of bad entries whose name could
    still be derived (they must not be pruned), and whether every bad entry had such a name.
    A file that is not a JSON array raises :class:`EntryError` (index ``None``, field ``file``).
    ``raw``, when a dict, receives ``{name: entry}`` of the good entries, as in the file;
    ``exec_bootstraps``, when a dict, the bootstraps of the good entries to run through vm.exec
    (:func:`map_entry`).
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
            found = {}
            spec = map_entry(entry, config, source, index, hypervisor, found)
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
        if exec_bootstraps is not None:
            exec_bootstraps.update(found)
        if raw is not None:
            raw[spec["name"]] = entry
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


def content_digest(content, config, minion=None, shared=()):
    """sha256 over the file's bytes, the parts of the config that shape the specs or what is
    written (the bootstrap text included), the minion id the file resolved to and the other
    files resolving to the same minion (none normally, then left out)."""
    h = hashlib.sha256()
    h.update(content)
    h.update(b"\0")
    relevant = {k: config.get(k) for k in ("network", "boot", "prune", "dry_run", "bootstrap", "master", "so_compat")}
    # Only when set, so that the digests of configs without them stay as they were (no rerun of
    # every hypervisor after an upgrade).
    for key in ("performance", "performance_roles"):
        if config.get(key):
            relevant[key] = config[key]
    # The roles matter only with an interface to give them.
    if config.get("capture_interface"):
        relevant["capture_interface"] = config["capture_interface"]
        relevant["capture_roles"] = config.get("capture_roles")
    relevant["minion"] = minion
    if shared:
        relevant["shared"] = sorted(shared)
    h.update(json.dumps(relevant, sort_keys=True).encode())
    return h.hexdigest()


class TargetError(HypervisorFailure):
    """A file's hypervisor did not resolve to exactly one accepted minion id."""

    def __init__(self, message, matches):
        super().__init__(message)
        self.matches = matches


def accepted_minions(pki_dir):
    """The ids of the master's accepted minion keys: the file names in ``<pki_dir>/minions``."""
    return [n for n in os.listdir(os.path.join(pki_dir, "minions")) if not n.startswith(".")]


def resolve_minion(template, hypervisor, accepted):
    """The one accepted minion id ``template`` (``{hypervisor}`` filled in) names: a glob
    (``*``, ``?``, ``[``) matched with fnmatch, else an exact id. Raises :class:`TargetError`
    when none or several match."""
    pattern = render(template, {"hypervisor": hypervisor})
    keys = sorted(set(accepted))
    if not GLOB_CHARS & set(pattern):
        if pattern in keys:
            return pattern
        raise TargetError(f"minion_id {pattern!r}: no accepted minion key has that id", [])
    matches = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise TargetError(f"minion_id {pattern!r}: no accepted minion key matches", [])
    raise TargetError(
        f"minion_id {pattern!r} matches {len(matches)} accepted minions ({', '.join(matches[:20])}); "
        "it must name exactly one: narrow minion_id",
        matches[:64],
    )


def _utc_stamp(now):
    """Salt's event ``_stamp`` form (UTC, no offset), which SO's status files carry."""
    return datetime.fromtimestamp(now, timezone.utc).replace(tzinfo=None).isoformat()


def _parse_stamp(text):
    """Seconds since the epoch of an ISO 8601 timestamp (no offset = UTC, as Salt stamps), or
    None."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def open_dir_nofollow(path):
    """A descriptor of the directory ``path`` (absolute), opened one component at a time from
    ``/`` with O_NOFOLLOW: a symbolic link anywhere in the path is refused (ELOOP or ENOTDIR),
    not only in its last component, so nobody who can write a parent directory can swap in a
    link that makes the engine read or write elsewhere. ``.`` and ``..`` components are refused
    (EINVAL): each would name a directory the walk did not check."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for part in path.split("/"):
            if not part:
                continue
            if part in (".", ".."):
                raise OSError(errno.EINVAL, f"{path}: . and .. components are refused")
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_holds(dir_fd):
    """``{vm: {from, to, since}}`` of the holds file in the directory ``dir_fd`` (``vms_dir``):
    the VMs the vmhost runner is moving between hypervisors right now, which the engine leaves
    alone. No file: no holds. A file that is not a JSON object of objects raises OSError (the
    engine then skips the round rather than guess)."""
    try:
        fd = os.open(HOLDS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, f"{HOLDS_FILE} is not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    try:
        holds = json.loads(data) if data.strip() else {}
    except ValueError as exc:
        raise OSError(errno.EINVAL, f"{HOLDS_FILE} is not JSON: {exc}") from None
    if not isinstance(holds, dict) or not all(isinstance(v, dict) for v in holds.values()):
        raise OSError(errno.EINVAL, f"{HOLDS_FILE} must be a JSON object of VM name to hold")
    return holds


class SoFiles:
    """Security Onion's files of one hypervisor, in ``<vms_dir>/<hypervisor>/``: the tracking file
    ``<vm>``, ``<vm>.error`` and ``<vm>.status``. Everything goes through a descriptor of that
    directory opened with O_NOFOLLOW (a symlinked directory is refused), names are VM names
    the engine derived itself, every write is atomic (temp file in the same directory, fsync,
    rename, fsync of the directory) and never follows a link; the files it writes, and the
    directory when it made it, are given ``owner`` (uid, gid) when the engine runs as root. The
    directory is opened relative to ``base_fd``, the engine's one descriptor of ``vms_dir``."""

    def __init__(self, base_fd, base, hypervisor, owner=None, euid=os.geteuid):
        self.base_fd = base_fd
        self.name = hypervisor
        self.path = os.path.join(base, hypervisor)
        self.owner = owner
        self.euid = euid
        self.fd = None

    def __enter__(self):
        created = False
        try:
            os.mkdir(self.name, 0o755, dir_fd=self.base_fd)
            created = True
        except FileExistsError:
            pass
        try:
            self.fd = os.open(
                self.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.base_fd
            )
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise HypervisorFailure(
                    f"{self.path} is a symbolic link or not a directory: refused (Security Onion files "
                    "are written only into a real directory)"
                ) from None
            raise HypervisorFailure(f"cannot open {self.path}: {exc}") from None
        # Only a directory the engine just made is given away: chowning one that was there
        # would hand whatever it is (someone else's directory) to the files' owner.
        if created:
            try:
                self._chown(self.fd)
            except OSError as exc:
                log.error("vmhost_engine: cannot chown %s: %s", self.path, exc)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _chown(self, fd):
        if self.owner is None or self.euid() != 0:
            return
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != tuple(self.owner):
            os.fchown(fd, *self.owner)

    def exists(self, name):
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def read(self, name):
        """``(parsed JSON, stat)`` of a regular file, or ``(None, stat or None)``."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None, None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                return None, st
            data = f.read(MAX_FILE_BYTES + 1)
        try:
            return json.loads(data), st
        except ValueError:
            return None, st

    def write(self, name, obj, mode=0o644):
        """Replaces ``name`` with ``obj`` as JSON (indent 2), atomically and durably."""
        data = json.dumps(obj, indent=2).encode("utf-8")
        tmp = f".{name}.vmhost-tmp"
        try:
            os.unlink(tmp, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                self._chown(f.fileno())
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        os.fsync(self.fd)

    def remove(self, name):
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return
        os.fsync(self.fd)

    def names(self):
        return [n for n in os.listdir(self.fd) if not n.startswith(".")]

    # -- SO's formats --------------------------------------------------------------------------

    def track(self, vm, entry):
        """The tracking file ``<vm>``: ``{"config": entry}``; rewritten only when it differs."""
        obj = {"config": entry}
        current, _ = self.read(vm)
        if current != obj:
            self.write(vm, obj)

    def error(self, vm, entry, code, message, now, drop=True):
        """``<vm>.error``; ``drop`` leaves out SO_ERROR_DROPPED (a failed create)."""
        config = {k: v for k, v in entry.items() if not (drop and k in SO_ERROR_DROPPED)}
        obj = {
            "config": config,
            "status": "error",
            "timestamp": datetime.fromtimestamp(now).isoformat(),
            "error_details": {"code": code, "message": message},
        }
        self.write(f"{vm}.error", obj)

    def status(self, vm, status, now):
        self.write(f"{vm}.status", {"status": status, "timestamp": _utc_stamp(now)}, mode=0o600)

    def expire_destroyed(self, now):
        """Deletes ``*.status`` files saying ``Destroyed Instance`` whose timestamp (else mtime)
        is more than 48 hours old. Returns the VM names whose file went."""
        gone = []
        for fname in self.names():
            if not fname.endswith(".status"):
                continue
            obj, st = self.read(fname)
            if not isinstance(obj, dict) or obj.get("status") != SO_DESTROYED:
                continue
            when = _parse_stamp(obj.get("timestamp"))
            if when is None:
                when = st.st_mtime
            if now - when > SO_DESTROYED_KEEP:
                self.remove(fname)
                gone.append(fname[: -len(".status")])
        return gone


def _is_hardware_change(fields):
    return any(re.split(r"[.\[]", f, maxsplit=1)[0] in HARDWARE_FIELDS for f in fields or [])


def _so_error(error):
    """``(SO code, message, SO failure status or None)`` for a daemon error of one VM: the
    3xxx codes (the host lacks it, capacity, device conflicts, IOMMU group, host use) are SO's
    hardware validation failure (3), anything else a failed provisioning (4)."""
    code = _error_code(error)
    message = error.get("message") if isinstance(error, dict) else error
    message = str(message or "unknown error")[:1000]
    if isinstance(code, int) and 3000 <= code < 4000:
        data = error.get("data") if isinstance(error.get("data"), dict) else {}
        details = data.get("details") if isinstance(data.get("details"), dict) else {}
        field = data.get("field") if isinstance(data.get("field"), str) else ""
        full = code == 3002 and details.get("resource") == "disk_gib" and field.startswith("spec.disks")
        return SO_HARDWARE_CODE, f"Hardware validation failure: {message}", SO_DISK_FULL if full else SO_HARDWARE_FAILED
    prefix = f"vmhostd error {code}: " if code is not None else ""
    return SO_PROVISION_CODE, f"{prefix}{message}", None


class Engine:
    """One engine instance. ``client`` has LocalClient's ``cmd``, or is a factory making one
    (then every worker thread makes its own: a LocalClient is not shared between threads);
    ``fire(data, tag)`` puts an event on the master bus; ``cachedir`` is the engine's own
    directory (state file); ``accepted()`` lists the accepted minion ids; ``owner`` is the
    (uid, gid) of the Security Onion files; ``clock`` and ``euid`` are injectable for tests."""

    def __init__(self, config, client, fire, cachedir, clock=time.time, accepted=None, owner=None, euid=os.geteuid):
        self.config = config
        if hasattr(client, "cmd"):
            self.client, self._factory = client, None
        else:
            self.client, self._factory = None, client
        self._local = threading.local()
        self.fire_event = fire
        self.cachedir = cachedir
        self.clock = clock
        self.accepted = accepted or (lambda: [])
        self.owner = owner
        self.euid = euid
        # Guards self.state and the state file; the bus gets one event at a time.
        self.lock = threading.RLock()
        self.fire_lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.get("parallel", 8), thread_name_prefix="vmhost_engine"
        )
        self.inflight = {}
        self.state = self._load_state()
        # vms_dir, opened once (open_dir_nofollow) and used relative to from then on.
        self._vms_fd = None

    def vms_fd(self):
        """The engine's descriptor of ``vms_dir``, opened at the first pass that finds it (the
        directory may appear after the engine starts) and kept: every later read and write is
        relative to it, so a link swapped into the path later changes nothing. A directory
        that was removed (no links left) is opened again by path, with the same checks: a
        ``vms_dir`` deleted and made anew is followed, not listed as empty forever."""
        if self._vms_fd is not None and os.fstat(self._vms_fd).st_nlink == 0:
            os.close(self._vms_fd)
            self._vms_fd = None
        if self._vms_fd is None:
            self._vms_fd = open_dir_nofollow(self.config["vms_dir"])
        return self._vms_fd

    def holds(self):
        """The VM names the vmhost runner holds (:func:`read_holds` of ``vms_dir``)."""
        try:
            return read_holds(self.vms_fd())
        except OSError as exc:
            # Unreadable holds: hold nothing back would let a moving VM be made again on its
            # old hypervisor; refuse the run instead (retried).
            raise HypervisorFailure(f"cannot read {self.config['vms_dir']}/{HOLDS_FILE}: {exc}") from None

    def _client(self):
        if self._factory is None:
            return self.client
        if getattr(self._local, "client", None) is None:
            self._local.client = self._factory()
        return self._local.client

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
                done = rec.get("bootstrapped")
                rec["bootstrapped"] = sorted(
                    n for n in (done if isinstance(done, list) else []) if isinstance(n, str) and VM_NAME_RE.match(n)
                )
                out[hyp] = rec
        return out

    def _save_state(self):
        """Writes the state so that a crash or power loss leaves the old file or the new one,
        never a torn or empty one: a temp file written and fsynced, renamed over the state
        file, then the directory fsynced so the rename itself is on disk. The temp file is
        removed when any step fails (the old state stays). Callers hold ``self.lock``."""
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

    def _save(self):
        with self.lock:
            try:
                self._save_state()
            except OSError as exc:
                log.error("vmhost_engine: cannot write %s: %s", self._state_path(), exc)

    def _send(self, tag, data):
        try:
            with self.fire_lock:
                self.fire_event(data, tag)
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            log.error("vmhost_engine: cannot fire %s: %s", tag, exc)

    def _fire(self, hypervisor, vm, status, data):
        body = dict(data, hypervisor=hypervisor, vm=vm, status=status, source="vmhost_engine")
        self._send(build_tag(hypervisor, vm, status), body)

    # -- scanning -----------------------------------------------------------------------------

    def scan(self):
        """Definition files in ``vms_dir``: ``{hypervisor: path}``."""
        suffix = self.config["suffix"]
        try:
            names = os.listdir(self.vms_fd())
        except OSError as exc:
            log.error("vmhost_engine: cannot list %s: %s", self.config["vms_dir"], exc)
            return {}
        out = {}
        for fname in sorted(names):
            if not fname.endswith(suffix) or fname.startswith("."):
                continue
            hyp = fname[: -len(suffix)]
            if not hyp or tag_part(hyp) != hyp:
                log.warning("vmhost_engine: ignoring %s: not <hypervisor>%s", fname, suffix)
                continue
            out[hyp] = os.path.join(self.config["vms_dir"], fname)
        return out

    def _read(self, path):
        """Opens the file ``path`` of ``vms_dir`` by its name, relative to the engine's
        descriptor of ``vms_dir``, without following a symbolic link (O_NOFOLLOW; O_NONBLOCK so
        that a FIFO cannot stall the engine) and checks what was opened (fstat), not what a path
        named a moment before: a link swapped in cannot make the engine read another file."""
        try:
            fd = os.open(
                os.path.basename(path),
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=self.vms_fd(),
            )
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
        with self.lock:
            rec = self.state.get(hypervisor) or {}
            if rec.get("applied") != digest:
                if rec.get("attempted") != digest:
                    return True
                return now - rec.get("last_attempt", 0) >= self.config["retry"]
            return now - rec.get("last_success", 0) >= self.config["interval"]

    def resolve(self, hyp):
        """The accepted minion id of a file's hypervisor (``minion_id`` template)."""
        try:
            keys = list(self.accepted())
        except OSError as exc:
            raise TargetError(f"cannot list the accepted minion keys: {exc}", []) from None
        return resolve_minion(self.config["minion_id"], hyp, keys)

    def _resolve_all(self, files):
        """``{hypervisor: (minion or None, TargetError or None)}`` for every file, from one
        listing of the accepted keys."""
        try:
            keys = list(self.accepted())
        except OSError as exc:
            err = TargetError(f"cannot list the accepted minion keys: {exc}", [])
            return {hyp: (None, err) for hyp in files}
        out = {}
        for hyp in files:
            try:
                out[hyp] = (resolve_minion(self.config["minion_id"], hyp, keys), None)
            except TargetError as exc:
                out[hyp] = (None, exc)
        return out

    # -- passes -------------------------------------------------------------------------------

    def run_once(self, wait=True):
        """One pass over every definition file: each due hypervisor not already in flight is
        submitted to the worker pool (at most ``parallel`` at once). With ``wait`` the pass
        waits for every run in flight; without, it collects only the runs that have finished, so
        a minion that does not answer delays only its own hypervisor. Returns
        ``{hypervisor: outcome}`` with outcome ``skipped``, ``ok``, ``partial`` (some entries bad
        or failed), ``failed`` or ``running`` (still in flight)."""
        outcomes = {}
        self._collect(outcomes)
        files = self.scan()
        targets = self._resolve_all(files)
        # Two files driving one minion would undo each other's VMs (with prune all, destroy
        # them): neither is run while that lasts.
        by_minion = {}
        for hyp, (minion, _) in targets.items():
            if minion is not None:
                by_minion.setdefault(minion, []).append(files[hyp])
        for hyp, path in files.items():
            if hyp in self.inflight:
                outcomes[hyp] = "running"
                continue
            now = self.clock()
            minion = targets[hyp][0]
            shared = [p for p in by_minion.get(minion, []) if p != path] if minion is not None else []
            try:
                job = self._prepare(hyp, path, now, targets[hyp], shared)
            except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
                # One hypervisor's failure never stops the others.
                self._failed(getattr(exc, "minion", None) or hyp, hyp, path, now, exc)
                outcomes[hyp] = "failed"
                self._save()
                continue
            if job is None:
                outcomes[hyp] = "skipped"
                continue
            self.inflight[hyp] = self.pool.submit(self._run_job, *job)
        if wait:
            concurrent.futures.wait(list(self.inflight.values()))
        self._collect(outcomes)
        for hyp in self.inflight:
            outcomes[hyp] = "running"
        return outcomes

    def _collect(self, outcomes):
        for hyp, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[hyp]
                outcomes[hyp] = future.result()

    def close(self):
        """Waits for the runs in flight and stops the worker threads."""
        self.pool.shutdown(wait=True)
        if self._vms_fd is not None:
            os.close(self._vms_fd)
            self._vms_fd = None

    def _failed(self, tag_hyp, hyp, path, now, exc):
        log.error("vmhost_engine: %s: %s", hyp, exc)
        with self.lock:
            rec = self.state.setdefault(hyp, {"managed": []})
            rec["last_attempt"] = now
            rec["last_error"] = str(exc)[:2000]
        data = {"file": path, "error": str(exc)[:2000]}
        if isinstance(exc, TargetError):
            data["matches"] = exc.matches
        self._fire(tag_hyp, HYPERVISOR_TAG, "reconcile_failed", data)

    def _prepare(self, hyp, path, now, target=None, shared=()):
        """Reads and hashes a file, resolves its minion (or takes ``target``, ``(minion,
        TargetError)``); ``(hyp, path, content, digest, now, minion)`` when the hypervisor is
        due, else None. Raises when the file cannot be read or (once due) when its minion does
        not resolve or other files (``shared``, their paths) resolve to the same minion."""
        # Files are small: hash the content at every poll instead of trusting mtime, which
        # misses an edit within the file system's timestamp granularity.
        try:
            _, content = self._read(path)
        except OSError as exc:
            raise HypervisorFailure(f"cannot read {path}: {exc}") from None
        if target is None:
            try:
                target = self.resolve(hyp), None
            except TargetError as exc:
                target = None, exc
        minion, target_error = target
        digest = content_digest(content, self.config, minion, shared)
        if not self.due(hyp, digest, now):
            return None
        with self.lock:
            rec = self.state.setdefault(hyp, {"managed": []})
            rec["attempted"] = digest
            rec["last_attempt"] = now
        if target_error is not None:
            raise target_error
        if shared:
            exc = HypervisorFailure(
                f"{path} and {', '.join(sorted(shared))} resolve to the same minion {minion}: none of "
                "them is run (files driving one host would undo, or with prune all destroy, each "
                "other's VMs); make minion_id name one minion per file, or merge the files"
            )
            exc.minion = minion
            raise exc
        return hyp, path, content, digest, now, minion

    def _run_job(self, hyp, path, content, digest, now, minion):
        """A worker thread's run of one hypervisor; returns its outcome, never raises."""
        try:
            ok = self.reconcile(hyp, path, content, minion)
            with self.lock:
                rec = self.state.setdefault(hyp, {"managed": []})
                if ok:
                    rec["applied"] = digest
                    rec["last_success"] = now
                    rec.pop("last_error", None)
            outcome = "ok" if ok else "partial"
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            self._failed(minion, hyp, path, now, exc)
            outcome = "failed"
        self._save()
        return outcome

    # -- Security Onion's files and events ------------------------------------------------------

    def _so_event(self, hyp, vm, status):
        """SO's status event: tag ``soc/dyanno/hypervisor/<status lower-cased>`` (spaces kept,
        as SO's own emitter does), data exactly ``{vm_name, hypervisor, status}``."""
        self._send(SO_EVENT_PREFIX + status.lower(), {"vm_name": vm, "hypervisor": hyp, "status": status})

    def _so_do(self, what, fn, *args):
        """Runs one SO file operation; a failure is logged and reported as False."""
        try:
            fn(*args)
            return True
        except OSError as exc:
            log.error("vmhost_engine: %s: %s", what, exc)
            return False

    def _so_status(self, so, hyp, vm, status, now):
        ok = self._so_do(f"{so.path}/{vm}.status", so.status, vm, status, now)
        self._so_event(hyp, vm, status)
        return ok

    def _so_destroyed(self, so, hyp, vm, now):
        ok = self._so_do(f"{so.path}/{vm}", so.remove, vm)
        ok = self._so_do(f"{so.path}/{vm}.error", so.remove, f"{vm}.error") and ok
        return self._so_status(so, hyp, vm, SO_DESTROYED, now) and ok

    # -- one hypervisor -------------------------------------------------------------------------

    def reconcile(self, hyp, path, content, minion=None):
        """Maps the file and drives one hypervisor (``minion``, the file's prefix ``hyp`` by
        default). True when everything succeeded."""
        minion = minion or hyp
        with self.lock:
            managed = set((self.state.get(hyp) or {}).get("managed", []))
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise HypervisorFailure(f"{path}: not UTF-8") from None
        raw = {}
        bootstraps = {}
        try:
            specs, errors, protected, complete = map_file(text, self.config, path, hyp, raw, bootstraps)
        except EntryError as exc:
            self._fire(minion, HYPERVISOR_TAG, "invalid", {"file": path, "field": exc.field, "error": str(exc)})
            raise HypervisorFailure(str(exc)) from None
        for err in errors:
            log.error("vmhost_engine: %s", err)
            self._fire(
                minion,
                err.name or f"_entry{err.index}",
                "invalid",
                {
                    "file": path,
                    "index": err.index,
                    "field": err.field,
                    "error": str(err),
                },
            )
        dry = self.config["dry_run"]
        all_ok = not errors
        # Names of an earlier engine (<hostname>-<role>): such a VM is neither destroyed nor
        # doubled by its new name while it is managed; the operator migrates it by hand. A bad
        # entry's name (protected) holds its old-named VM too: the entry is not applied, and
        # its VM must not be pruned for that.
        held = {}
        for name in [s["name"] for s in specs] + sorted(protected):
            old = old_vm_name(name)
            if old and old in managed:
                held[name] = old
        # The largest request of this run (held specs are left out later, prune is a bool).
        size = len(json.dumps({"vms": specs, "prune": True, "dry_run": dry}).encode("utf-8"))
        if size > MAX_REQUEST_LINE - REQUEST_MARGIN:
            raise HypervisorFailure(
                f"{path}: the vmhost.reconcile request for {minion} would be {size} bytes, above the "
                f"{MAX_REQUEST_LINE - REQUEST_MARGIN} that fit vmhostd's {MAX_REQUEST_LINE}-byte request line "
                f"({len(specs)} VMs; a long bootstrap text counts once per VM): nothing is applied on "
                "this hypervisor; shorten the bootstrap text or split its VMs"
            )
        # VMs the vmhost runner is moving between hypervisors (HOLDS_FILE): neither created,
        # changed nor pruned until the runner has moved their entry to the destination's file
        # and lifted the hold. The run is not "applied", so it is retried once the hold goes.
        moving = sorted(set(self.holds()) & ({s["name"] for s in specs} | protected | managed))
        if moving:
            all_ok = False
            specs = [s for s in specs if s["name"] not in moving]
            log.info("vmhost_engine: %s: %s left alone: the vmhost runner is moving them", minion, ", ".join(moving))
        send_prune = not moving and self._prune_all(minion, specs, complete, errors, held)
        if held:
            all_ok = False
            specs = [s for s in specs if s["name"] not in held]
            for new, old in sorted(held.items()):
                log.warning("vmhost_engine: %s: VM %s is not renamed to %s: %s", minion, old, new, MIGRATE_HINT)
                self._fire(minion, old, "migration_needed", {"file": path, "vm_name": new, "hint": MIGRATE_HINT})
        held_names = set(held) | set(held.values()) | set(moving)
        so = None
        if self.config.get("so_compat") and not dry:
            so = SoFiles(self.vms_fd(), self.config["vms_dir"], hyp, self.owner, self.euid).__enter__()
        try:
            return self._reconcile(
                hyp,
                minion,
                path,
                specs,
                errors,
                protected,
                complete,
                managed,
                raw,
                so,
                all_ok,
                held_names,
                send_prune,
                {n: t for n, t in bootstraps.items() if n not in held and n not in moving},
            )
        finally:
            if so is not None:
                so.__exit__(None, None, None)

    def _prune_all(self, minion, specs, complete, errors, held):
        """Whether to send ``prune: true`` (``prune: all``): only with no bad entry and nothing
        held. The daemon then destroys every VM not in the request, so an old-form VM
        (``<hostname>-<role>``) of a name in the file would go with its disk even when the
        engine does not manage it: a dry run (``prune: true``) first lists the host's VMs, and
        each such VM found is added to ``held`` (then ``prune: false`` is sent)."""
        if self.config["prune"] != "all" or not complete or errors or held:
            return False
        olds = {old_vm_name(s["name"]): s["name"] for s in specs if old_vm_name(s["name"])}
        if not olds:
            return True
        plan, _ = check_reconcile_return(
            self._call(minion, "vmhost.reconcile", {"vms": specs, "prune": True, "dry_run": True})
        )
        for item in plan:
            if item["vm"] in olds:
                held[olds[item["vm"]]] = item["vm"]
        return not held

    def _reconcile(
        self,
        hyp,
        minion,
        path,
        specs,
        errors,
        protected,
        complete,
        managed,
        raw,
        so,
        all_ok,
        held,
        send_prune,
        bootstraps=None,
    ):
        prune = self.config["prune"]
        dry = self.config["dry_run"]
        now = self.clock()
        processing = set()
        if so is not None:
            # SO's order: a new VM is announced (Processing), its tracking file written before
            # it is provisioned. A VM that exists keeps its tracking file (what it runs) until
            # its change succeeded (_so_result).
            for spec in specs:
                name = spec["name"]
                if name not in managed and not so.exists(name):
                    processing.add(name)
                    if not self._so_do(f"{so.path}/{name}", so.track, name, raw[name]):
                        all_ok = False
            for name in sorted(processing):
                all_ok = self._so_status(so, hyp, name, SO_PROCESSING, now) and all_ok
        # Never with replace: an edited entry is changed in place (its disk kept), and an entry
        # whose boot image changed gets the daemon's 2002 and is left alone (see REPLACE_HINT).
        # replace is left out rather than sent as false: the daemon's default, and a minion with
        # an older execution module still accepts the call.
        ret = self._call(
            minion,
            "vmhost.reconcile",
            {
                "vms": specs,
                "prune": send_prune,
                "dry_run": dry,
            },
        )
        plan, results = check_reconcile_return(ret)
        desired = {s["name"] for s in specs}
        all_ok = all_ok and bool(ret.get("ok", False))
        planned = {p["vm"]: p for p in plan}
        for res in results:
            name = res["vm"]
            if name not in desired and res["action"] != "destroy":
                continue
            if so is not None:
                all_ok = self._so_result(so, hyp, res, planned.get(name, {}), raw, processing, now) and all_ok
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
                log.warning("vmhost_engine: %s: VM %s not replaced: %s", minion, name, REPLACE_HINT)
            self._fire(minion, name, status, data)
        if not results and dry:
            for item in plan:
                if item["vm"] in desired and item.get("error"):
                    all_ok = False
        on_host_extra = {p["vm"] for p in plan if p["vm"] not in desired}
        destroyed = {r["vm"] for r in results if r["action"] == "destroy" and r["ok"]}
        if prune == "managed":
            # held: old names (<hostname>-<role>) of VMs whose new name is in the file, and
            # those new names (not created, and never destroyed while held).
            doomed = sorted((managed & on_host_extra) - protected - held)
            if doomed and not complete:
                log.error(
                    "vmhost_engine: %s: not pruning %s: a bad entry in %s has no usable name",
                    minion,
                    ", ".join(doomed),
                    path,
                )
                all_ok = False
                doomed = []
            for name in doomed:
                if dry:
                    self._fire(
                        minion, name, "reconciled", {"action": "destroy", "ok": True, "changed": False, "dry_run": True}
                    )
                    continue
                try:
                    self._call(minion, "vmhost.destroy", {"name": name})
                except HypervisorFailure as exc:
                    if "vmhostd error 4040" in str(exc):
                        # Gone already (destroyed by hand meanwhile): what we wanted.
                        destroyed.add(name)
                        if so is not None:
                            all_ok = self._so_destroyed(so, hyp, name, now) and all_ok
                        continue
                    all_ok = False
                    self._fire(
                        minion,
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
                if so is not None:
                    all_ok = self._so_destroyed(so, hyp, name, now) and all_ok
                self._fire(
                    minion,
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
            all_ok = self._bootstrap(hyp, minion, bootstraps or {}, specs, results) and all_ok
            # A VM stays managed until it is seen gone; bad entries keep their VMs managed.
            keep = (managed & (on_host_extra | protected)) - destroyed
            with self.lock:
                rec = self.state.setdefault(hyp, {"managed": []})
                rec["managed"] = sorted(desired | keep)
                # A VM that is gone has its bootstrap run again if it comes back (a new disk).
                rec["bootstrapped"] = sorted(set(rec.get("bootstrapped", [])) & set(rec["managed"]))
        if so is not None:
            all_ok = self._so_tidy(so, desired | protected | on_host_extra, complete, now) and all_ok
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
        self._fire(minion, HYPERVISOR_TAG, "reconciled" if all_ok else "reconcile_failed", summary)
        log.info("vmhost_engine: %s: %s", minion, summary)
        return all_ok

    def _bootstrap(self, hyp, minion, bootstraps, specs, results):
        """Runs the bootstrap of each VM without cloud-init (boot ``cloud_init: false``) that is
        running and has not had it: written to BOOTSTRAP_PATH (``vmhost.guest_file_push``, mode
        0700) and run (``vmhost.guest_exec``, ``bootstrap_timeout``) on its hypervisor minion.
        Once per VM, as cloud-init runs user-data once per instance: the VMs that ran it are
        recorded in the engine's state (a new VM, from a create, runs it again). A VM whose guest
        cannot be reached yet (5001: still booting) is told ``bootstrap_waiting``, one whose
        bootstrap failed ``bootstrap_failed``; both are tried again at the next run (the run is
        partial, so it comes after ``retry`` seconds). Returns False when any is left to do."""
        if not bootstraps:
            return True
        with self.lock:
            done = set((self.state.get(hyp) or {}).get("bootstrapped", []))
        outcome = {r["vm"]: r for r in results}
        running = {s["name"] for s in specs if s.get("state") == "running"}
        ok = True
        for name in sorted(bootstraps):
            res = outcome.get(name)
            if res is None or not res["ok"] or name not in running:
                continue
            if res["action"] == "create" and res.get("changed"):
                done.discard(name)
            if name in done:
                continue
            try:
                self._call(
                    minion,
                    "vmhost.guest_file_push",
                    {"name": name, "path": BOOTSTRAP_PATH, "content": bootstraps[name], "mode": "0700", "mkdir": True},
                )
                ret = self._call(
                    minion,
                    "vmhost.guest_exec",
                    {"name": name, "argv": [BOOTSTRAP_PATH], "timeout_s": self.config["bootstrap_timeout"]},
                )
                if not isinstance(ret, dict) or ret.get("exit_code") != 0 or ret.get("timed_out"):
                    raise HypervisorFailure(f"{BOOTSTRAP_PATH} ended {_exec_outcome(ret)}")
            except HypervisorFailure as exc:
                ok = False
                waiting = f"vmhostd error {EXEC_UNREACHABLE}" in str(exc)
                status = "bootstrap_waiting" if waiting else "bootstrap_failed"
                (log.info if waiting else log.error)("vmhost_engine: %s: %s: %s: %s", minion, name, status, exc)
                self._fire(minion, name, status, {"error": str(exc)[:1000], "path": BOOTSTRAP_PATH})
                continue
            done.add(name)
            self._fire(
                minion,
                name,
                "bootstrapped",
                {"path": BOOTSTRAP_PATH, "exit_code": 0, "duration_ms": ret.get("duration_ms")},
            )
        with self.lock:
            rec = self.state.setdefault(hyp, {"managed": []})
            rec["bootstrapped"] = sorted(done)
        return ok

    def _so_result(self, so, hyp, res, plan_item, raw, processing, now):
        """SO's files and events for one VM's reconcile result. False when a file could not be
        written."""
        name, action = res["vm"], res["action"]
        if action == "destroy":
            return self._so_destroyed(so, hyp, name, now) if res["ok"] else True
        ok = True
        if res["ok"]:
            ok = self._so_do(f"{so.path}/{name}", so.track, name, raw[name])
            ok = self._so_do(f"{so.path}/{name}.error", so.remove, f"{name}.error") and ok
            if (action == "create" and res.get("changed")) or name in processing:
                ok = self._so_status(so, hyp, name, SO_CREATED, now) and ok
            elif action == "reconfigure" and res.get("changed") and _is_hardware_change(plan_item.get("fields")):
                ok = self._so_status(so, hyp, name, SO_HARDWARE, now) and ok
            return ok
        code, message, failure = _so_error(res.get("error"))
        # SO drops cpu, memory, sfp and copper from a failed create's .error (nothing claims
        # resources); a VM that exists still runs with its old hardware, which its tracking
        # file (left as it was) claims, so its .error keeps the whole entry that failed.
        ok = self._so_do(
            f"{so.path}/{name}.error",
            so.error,
            name,
            raw.get(name) or {},
            code,
            message,
            now,
            action == "create",
        )
        if action == "create":
            # Nothing was made: like SO after a failed provisioning, no tracking file stays.
            ok = self._so_do(f"{so.path}/{name}", so.remove, name) and ok
        if failure is not None:
            ok = self._so_status(so, hyp, name, failure, now) and ok
        return ok

    def _so_tidy(self, so, known, complete, now):
        """As SO does: the ``.error`` and ``.status`` of a VM that failed, never existed and is no
        longer in the file go; ``Destroyed Instance`` status files expire after 48 hours."""
        ok = True
        try:
            names = set(so.names())
        except OSError as exc:
            log.error("vmhost_engine: cannot list %s: %s", so.path, exc)
            return False
        if complete:
            for fname in sorted(names):
                if not fname.endswith(".error"):
                    continue
                vm = fname[: -len(".error")]
                if vm in known or vm in names:
                    continue
                ok = self._so_do(f"{so.path}/{fname}", so.remove, fname) and ok
                ok = self._so_do(f"{so.path}/{vm}.status", so.remove, f"{vm}.status") and ok
        return self._so_do(f"{so.path} (expiry)", so.expire_destroyed, now) and ok

    def _call(self, hyp, fun, kwarg):
        try:
            ret = self._client().cmd(
                [hyp],
                fun,
                kwarg=kwarg,
                tgt_type="list",
                timeout=self.config["timeout"],
                full_return=True,
            )
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            raise HypervisorFailure(f"{fun} on {hyp} could not be published: {exc}") from None
        answer = ret.get(hyp) if isinstance(ret, dict) else None
        if _no_answer(answer):
            raise HypervisorFailure(
                f"minion {hyp} did not answer {fun} within {self.config['timeout']} s "
                "(down, key not accepted, or no such minion)"
            )
        retcode, body = answer.get("retcode", 0), answer["ret"]
        if retcode not in (0, None) or (isinstance(body, str) and body.startswith("ERROR")):
            raise HypervisorFailure(f"{fun} failed on {hyp}: {str(body)[:1000]}")
        return body


def _exec_outcome(ret):
    """How a vm.exec answer says its command ended, for a message (the guest's stderr is cut)."""
    if not isinstance(ret, dict):
        return f"with an answer that is not vm.exec's: {str(ret)[:200]}"
    if ret.get("timed_out"):
        return "killed at its timeout"
    if ret.get("signal") is not None:
        return f"by signal {ret.get('signal')}"
    return f"with exit code {ret.get('exit_code')}: {str(ret.get('stderr', ''))[:500]}"


def _no_answer(answer):
    """Whether a minion's entry in ``LocalClient.cmd(..., full_return=True)`` means it did not
    answer. Salt 3007's forms: the id absent (nothing published, or no such minion), ``False``
    (the id was targeted but returned nothing within the timeout: ``cmd`` fills those in),
    ``{"out": "no_return", "ret": "Minion did not return. [No response]...", "retcode": 1}`` or
    ``[Not connected]`` (``get_cli_event_returns`` for a minion reported missing), and, to be
    safe, any other entry that is not a dict with ``ret`` (``{"failed": True}``, None)."""
    if not isinstance(answer, dict) or "ret" not in answer or answer.get("failed") is True:
        return True
    if answer.get("out") == "no_return":
        return True
    body = answer["ret"]
    return isinstance(body, str) and body.startswith("Minion did not return")


def _default_master(opts):
    """The address guests use to reach the master when the config has no ``master``: the
    master host's fully qualified name."""
    import socket  # pylint: disable=import-outside-toplevel

    return socket.getfqdn() or opts.get("id")


def start(**kwargs):
    """Engine entry point (salt calls it in its own process on the master)."""
    import salt.client  # pylint: disable=import-outside-toplevel
    import salt.utils.event  # pylint: disable=import-outside-toplevel

    opts = __opts__  # noqa: F821  pylint: disable=undefined-variable
    try:
        config = parse_config(kwargs, default_master=_default_master(opts))
        owner = file_owner_ids(config) if config["so_compat"] else None
    except ConfigError as exc:
        # Returning would make salt's process manager restart the engine at once, forever:
        # stay idle instead and repeat the complaint now and then.
        while True:
            log.error("vmhost_engine: bad configuration, engine idle until fixed: %s", exc)
            time.sleep(3600)
    cachedir = os.path.join(opts["cachedir"], "vmhost_engine")
    bus = salt.utils.event.get_master_event(opts, opts["sock_dir"], listen=False)
    engine = Engine(
        config,
        lambda: salt.client.LocalClient(mopts=opts),
        bus.fire_event,
        cachedir,
        accepted=lambda: accepted_minions(opts["pki_dir"]),
        owner=owner,
    )
    log.info(
        "vmhost_engine: watching %s every %s s, %s hypervisors at once",
        config["vms_dir"],
        config["poll"],
        config["parallel"],
    )
    while True:
        try:
            for hyp, outcome in engine.run_once(wait=False).items():
                if outcome not in ("skipped", "running"):
                    log.debug("vmhost_engine: %s: %s", hyp, outcome)
        except Exception:  # pylint: disable=broad-except
            log.exception("vmhost_engine: pass failed")
        time.sleep(config["poll"])
