//! Capabilities: which ones each process keeps, and why.
//!
//! vmhostd starts as root with every capability. It keeps, in its effective, permitted and
//! bounding sets, exactly [`DAEMON`]; the spawner keeps [`SPAWNER`] (plus `CAP_SYS_MODULE` when
//! passthrough is configured, see [`spawner_caps`]). Inheritable and ambient sets are empty
//! except for that one case. Both processes also set the securebits `SECBIT_NOROOT` and
//! `SECBIT_NO_SETUID_FIXUP` (locked), so a program they start as uid 0 does **not** get the
//! full capability set that root normally gets on `execve`: a program run as root (modprobe,
//! QEMU without a `qemu.user`) has no capabilities at all. Everything else root-owned the daemon needs (its state files, sysfs
//! attributes, `/dev/kvm`, `/dev/vfio/*`, QEMU's sockets, /proc of its QEMUs) is reachable as
//! the owner, without `CAP_DAC_OVERRIDE`; tests prove it (tests/tests/sandbox.rs and every
//! earlier end-to-end test run with `sandbox = "require"`).
//!
//! Order: bounding set first (dropping from it needs `CAP_SETPCAP`), then securebits (also
//! needs `CAP_SETPCAP`), then inheritable, permitted and effective.

use caps::{CapSet, Capability, CapsHashSet};

/// `CAP_SYS_MODULE`'s number (for `PR_CAP_AMBIENT`).
pub const CAP_SYS_MODULE: u32 = 16;

/// What the daemon keeps, each with the reason (shown by docs/sandbox.md and `host.check`).
pub const DAEMON: &[(Capability, &str)] = &[
    (Capability::CAP_NET_ADMIN, "netlink changes to links and bridges, TUNSETIFF/TUNSETPERSIST on /dev/net/tun"),
    (
        Capability::CAP_KILL,
        "signals to QEMU processes that may run as another user (re-adopted VMs, later an unprivileged QEMU user)",
    ),
];

/// Why the daemon keeps `CAP_SYS_NICE` when `[hardware] vm_cpus` is configured.
pub const SYS_NICE_WHY: &str = "sched_setaffinity of the threads of QEMU processes running as another user \
     (vCPU pinning, re-pinning shared VMs, repairing pins after a restart)";

/// The daemon's set: [`DAEMON`] plus `CAP_SYS_NICE` when `pinning` (`[hardware] vm_cpus` is
/// configured): changing the affinity of another user's task needs it, and without `vm_cpus`
/// nothing is pinned, so the daemon does not keep it.
pub fn daemon_caps(pinning: bool) -> Vec<(Capability, &'static str)> {
    let mut v = DAEMON.to_vec();
    if pinning {
        v.push((Capability::CAP_SYS_NICE, SYS_NICE_WHY));
    }
    v
}

/// What the spawner keeps, each with the reason. `CAP_DAC_READ_SEARCH` is permitted but not
/// effective: [`with_effective`] raises it only while a kernel or initrd is opened.
pub const SPAWNER: &[(Capability, &str)] = &[
    (Capability::CAP_SYS_RESOURCE, "raise QEMU's RLIMIT_MEMLOCK hard limit (VFIO pins all guest memory)"),
    (Capability::CAP_SETUID, "start QEMU as the unprivileged qemu.user"),
    (Capability::CAP_SETGID, "start QEMU with qemu.user's group (and the one owning /dev/kvm)"),
    (
        Capability::CAP_DAC_READ_SEARCH,
        "open a kernel or initrd a spec names wherever root could read it (raised only for that open)",
    ),
];

/// Runs `f` with `cap` raised in the effective set (when it is permitted), then lowers it.
/// For a single-threaded process (the spawner): the sets are per thread.
pub fn with_effective<T>(cap: Capability, f: impl FnOnce() -> T) -> T {
    let raised = caps::raise(None, CapSet::Effective, cap).is_ok();
    let out = f();
    if raised {
        let _ = caps::drop(None, CapSet::Effective, cap);
    }
    out
}

/// Why the spawner keeps `CAP_SYS_MODULE` when passthrough is configured.
pub const SYS_MODULE_WHY: &str = "modprobe vfio-pci (its only allowed use), as an ambient capability of that modprobe";

/// Why the spawner keeps `CAP_CHOWN` when passthrough is configured (and it was started with
/// it): putting a VFIO group node back to a group other than root's or qemu.user's, which the
/// spawner, the node's owner and a member of those two, may give it without.
pub const CHOWN_WHY: &str = "put a VFIO group node (/dev/vfio/N) back to a group the spawner is not a member of \
     (raised only for that change)";

/// The spawner's set: [`SPAWNER`] plus `CAP_SYS_MODULE` and `CAP_CHOWN` (permitted, raised only
/// while a VFIO group node changes group; kept only if the daemon was started with it) when
/// `passthrough`.
pub fn spawner_caps(passthrough: bool) -> Vec<(Capability, &'static str)> {
    let mut v = SPAWNER.to_vec();
    if passthrough {
        v.push((Capability::CAP_SYS_MODULE, SYS_MODULE_WHY));
        v.push((Capability::CAP_CHOWN, CHOWN_WHY));
    }
    v
}

/// Capability errors.
#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    /// A capability set could not be read or changed.
    #[error("cannot change the {set} capability set: {source}")]
    Set {
        /// Which set.
        set: &'static str,
        /// From the caps crate.
        source: caps::errors::CapsError,
    },
    /// prctl(PR_SET_SECUREBITS) failed.
    #[error("cannot set securebits: {0}")]
    Securebits(std::io::Error),
    /// The sets read back after the change are not the ones asked for.
    #[error("capabilities after dropping are {found}, expected {expected}")]
    Mismatch {
        /// What /proc/self/status shows.
        found: String,
        /// What was asked for.
        expected: String,
    },
}

const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;

/// Reduces the calling thread (before other threads exist: the process) to `keep` (those of
/// them it has).
///
/// `inheritable` is added to the inheritable set (for an ambient raise in a child).
///
/// # Errors
/// [`CapsError`] when a set cannot be changed or does not read back as asked.
pub fn restrict(keep: &[Capability], inheritable: &[Capability]) -> Result<(), CapsError> {
    // What the process was not started with cannot be kept (e.g. a container without
    // CAP_SYS_RESOURCE): keep the intersection, and host.check shows the result.
    let had = CapSets::of_self().permitted;
    let keep: Vec<Capability> = keep.iter().copied().filter(|c| had & c.bitmask() != 0).collect();
    let inheritable: Vec<Capability> = inheritable.iter().copied().filter(|c| had & c.bitmask() != 0).collect();
    let set: CapsHashSet = keep.iter().copied().collect();
    let set_err = |set: &'static str| move |source| CapsError::Set { set, source };
    for cap in caps::all() {
        if !set.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap).map_err(set_err("bounding"))?;
        }
    }
    let bits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_SETUID_FIXUP_LOCKED;
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) } != 0 {
        return Err(CapsError::Securebits(std::io::Error::last_os_error()));
    }
    caps::clear(None, CapSet::Ambient).map_err(set_err("ambient"))?;
    let inh: CapsHashSet = inheritable.iter().copied().collect();
    caps::set(None, CapSet::Inheritable, &inh).map_err(set_err("inheritable"))?;
    caps::set(None, CapSet::Effective, &set).map_err(set_err("effective"))?;
    caps::set(None, CapSet::Permitted, &set).map_err(set_err("permitted"))?;
    caps::set(None, CapSet::Effective, &set).map_err(set_err("effective"))?;
    let found = CapSets::of_self();
    let want = mask(&keep);
    if found.effective != want || found.permitted != want || found.bounding != want || found.ambient != 0 {
        return Err(CapsError::Mismatch { found: found.describe(), expected: names(want) });
    }
    Ok(())
}

/// Bit mask of a list of capabilities.
pub fn mask(caps: &[Capability]) -> u64 {
    caps.iter().fold(0, |m, c| m | c.bitmask())
}

/// `cap_net_admin,cap_kill` for a mask (`none` when empty), lowest bit first.
pub fn names(mask: u64) -> String {
    let mut caps: Vec<Capability> = caps::all().into_iter().filter(|c| mask & c.bitmask() != 0).collect();
    caps.sort_by_key(Capability::index);
    if caps.is_empty() {
        return "none".into();
    }
    caps.iter().map(|c| c.to_string().to_lowercase()).collect::<Vec<_>>().join(",")
}

/// The five sets as /proc/PID/status shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapSets {
    /// CapInh.
    pub inheritable: u64,
    /// CapPrm.
    pub permitted: u64,
    /// CapEff.
    pub effective: u64,
    /// CapBnd.
    pub bounding: u64,
    /// CapAmb.
    pub ambient: u64,
}

impl CapSets {
    /// Parses the `Cap*` lines of a /proc/PID/status text (missing lines read as 0).
    pub fn parse(status: &str) -> CapSets {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .unwrap_or(0)
        };
        CapSets {
            inheritable: field("CapInh:"),
            permitted: field("CapPrm:"),
            effective: field("CapEff:"),
            bounding: field("CapBnd:"),
            ambient: field("CapAmb:"),
        }
    }

    /// This process's sets.
    pub fn of_self() -> CapSets {
        CapSets::parse(&std::fs::read_to_string("/proc/self/status").unwrap_or_default())
    }

    /// Sets of process `pid` (all zero when it cannot be read).
    pub fn of_pid(pid: i32) -> CapSets {
        CapSets::parse(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default())
    }

    /// `effective=…; permitted=…; bounding=…; inheritable=…; ambient=…` with names.
    pub fn describe(&self) -> String {
        format!(
            "effective={} permitted={} bounding={} inheritable={} ambient={}",
            names(self.effective),
            names(self.permitted),
            names(self.bounding),
            names(self.inheritable),
            names(self.ambient)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_and_spawner_sets_are_the_documented_ones() {
        let d: Vec<Capability> = DAEMON.iter().map(|(c, _)| *c).collect();
        assert_eq!(d, [Capability::CAP_NET_ADMIN, Capability::CAP_KILL]);
        assert_eq!(names(mask(&d)), "cap_kill,cap_net_admin");
        let d: Vec<Capability> = daemon_caps(false).iter().map(|(c, _)| *c).collect();
        assert_eq!(names(mask(&d)), "cap_kill,cap_net_admin");
        let d: Vec<Capability> = daemon_caps(true).iter().map(|(c, _)| *c).collect();
        assert_eq!(names(mask(&d)), "cap_kill,cap_net_admin,cap_sys_nice");
        let s: Vec<Capability> = spawner_caps(false).iter().map(|(c, _)| *c).collect();
        assert_eq!(names(mask(&s)), "cap_dac_read_search,cap_setgid,cap_setuid,cap_sys_resource");
        let s: Vec<Capability> = spawner_caps(true).iter().map(|(c, _)| *c).collect();
        assert_eq!(
            names(mask(&s)),
            "cap_chown,cap_dac_read_search,cap_setgid,cap_setuid,cap_sys_module,cap_sys_resource"
        );
        assert_eq!(Capability::CAP_SYS_MODULE.index() as u32, CAP_SYS_MODULE);
        assert_eq!(names(0), "none");
    }

    #[test]
    fn status_lines_parse() {
        let s = "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t0000000000001020\nCapEff:\t0000000000001020\nCapBnd:\t0000000000001020\nCapAmb:\t0000000000000000\n";
        let c = CapSets::parse(s);
        assert_eq!(c.effective, (1 << 12) | (1 << 5));
        assert_eq!(names(c.effective), "cap_kill,cap_net_admin");
        assert_eq!(c.ambient, 0);
    }
}
