"""
State module for vmhost: declare the VMs of a hypervisor in Salt states.

Why it exists: operators keep the desired VMs of each hypervisor in Salt. These states hand the
declared spec to vmhostd and report what vmhostd did; every rule (validation, capacity, what
counts as a change) stays in the daemon. Under ``test=True`` the prediction is the daemon's own
dry run (``host.reconcile`` with ``vms=[spec]``, ``prune: false``, ``dry_run: true``: a plan for
this VM that leaves the others alone), never a re-implementation in Python.

A VM whose spec differs is changed in place and keeps its disk (a running one restarts for it
unless ``restart: False``); only a new ``boot.image`` needs ``replace: True``, which gives the VM
a new disk and deletes the old one.

It needs the ``vmhost`` execution module (same extension, or ``salt://_modules/vmhost.py``) and
nothing but the Python standard library (``hardware_from_so`` also reads YAML with PyYAML, which
Salt itself requires).

.. code-block:: yaml

    sensor1:
      vmhost.running:
        - cpu: 1
        - memory_mib: 256
        - boot:
            kernel: /srv/guest/vmlinuz
            initrd: /srv/guest/initramfs.cpio.gz

A kernel and initrd must be in one of the host's boot directories (vmhostd's ``paths.boot``;
here ``/srv/guest`` would be one), or vmhostd refuses the spec with 2001.

The images VMs boot from (``boot.image``) are declared the same way, verified by their sha256
(``image.import``; ``source`` is a URL or a file in vmhostd's import directory):

.. code-block:: yaml

    debian-12.qcow2:
      vmhost.image_present:
        - sha256: 6a3f...e1
        - source: https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-genericcloud-amd64.qcow2

A VM's named snapshots are declared with ``vmhost.snapshot_present`` and
``vmhost.snapshot_absent`` (``vm.snapshot``, ``vm.snapshot_delete``); reverting, exporting and
importing are actions, the execution module's ``vmhost.revert``, ``vmhost.export`` and
``vmhost.import``.
"""

import contextlib
import difflib
import os
import re
import subprocess
import tempfile

from salt.exceptions import CommandExecutionError

__virtualname__ = "vmhost"

NOT_FOUND = 4040
SPEC_DRIFT = 2002
IMAGE_IN_USE = 4092
# What a plan action means, for comments.
_ACTION_TEXT = {
    "create": "created",
    "reconfigure": "reconfigured in place (disk kept)",
    "replace": "replaced (new disk)",
    "start": "started",
    "stop": "stopped",
    "destroy": "destroyed",
}
# Spec members that are never drift: the run state converges by a start or stop, guest
# interfaces are applied live by the guest agent and SSH access is written live by the guest's
# exec server. (``guest_exec`` is drift as vmhostd names it, changed in place without a restart.)
_NOT_DRIFT = ("state", "guest_interfaces", "ssh")
# The members of those that vmhost.apply changes live (the run state aside), in comment order.
_LIVE = ("guest_interfaces", "ssh")
# The account vmhostd records for an ``ssh`` that names none (docs/api.md, "The VM spec"): a
# declared ``ssh`` without ``user`` is the same as the recorded one with this user.
_SSH_DEFAULT_USER = "vmhost"
# Statuses in which vmhost.apply sends a live change to the guest at once; otherwise the change
# is recorded and reaches the guest at its next start.
_UP = ("running", "starting", "creating")
_REPLACE_HINT = "set replace: True to recreate the VM with a new disk (its old disk overlay is deleted)"


def __virtual__():
    if "vmhost.apply" not in __salt__:
        return (False, "the vmhost execution module is not loaded")
    return __virtualname__


def _ret(name):
    return {"name": name, "changes": {}, "result": True, "comment": ""}


def _get(name):
    """The VM view, or None when vmhostd has no such VM."""
    try:
        return __salt__["vmhost.get"](name)
    except CommandExecutionError as exc:
        if getattr(exc, "code", None) == NOT_FOUND:
            return None
        raise


def _build_spec(name, spec, kwargs):
    """The spec to send: ``spec`` (a dict, e.g. from pillar) updated by the state's arguments."""
    if spec is not None and not isinstance(spec, dict):
        raise CommandExecutionError("spec must be a dict")
    out = dict(spec or {})
    out.update({k: v for k, v in kwargs.items() if not k.startswith("__")})
    if out.get("name", name) != name:
        raise CommandExecutionError(f"spec name {out['name']!r} differs from the state's name {name!r}")
    out["name"] = name
    return out


def _summary(view):
    """What the changes show of a VM view: the spec and the run state, not timestamps."""
    if view is None:
        return None
    return {"spec": view.get("spec"), "status": view.get("status"), "pid": view.get("pid")}


def _diff(old, new):
    """Old/new holding only what differs: status, pid, pending_restart and the top-level spec
    members."""
    if old is None or new is None:
        return {"old": _summary(old), "new": _summary(new)}
    o, n = {}, {}
    for key in ("status", "pid"):
        if old.get(key) != new.get(key):
            o[key], n[key] = old.get(key), new.get(key)
    if bool(old.get("pending_restart")) != bool(new.get("pending_restart")):
        o["pending_restart"], n["pending_restart"] = bool(old.get("pending_restart")), bool(new.get("pending_restart"))
    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    for key in sorted(set(ospec) | set(nspec)):
        if ospec.get(key) != nspec.get(key):
            o.setdefault("spec", {})[key] = ospec.get(key)
            n.setdefault("spec", {})[key] = nspec.get(key)
    return {"old": o, "new": n}


def _drift(old_spec, new_spec):
    """Dotted paths of the spec members that differ (``memory_mib``, ``boot.image``), as the
    daemon names them; the run state and guest interfaces are not drift."""
    out = []

    def walk(path, a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(f"{path}.{key}" if path else key, a.get(key), b.get(key))
        elif a != b:
            out.append(path)

    walk("", _without(old_spec, _NOT_DRIFT), _without(new_spec, _NOT_DRIFT))
    return out


def _without(spec, keys):
    return {k: v for k, v in (spec or {}).items() if k not in keys}


def _live_value(spec, key):
    """``spec[key]`` as vmhostd compares it: a missing list is empty, ``ssh`` has its user."""
    value = (spec or {}).get(key)
    if key == "guest_interfaces":
        return value or []
    if key == "ssh" and isinstance(value, dict) and "user" not in value:
        return dict(value, user=_SSH_DEFAULT_USER)
    return value


def _live_changes(old_spec, new_spec):
    """The live members (``guest_interfaces``, ``ssh``) that differ between two specs."""
    return [k for k in _LIVE if _live_value(old_spec, k) != _live_value(new_spec, k)]


def _live_text(live, status):
    """How a change of the live members ``live`` reaches the guest, for comments."""
    what = " and ".join(live)
    if status in _UP:
        return f"its {what} applied live"
    return f"its {what} recorded (the guest gets the change at its next start)"


def _error_comment(exc_text, code, replace):
    """A daemon error as the comment; a 2002 (a new boot.image) says how to allow it."""
    if code == SPEC_DRIFT and not replace:
        return f"{exc_text}; {_REPLACE_HINT}"
    return exc_text


def _what_changed(current, new):
    """How an existing VM was changed, from its view before and after ``vm.apply``."""
    fields = _drift(current.get("spec"), new.get("spec"))
    if "boot.image" in fields:
        return f"replaced (new disk; the old disk overlay was deleted): {', '.join(fields)}"
    if fields:
        text = f"reconfigured in place (disk kept): {', '.join(fields)}"
        if new.get("pending_restart"):
            text += "; restart pending (restart is False): the change applies at its next start"
        return text
    if current.get("pending_restart") and not new.get("pending_restart"):
        return "restarted to apply its pending change"
    live = _live_changes(current.get("spec"), new.get("spec"))
    if live:
        return f"updated: {_live_text(live, new.get('status'))}"
    return "updated"


def _dry_run(ret, spec, current, replace, restart):
    """Fills ``ret`` for test=True from the daemon's plan for this one VM."""
    report = __salt__["vmhost.reconcile"]([spec], prune=False, dry_run=True, replace=replace)
    name = spec["name"]
    entry = next((e for e in report.get("plan", []) if e.get("vm") == name), None)
    if entry is None:
        ret["result"] = False
        ret["comment"] = f"vmhostd's dry run has no plan entry for VM {name}"
        return ret
    action, reason, error = entry.get("action"), entry.get("reason", ""), entry.get("error")
    fields = entry.get("fields") or []
    if error:
        data = error.get("data") or {}
        field = f" ({data['field']})" if data.get("field") else ""
        text = (
            f"VM {name} would fail to be {_ACTION_TEXT.get(action, action)}: "
            f"vmhostd error {error.get('code')}{field}: {error.get('message')}"
        )
        ret["result"] = False
        ret["comment"] = _error_comment(text, error.get("code"), replace)
        return ret
    if action == "reconfigure":
        return _dry_run_reconfigure(ret, name, reason, fields, bool(entry.get("restart")), restart)
    # The plan's `none` also covers a change of guest_interfaces or ssh alone, which vm.apply
    # makes live; the recorded spec tells whether there is one.
    live = []
    if action == "none" and current is not None:
        live = _live_changes(current.get("spec"), spec)
        if live:
            action = live[0] if len(live) == 1 else "live"
    if action == "none":
        ret["comment"] = f"VM {name} is as declared ({reason})"
        return ret
    ret["result"] = None
    ret["changes"] = {"action": action, "reason": reason}
    if live:
        ret["changes"]["live"] = live
        ret["comment"] = f"VM {name} would get {_live_text(live, current.get('status'))}"
    elif action == "replace":
        ret["changes"]["fields"] = fields
        ret["comment"] = f"VM {name} would be replaced (new disk; the old disk overlay is deleted): {', '.join(fields)}"
    else:
        ret["comment"] = f"VM {name} would be {_ACTION_TEXT.get(action, action)} ({reason})"
    return ret


def _dry_run_reconfigure(ret, name, reason, fields, planned_restart, restart):
    """test=True for a ``reconfigure`` plan entry. The plan assumes ``restart: true`` (as
    ``host.reconcile`` runs it); with ``restart=False`` the restart it plans stays pending."""
    pending = planned_restart and not restart
    if not fields and pending:
        # Only a change recorded earlier is pending, and restart=False leaves it so.
        ret["comment"] = f"VM {name} is as declared; it runs an older spec until its next start (restart is False)"
        return ret
    ret["result"] = None
    ret["changes"] = {
        "action": "reconfigure",
        "reason": reason,
        "fields": fields,
        "restart": planned_restart and restart,
    }
    if not fields:
        ret["comment"] = f"VM {name} would be restarted to apply its pending change ({reason})"
        return ret
    if pending:
        ret["changes"]["pending_restart"] = True
        how = "restart pending (restart is False): the change applies at its next start"
    elif planned_restart:
        how = "it is restarted"
    else:
        how = "no restart"
    ret["comment"] = f"VM {name} would be reconfigured in place (disk kept): {', '.join(fields)}; {how}"
    return ret


def _flag(value, name):
    """A boolean argument, read as the execution module reads it (``"False"`` is false)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise CommandExecutionError(f"{name} must be True or False, not {value!r}")


def _converge(name, spec, kwargs, state, replace, restart, timeout_s):
    ret = _ret(name)
    try:
        replace, restart = _flag(replace, "replace"), _flag(restart, "restart")
        spec = _build_spec(name, spec, kwargs)
        current = _get(name)
        if state is None:
            # present: keep the desired run state vmhostd records (the daemon's default,
            # running, for a new VM).
            spec.pop("state", None)
            if current is not None:
                spec["state"] = current.get("desired_state") or (current.get("spec") or {}).get("state")
        else:
            spec["state"] = state
        if __opts__.get("test"):
            return _dry_run(ret, spec, current, replace, restart)
        result = __salt__["vmhost.apply"](spec, replace=replace, restart=restart, timeout_s=timeout_s)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = _error_comment(str(exc), getattr(exc, "code", None), replace)
        return ret
    new = result.get("vm") or {}
    if not result.get("changed"):
        ret["comment"] = f"VM {name} is as declared ({new.get('status')})"
        return ret
    ret["changes"] = _diff(current, new)
    what = "created" if current is None else _what_changed(current, new)
    ret["comment"] = f"VM {name} {what} ({new.get('status')})"
    return ret


def running(name, spec=None, replace=False, restart=True, timeout_s=30, **kwargs):
    """
    The VM exists with this spec and runs.

    name
        the VM's name (the spec's ``name``).
    spec
        optional dict with spec members (e.g. from pillar); the state's other arguments are
        spec members too (``cpu``, ``memory_mib``, ``boot``, ``nics``, ``disks``, ``hardware``,
        ``pci``, ``role``, ``guest_interfaces``, ``ssh``, ``guest_exec``, ``cpu_policy``,
        ``numa``, ``hugepages``, ``emulator_cpu``; a NIC may carry ``queues``, ``vlans``,
        ``trunk``, or be a capture NIC: ``mode: monitor``, ``source``, ``direction``) and
        override it. A change of ``guest_interfaces`` or ``ssh`` alone is applied live (no
        restart); ``guest_exec`` is changed in place without a restart; ``cpu_policy``,
        ``numa``, ``hugepages``, ``emulator_cpu`` and a NIC's ``queues``, ``mode``, ``source``,
        ``direction``, ``vlans`` and ``trunk`` need a restart (see ``restart``). They are passed
        through as given: vmhostd checks them (a ``numa`` node is a number, ``numa: 1``, not
        ``"1"``; a monitor NIC's ``source`` must be in the host's ``[capture] interfaces`` and
        present, else 3001 on ``spec.nics[N].source``) and places the VM when it starts
        (3001/3002 when the host cannot). ``tpm``, ``boot``'s ``secure_boot`` and a disk's
        ``snapshot`` are sent as given too; whether the VM is as declared is vmhostd's answer
        (``vm.apply``'s ``changed``, the dry run's plan), so ``tpm: False``, ``secure_boot:
        False`` and ``snapshot: True``, which vmhostd leaves out of its views, are no change.
    replace
        only for a change of ``boot.image``, which needs a new disk: True recreates the VM
        (vmhostd deletes its old disk overlay); False (default) fails with vmhostd's 2002. Every
        other change is made in place and keeps the disk.
    restart
        for an in-place change of a running VM: True (default) restarts it with the new spec
        (ACPI power-off, killed after ``timeout_s``); False only records the change, which
        applies at its next start (the VM view shows ``pending_restart``).
    timeout_s
        seconds the guest has to power off for that restart before QEMU is killed (default 30,
        at most 3600).

    Calls ``vm.apply`` with ``state: running``.
    """
    return _converge(name, spec, kwargs, "running", replace, restart, timeout_s)


def stopped(name, spec=None, replace=False, restart=True, timeout_s=30, **kwargs):
    """
    The VM exists with this spec and does not run (a new VM is created stopped; a running one
    gets an ACPI power-off, killed after 30 s). Arguments as for ``running``.
    """
    return _converge(name, spec, kwargs, "stopped", replace, restart, timeout_s)


def present(name, spec=None, replace=False, restart=True, timeout_s=30, **kwargs):
    """
    The VM exists with this spec; its desired run state is left as vmhostd records it (a new VM
    gets the daemon's default, running). As with ``vm.apply``, vmhostd still converges the VM to
    that recorded state: a VM recorded as running whose QEMU died is started again. Arguments
    as for ``running``.
    """
    return _converge(name, spec, kwargs, None, replace, restart, timeout_s)


def absent(name):
    """
    No VM of this name exists: ``vm.destroy`` (QEMU is killed, no ACPI power-off; its disk
    overlay, console log and record are removed).
    """
    ret = _ret(name)
    try:
        current = _get(name)
        if current is None:
            ret["comment"] = f"VM {name} is already absent"
            return ret
        if __opts__.get("test"):
            ret["result"] = None
            ret["changes"] = {"action": "destroy", "reason": f"exists ({current.get('status')})"}
            ret["comment"] = f"VM {name} would be destroyed"
            return ret
        try:
            __salt__["vmhost.destroy"](name)
        except CommandExecutionError as exc:
            if getattr(exc, "code", None) != NOT_FOUND:
                raise
            ret["comment"] = f"VM {name} is already absent"
            return ret
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        return ret
    ret["changes"] = {"old": _summary(current), "new": None}
    ret["comment"] = f"VM {name} destroyed"
    return ret


# --- vmhost.image_present / vmhost.image_absent: the images VMs boot from ---


def _image(name):
    """The image's entry of ``image.list``, or None when there is no such file."""
    for image in __salt__["vmhost.image_list"]() or []:
        if isinstance(image, dict) and image.get("name") == name:
            return image
    return None


def _image_summary(image):
    """What the changes show of an image: its sha256, size, format and source."""
    if image is None:
        return None
    return {k: image.get(k) for k in ("sha256", "bytes", "format", "virtual_size", "source")}


def image_present(name, sha256, source=None, timeout_s=None):
    """
    The image ``name`` is in vmhostd's images directory with this sha256 (``image.import``).

    name
        the image's file name there (what a VM's ``boot.image`` names).
    sha256
        its sha256, 64 hex digits. A copy with another one fails with vmhostd's 2003 and nothing
        is kept.
    source
        where to copy it from when it is not there: an ``http://`` or ``https://`` URL, or a file
        in vmhostd's import directory (``paths.import``: its name or its absolute path there).
        Not given: the file must be in the images directory already (put there by hand); it is
        hashed and recorded where it is. Never compared: an image that is there with its sha256
        is as declared, wherever it came from.
    timeout_s
        the longest a download may take, in seconds (the daemon's default: 3600).

    Changes only when vmhostd says it changed something. An image that is there with another
    sha256 is never replaced (vmhostd refuses with 4093, since VMs hold overlays over it): the
    state fails naming both; delete it first (``image_absent``) or import under a new name.
    Under ``test=True`` the prediction comes from ``image.list``.
    """
    ret = _ret(name)
    try:
        if __opts__.get("test"):
            return _image_predict(ret, name, sha256, source)
        result = __salt__["vmhost.image_import"](name, sha256, source=source, timeout_s=timeout_s)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        return ret
    image = result.get("image") or {}
    if not result.get("changed"):
        ret["comment"] = f"image {name} is present with sha256 {image.get('sha256')}"
        return ret
    if image.get("source") is None:
        # Nothing was copied: a file that was there without a record was hashed and recorded.
        ret["changes"] = {"old": {"sha256": None}, "new": _image_summary(image)}
        ret["comment"] = f"image {name} (put there by hand) checked and recorded with sha256 {image.get('sha256')}"
    else:
        ret["changes"] = {"old": None, "new": _image_summary(image)}
        ret["comment"] = f"image {name} imported from {image.get('source')} (sha256 {image.get('sha256')})"
    return ret


def _image_predict(ret, name, sha256, source):
    """Fills ``ret`` for ``image_present`` under test=True from ``image.list``."""
    want = str(sha256).lower()
    current = _image(name)
    if current is not None and current.get("sha256") is not None:
        have = str(current["sha256"]).lower()
        if have == want:
            ret["comment"] = f"image {name} is present with sha256 {have}"
            return ret
        ret["result"] = False
        ret["comment"] = (
            f"image {name} is there with sha256 {have}, not {want}: vmhostd never replaces an image "
            "(error 4093, VMs hold overlays over it); delete it first (vmhost.image_absent) or "
            "import it under a new name"
        )
        return ret
    ret["result"] = None
    if current is not None:
        ret["changes"] = {"old": {"sha256": None}, "new": {"sha256": want}}
        ret["comment"] = (
            f"image {name} is there without a sha256 record (put there by hand): it would be hashed "
            f"where it is and recorded with sha256 {want} if it has that sha256"
        )
        return ret
    if source in (None, ""):
        ret["result"] = False
        ret["comment"] = (
            f"image {name} is not in vmhostd's images directory and no source is given: vmhostd would "
            "refuse (error 4040 on source); give a source (a URL or a file in the import directory)"
        )
        return ret
    ret["changes"] = {"old": None, "new": {"sha256": want, "source": source}}
    ret["comment"] = f"image {name} would be imported from {source} (sha256 {want})"
    return ret


def image_absent(name):
    """
    No image ``name`` is in vmhostd's images directory (``image.delete``: the file and its
    record are removed). vmhostd refuses while VMs boot from it (4092): the state fails naming
    them. Under ``test=True`` the prediction comes from ``image.list`` (its ``used_by``).
    """
    ret = _ret(name)
    try:
        current = _image(name)
        if __opts__.get("test"):
            if current is None:
                ret["comment"] = f"image {name} is already absent"
            elif current.get("used_by"):
                ret["result"] = False
                ret["comment"] = (
                    f"image {name} is the base of VMs {', '.join(current['used_by'])}: "
                    "vmhostd would refuse to delete it (4092)"
                )
            else:
                ret["result"] = None
                ret["changes"] = {"old": _image_summary(current), "new": None}
                ret["comment"] = f"image {name} would be deleted"
            return ret
        result = __salt__["vmhost.image_delete"](name)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        if getattr(exc, "code", None) == IMAGE_IN_USE:
            vms = (getattr(exc, "details", None) or {}).get("vms") or []
            ret["comment"] = f"image {name} is the base of VMs {', '.join(map(str, vms))}, not deleted: {exc}"
        return ret
    if not result.get("changed"):
        ret["comment"] = f"image {name} is already absent"
        return ret
    ret["changes"] = {"old": _image_summary(current) or {"name": name}, "new": None}
    ret["comment"] = f"image {name} deleted"
    return ret


# --- vmhost.snapshot_present / vmhost.snapshot_absent: a VM's named snapshots ---


def _snapshot(vm, snapshot):
    """VM's snapshot of that name as ``vm.snapshots`` lists it, or None (also when there is no
    such VM: a VM that does not exist has no snapshots)."""
    try:
        listed = __salt__["vmhost.snapshots"](vm)
    except CommandExecutionError as exc:
        if getattr(exc, "code", None) == NOT_FOUND:
            return None
        raise
    for view in listed or []:
        if isinstance(view, dict) and view.get("name") == snapshot:
            return view
    return None


def _snapshot_summary(view):
    """What the changes show of a snapshot."""
    return {k: view.get(k) for k in ("name", "created_at", "live", "consistency", "reason") if k in view}


def snapshot_present(name, vm, snapshot=None, requires=None, timeout_s=None):
    """
    VM ``vm`` has a snapshot named ``snapshot`` (default: the state's name), taken
    (``vm.snapshot``, running or stopped) when it has none. An existing snapshot is never
    retaken or compared: it is what the disks were when it was taken. Putting the VM back is an
    action, ``vmhost.revert`` of the execution module.

    requires
        ``frozen``: vmhostd refuses (4094) rather than take a crash-consistent snapshot, and
        the state fails with its reason.
    timeout_s
        longest the copy may take (the daemon's default: 3600).

    Under ``test=True`` the prediction comes from ``vm.snapshots``.

    .. code-block:: yaml

        before-upgrade:
          vmhost.snapshot_present:
            - vm: sensor1
            - requires: frozen
    """
    ret = _ret(name)
    snapshot = str(name if snapshot in (None, "") else snapshot)
    try:
        if _snapshot(vm, snapshot) is not None:
            ret["comment"] = f"VM {vm} has snapshot {snapshot}"
            return ret
        if __opts__.get("test"):
            ret["result"] = None
            ret["changes"] = {"old": None, "new": {"name": snapshot}}
            ret["comment"] = f"snapshot {snapshot} of VM {vm} would be taken"
            return ret
        view = __salt__["vmhost.snapshot"](vm, snapshot, timeout_s=timeout_s, requires=requires, test=False)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        return ret
    ret["changes"] = {"old": None, "new": _snapshot_summary(view if isinstance(view, dict) else {})}
    ret["comment"] = f"snapshot {snapshot} of VM {vm} taken"
    if isinstance(view, dict) and view.get("consistency"):
        ret["comment"] += f" ({view['consistency']})"
    return ret


def snapshot_absent(name, vm, snapshot=None):
    """
    VM ``vm`` has no snapshot named ``snapshot`` (default: the state's name): deleted
    (``vm.snapshot_delete``) when it has one. A VM that does not exist has none. Under
    ``test=True`` the prediction comes from ``vm.snapshots``.
    """
    ret = _ret(name)
    snapshot = str(name if snapshot in (None, "") else snapshot)
    try:
        current = _snapshot(vm, snapshot)
        if current is None:
            ret["comment"] = f"VM {vm} has no snapshot {snapshot}"
            return ret
        if __opts__.get("test"):
            ret["result"] = None
            ret["changes"] = {"old": _snapshot_summary(current), "new": None}
            ret["comment"] = f"snapshot {snapshot} of VM {vm} would be deleted"
            return ret
        result = __salt__["vmhost.snapshot_delete"](vm, snapshot, test=False)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        return ret
    if not (isinstance(result, dict) and result.get("changed")):
        ret["comment"] = f"VM {vm} has no snapshot {snapshot}"
        return ret
    ret["changes"] = {"old": _snapshot_summary(current), "new": None}
    ret["comment"] = f"snapshot {snapshot} of VM {vm} deleted"
    return ret


# --- vmhost.hardware_from_so: the [hardware] section of vmhostd.toml from Security Onion ---

DEFAULT_CONFIG = "/etc/vmhost/vmhostd.toml"
# Where Security Onion installs its default Salt tree (salt/hypervisor/defaults.yaml in its source).
DEFAULT_SO_DEFAULTS = "/opt/so/saltstack/default/salt/hypervisor/defaults.yaml"
# Where the vmhostd package installs the daemon (packaging/build-debs.sh).
DEFAULT_VMHOSTD = "/usr/sbin/vmhostd"
# The host's own reservation Security Onion keeps outside its hypervisor engine.
DEFAULT_RESERVED_CPU = 8
DEFAULT_RESERVED_MEMORY_GIB = 16
HW_CLASSES = ("disk", "copper", "sfp")
_SO_PCI = re.compile(r"pci_([0-9a-fA-F]{4})_([0-9a-fA-F]{2})_([0-9a-fA-F]{2})_([0-7])")
_PLAIN_PCI = re.compile(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
# A header, its brackets captured: `[[x]]` and `[x]` with an optional comment after them (keys
# are matched as TOML keys, so a `#` or `]` inside a quoted key does not end them).
_HEADER = re.compile(r"\s*(\[\[?)\s*(" + _KEY + r"(?:\s*\.\s*" + _KEY + r")*)\s*(\]\]?)\s*(?:#.*)?")
_ALLOW_RAW_PCI = re.compile(r"\s*allow_raw_pci\s*=\s*(true|false)\s*(?:#.*)?")


class _Refused(Exception):
    """A reason not to write, for the comment."""


def _header(line):
    """The dotted key of a table header line (``[hardware.sfp]`` → ``["hardware", "sfp"]``), or None."""
    m = _HEADER.fullmatch(line.rstrip("\r\n"))
    if not m or len(m.group(1)) != len(m.group(3)):
        return None
    parts = re.findall(_KEY, m.group(2))
    return [p[1:-1] if p[:1] in ('"', "'") else p for p in parts]


def _scan(line, delim, depth):
    """``(delim, depth)`` at the end of ``line`` given those at its start: the multi-line string
    delimiter (``\"\"\"`` or ``'''``) still open, and how many ``[`` of a value (a multi-line
    array) are still open, counted outside strings and comments. Enough TOML to not take a line
    inside such a string or array for a table header."""
    i, n = 0, len(line)
    while i < n:
        if delim:
            j = line.find(delim, i)
            if j < 0:
                return delim, depth
            i = j + 3
            while i < n and line[i] == delim[0]:
                i += 1
            delim = None
            continue
        c = line[i]
        if c == "#":
            break
        if line.startswith('"""', i) or line.startswith("'''", i):
            delim, i = line[i : i + 3], i + 3
        elif c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
        elif c == "'":
            j = line.find("'", i + 1)
            i = j + 1 if j >= 0 else n
        else:
            if c == "[":
                depth += 1
            elif c == "]":
                depth = max(0, depth - 1)
            i += 1
    return delim, depth


def _lines(text):
    """The file's lines as ``(line, header, inside)``: ``header`` the dotted key of a table
    header (or None); ``inside`` True for a line that starts inside a multi-line string or
    array, which is never a header nor a key of its own."""
    delim, depth = None, 0
    for line in text.splitlines(keepends=True):
        inside = bool(delim) or depth > 0
        yield line, None if inside else _header(line), inside
        delim, depth = _scan(line, delim, depth)


def _segments(text):
    """The file cut at its table headers: ``[(is_hardware, lines)]``; the lines before the first
    header are one segment that is not hardware. Consecutive hardware tables are one segment."""
    segments = [(False, [])]
    for line, parts, _ in _lines(text):
        if parts is not None:
            is_hw = parts[0] == "hardware"
            if is_hw != segments[-1][0]:
                segments.append((is_hw, []))
        segments[-1][1].append(line)
    return segments


def _trailing_comments(lines):
    """Splits a hardware segment into its tables and the blank and comment lines that end it;
    those describe what follows (the next table, or commented-out examples) and are kept."""
    cut = len(lines)
    while cut > 1 and lines[cut - 1].strip()[:1] in ("", "#"):
        cut -= 1
    return lines[:cut], lines[cut:]


def _allow_raw_pci(text):
    """``allow_raw_pci`` as the file's ``[hardware]`` table sets it (True/False), or None."""
    value, in_table = None, False
    for line, parts, inside in _lines(text):
        if parts is not None:
            in_table = parts == ["hardware"]
            continue
        m = _ALLOW_RAW_PCI.fullmatch(line.rstrip("\r\n"))
        if in_table and not inside and m:
            value = m.group(1) == "true"
    return value


def _splice(text, section):
    """``text`` with its ``[hardware]`` and ``[hardware.*]`` tables replaced by ``section``
    (appended when there are none); every other byte stays as it was."""
    out, placed = [], False
    for is_hw, lines in _segments(text):
        if not is_hw:
            out.extend(lines)
            continue
        _, kept = _trailing_comments(lines)
        if not placed:
            out.append(section)
            placed = True
        out.extend(kept)
    result = "".join(out)
    if not placed:
        if result and not result.endswith("\n"):
            result += "\n"
        result += ("\n" if result else "") + section
    return result


def _index(value, key):
    """A model index: a non-negative integer, or a string of digits (SO writes both)."""
    if isinstance(value, bool):
        raise _Refused(f"{key}: index {value!r} is not a non-negative integer")
    if isinstance(value, int) and 0 <= value <= 0xFFFFFFFF:
        return value
    if isinstance(value, str) and value.strip().isdigit() and value.strip().isascii():
        number = int(value.strip())
        if number <= 0xFFFFFFFF:
            return number
    raise _Refused(f"{key}: index {value!r} is not a non-negative integer")


def _pci(value, key):
    """``pci_0000_c7_00_0`` (or ``0000:c7:00.0``) as ``0000:c7:00.0``."""
    text = value.strip() if isinstance(value, str) else ""
    m = _SO_PCI.fullmatch(text) or _PLAIN_PCI.fullmatch(text)
    if not m or int(m.group(3), 16) > 0x1F:
        raise _Refused(f"{key}: {value!r} is not a PCI address of the form pci_DDDD_BB_SS_F")
    domain, bus, slot, function = (g.lower() for g in m.groups())
    return f"{domain}:{bus}:{slot}.{function}"


def _count(value, key, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _Refused(f"{key}: {value!r} is not an integer of at least {minimum}")
    return value


def _so_model(defaults, model):
    """The model's hardware from SO's defaults.yaml: ``{cpu, memory_gib, disk, copper, sfp}``,
    each class ``{index: address}`` (empty when absent or null)."""
    import yaml  # PyYAML: a dependency of Salt itself

    try:
        with open(defaults, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise _Refused(f"cannot read {defaults}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise _Refused(f"{defaults} is not valid YAML: {exc}") from None
    models = None
    if isinstance(data, dict) and isinstance(data.get("hypervisor"), dict):
        models = data["hypervisor"].get("model")
    if not isinstance(models, dict):
        raise _Refused(f"{defaults} has no hypervisor.model mapping")
    found = {str(k): v for k, v in models.items()}
    if model not in found:
        available = ", ".join(sorted(found)) or "none"
        raise _Refused(f"model {model!r} is not in {defaults} (models there: {available})")
    base = f"hypervisor.model.{model}.hardware"
    hw = found[model].get("hardware") if isinstance(found[model], dict) else None
    if not isinstance(hw, dict):
        raise _Refused(f"{defaults}: {base} is missing or not a mapping")
    out = {
        "cpu": _count(hw.get("cpu"), f"{base}.cpu", 1),
        "memory_gib": _count(hw.get("memory"), f"{base}.memory", 1),
    }
    for cls in HW_CLASSES:
        table = hw.get(cls)
        if table is None:
            out[cls] = {}
            continue
        if not isinstance(table, dict):
            raise _Refused(f"{base}.{cls}: not a mapping of index to PCI address (or null)")
        devices = {}
        for raw, address in table.items():
            index = _index(raw, f"{base}.{cls}.{raw}")
            if index in devices:
                raise _Refused(f"{base}.{cls}: index {index} is given twice")
            devices[index] = _pci(address, f"{base}.{cls}.{raw}")
        out[cls] = devices
    return out


def _render(hw, model, reserved_cpu, reserved_memory_gib, allow_raw_pci):
    """The ``[hardware]`` section, ending with a newline."""
    shown = re.sub(r"[^\x20-\x7e]", "?", model)
    lines = [
        "[hardware]",
        f"# Written by Salt (vmhost.hardware_from_so) from Security Onion model {shown}; the",
        "# [hardware] tables are replaced at its next run.",
        f"cpu = {hw['cpu']}",
        f"memory_gib = {hw['memory_gib']}",
        f"reserved_cpu = {reserved_cpu}",
        f"reserved_memory_gib = {reserved_memory_gib}",
    ]
    if allow_raw_pci is not None:
        lines.append(f"allow_raw_pci = {'true' if allow_raw_pci else 'false'}")
    for cls in HW_CLASSES:
        if hw[cls]:
            lines += ["", f"[hardware.{cls}]"]
            lines += [f'{index} = "{hw[cls][index]}"' for index in sorted(hw[cls])]
    return "\n".join(lines) + "\n"


def _check_config(vmhostd, path, shown_as):
    """Runs ``vmhostd --config PATH --check-config``; raises with the daemon's message if it
    refuses (the candidate's temporary name replaced by ``shown_as``)."""
    try:
        proc = subprocess.run(
            [vmhostd, "--config", path, "--check-config"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _Refused(f"cannot run {vmhostd} --check-config: {exc}") from None
    if proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").replace(path, shown_as)
        raise _Refused(f"vmhostd refuses the new config (file left as it was): {message}")


def _write_candidate(directory, text, st, keep_owner=True):
    """A temporary file in ``directory`` holding ``text``, with ``st``'s mode (and owner, with
    ``keep_owner``), flushed to disk. Returns its path."""
    fd, tmp = tempfile.mkstemp(prefix=".vmhostd.toml.", suffix=".salt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8"))
            fh.flush()
            os.fchmod(fh.fileno(), st.st_mode & 0o7777)
            own = os.fstat(fh.fileno())
            if keep_owner and (own.st_uid, own.st_gid) != (st.st_uid, st.st_gid):
                os.fchown(fh.fileno(), st.st_uid, st.st_gid)
            os.fsync(fh.fileno())
    except OSError:
        os.unlink(tmp)
        raise
    return tmp


def _fsync_dir(directory):
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _replace(path, tmp):
    """Renames ``tmp`` over ``path`` and makes the rename durable."""
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _marker(name):
    """The file that records a restart of vmhostd still owed for a write of ``name``:
    ``.<basename>.vmhost-restart-pending`` next to it."""
    directory, base = os.path.split(name)
    return os.path.join(directory, f".{base}.vmhost-restart-pending")


def _set_marker(marker, name):
    """Writes the restart marker atomically and durably (a temporary file renamed into place)."""
    directory, base = os.path.split(marker)
    fd, tmp = tempfile.mkstemp(prefix=f"{base}.", suffix=".salt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(f"vmhost.hardware_from_so wrote {name}; vmhostd has not been restarted since\n".encode())
            fh.flush()
            os.fsync(fh.fileno())
        _replace(marker, tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _clear_marker(marker):
    os.unlink(marker)
    _fsync_dir(os.path.dirname(marker))


def _check_restart_cmd(restart_cmd):
    if restart_cmd is None:
        return
    argv = restart_cmd if isinstance(restart_cmd, (list, tuple)) else []
    if not argv or not all(isinstance(a, str) for a in argv):
        raise _Refused("restart_cmd must be a non-empty list of strings (an argv, run without a shell)")


def _restart_vmhostd(service, restart_cmd):
    """Restarts vmhostd; returns a description, raises with the reason when it fails."""
    if restart_cmd is not None:
        try:
            proc = subprocess.run(
                list(restart_cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _Refused(f"restart command {list(restart_cmd)} failed: {exc}") from None
        if proc.returncode != 0:
            detail = proc.stderr.strip() or proc.stdout.strip()
            raise _Refused(f"restart command {list(restart_cmd)} exited with {proc.returncode}: {detail}")
        return f"restarted with {' '.join(restart_cmd)}"
    if not __salt__["service.restart"](service):
        raise _Refused(f"service.restart {service} failed")
    return f"service {service} restarted"


def _read_config(name):
    """``(stat, bytes)`` of the config file. A symbolic link is refused: the rename that replaces
    the file would replace the link with a regular file and leave its target as it was."""
    try:
        if os.path.islink(name):
            raise _Refused(
                f"{name} is a symbolic link (to {os.readlink(name)}); refusing to replace it: "
                "give the file's real path as name"
            )
        # O_NOFOLLOW: a link that appears after the check is refused too (ELOOP).
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            return os.fstat(fh.fileno()), fh.read()
    except OSError as exc:
        raise _Refused(f"cannot read {name}: {exc.strerror or exc}") from None


def hardware_from_so(
    name=DEFAULT_CONFIG,
    defaults=DEFAULT_SO_DEFAULTS,
    model=None,
    reserved_cpu=DEFAULT_RESERVED_CPU,
    reserved_memory_gib=DEFAULT_RESERVED_MEMORY_GIB,
    allow_raw_pci=None,
    restart=True,
    service="vmhostd",
    restart_cmd=None,
    vmhostd=DEFAULT_VMHOSTD,
):
    """
    The ``[hardware]`` section of vmhostd's config is Security Onion's hardware model.

    name
        vmhostd's config file, an absolute path (the package's is ``/etc/vmhost/vmhostd.toml``;
        Salt passes the state's ID when ``name`` is not given); it must exist.
    defaults
        SO's ``defaults.yaml`` (default
        ``/opt/so/saltstack/default/salt/hypervisor/defaults.yaml``), read with
        ``yaml.safe_load``: ``hypervisor.model.<MODEL>.hardware.{cpu, memory, disk, copper, sfp}``.
    model
        the model's name; default the minion's ``sosmodel`` grain.
    reserved_cpu, reserved_memory_gib
        the host's own share, never given to VMs (default 8 and 16, SO's reservation).
    allow_raw_pci
        None (default) keeps the file's ``allow_raw_pci``; True or False writes it.
    restart
        restart vmhostd when the file changed (default True; running VMs keep running, the new
        vmhostd re-adopts them). The restart owed is recorded first in
        ``.<basename>.vmhost-restart-pending`` next to the file and removed once it succeeded; a
        later run that finds the file as wanted and that marker restarts vmhostd (``test=True``
        reports it; ``restart=False`` leaves it pending).
    service
        the service ``service.restart`` restarts (default ``vmhostd``).
    restart_cmd
        an argv list run without a shell instead of ``service.restart``.
    vmhostd
        the daemon binary whose ``--check-config`` validates the new file before it is written
        (default ``/usr/sbin/vmhostd``).

    Only the ``[hardware]`` and ``[hardware.*]`` tables are replaced; every other byte of the
    file stays as it was. The file is replaced atomically, keeping its mode and owner; a
    symbolic link as ``name`` is refused.
    """
    ret = _ret(name)
    try:
        restart = _flag(restart, "restart")
        if allow_raw_pci is not None:
            allow_raw_pci = _flag(allow_raw_pci, "allow_raw_pci")
        if model is None:
            model = __grains__.get("sosmodel")
        if model in (None, ""):
            raise _Refused("no model: the minion has no sosmodel grain and no model was given")
        model = str(model)
        reserved_cpu = _count(reserved_cpu, "reserved_cpu", 0)
        reserved_memory_gib = _count(reserved_memory_gib, "reserved_memory_gib", 0)
        _check_restart_cmd(restart_cmd)
        if not os.path.isabs(name):
            raise _Refused(f"{name} is not an absolute path")
        st, raw = _read_config(name)
        try:
            old = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused(f"{name} is not UTF-8") from None
        hw = _so_model(defaults, model)
        if allow_raw_pci is None:
            allow_raw_pci = _allow_raw_pci(old)
        new = _splice(old, _render(hw, model, reserved_cpu, reserved_memory_gib, allow_raw_pci))
        marker = _marker(name)
        pending = os.path.lexists(marker)
        if new == old:
            ret["comment"] = f"{name}: [hardware] is already Security Onion model {model}"
            if not pending:
                return ret
            # An earlier run wrote the file but did not restart vmhostd: it still runs the old
            # [hardware] until it is restarted.
            ret["comment"] += f", but vmhostd has not been restarted since it was written ({marker})"
            if not restart:
                ret["comment"] += "; not restarted (restart is False)"
                return ret
            if __opts__.get("test"):
                ret["result"] = None
                ret["changes"] = {"restart": "pending"}
                ret["comment"] += "; vmhostd would be restarted"
                return ret
            return _restart_and_clear(ret, service, restart_cmd, marker)
        diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, name))
        ret["changes"] = {"model": model, "diff": diff}
        if __opts__.get("test"):
            with tempfile.TemporaryDirectory(prefix="vmhost-hw-") as scratch:
                _check_config(vmhostd, _write_candidate(scratch, new, st, keep_owner=False), name)
            ret["result"] = None
            how = "and vmhostd restarted" if restart else "(no restart: restart is False)"
            ret["comment"] = f"{name}: [hardware] would be set to Security Onion model {model} {how}"
            return ret
        tmp = _write_candidate(os.path.dirname(name), new, st)
        try:
            _check_config(vmhostd, tmp, name)
            if restart:
                # Recorded before the rename: if the restart fails (or this process dies), the
                # next run finds the file as wanted and the marker, and restarts then.
                _set_marker(marker, name)
            _replace(name, tmp)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if restart and not pending:
                with contextlib.suppress(OSError):
                    os.unlink(marker)
            raise
    except (_Refused, CommandExecutionError, OSError) as exc:
        ret["result"] = False
        ret["changes"] = {}
        ret["comment"] = str(exc)
        return ret
    ret["comment"] = f"{name}: [hardware] set to Security Onion model {model}"
    if not restart:
        ret["comment"] += "; vmhostd not restarted (restart is False): it reads the file at its next start"
        return ret
    return _restart_and_clear(ret, service, restart_cmd, marker)


def _restart_and_clear(ret, service, restart_cmd, marker):
    """Restarts vmhostd, then removes the restart marker; a failure leaves the marker, so the
    next run restarts again."""
    try:
        ret["changes"]["restart"] = _restart_vmhostd(service, restart_cmd)
    except (_Refused, CommandExecutionError) as exc:
        ret["result"] = False
        ret["comment"] += f"; but vmhostd was not restarted: {exc} (still pending: the next run restarts it)"
        return ret
    ret["comment"] += f"; {ret['changes']['restart']}"
    try:
        _clear_marker(marker)
    except FileNotFoundError:
        pass
    except OSError as exc:
        ret["result"] = False
        ret["comment"] += f"; but {marker} could not be removed ({exc.strerror or exc}): the next run restarts again"
    return ret
