//! `fs.freeze` and `fs.thaw`: the guest's file systems held still while the host copies its
//! disks (a snapshot or export), so the copy is what a clean unmount would leave, not a power cut.
//!
//! A freeze walks the mount table (`PROC/self/mountinfo`) and freezes (`FIFREEZE`) each file
//! system on a block device whose superblock is writable, in mount order, each superblock once.
//! Writability is the superblock's, not the mount's: a read-only view of a writable file system
//! (a systemd unit's `ProtectSystem=`, a read-only bind mount) is still written through its other
//! mounts, so it is frozen too. One the kernel cannot freeze (`EOPNOTSUPP`: vfat, ...) is skipped
//! and reported as skipped, so the host can tell "every file system frozen" from "some left as
//! they are"; any other failure thaws what was frozen and fails the call. Skips and failures are
//! logged (stderr: the journal under systemd). A watchdog thread thaws everything after the
//! call's `timeout_s` unless `fs.thaw` came first, so a host that went away never leaves the
//! guest frozen. A thaw (`FITHAW`) goes in reverse order.
//!
//! Nothing the host sends chooses a path: the mount points come from the guest's own table.

use crate::protocol::RpcError;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use vmhost_agent_protocol::FreezeSkip;

/// `_IOWR('X', 119, int)`.
const FIFREEZE: libc::c_ulong = 0xC004_5877;
/// `_IOWR('X', 120, int)`.
const FITHAW: libc::c_ulong = 0xC004_5878;

/// Longest freeze a call may ask for.
pub const MAX_TIMEOUT_S: u32 = 60;

/// A file system a freeze covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted (its first mount in the table).
    pub point: PathBuf,
    /// Its type.
    pub fstype: String,
}

/// The file systems a freeze covers, from the text of `/proc/self/mountinfo`: on a block device
/// (source `/dev/...`), superblock writable (`rw` in the super options, whatever the mount's own
/// options say), each superblock once (by device number and by source: the subvolumes of one
/// btrfs are one superblock), in the table's order (parents before children).
pub fn freezable(mountinfo: &str) -> Vec<Mount> {
    let mut out: Vec<Mount> = Vec::new();
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for line in mountinfo.lines() {
        // ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(dash) = f.iter().position(|w| *w == "-") else { continue };
        let (Some(device), Some(point), Some(fstype), Some(source), Some(options)) =
            (f.get(2), f.get(4), f.get(dash + 1), f.get(dash + 2), f.get(dash + 3))
        else {
            continue;
        };
        if dash < 6 || !source.starts_with("/dev/") || !options.split(',').any(|o| o == "rw") {
            continue;
        }
        if seen.iter().any(|(d, s)| d == device || s == source) {
            continue;
        }
        seen.push((device, source));
        out.push(Mount { point: PathBuf::from(unescape(point)), fstype: unescape(fstype) });
    }
    out
}

/// A mount point as the kernel escapes it in `/proc/mounts` (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = u16::from(b[i + 1] - b'0') * 64 + u16::from(b[i + 2] - b'0') * 8 + u16::from(b[i + 3] - b'0');
            match u8::try_from(v) {
                Ok(byte) => {
                    out.push(byte);
                    i += 4;
                }
                Err(_) => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn ioctl_on(point: &Path, request: libc::c_ulong) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(point)?;
    // SAFETY: FIFREEZE and FITHAW take an int argument the kernel ignores; the fd is ours.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), request as _, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What is frozen now, and how to stop its watchdog.
#[derive(Debug)]
struct Held {
    mounts: Vec<PathBuf>,
    stop_watchdog: Sender<()>,
}

/// The freeze state of the agent.
#[derive(Debug, Default)]
pub struct Freezer {
    frozen: Arc<Mutex<Option<Held>>>,
}

/// What a freeze did: the mount points frozen and the file systems skipped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Frozen, in order.
    pub mounts: Vec<String>,
    /// Left unfrozen: the kernel cannot freeze them.
    pub skipped: Vec<FreezeSkip>,
}

fn thaw_all(mounts: &[PathBuf]) -> Vec<String> {
    let mut thawed = Vec::new();
    for point in mounts.iter().rev() {
        match ioctl_on(point, FITHAW) {
            Ok(()) => thawed.push(point.display().to_string()),
            Err(e) => crate::log(&format!("cannot thaw {}: {e}", point.display())),
        }
    }
    thawed
}

impl Freezer {
    /// Freezes what `mountinfo` (the text of `/proc/self/mountinfo`) lists ([`freezable`]),
    /// thawed by the watchdog after `timeout_s`. Each skip is logged.
    ///
    /// # Errors
    /// 5100 (invalid) on `timeout_s` or when already frozen; -32603 when a file system could not
    /// be frozen for another reason than `EOPNOTSUPP` (all thawed again).
    pub fn freeze(&self, mountinfo: &str, timeout_s: u32) -> Result<Outcome, RpcError> {
        if !(1..=MAX_TIMEOUT_S).contains(&timeout_s) {
            return Err(RpcError::invalid("timeout_s", format!("1 to {MAX_TIMEOUT_S} seconds")));
        }
        let mut frozen = self.frozen.lock().unwrap_or_else(|p| p.into_inner());
        if frozen.is_some() {
            return Err(RpcError::invalid("timeout_s", "the file systems are frozen already: fs.thaw first"));
        }
        let mut done: Vec<PathBuf> = Vec::new();
        let mut skipped = Vec::new();
        for m in freezable(mountinfo) {
            match ioctl_on(&m.point, FIFREEZE) {
                Ok(()) => done.push(m.point),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    crate::log(&format!(
                        "fs.freeze: skipped {} ({}): the kernel cannot freeze it: {e}",
                        m.point.display(),
                        m.fstype
                    ));
                    skipped.push(FreezeSkip {
                        mount: m.point.display().to_string(),
                        fstype: m.fstype,
                        errno: libc::EOPNOTSUPP,
                        error: e.to_string(),
                    });
                }
                Err(e) => {
                    let thawed = thaw_all(&done);
                    return Err(RpcError::internal(format!(
                        "cannot freeze {} ({}): {e}; thawed {thawed:?} again",
                        m.point.display(),
                        m.fstype
                    )));
                }
            }
        }
        let (stop_watchdog, stopped) = channel::<()>();
        let watched = Arc::clone(&self.frozen);
        std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(Duration::from_secs(timeout_s.into())) {
                let mut frozen = watched.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = frozen.take() {
                    crate::log("no fs.thaw in time: thawing the file systems");
                    thaw_all(&f.mounts);
                }
            }
        });
        let mounts = done.iter().map(|p| p.display().to_string()).collect();
        *frozen = Some(Held { mounts: done, stop_watchdog });
        Ok(Outcome { mounts, skipped })
    }

    /// Thaws what [`Freezer::freeze`] froze (nothing when nothing is). Returns the mount points.
    pub fn thaw(&self) -> Vec<String> {
        let mut frozen = self.frozen.lock().unwrap_or_else(|p| p.into_inner());
        match frozen.take() {
            Some(f) => {
                let _ = f.stop_watchdog.send(());
                thaw_all(&f.mounts)
            }
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Debian guest's table as a unit with `ProtectSystem=strict` and `PrivateTmp=` sees it:
    /// `/` and `/boot/efi` mounted read-only over writable superblocks, `/tmp` a bind of the
    /// root's own superblock.
    const MOUNTINFO: &str = "\
23 1 254:1 / / ro,relatime master:1 - ext4 /dev/vda1 rw,discard,errors=remount-ro
24 23 0:5 / /dev rw,nosuid,relatime master:2 - devtmpfs udev rw,size=1000k,mode=755
30 23 254:15 / /boot/efi ro,relatime master:20 - vfat /dev/vda15 rw,fmask=0077,dmask=0077
31 23 254:1 /tmp/systemd-private-ab-vmhost-agent.service-Xy/tmp /tmp rw,relatime master:1 - ext4 /dev/vda1 rw,discard
32 23 0:40 / /run rw,nosuid,nodev master:5 - tmpfs tmpfs rw,size=200k
33 23 254:16 / /srv/my\\040data ro,relatime master:21 - xfs /dev/vdb rw,attr2
34 23 254:32 / /mnt/ro ro,relatime master:22 - ext4 /dev/vdc ro
35 23 0:44 /sub /home/sub rw,relatime - btrfs /dev/vdd rw,subvol=/sub
36 23 0:44 /other /home/other rw,relatime - btrfs /dev/vdd rw,subvol=/other
37 23 0:21 / /proc rw - proc proc rw
garbage
38 23 254:48 / /short - ext4
";

    #[test]
    fn writable_superblocks_on_block_devices_are_frozen_each_once_through_read_only_views_too() {
        let mounts: Vec<(String, String)> =
            freezable(MOUNTINFO).into_iter().map(|m| (m.point.display().to_string(), m.fstype)).collect();
        let names: Vec<(&str, &str)> = mounts.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
        assert_eq!(names, [("/", "ext4"), ("/boot/efi", "vfat"), ("/srv/my data", "xfs"), ("/home/sub", "btrfs")]);
    }

    #[test]
    fn nothing_but_a_writable_block_device_is_a_candidate() {
        assert!(freezable("").is_empty());
        assert!(freezable("22 1 0:21 / /proc rw,relatime - proc proc rw\n").is_empty());
        assert!(freezable("22 1 254:1 / / rw - ext4 /dev/vda1 ro\n").is_empty(), "read-only superblock");
        assert!(freezable("22 1 254:1 / / rw - ext4 vda1 rw\n").is_empty(), "not a /dev node");
        assert!(freezable("254:1 / / rw - ext4 /dev/vda1 rw\n").is_empty(), "too few fields");
    }

    /// The packaged unit (`vmhost-agent.service`, shipped as it is by packaging/build-debs.sh)
    /// must let the agent freeze: CAP_SYS_ADMIN, and the guest's mounts as they are (no
    /// read-only view of `/`, no hidden `/home`, no other `/tmp`).
    #[test]
    fn the_packaged_unit_lets_the_agent_freeze_the_real_file_systems() {
        let unit = include_str!("../vmhost-agent.service");
        let lines: Vec<&str> = unit.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
        let caps = lines.iter().find_map(|l| l.strip_prefix("CapabilityBoundingSet=")).unwrap_or_default();
        assert!(caps.split_whitespace().any(|c| c == "CAP_SYS_ADMIN"), "{caps}");
        for hiding in [
            "ProtectSystem=",
            "ProtectHome=",
            "PrivateTmp=",
            "ReadOnlyPaths=",
            "InaccessiblePaths=",
            "TemporaryFileSystem=",
            "BindReadOnlyPaths=",
            "ReadOnlyDirectories=",
            "InaccessibleDirectories=",
        ] {
            assert!(!lines.iter().any(|l| l.starts_with(hiding)), "the unit sets {hiding}");
        }
        // The mounts it can see are not the agent's to change.
        assert!(lines
            .iter()
            .any(|l| l.starts_with("SystemCallFilter=~") && l.split_whitespace().any(|g| g.ends_with("@mount"))));
    }

    #[test]
    fn escapes_are_read_and_nonsense_is_kept() {
        assert_eq!(unescape("/a\\040b\\011c"), "/a b\tc");
        assert_eq!(unescape("/x\\777y\\04"), "/x\\777y\\04");
    }

    #[test]
    fn a_timeout_outside_1_to_60_is_refused() {
        let f = Freezer::default();
        assert!(f.freeze("", 0).is_err());
        assert!(f.freeze("", 61).is_err());
        assert_eq!(f.freeze("", 5).unwrap(), Outcome::default(), "nothing to freeze");
        assert!(f.freeze("", 5).is_err(), "frozen already (even if nothing was)");
        assert!(f.thaw().is_empty());
        assert!(f.freeze("", 5).is_ok(), "thawed: may freeze again");
    }
}
