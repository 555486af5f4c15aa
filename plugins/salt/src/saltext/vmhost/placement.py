"""
Placement of VMs across vmhostds: which host a spec goes to, and where every VM of a host goes
when the host is emptied.

Why it exists: the ``vmhost`` runner (``vmhost.place``, ``vmhost.migrate``,
``vmhost.evacuate``) must choose hosts, and that choice must be reviewable and testable
without a fleet. So it is a pure function of what the minions answered (each host's
``host.info``, ``vm.list`` and ``image.list``): no I/O, no Salt, no clock. Each vmhostd still
admits or refuses what it is sent; a plan is the runner's best reading of the fleet, not a
reservation.

Order of use: :func:`host_view` turns one minion's answers into a host; :func:`demand` reads
what a spec needs; :func:`misfits` says why a spec does not fit a host (empty: it fits);
:func:`place` ranks the hosts a spec fits; :func:`movability` says how a VM can leave its host
(live, cold, or not at all); :func:`evacuate_plan` places every VM of a host on the others,
one after another, each placement taking its share of the destination for the next ones;
:func:`migration_spec` is the spec a destination is sent (the source's MACs pinned).

Rules (docs/salt.md, "Runner"):

- capacity: CPUs and memory from ``host.info``'s ``available``; disk from ``storage`` as
  vmhostd admits it (the disks' full size within ``free_bytes`` times ``overcommit``, the
  preallocated part within 90 % of ``free_bytes``); dedicated CPUs from ``cpus.shared_pool``;
  hugepages from the NUMA nodes' free pages;
- what the spec names must be there: its bridge NICs' networks (ready; ``vlan_filtering`` for
  a NIC with VLANs), its monitor NICs' capture interfaces (present), its ``boot.image``, its
  passthrough devices (the same hardware class and index, present and held by nobody; a raw
  ``pci`` address only when the destination's model lists it free);
- nothing it would collide with: a VM of that name, kept data disks of that name, a NIC with
  its MAC or static address on that network;
- anti-affinity: never two VMs with the same value of the ``anti_affinity`` spec member
  (default ``role``) on one host while another host has room; among equals the host with the
  most free memory wins, then the name.
"""

import copy
import math

GIB = 1024**3
# vmhostd keeps 10 % of the free space out of reach of preallocated disks (docs/storage.md).
PREALLOC_SHARE = 0.9
HARDWARE_CLASSES = ("disk", "copper", "sfp")
HUGEPAGE_MIB = {"2M": 2, "1G": 1024}


class PlacementError(ValueError):
    """A spec or a host's answer that placement cannot read."""


# ---------------------------------------------------------------------------------------------
# Reading the minions' answers
# ---------------------------------------------------------------------------------------------


def _int(value, default=0):
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _cpulist(text):
    """The CPUs of a Linux cpulist (``"0-3,8"``); an empty set for anything else."""
    out = set()
    if not isinstance(text, str):
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            return set()
        out.update(range(first, last + 1))
    return out


def host_view(name, info, vms, images=None):
    """One host as placement sees it, from its minion's ``vmhost.info`` (``info``),
    ``vmhost.list`` (``vms``) and ``vmhost.image_list`` (``images``; None when unknown: then
    images are not checked). Raises :class:`PlacementError` when ``info`` is not host.info's
    shape."""
    if not isinstance(info, dict) or not all(isinstance(info.get(k), dict) for k in ("cpu", "memory_mib")):
        raise PlacementError(f"{name}: host.info answer without cpu and memory_mib")
    if not isinstance(vms, list):
        raise PlacementError(f"{name}: vm.list answer is not a list")
    storage = info.get("storage") if isinstance(info.get("storage"), dict) else {}
    hardware = {}
    for item in info.get("hardware") or []:
        if isinstance(item, dict) and item.get("class") in HARDWARE_CLASSES and isinstance(item.get("index"), int):
            hardware[(item["class"], item["index"])] = {
                "pci": item.get("pci"),
                "holder": item.get("holder"),
                "present": item.get("present") is True,
            }
    networks = {}
    for net in info.get("networks") or []:
        if isinstance(net, dict) and isinstance(net.get("name"), str):
            nics = [n for n in net.get("nics") or [] if isinstance(n, dict)]
            networks[net["name"]] = {
                "ready": net.get("ready") is not False,
                "vlan_filtering": net.get("vlan_filtering") is True,
                "macs": {str(n.get("mac", "")).lower() for n in nics if n.get("mac")},
                "addresses": {str(n["address"]).split("/")[0] for n in nics if n.get("address")},
            }
    capture = {
        c["interface"]: c.get("present") is True
        for c in info.get("capture") or []
        if isinstance(c, dict) and isinstance(c.get("interface"), str)
    }
    cpus = info.get("cpus") if isinstance(info.get("cpus"), dict) else {}
    hugepages = {}
    for node in info.get("numa") or []:
        pools = node.get("hugepages") if isinstance(node, dict) else None
        for size, pool in (pools or {}).items():
            if isinstance(pool, dict):
                hugepages[size] = hugepages.get(size, 0) + _int(pool.get("free"))
    vm_list = []
    for view in vms:
        if isinstance(view, dict) and isinstance(view.get("name"), str):
            vm_list.append(view)
    image_names = None
    if images is not None:
        image_names = {i["name"] for i in images if isinstance(i, dict) and isinstance(i.get("name"), str)}
    return {
        "name": name,
        "cpu_free": _int(info["cpu"].get("available")),
        "memory_free": _int(info["memory_mib"].get("available")),
        "disk_free": _int(storage.get("free_bytes")),
        "overcommit": float(storage.get("overcommit") or 1.0),
        "disk_added": 0,
        "prealloc_added": 0,
        "hardware": hardware,
        "networks": networks,
        "capture": capture,
        "dedicated_free": len(_cpulist(cpus.get("shared_pool"))) if cpus.get("vm_cpus") is not None else None,
        "hugepages_free": hugepages,
        "images": image_names,
        "kept": {k.get("vm") for k in info.get("kept_disks") or [] if isinstance(k, dict)},
        "vms": vm_list,
    }


def _spec(spec):
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise PlacementError("a spec must be a dict with a name (a VM spec, see docs/api.md)")
    return spec


def demand(spec):
    """What ``spec`` takes from a host: ``{cpu, memory_mib, disk_bytes, prealloc_bytes,
    dedicated, hugepages, networks, vlans, capture, image, hardware, pci, macs, addresses}``."""
    spec = _spec(spec)
    boot = spec.get("boot") if isinstance(spec.get("boot"), dict) else {}
    disk = _int(boot.get("disk_gib")) * GIB
    prealloc = 0
    for d in spec.get("disks") or []:
        if isinstance(d, dict):
            size = _int(d.get("size_gib")) * GIB
            disk += size
            if d.get("preallocate") is True:
                prealloc += size
    networks, vlans, capture, macs, addresses = [], [], [], [], []
    for nic in spec.get("nics") or []:
        if not isinstance(nic, dict):
            continue
        if nic.get("mode") == "monitor":
            if isinstance(nic.get("source"), str):
                capture.append(nic["source"])
            continue
        net = nic.get("network")
        if isinstance(net, str):
            networks.append(net)
            if nic.get("vlan") is not None or nic.get("vlans") or nic.get("trunk"):
                vlans.append(net)
            if isinstance(nic.get("mac"), str):
                macs.append((net, nic["mac"].lower()))
            ipv4 = nic.get("ipv4") if isinstance(nic.get("ipv4"), dict) else {}
            if ipv4.get("mode", "static") == "static" and isinstance(ipv4.get("address"), str):
                addresses.append((net, ipv4["address"].split("/")[0]))
    hardware = []
    for cls in HARDWARE_CLASSES:
        for index in (spec.get("hardware") or {}).get(cls) or []:
            hardware.append((cls, index))
    cpu = _int(spec.get("cpu"))
    dedicated = 0
    if spec.get("cpu_policy") == "dedicated":
        dedicated = cpu + (1 if spec.get("emulator_cpu") is True else 0)
    hugepages = None
    size = spec.get("hugepages")
    if size in HUGEPAGE_MIB:
        hugepages = (size, math.ceil(_int(spec.get("memory_mib")) / HUGEPAGE_MIB[size]))
    return {
        "cpu": cpu,
        "memory_mib": _int(spec.get("memory_mib")),
        "disk_bytes": disk,
        "prealloc_bytes": prealloc,
        "dedicated": dedicated,
        "hugepages": hugepages,
        "networks": networks,
        "vlans": vlans,
        "capture": capture,
        "image": boot.get("image") if isinstance(boot.get("image"), str) else None,
        "hardware": hardware,
        "pci": [p for p in spec.get("pci") or [] if isinstance(p, str)],
        "macs": macs,
        "addresses": addresses,
    }


def passthrough(spec):
    """Whether the spec passes devices through (``hardware`` or ``pci``): such a VM cannot move
    live."""
    hw = spec.get("hardware") or {}
    return bool(spec.get("pci")) or any(hw.get(cls) for cls in HARDWARE_CLASSES)


def _pci_norm(text):
    text = text.strip().lower()
    if text.startswith("pci_"):
        parts = text[4:].split("_")
        if len(parts) == 4:
            return f"{parts[0]}:{parts[1]}:{parts[2]}.{parts[3]}"
    if text.count(":") == 1:
        return "0000:" + text
    return text


def misfits(spec, host):
    """Why ``spec`` cannot go to ``host`` (a :func:`host_view`): a list of reasons, empty when
    it fits."""
    need = demand(spec)
    name = spec["name"]
    out = []
    if any(v.get("name") == name for v in host["vms"]):
        out.append(f"a VM named {name} exists there")
    if name in host["kept"]:
        out.append(f"kept data disks of a VM named {name} are there (never overwritten)")
    if need["cpu"] > host["cpu_free"]:
        out.append(f"cpu: {need['cpu']} needed, {host['cpu_free']} free")
    if need["memory_mib"] > host["memory_free"]:
        out.append(f"memory: {need['memory_mib']} MiB needed, {host['memory_free']} MiB free")
    free = host["disk_free"]
    if need["disk_bytes"] and need["disk_bytes"] + host["disk_added"] > free * host["overcommit"]:
        room = max(free * host["overcommit"] - host["disk_added"], 0) / GIB
        out.append(
            f"disk: {need['disk_bytes'] / GIB:.0f} GiB needed, {room:.1f} GiB free (overcommit {host['overcommit']:g})"
        )
    elif need["prealloc_bytes"] and need["prealloc_bytes"] + host["prealloc_added"] > free * PREALLOC_SHARE:
        out.append(
            f"disk: {need['prealloc_bytes'] / GIB:.0f} GiB preallocated needed, "
            f"{max(free * PREALLOC_SHARE - host['prealloc_added'], 0) / GIB:.1f} GiB allowed (90 % of the free space)"
        )
    if need["dedicated"]:
        have = host["dedicated_free"]
        if have is None:
            out.append("cpu_policy dedicated: the host has no [hardware] vm_cpus")
        elif need["dedicated"] > have:
            out.append(f"dedicated CPUs: {need['dedicated']} needed, {have} free")
    if need["hugepages"]:
        size, pages = need["hugepages"]
        have = host["hugepages_free"].get(size, 0)
        if pages > have:
            out.append(f"hugepages {size}: {pages} needed, {have} free")
    for net in sorted(set(need["networks"])):
        info = host["networks"].get(net)
        if info is None:
            out.append(f"network {net}: not configured there")
        elif not info["ready"]:
            out.append(f"network {net}: not ready there")
        elif net in need["vlans"] and not info["vlan_filtering"]:
            out.append(f"network {net}: no vlan_filtering there (the VM's NIC has VLANs)")
    for net, mac in need["macs"]:
        if mac in host["networks"].get(net, {}).get("macs", ()):
            out.append(f"network {net}: MAC {mac} is taken there")
    for net, address in need["addresses"]:
        if address in host["networks"].get(net, {}).get("addresses", ()):
            out.append(f"network {net}: address {address} is taken there")
    for source in sorted(set(need["capture"])):
        if source not in host["capture"]:
            out.append(f"capture interface {source}: not in [capture] interfaces there")
        elif not host["capture"][source]:
            out.append(f"capture interface {source}: absent there")
    if need["image"] is not None and host["images"] is not None and need["image"] not in host["images"]:
        out.append(f"image {need['image']}: not there (vmhost.image_import it first)")
    for cls, index in need["hardware"]:
        dev = host["hardware"].get((cls, index))
        if dev is None:
            out.append(f"hardware {cls} {index}: not in the hardware model there")
        elif not dev["present"]:
            out.append(f"hardware {cls} {index}: not present there")
        elif dev["holder"] not in (None, name):
            out.append(f"hardware {cls} {index}: held by {dev['holder']} there")
    by_pci = {str(d["pci"]).lower(): d for d in host["hardware"].values() if d.get("pci")}
    for address in need["pci"]:
        dev = by_pci.get(_pci_norm(address))
        if dev is None:
            out.append(f"pci {address}: not in the hardware model there (a raw address cannot be checked)")
        elif not dev["present"]:
            out.append(f"pci {address}: not present there")
        elif dev["holder"] not in (None, name):
            out.append(f"pci {address}: held by {dev['holder']} there")
    return out


def _key(spec, anti_affinity):
    if not anti_affinity:
        return None
    value = spec.get(anti_affinity) if isinstance(spec, dict) else None
    return value if isinstance(value, (str, int)) and value != "" else None


def _sharing(host, key, anti_affinity, name):
    """VMs on ``host`` (other than ``name``) with the anti-affinity ``key``."""
    if key is None:
        return []
    return sorted(
        v["name"] for v in host["vms"] if v.get("name") != name and _key(v.get("spec") or {}, anti_affinity) == key
    )


def place(spec, hosts, anti_affinity="role", exclude=()):
    """The host for ``spec`` among ``hosts`` (a list of :func:`host_view`), leaving out the
    names in ``exclude``. Returns ``{host, key, sharing, ranking, refused}``: ``host`` the
    chosen name or None when no host fits, ``key`` the spec's anti-affinity value, ``sharing``
    the VMs with that key on the chosen host (empty unless every host that fits has one),
    ``ranking`` every host that fits in order of preference (``{host, sharing,
    memory_free}``), ``refused`` ``{host: [reasons]}`` for those that do not."""
    spec = _spec(spec)
    key = _key(spec, anti_affinity)
    ranking, refused = [], {}
    for host in hosts:
        if host["name"] in exclude:
            continue
        reasons = misfits(spec, host)
        if reasons:
            refused[host["name"]] = reasons
            continue
        sharing = _sharing(host, key, anti_affinity, spec["name"])
        ranking.append({"host": host["name"], "sharing": sharing, "memory_free": host["memory_free"]})
    ranking.sort(key=lambda r: (bool(r["sharing"]), -r["memory_free"], r["host"]))
    best = ranking[0] if ranking else None
    return {
        "host": best["host"] if best else None,
        "key": key,
        "sharing": best["sharing"] if best else [],
        "ranking": ranking,
        "refused": refused,
    }


def take(host, spec, view=None):
    """Books ``spec`` on ``host`` (in place): its resources taken, its devices held, the VM
    listed (``view``, else a stopped view of the spec). Used between the steps of a plan."""
    need = demand(spec)
    host["cpu_free"] -= need["cpu"]
    host["memory_free"] -= need["memory_mib"]
    host["disk_added"] += need["disk_bytes"]
    host["prealloc_added"] += need["prealloc_bytes"]
    if need["dedicated"] and host["dedicated_free"] is not None:
        host["dedicated_free"] -= need["dedicated"]
    if need["hugepages"]:
        size, pages = need["hugepages"]
        host["hugepages_free"][size] = host["hugepages_free"].get(size, 0) - pages
    for cls_index in need["hardware"]:
        if cls_index in host["hardware"]:
            host["hardware"][cls_index]["holder"] = spec["name"]
    by_pci = {str(d["pci"]).lower(): d for d in host["hardware"].values() if d.get("pci")}
    for address in need["pci"]:
        if _pci_norm(address) in by_pci:
            by_pci[_pci_norm(address)]["holder"] = spec["name"]
    for net, mac in need["macs"]:
        if net in host["networks"]:
            host["networks"][net]["macs"].add(mac)
    for net, address in need["addresses"]:
        if net in host["networks"]:
            host["networks"][net]["addresses"].add(address)
    host["vms"].append(view if view is not None else {"name": spec["name"], "spec": spec, "status": "stopped"})


# ---------------------------------------------------------------------------------------------
# Moving VMs
# ---------------------------------------------------------------------------------------------


def movability(view):
    """How the VM of ``view`` (a VM view) can leave its host: ``{mode, stop}`` with mode
    ``live`` (running, no passthrough), ``cold`` (stopped: ``stop`` False; running with
    passthrough: ``stop`` True, it is stopped, moved and started again), or ``{mode: None,
    reason}`` when it cannot move now."""
    spec = view.get("spec") if isinstance(view.get("spec"), dict) else {}
    status = view.get("status")
    if status == "running":
        if view.get("pending_restart"):
            return {"mode": None, "reason": "pending_restart: a change waits for a restart (apply or restart it first)"}
        if passthrough(spec):
            return {"mode": "cold", "stop": True}
        return {"mode": "live", "stop": False}
    if status == "stopped":
        return {"mode": "cold", "stop": False}
    return {"mode": None, "reason": f"status {status}: only a running or stopped VM moves"}


def migration_spec(view):
    """The spec a destination's ``vm.migrate_in`` is sent for the VM of ``view``: its recorded
    spec with each bridge NIC's ``mac`` set to the MAC the source gave it (the guest keeps its
    interfaces). Raises :class:`PlacementError` when a bridge NIC has no MAC in the view."""
    spec = copy.deepcopy(_spec(view.get("spec")))
    nic_views = view.get("nics") or []
    for i, nic in enumerate(spec.get("nics") or []):
        if not isinstance(nic, dict) or nic.get("mode") == "monitor" or nic.get("mac"):
            continue
        mac = nic_views[i].get("mac") if i < len(nic_views) and isinstance(nic_views[i], dict) else None
        if not isinstance(mac, str) or not mac:
            raise PlacementError(f"{spec['name']}: NIC {i} has no MAC in the VM view")
        nic["mac"] = mac
    return spec


def _size(view):
    spec = view.get("spec") or {}
    return (-_int(spec.get("memory_mib")), -_int(spec.get("cpu")), view.get("name"))


def evacuate_plan(host, hosts, anti_affinity="role", barred=None):
    """Where every VM of ``host`` (a name) goes: each VM of its ``vm.list``, the largest
    first (memory, then CPUs, then name), placed among the other ``hosts`` with what the
    moves planned before it took. Returns ``{host, moves, unmovable, unplaced}``: ``moves``
    ``[{vm, to, mode, stop, status, sharing}]`` in order, ``unmovable`` ``[{vm, reason}]``
    (its status forbids a move), ``unplaced`` ``[{vm, mode, refused}]`` (no host fits; a
    passthrough VM only fits a host whose same hardware class and index is free).
    ``barred`` ``{vm: {host: reason}}`` keeps a VM off hosts for reasons outside host.info
    (the runner's: no Security Onion VMs file drives that host). The input is not changed."""
    hosts = copy.deepcopy(hosts)
    by_name = {h["name"]: h for h in hosts}
    if host not in by_name:
        raise PlacementError(f"{host}: no answer from that host (not among the hosts asked)")
    moves, unmovable, unplaced = [], [], []
    for view in sorted(by_name[host]["vms"], key=_size):
        how = movability(view)
        if how["mode"] is None:
            unmovable.append({"vm": view["name"], "reason": how["reason"]})
            continue
        try:
            spec = migration_spec(view)
        except PlacementError as exc:
            unmovable.append({"vm": view["name"], "reason": str(exc)})
            continue
        bars = (barred or {}).get(view["name"]) or {}
        choice = place(spec, hosts, anti_affinity, exclude=(host, *bars))
        if choice["host"] is None:
            refused = dict(choice["refused"], **{h: [r] for h, r in bars.items() if h != host and h in by_name})
            unplaced.append({"vm": view["name"], "mode": how["mode"], "refused": refused})
            continue
        take(by_name[choice["host"]], spec, dict(view, spec=spec))
        moves.append(
            {
                "vm": view["name"],
                "to": choice["host"],
                "mode": how["mode"],
                "stop": how["stop"],
                "status": view.get("status"),
                "sharing": choice["sharing"],
            }
        )
    return {"host": host, "moves": moves, "unmovable": unmovable, "unplaced": unplaced}
