"""
vmhost runner: the fleet of vmhostds seen from the Salt master. Moves a VM between
hypervisors (``vmhost.migrate``), empties a hypervisor (``vmhost.evacuate``) and picks a host
for a new spec (``vmhost.place``).

Why it exists: each vmhostd knows only its own host; moving a VM needs two of them (the
destination prepares with ``vm.migrate_in``, the source sends with ``vm.migrate`` or
``vm.move``) and choosing a host needs all of them. The runner asks the minions' ``vmhost``
execution module for what their vmhostds report, plans with the pure ``placement`` module and
drives the two calls of each move. Each vmhostd still admits or refuses what it is sent.

Order of use: :class:`Fleet` asks the minions (or reads a saved snapshot, ``fleet=PATH``) and
turns the answers into hosts (``placement.host_view``); the public functions plan on them;
:func:`_move` runs one move: the destination's check, the Security Onion hold (:class:`SoVms`),
``migrate_in`` there, ``migrate``/``move`` here, the SO files' update, the hold lifted.

Master config (all optional)::

    vmhost_runner:
      hosts: 'hv*'          # the hypervisor minions (default '*': minions without vmhostd are
      tgt_type: glob        #   left out, they answer no host.info)
      timeout: 60           # seconds to wait for the minions' reads
      anti_affinity: role   # spec member whose equal values are kept apart ('' = none)
      so: true              # update Security Onion's VMs files (default: when the
                            #   vmhost_engine engine is configured with so_compat)

See docs/salt.md, "Runner".
"""

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

__virtualname__ = "vmhost"

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TIMEOUT = 60
# vm.migrate's default timeout_s; the runner waits that long plus MARGIN for the source.
DEFAULT_MIGRATE_TIMEOUT_S = 3600
# vmhost.move waits vmhost:move_timeout (default 6 h) on the minion.
DEFAULT_MOVE_WAIT = 6 * 3600
MARGIN = 300
# vmhostd's migration_in preparation must be answered well within this.
PREPARE_WAIT = 300


def _load(name, relpath):
    """A sibling module of the extension: the installed package's, else the file next to this
    one (the runner loaded from a ``runner_dirs`` directory of a checkout)."""
    try:
        return importlib.import_module(f"saltext.vmhost.{name}")
    except ImportError:
        pass
    key = f"_vmhost_runner_{name.replace('.', '_')}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, os.path.join(PKG_DIR, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


placement = _load("placement", "placement.py")
engine_lib = _load("engines.vmhost_engine", os.path.join("engines", "vmhost_engine.py"))


def __virtual__():
    return __virtualname__


class RunnerError(Exception):
    """A refusal or failure the runner reports (its message is the answer's ``error``)."""


def _opts():
    return globals().get("__opts__") or {}


def _conf():
    conf = _opts().get("vmhost_runner") or {}
    return conf if isinstance(conf, dict) else {}


def _setting(value, key, default):
    """An argument, else the master config's ``vmhost_runner:KEY``, else ``default``."""
    if value not in (None, ""):
        return value
    found = _conf().get(key)
    return default if found is None else found


def _flag(value, name):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.strip().lower() in ("true", "yes", "on", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RunnerError(f"{name} must be True or False, not {value!r}")


def _spec_arg(spec):
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise RunnerError(f"spec is not JSON: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RunnerError("spec must be a VM spec (a dict with a name, see docs/api.md)")
    return spec


def _failed(message, **extra):
    """The answer of a refused or failed call. The job fails: ``salt-run`` exits with the
    answer's ``retcode`` (Salt 3007 reads it from the returned dict), and the job's
    ``success`` comes from ``__context__["retcode"]``."""
    context = globals().get("__context__")
    if hasattr(context, "__setitem__"):
        context["retcode"] = 1
    return dict(extra, result=False, error=message, retcode=1)


def _no_answer(answer):
    return engine_lib._no_answer(answer)  # pylint: disable=protected-access


class Fleet:
    """The hypervisor minions: ``client`` has LocalClient's ``cmd``; ``hosts``/``tgt_type``
    target them; ``snapshot`` (a dict as :meth:`raw` returns, from ``fleet=PATH``) answers the
    reads instead of the minions and forbids every change."""

    def __init__(self, client, hosts="*", tgt_type="glob", timeout=DEFAULT_TIMEOUT, snapshot=None):
        self.client = client
        self.hosts = hosts
        self.tgt_type = tgt_type
        self.timeout = timeout
        self.snapshot = snapshot

    def call(self, minion, fun, kwarg=None, timeout=None):
        """One minion's answer to ``fun`` (the execution module's return); raises RunnerError
        when it did not answer or failed."""
        if self.snapshot is not None:
            raise RunnerError(f"{fun} on {minion}: not with fleet=PATH (a saved snapshot only plans)")
        timeout = timeout or self.timeout
        try:
            ret = self.client.cmd([minion], fun, kwarg=kwarg or {}, tgt_type="list", timeout=timeout, full_return=True)
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            raise RunnerError(f"{fun} on {minion} could not be published: {exc}") from None
        answer = ret.get(minion) if isinstance(ret, dict) else None
        if _no_answer(answer):
            raise RunnerError(f"minion {minion} did not answer {fun} within {timeout} s")
        retcode, body = answer.get("retcode", 0), answer["ret"]
        if retcode not in (0, None) or (isinstance(body, str) and body.startswith("ERROR")):
            raise RunnerError(f"{fun} failed on {minion}: {str(body)[:2000]}")
        return body

    def lists(self, fun):
        """``({minion: answer}, {minion: why not})`` of ``fun`` on every targeted minion."""
        try:
            ret = self.client.cmd(self.hosts, fun, tgt_type=self.tgt_type, timeout=self.timeout, full_return=True)
        except Exception as exc:  # noqa: BLE001  pylint: disable=broad-except
            raise RunnerError(f"{fun} could not be published to {self.hosts}: {exc}") from None
        good, bad = {}, {}
        for minion, answer in sorted((ret or {}).items()):
            if _no_answer(answer):
                bad[minion] = "no answer"
                continue
            body = answer["ret"]
            if answer.get("retcode", 0) not in (0, None) or (isinstance(body, str) and body.startswith("ERROR")):
                bad[minion] = str(body)[:500]
                continue
            good[minion] = body
        return good, bad

    def raw(self):
        """``{hosts: {minion: {info, vms, images}}, skipped: {minion: why}}``: what every
        targeted minion's vmhostd answered to ``host.info``, ``vm.list`` and ``image.list``.
        A minion missing one of them (no vmhostd, down) is skipped."""
        if self.snapshot is not None:
            return self.snapshot
        infos, skipped = self.lists("vmhost.info")
        vms, bad_vms = self.lists("vmhost.list")
        images, bad_images = self.lists("vmhost.image_list")
        hosts = {}
        for minion, info in infos.items():
            if minion not in vms:
                skipped[minion] = f"vmhost.list: {bad_vms.get(minion, 'no answer')}"
                continue
            hosts[minion] = {"info": info, "vms": vms[minion], "images": images.get(minion)}
        return {"hosts": hosts, "skipped": skipped}

    def views(self):
        """``(hosts as placement.host_view, skipped)``."""
        raw = self.raw()
        hosts, skipped = [], dict(raw.get("skipped") or {})
        for minion, data in sorted((raw.get("hosts") or {}).items()):
            try:
                hosts.append(placement.host_view(minion, data.get("info"), data.get("vms"), data.get("images")))
            except placement.PlacementError as exc:
                skipped[minion] = str(exc)
        return hosts, skipped

    def view_of(self, minion):
        """One host's view, asked of that minion alone."""
        info = self.call(minion, "vmhost.info")
        vms = self.call(minion, "vmhost.list")
        images = self.call(minion, "vmhost.image_list")
        return placement.host_view(minion, info, vms, images)


def _local_client():
    """The master's LocalClient (replaced in the tests by one answering from fake minions)."""
    import salt.client  # pylint: disable=import-outside-toplevel

    return salt.client.LocalClient(mopts=_opts())


def _fleet(hosts=None, tgt_type=None, fleet=None, client=None):
    snapshot = None
    if fleet not in (None, ""):
        try:
            with open(fleet, encoding="utf-8") as f:
                snapshot = json.load(f)
        except (OSError, ValueError) as exc:
            raise RunnerError(f"cannot read the fleet snapshot {fleet}: {exc}") from None
        if not isinstance(snapshot, dict) or not isinstance(snapshot.get("hosts"), dict):
            raise RunnerError(f"{fleet}: not a fleet snapshot (salt-run vmhost.fleet's answer)")
    if client is None and snapshot is None:
        client = _local_client()
    return Fleet(
        client,
        _setting(hosts, "hosts", "*"),
        _setting(tgt_type, "tgt_type", "glob"),
        int(_setting(None, "timeout", DEFAULT_TIMEOUT)),
        snapshot,
    )


# ---------------------------------------------------------------------------------------------
# Security Onion's VMs files
# ---------------------------------------------------------------------------------------------


class SoVms:
    """The vmhost_engine's ``<hypervisor>VMs`` files, seen by the runner: which file drives a
    minion, the entry of a VM, the hold that keeps the engine off a VM while it moves
    (``engine_lib.HOLDS_FILE``), and the move of the entry from one file to the other. Every
    file is opened relative to one descriptor of ``vms_dir`` (no link followed) and replaced
    atomically (temp file, fsync, rename, fsync of the directory), keeping its mode and owner."""

    def __init__(self, vms_dir, suffix="VMs", minion_id="{hypervisor}_*", accepted=None, clock=time.time):
        self.vms_dir = vms_dir
        self.suffix = suffix
        self.minion_id = minion_id
        self.accepted = accepted or (lambda: [])
        self.clock = clock
        self.fd = None

    def __enter__(self):
        self.fd = engine_lib.open_dir_nofollow(self.vms_dir)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def hypervisor_of(self, minion):
        """The hypervisor (file prefix) whose file drives ``minion``, or None. Raises
        RunnerError when several do (the engine runs neither)."""
        keys = list(self.accepted())
        found = []
        for fname in sorted(os.listdir(self.fd)):
            if fname.startswith(".") or not fname.endswith(self.suffix):
                continue
            hyp = fname[: -len(self.suffix)]
            try:
                if engine_lib.resolve_minion(self.minion_id, hyp, keys) == minion:
                    found.append(hyp)
            except engine_lib.TargetError:
                continue
        if len(found) > 1:
            raise RunnerError(f"{', '.join(found)}: several VMs files drive {minion}")
        return found[0] if found else None

    def _read(self, name):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None, None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > engine_lib.MAX_FILE_BYTES:
                raise RunnerError(f"{self.vms_dir}/{name}: not a regular file of at most 1 MiB")
            data = f.read(engine_lib.MAX_FILE_BYTES + 1)
        try:
            return json.loads(data) if data.strip() else None, st
        except ValueError as exc:
            raise RunnerError(f"{self.vms_dir}/{name}: not JSON: {exc}") from None

    def _write(self, name, obj, like=None, indent=2):
        data = json.dumps(obj, indent=indent).encode("utf-8") + b"\n"
        tmp = f".{name}.vmhost-runner-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if like is not None:
                    os.fchmod(f.fileno(), like.st_mode & 0o7777)
                    if os.geteuid() == 0:
                        os.fchown(f.fileno(), like.st_uid, like.st_gid)
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        os.fsync(self.fd)

    def entry(self, vm, hypervisor):
        """``(index, entry)`` of the entry naming ``vm`` in ``hypervisor``'s file, or None."""
        entries, _ = self._read(hypervisor + self.suffix)
        for i, item in enumerate(entries if isinstance(entries, list) else []):
            if engine_lib.vm_name(item) == vm:
                return i, item
        return None

    def barred(self, source, hosts):
        """``{vm: {host: reason}}``: the VMs of ``source`` in its VMs file may go only to hosts
        a VMs file drives (elsewhere the engine would make them again on ``source``)."""
        src_hyp = self.hypervisor_of(source)
        if src_hyp is None:
            return {}
        entries, _ = self._read(src_hyp + self.suffix)
        names = (
            {engine_lib.vm_name(e) for e in entries if engine_lib.vm_name(e)} if isinstance(entries, list) else set()
        )
        without = [h["name"] for h in hosts if h["name"] != source and self.hypervisor_of(h["name"]) is None]
        reason = f"no Security Onion VMs file drives it ({source}'s file lists the VM)"
        return {vm: {h: reason for h in without} for vm in sorted(names) if without}

    def holds(self):
        try:
            return engine_lib.read_holds(self.fd)
        except OSError as exc:
            raise RunnerError(f"{self.vms_dir}/{engine_lib.HOLDS_FILE}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self):
        """Runners at once (two moves, an evacuation and a release) take turns at each
        read-change-write of the holds and VMs files: an exclusive flock on ``vms_dir``, held
        for the rewrite only, never across a move."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def hold(self, vm, source, destination):
        with self._locked():
            holds = self.holds()
            if vm in holds:
                raise RunnerError(
                    f"{vm} is held already ({json.dumps(holds[vm], sort_keys=True)}): another move runs, or one "
                    f"was interrupted (then: salt-run vmhost.release {vm})"
                )
            holds[vm] = {"from": source, "to": destination, "since": int(self.clock())}
            _, st = self._read(engine_lib.HOLDS_FILE)
            self._write(engine_lib.HOLDS_FILE, holds, st, indent=1)

    def release(self, vm):
        with self._locked():
            holds = self.holds()
            if holds.pop(vm, None) is None:
                return False
            _, st = self._read(engine_lib.HOLDS_FILE)
            if holds:
                self._write(engine_lib.HOLDS_FILE, holds, st, indent=1)
            else:
                os.unlink(engine_lib.HOLDS_FILE, dir_fd=self.fd)
                os.fsync(self.fd)
            return True

    def transfer(self, vm, source_hyp, dest_hyp):
        """Moves ``vm``'s entry from ``source_hyp``'s file to the end of ``dest_hyp``'s (the
        destination's file first: while the hold stands the engine reads neither entry)."""
        with self._locked():
            self._transfer(vm, source_hyp, dest_hyp)

    def _transfer(self, vm, source_hyp, dest_hyp):
        src, src_st = self._read(source_hyp + self.suffix)
        dst, dst_st = self._read(dest_hyp + self.suffix)
        if not isinstance(src, list):
            raise RunnerError(f"{source_hyp}{self.suffix}: not a JSON array")
        if dst is None:
            dst = []
        if not isinstance(dst, list):
            raise RunnerError(f"{dest_hyp}{self.suffix}: not a JSON array")
        keep = [e for e in src if engine_lib.vm_name(e) != vm]
        moved = [e for e in src if engine_lib.vm_name(e) == vm]
        if len(moved) != 1:
            raise RunnerError(f"{source_hyp}{self.suffix}: {len(moved)} entries name {vm}")
        if any(engine_lib.vm_name(e) == vm for e in dst):
            raise RunnerError(f"{dest_hyp}{self.suffix}: an entry names {vm} already")
        self._write(dest_hyp + self.suffix, dst + moved, dst_st)
        self._write(source_hyp + self.suffix, keep, src_st)


def _so(so=None):
    """SoVms of the master's vmhost_engine config, or None when SO files are not updated
    (``so=False``, or no engine with ``so_compat``)."""
    wanted = _setting(so, "so", None)
    if wanted is not None and not _flag(wanted, "so"):
        return None
    conf = None
    for item in _opts().get("engines") or []:
        if isinstance(item, dict) and isinstance(item.get("vmhost_engine"), dict):
            conf = item["vmhost_engine"]
    if conf is None or not isinstance(conf.get("vms_dir"), str):
        if wanted is not None:
            raise RunnerError("so=True but the master config has no vmhost_engine engine with vms_dir")
        return None
    vms_dir = conf["vms_dir"]
    so_compat = conf.get("so_compat", os.path.normpath(vms_dir) == engine_lib.SO_VMS_DIR)
    if wanted is None and not so_compat:
        return None
    pki = _opts().get("pki_dir")
    return SoVms(
        vms_dir,
        conf.get("suffix", "VMs"),
        conf.get("minion_id", "{hypervisor}_*"),
        (lambda: engine_lib.accepted_minions(pki)) if pki else None,
    )


# ---------------------------------------------------------------------------------------------
# One move
# ---------------------------------------------------------------------------------------------


def _source_of(fleet, vm):
    """The one minion whose vmhostd has ``vm``, and its view."""
    if fleet.snapshot is not None:
        lists = {m: d.get("vms") for m, d in fleet.snapshot["hosts"].items()}
    else:
        lists, _ = fleet.lists("vmhost.list")
    found = [
        (m, v)
        for m, vms in sorted(lists.items())
        for v in (vms if isinstance(vms, list) else [])
        if isinstance(v, dict) and v.get("name") == vm
    ]
    if not found:
        raise RunnerError(f"no hypervisor among {fleet.hosts} has a VM {vm}")
    if len(found) > 1:
        raise RunnerError(f"VM {vm} is on {', '.join(m for m, _ in found)}: give source=")
    return found[0]


def _move(fleet, vm, source, to, view=None, check=True, so=None, migrate_args=None):
    """Moves ``vm`` from minion ``source`` to minion ``to``; returns the report. Raises
    RunnerError before anything moved when it cannot."""
    if source == to:
        raise RunnerError(f"{vm} is on {to} already")
    if view is None:
        view = fleet.call(source, "vmhost.get", {"name": vm})
    how = placement.movability(view)
    if how["mode"] is None:
        raise RunnerError(f"{vm} cannot move now: {how['reason']}")
    try:
        spec = placement.migration_spec(view)
    except placement.PlacementError as exc:
        raise RunnerError(str(exc)) from None
    if check:
        reasons = placement.misfits(spec, fleet.view_of(to))
        if reasons:
            raise RunnerError(f"{vm} does not fit {to}: {'; '.join(reasons)}")
    report = {"vm": vm, "from": source, "to": to, "mode": how["mode"], "stop": how["stop"]}
    so_hyps = None
    if so is not None:
        src_hyp = so.hypervisor_of(source)
        if src_hyp is not None and so.entry(vm, src_hyp) is not None:
            dst_hyp = so.hypervisor_of(to)
            if dst_hyp is None:
                raise RunnerError(
                    f"{vm} is in {src_hyp}{so.suffix} (Security Onion) but no VMs file drives {to}: the engine "
                    f"would make {vm} again on {source}; create the destination's file (it may be []) first"
                )
            so.hold(vm, source, to)
            so_hyps = (src_hyp, dst_hyp)
    sent = done = False
    try:
        prepared = fleet.call(to, "vmhost.migrate_in", {"spec": spec, "mode": how["mode"]}, timeout=PREPARE_WAIT)
        if not isinstance(prepared, dict) or not prepared.get("address") or not prepared.get("secret"):
            raise RunnerError(f"vmhost.migrate_in on {to} answered without address and secret: {str(prepared)[:300]}")
        args = {"name": vm, "destination": prepared["address"], "secret": prepared["secret"]}
        sent = True
        if how["mode"] == "live":
            args.update({k: v for k, v in (migrate_args or {}).items() if v not in (None, "")})
            wait = int(args.get("timeout_s") or DEFAULT_MIGRATE_TIMEOUT_S) + MARGIN
            report["outcome"] = fleet.call(source, "vmhost.migrate", args, timeout=wait)
        else:
            args["stop"] = how["stop"]
            report["outcome"] = fleet.call(source, "vmhost.move", args, timeout=DEFAULT_MOVE_WAIT + MARGIN)
        if so_hyps is not None:
            so.transfer(vm, *so_hyps)
            report["so"] = {"from": so_hyps[0] + so.suffix, "to": so_hyps[1] + so.suffix}
        done = True
    finally:
        if so_hyps is not None and not done:
            # Refused before anything was sent: the VM and its entry stayed. Once sent, a
            # failure may still end with the VM on the destination (the runner's wait ran out,
            # or the daemons settle an unknown outcome later): the entry follows where the VM
            # is, and while that is not known the hold stays (`vmhost.release` lifts it).
            where = _where_now(fleet, vm, source, to) if sent else "source"
            if where == "destination":
                so.transfer(vm, *so_hyps)
            if where is not None:
                so.release(vm)
        elif so_hyps is not None:
            so.release(vm)
    return report


def _settled(view):
    """Whether a ``vmhost.get`` answer shows a VM no migration is settling."""
    if not isinstance(view, dict) or view.get("status") not in ("running", "stopped", "dead"):
        return False
    migration = view.get("migration")
    return not migration or (migration.get("role") == "incoming" and migration.get("phase") == "committed")


def _where_now(fleet, vm, source, to):
    """``"destination"`` or ``"source"`` when the VM is settled on exactly that minion, else
    None (unknown yet, or unreachable)."""
    found = {}
    for side, minion in (("destination", to), ("source", source)):
        try:
            found[side] = fleet.call(minion, "vmhost.get", {"name": vm})
        except RunnerError:
            found[side] = None
    here = [side for side, view in found.items() if _settled(view)]
    return here[0] if len(here) == 1 else None


def _migrate_args(max_downtime_ms, bandwidth_mib_s, timeout_s):
    return {"max_downtime_ms": max_downtime_ms, "bandwidth_mib_s": bandwidth_mib_s, "timeout_s": timeout_s}


# ---------------------------------------------------------------------------------------------
# Runner functions
# ---------------------------------------------------------------------------------------------


def fleet(hosts=None, tgt_type=None):
    """
    What every hypervisor minion's vmhostd reports (``host.info``, ``vm.list``,
    ``image.list``): ``{hosts: {minion: {info, vms, images}}, skipped: {minion: why}}``. Saved
    to a file, it is a snapshot ``place`` and ``evacuate dry_run=True`` can plan from
    (``fleet=PATH``).

    CLI Example: ``salt-run vmhost.fleet --out=json > fleet.json``
    """
    try:
        return _fleet(hosts, tgt_type).raw()
    except RunnerError as exc:
        return _failed(str(exc))


def place(spec, hosts=None, tgt_type=None, anti_affinity=None, fleet=None):  # pylint: disable=redefined-outer-name
    """
    The minion whose vmhostd should get a new VM ``spec``: every host the spec fits
    (capacity, networks, capture interfaces, image, passthrough devices, no name taken),
    VMs with the same ``anti_affinity`` value (default: the spec's ``role``) kept apart while
    another host has room, then the most free memory, then the name. Nothing is created: give
    the answer's ``host`` to ``salt HOST vmhost.apply``; that vmhostd still admits or refuses.

    Returns ``{result, host, key, sharing, ranking, refused, skipped}``; ``result`` False
    (retcode 1) when no host fits.

    CLI Example: ``salt-run vmhost.place spec='{"name": "web3", "role": "web", ...}'``
    """
    try:
        spec = _spec_arg(spec)
        hosts_, skipped = _fleet(hosts, tgt_type, fleet).views()
        choice = placement.place(spec, hosts_, _setting(anti_affinity, "anti_affinity", "role"))
    except (RunnerError, placement.PlacementError) as exc:
        return _failed(str(exc))
    choice["skipped"] = skipped
    if choice["host"] is None:
        return _failed(f"no host fits {spec['name']}", **choice)
    return dict(choice, result=True)


def migrate(
    vm,
    to,
    source=None,
    hosts=None,
    tgt_type=None,
    check=True,
    so=None,
    max_downtime_ms=None,
    bandwidth_mib_s=None,
    timeout_s=None,
):
    """
    Move VM ``vm`` to minion ``to``: live (``vm.migrate``) when it runs without passthrough,
    cold (``vm.move``) when it is stopped, or when it passes devices through (stopped, moved,
    started again there: ``stop=True``). ``source`` is found by asking the minions'
    ``vmhost.list`` when not given. With ``check`` (default) the destination's host.info is
    checked first (placement's rules) and the move refused with the reasons. A VM in a Security
    Onion VMs file has its entry moved to the destination's file.

    Returns ``{result, vm, from, to, mode, stop, outcome, so}``: ``outcome`` the source's
    ``vm.migrate``/``vm.move`` answer (times, downtime, bytes), ``so`` the VMs files the entry
    moved between (absent when the VM is in none).

    CLI Example: ``salt-run vmhost.migrate vm=web1 to=hv2``
    """
    try:
        fl = _fleet(hosts, tgt_type)
        view = None
        if source in (None, ""):
            source, view = _source_of(fl, vm)
        args = (fl, vm, source, to, view, _flag(check, "check"))
        extra = _migrate_args(max_downtime_ms, bandwidth_mib_s, timeout_s)
        files = _so(so)
        if files is None:
            report = _move(*args, None, extra)
        else:
            with files:
                report = _move(*args, files, extra)
    except (RunnerError, OSError) as exc:
        return _failed(str(exc), vm=vm, to=to, **({"from": source} if source else {}))
    report["result"] = True
    return report


def evacuate(host, dry_run=False, hosts=None, tgt_type=None, anti_affinity=None, so=None, fleet=None):  # pylint: disable=redefined-outer-name
    """
    Move every movable VM off minion ``host`` to the other hypervisors with room: live where
    possible, cold for stopped VMs and for passthrough VMs (only onto hosts whose same
    hardware class and index is free). The plan (``placement.evacuate_plan``) is made first
    from every host's answers; ``dry_run=True`` returns it and moves nothing. Otherwise each
    move runs in the plan's order and the report says how each went; a failed move does not
    stop the others.

    Returns ``{result, host, dry_run, plan: {moves, unmovable, unplaced}, done, failed,
    skipped}``; ``result`` False (retcode 1) when a VM stays (unmovable, unplaced or failed).

    CLI Example: ``salt-run vmhost.evacuate host=hv1 dry_run=True``
    """
    try:
        dry = _flag(dry_run, "dry_run")
        if not dry and fleet not in (None, ""):
            raise RunnerError("fleet=PATH only plans: use dry_run=True, or ask the minions")
        fl = _fleet(hosts, tgt_type, fleet)
        hosts_, skipped = fl.views()
        so_files = _so(so)
        barred = {}
        if so_files is not None:
            with so_files:
                barred = so_files.barred(host, hosts_)
        plan = placement.evacuate_plan(host, hosts_, _setting(anti_affinity, "anti_affinity", "role"), barred)
    except (RunnerError, placement.PlacementError, OSError) as exc:
        return _failed(str(exc), host=host)
    report = {"host": host, "dry_run": dry, "plan": plan, "skipped": skipped, "done": [], "failed": []}
    if not dry:
        views = {v["name"]: v for h in hosts_ if h["name"] == host for v in h["vms"]}
        for step in plan["moves"]:
            try:
                if so_files is not None:
                    with so_files:
                        done = _move(fl, step["vm"], host, step["to"], views[step["vm"]], True, so_files)
                else:
                    done = _move(fl, step["vm"], host, step["to"], views[step["vm"]], True, None)
                report["done"].append(done)
            except (RunnerError, OSError) as exc:
                log.error("vmhost.evacuate: %s -> %s: %s", step["vm"], step["to"], exc)
                report["failed"].append({"vm": step["vm"], "to": step["to"], "error": str(exc)})
    stays = plan["unmovable"] or plan["unplaced"] or report["failed"]
    if stays:
        return _failed(f"{host}: some VMs stay (see plan.unmovable, plan.unplaced, failed)", **report)
    report["result"] = True
    return report


def release(vm, so=None):
    """
    Lift the Security Onion hold of ``vm`` that an interrupted ``vmhost.migrate`` or
    ``vmhost.evacuate`` left (the engine leaves a held VM alone). Check first where the VM runs
    and that its entry is in that hypervisor's VMs file.

    CLI Example: ``salt-run vmhost.release sensor1_sensor``
    """
    try:
        files = _so(so)
        if files is None:
            raise RunnerError("no Security Onion VMs files configured (vmhost_engine with so_compat)")
        with files:
            return {"result": True, "released": files.release(vm)}
    except (RunnerError, OSError) as exc:
        return _failed(str(exc))
