//! `fs.freeze` and `fs.thaw`: the guest's file systems held still while the host copies its
//! disks (a snapshot or export), so the copy is what a clean unmount would leave, not a power cut.
//!
//! A freeze walks the mount table (`PROC/mounts`) and freezes (`FIFREEZE`) each writable file
//! system on a block device, in mount order, each once; one that cannot be frozen
//! (`EOPNOTSUPP`) is skipped, any other failure thaws what was frozen and fails the call. A
//! watchdog thread thaws everything after the call's `timeout_s` unless `fs.thaw` came first, so
//! a host that went away never leaves the guest frozen. A thaw (`FITHAW`) goes in reverse order.
//!
//! Nothing the host sends chooses a path: the mount points come from the guest's own table.

use crate::protocol::RpcError;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `_IOWR('X', 119, int)`.
const FIFREEZE: libc::c_ulong = 0xC004_5877;
/// `_IOWR('X', 120, int)`.
const FITHAW: libc::c_ulong = 0xC004_5878;

/// Longest freeze a call may ask for.
pub const MAX_TIMEOUT_S: u32 = 60;

/// The file systems a freeze covers: writable, on a block device (`/dev/...`), each mount point
/// once, in the table's order (parents before children).
pub fn freezable(mounts: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut sources: Vec<&str> = Vec::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [source, point, _fstype, options, ..] = f[..] else { continue };
        let writable = options.split(',').any(|o| o == "rw");
        if !source.starts_with("/dev/") || !writable || sources.contains(&source) {
            continue;
        }
        sources.push(source);
        out.push(PathBuf::from(unescape(point)));
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
struct Frozen {
    mounts: Vec<PathBuf>,
    stop_watchdog: Sender<()>,
}

/// The freeze state of the agent.
#[derive(Debug, Default)]
pub struct Freezer {
    frozen: Arc<Mutex<Option<Frozen>>>,
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
    /// Freezes what `mounts` (the text of `/proc/mounts`) lists, thawed by the watchdog after
    /// `timeout_s`. Returns the mount points frozen.
    ///
    /// # Errors
    /// 5100 (invalid) on `timeout_s` or when already frozen; -32603 when a file system could not
    /// be frozen (all thawed again).
    pub fn freeze(&self, mounts: &str, timeout_s: u32) -> Result<Vec<String>, RpcError> {
        if !(1..=MAX_TIMEOUT_S).contains(&timeout_s) {
            return Err(RpcError::invalid("timeout_s", format!("1 to {MAX_TIMEOUT_S} seconds")));
        }
        let mut frozen = self.frozen.lock().unwrap_or_else(|p| p.into_inner());
        if frozen.is_some() {
            return Err(RpcError::invalid("timeout_s", "the file systems are frozen already: fs.thaw first"));
        }
        let mut done: Vec<PathBuf> = Vec::new();
        for point in freezable(mounts) {
            match ioctl_on(&point, FIFREEZE) {
                Ok(()) => done.push(point),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                Err(e) => {
                    thaw_all(&done);
                    return Err(RpcError::internal(format!("cannot freeze {}: {e}", point.display())));
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
        let names = done.iter().map(|p| p.display().to_string()).collect();
        *frozen = Some(Frozen { mounts: done, stop_watchdog });
        Ok(names)
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

    #[test]
    fn only_writable_block_device_file_systems_are_frozen_each_once() {
        let mounts = "rootfs / rootfs rw 0 0\n\
                      /dev/vda1 / ext4 rw,relatime 0 0\n\
                      proc /proc proc rw 0 0\n\
                      /dev/vdb /srv/my\\040data xfs rw 0 0\n\
                      /dev/vdc /mnt/ro ext4 ro 0 0\n\
                      /dev/vdb /bind xfs rw 0 0\n\
                      tmpfs /run tmpfs rw 0 0\n";
        assert_eq!(freezable(mounts), [PathBuf::from("/"), PathBuf::from("/srv/my data")]);
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
        assert_eq!(f.freeze("", 5).unwrap(), Vec::<String>::new(), "nothing to freeze");
        assert!(f.freeze("", 5).is_err(), "frozen already (even if nothing was)");
        assert!(f.thaw().is_empty());
        assert!(f.freeze("", 5).is_ok(), "thawed: may freeze again");
    }
}
