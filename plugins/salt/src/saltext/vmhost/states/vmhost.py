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
nothing but the Python standard library.

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
"""

from salt.exceptions import CommandExecutionError

__virtualname__ = "vmhost"

NOT_FOUND = 4040
SPEC_DRIFT = 2002
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
# interfaces are applied live by the guest agent.
_NOT_DRIFT = ("state", "guest_interfaces")
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
    # The plan's `none` also covers a change of guest_interfaces alone, which vm.apply makes
    # live; the recorded list tells whether there is one.
    if action == "none" and current is not None:
        recorded = (current.get("spec") or {}).get("guest_interfaces") or []
        if recorded != (spec.get("guest_interfaces") or []):
            action = "guest_interfaces"
    if action == "none":
        ret["comment"] = f"VM {name} is as declared ({reason})"
        return ret
    ret["result"] = None
    ret["changes"] = {"action": action, "reason": reason}
    if action == "guest_interfaces":
        ret["comment"] = f"VM {name} would get its guest_interfaces applied live"
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
        ``pci``, ``role``, ``guest_interfaces``) and override it.
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
