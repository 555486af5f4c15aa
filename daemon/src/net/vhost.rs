//! vhost-net: the host kernel moves a NIC's packets between its tap and the guest's virtio-net
//! queues, instead of a QEMU thread copying each one through userspace.
//!
//! Why: a sensor VM receives line-rate traffic; in QEMU's userspace every packet costs two copies
//! and a wake-up of QEMU's main loop, with vhost-net a kernel thread per queue reads the tap and
//! writes guest memory directly. QEMU gets one `/dev/vhost-net` descriptor per queue
//! (`vhostfd=`/`vhostfds=`) and binds it to itself (`VHOST_SET_OWNER`), so it needs no access to
//! the device node: the daemon opens it, as it makes the taps.
//!
//! vhost-net needs KVM: virtio-pci uses ioeventfds only with KVM, and without them QEMU cannot
//! start vhost-net; under TCG it would take the descriptors and then, when the guest's driver
//! starts, fall back on userspace virtio-net, while the view said vhost. So [`for_accel`] makes
//! vhost-net unusable under TCG, and the view and `host.check` say so.
//!
//! Order of use: [`for_accel`] (of [`probe`]) answers `host.check` (item `vhost_net`) and whether
//! a launch tries vhost at all; at a launch, [`open_for_nics`] opens one descriptor per queue of each NIC,
//! before the taps are made. Nothing is configured: vhost-net is used whenever the device can be
//! opened, and a VM starts without it (virtio-net in QEMU's userspace, slower but the same to
//! the guest) when it cannot. What a running VM got is in its record ([`crate::nic::NicAlloc`])
//! and its view (`vm.get`'s `nics[i].vhost`).

use std::fs::OpenOptions;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use super::NetError;

/// The vhost-net control device.
pub const VHOST_NET_DEVICE: &str = "/dev/vhost-net";

/// Whether VMs can get vhost-net, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostStatus {
    /// `/dev/vhost-net` opens read-write for the daemon.
    pub usable: bool,
    /// What was found: the device opened, or why it did not (absent, refused, no module).
    pub reason: String,
}

/// Debug builds only (tests): set to `1`, vhost-net is used under TCG too, so the lab (TCG) can
/// prove that the descriptors reach QEMU. QEMU then falls back on userspace virtio-net.
pub const TEST_UNDER_TCG_VAR: &str = "VMHOST_TEST_VHOST_UNDER_TCG";

/// Why VMs run with `accel` get no vhost-net whatever the device says (TCG: no ioeventfds
/// without KVM, module doc), or `None` when they may. Pure apart from the debug builds' test
/// variable.
pub fn accel_refusal(accel: crate::config::Accel) -> Option<String> {
    refusal(accel, test_override())
}

/// [`TEST_UNDER_TCG_VAR`] as the process started: the sandbox clears the environment, so
/// [`capture_test_override`] reads it before (the first call reads it otherwise).
static TEST_OVERRIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Reads [`TEST_UNDER_TCG_VAR`] once (debug builds; always false in release builds). Called by
/// the sandbox before it clears the environment.
pub fn capture_test_override() {
    test_override();
}

fn test_override() -> bool {
    *TEST_OVERRIDE.get_or_init(|| cfg!(debug_assertions) && std::env::var(TEST_UNDER_TCG_VAR).as_deref() == Ok("1"))
}

fn refusal(accel: crate::config::Accel, test_override: bool) -> Option<String> {
    match accel {
        crate::config::Accel::Tcg if !test_override => {
            Some("accel is tcg: vhost-net needs KVM's ioeventfds (QEMU would fall back on userspace virtio-net)".into())
        }
        _ => None,
    }
}

/// The device's `status` as it applies to VMs run with `accel` ([`accel_refusal`]).
pub fn for_accel(accel: crate::config::Accel, status: VhostStatus) -> VhostStatus {
    judge_accel(status, accel_refusal(accel))
}

fn judge_accel(status: VhostStatus, refusal: Option<String>) -> VhostStatus {
    match refusal {
        Some(why) => VhostStatus { usable: false, reason: format!("{why}; {}", status.reason) },
        None => status,
    }
}

/// Opens `/dev/vhost-net` once and closes it again: can a launch get vhost-net descriptors?
pub fn probe() -> VhostStatus {
    probe_at(Path::new(VHOST_NET_DEVICE))
}

/// [`probe`] of the device at `path` (tests give another).
pub fn probe_at(path: &Path) -> VhostStatus {
    match open_one(path) {
        Ok(_fd) => VhostStatus { usable: true, reason: format!("{} opens read-write", path.display()) },
        Err(e) => VhostStatus { usable: false, reason: why_not(path, &e) },
    }
}

/// Why `path` could not be opened, in words an operator acts on.
fn why_not(path: &Path, e: &io::Error) -> String {
    let p = path.display();
    match e.raw_os_error() {
        Some(libc::ENOENT) => {
            format!("{p} does not exist: the vhost_net module is not loaded (modprobe vhost_net, and list it in /etc/modules)")
        }
        // A device node from a static list whose driver is absent and cannot be loaded.
        Some(libc::ENODEV) | Some(libc::ENXIO) => {
            format!(
                "{p} has no driver: the vhost_net module is not loaded and could not be loaded (modprobe vhost_net)"
            )
        }
        Some(libc::EACCES) | Some(libc::EPERM) => format!(
            "{p}: permission denied ({e}); vmhostd opens it as root, and its Landlock rules grant it only when it \
             existed when vmhostd started (restart vmhostd after loading vhost_net)"
        ),
        _ => format!("{p} cannot be opened: {e}"),
    }
}

/// Opens `path` read-write, close-on-exec (std sets `O_CLOEXEC`): the descriptor goes to QEMU
/// through the spawner, which places it at the number the argv names.
fn open_one(path: &Path) -> io::Result<OwnedFd> {
    OpenOptions::new().read(true).write(true).open(path).map(OwnedFd::from)
}

/// One vhost-net descriptor per queue of each NIC (`queues[i]` for NIC `i`), in NIC order; each
/// descriptor is a separate open, since each backs one queue pair.
///
/// # Errors
/// [`NetError::Vhost`] for the first open that fails; the descriptors opened so far are closed.
pub fn open_for_nics(queues: &[u8]) -> Result<Vec<Vec<OwnedFd>>, NetError> {
    open_for_nics_at(Path::new(VHOST_NET_DEVICE), queues)
}

/// [`open_for_nics`] of the device at `path`.
///
/// # Errors
/// As [`open_for_nics`].
pub fn open_for_nics_at(path: &Path, queues: &[u8]) -> Result<Vec<Vec<OwnedFd>>, NetError> {
    queues
        .iter()
        .map(|q| {
            (0..*q)
                .map(|_| open_one(path).map_err(|source| NetError::Vhost { reason: why_not(path, &source), source }))
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_device_is_not_usable_and_says_which_module() {
        let d = tempfile::tempdir().unwrap();
        let s = probe_at(&d.path().join("vhost-net"));
        assert!(!s.usable);
        assert!(s.reason.contains("does not exist") && s.reason.contains("modprobe vhost_net"), "{}", s.reason);
        let e = open_for_nics_at(&d.path().join("vhost-net"), &[1, 2]).unwrap_err();
        assert_eq!(e.code(), "vhost");
        assert_eq!(e.errno(), Some(libc::ENOENT));
    }

    #[test]
    fn refusals_and_missing_drivers_are_told_apart() {
        let p = Path::new("/dev/vhost-net");
        let r = |errno| why_not(p, &io::Error::from_raw_os_error(errno));
        assert!(r(libc::EACCES).contains("permission denied") && r(libc::EACCES).contains("restart vmhostd"));
        assert!(r(libc::ENODEV).contains("no driver"));
        assert!(r(libc::ENXIO).contains("no driver"));
        assert!(r(libc::EIO).contains("cannot be opened"));
    }

    #[test]
    fn tcg_never_gets_vhost_unless_a_test_asks() {
        use crate::config::Accel;
        assert_eq!(refusal(Accel::Kvm, false), None);
        assert_eq!(refusal(Accel::Kvm, true), None);
        assert_eq!(refusal(Accel::Tcg, true), None, "the lab's override");
        let why = refusal(Accel::Tcg, false).unwrap();
        assert!(why.contains("accel is tcg") && why.contains("KVM"), "{why}");
        let ok = VhostStatus { usable: true, reason: "/dev/vhost-net opens read-write".into() };
        assert_eq!(judge_accel(ok.clone(), None), ok);
        let tcg = judge_accel(ok, Some(why));
        assert!(
            !tcg.usable && tcg.reason.contains("accel is tcg") && tcg.reason.ends_with("opens read-write"),
            "{}",
            tcg.reason
        );
    }

    #[test]
    fn one_descriptor_per_queue_of_each_nic() {
        // Any device that opens read-write stands in for /dev/vhost-net: what is counted is the
        // opens, one per queue.
        let p = Path::new("/dev/null");
        assert!(probe_at(p).usable);
        let fds = open_for_nics_at(p, &[1, 4, 2]).unwrap();
        assert_eq!(fds.iter().map(Vec::len).collect::<Vec<_>>(), [1, 4, 2]);
        use std::os::fd::AsRawFd;
        let mut raw: Vec<i32> = fds.iter().flatten().map(|f| f.as_raw_fd()).collect();
        raw.sort_unstable();
        raw.dedup();
        assert_eq!(raw.len(), 7, "separate descriptors");
        assert!(open_for_nics_at(p, &[]).unwrap().is_empty());
    }
}
