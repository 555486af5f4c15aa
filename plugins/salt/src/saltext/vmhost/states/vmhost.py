"""
State module for vmhost: declare the VMs of a hypervisor in Salt states.

Why it exists: operators keep the desired VMs of each hypervisor in Salt. These states hand the
declared spec to vmhostd and report what vmhostd did; every rule (validation, capacity, what
counts as a change) stays in the daemon. Under ``test=True`` the prediction is the daemon's own
dry run (``host.reconcile`` with ``vms=[spec]``, ``prune: false``, ``dry_run: true``: a plan for
this VM that leaves the others alone), never a re-implementation in Python.

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
"""

from salt.exceptions import CommandExecutionError

__virtualname__ = "vmhost"

NOT_FOUND = 4040
# What a plan action means, for comments.
_ACTION_TEXT = {
    "create": "created",
    "replace": "replaced (destroyed and created again: its disk overlay is deleted)",
    "start": "started",
    "stop": "stopped",
    "destroy": "destroyed",
}


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
    """Old/new holding only what differs: status, pid and the top-level spec members."""
    if old is None or new is None:
        return {"old": _summary(old), "new": _summary(new)}
    o, n = {}, {}
    for key in ("status", "pid"):
        if old.get(key) != new.get(key):
            o[key], n[key] = old.get(key), new.get(key)
    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    for key in sorted(set(ospec) | set(nspec)):
        if ospec.get(key) != nspec.get(key):
            o.setdefault("spec", {})[key] = ospec.get(key)
            n.setdefault("spec", {})[key] = nspec.get(key)
    return {"old": o, "new": n}


def _dry_run(ret, spec, current, replace):
    """Fills ``ret`` for test=True from the daemon's plan for this one VM."""
    report = __salt__["vmhost.reconcile"]([spec], prune=False, dry_run=True)
    entry = next((e for e in report.get("plan", []) if e.get("vm") == spec["name"]), None)
    if entry is None:
        ret["result"] = False
        ret["comment"] = f"vmhostd's dry run has no plan entry for VM {spec['name']}"
        return ret
    action, reason, error = entry.get("action"), entry.get("reason", ""), entry.get("error")
    if error:
        data = error.get("data") or {}
        field = f" ({data['field']})" if data.get("field") else ""
        ret["result"] = False
        ret["comment"] = (
            f"VM {spec['name']} would fail to be {_ACTION_TEXT.get(action, action)}: "
            f"vmhostd error {error.get('code')}{field}: {error.get('message')}"
        )
        return ret
    if action == "replace" and not replace:
        ret["result"] = False
        ret["comment"] = f"VM {spec['name']} exists with a different spec ({reason}) and replace is False"
        return ret
    # The plan's `none` also covers a change of guest_interfaces alone, which vm.apply makes
    # live; the recorded list tells whether there is one.
    if action == "none" and current is not None:
        recorded = (current.get("spec") or {}).get("guest_interfaces") or []
        if recorded != (spec.get("guest_interfaces") or []):
            action = "guest_interfaces"
    if action == "none":
        ret["comment"] = f"VM {spec['name']} is as declared ({reason})"
        return ret
    ret["result"] = None
    ret["changes"] = {"action": action, "reason": reason}
    if action == "guest_interfaces":
        ret["comment"] = f"VM {spec['name']} would get its guest_interfaces applied live"
    else:
        ret["comment"] = f"VM {spec['name']} would be {_ACTION_TEXT.get(action, action)} ({reason})"
    return ret


def _converge(name, spec, kwargs, state, replace):
    ret = _ret(name)
    try:
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
            return _dry_run(ret, spec, current, replace)
        result = __salt__["vmhost.apply"](spec, replace=replace)
    except CommandExecutionError as exc:
        ret["result"] = False
        ret["comment"] = str(exc)
        return ret
    new = result.get("vm") or {}
    if not result.get("changed"):
        ret["comment"] = f"VM {name} is as declared ({new.get('status')})"
        return ret
    ret["changes"] = _diff(current, new)
    verb = "created" if current is None else "updated"
    ret["comment"] = f"VM {name} {verb} ({new.get('status')})"
    return ret


def running(name, spec=None, replace=True, **kwargs):
    """
    The VM exists with this spec and runs.

    name
        the VM's name (the spec's ``name``).
    spec
        optional dict with spec members (e.g. from pillar); the state's other arguments are
        spec members too (``cpu``, ``memory_mib``, ``boot``, ``nics``, ``hardware``, ``pci``,
        ``role``, ``guest_interfaces``) and override it.
    replace
        when the VM exists with a different spec: True (default) recreates it (vmhostd deletes
        its disk overlay), False fails with vmhostd's 2002 listing the differing fields.

    Calls ``vm.apply`` with ``state: running``.
    """
    return _converge(name, spec, kwargs, "running", replace)


def stopped(name, spec=None, replace=True, **kwargs):
    """
    The VM exists with this spec and does not run (a new VM is created stopped; a running one
    gets an ACPI power-off, killed after 30 s). Arguments as for ``running``.
    """
    return _converge(name, spec, kwargs, "stopped", replace)


def present(name, spec=None, replace=True, **kwargs):
    """
    The VM exists with this spec; its desired run state is left as vmhostd records it (a new VM
    gets the daemon's default, running). As with ``vm.apply``, vmhostd still converges the VM to
    that recorded state: a VM recorded as running whose QEMU died is started again. Arguments
    as for ``running``.
    """
    return _converge(name, spec, kwargs, None, replace)


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
