//! The state directory's subdirectories are private to root (mode 0700).
//!
//! Their entries name the VMs (`vms/NAME.json`, `logs/NAME.serial.log`, `disks/NAME.qcow2`,
//! `disks/NAME/` with its data disks, `kept-disks/NAME/`, `seeds/NAME.img`), and a VM's name is all a local user needs to forge the command-line marker
//! the daemon used to trust ([`crate::qemu::identity`]); logs and seeds also hold what a guest
//! printed and its cloud-init data. Nothing but the daemon needs to enter them: QEMU, running as
//! `qemu.user`, gets every file in them as a descriptor (docs/sandbox.md).
//!
//! [`prepare`] runs at start-up, before the sandbox and again from the lifecycle: it creates
//! each of [`PRIVATE`] with mode 0700, and a directory that already exists with any group or
//! other permission (an older vmhostd made them 0755) is tightened to 0700 through a descriptor
//! (`fchmod`), so an upgrade closes them too. The state directory itself is left as the operator
//! made it: the default image directory lives in it.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The subdirectories of the state directory that are private.
pub const PRIVATE: [&str; 5] = ["vms", "disks", "kept-disks", "logs", "seeds"];

/// The mode of a private directory.
pub const MODE: u32 = 0o700;

/// Whether a directory of mode `mode` must be tightened: any permission for group or others.
pub fn too_open(mode: u32) -> bool {
    mode & 0o077 != 0
}

/// Makes `dir` a private directory: creates it with mode 0700 (its parents as usual), or
/// tightens it to 0700 when it exists with group or other permissions. Returns true when it
/// tightened an existing directory.
///
/// # Errors
/// It cannot be created, opened as a directory or changed.
pub fn private_dir(dir: &Path) -> io::Result<bool> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new().mode(MODE).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let handle = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(dir)?;
    let mode = handle.metadata()?.mode() & 0o7777;
    if !too_open(mode) {
        return Ok(false);
    }
    nix::sys::stat::fchmod(handle.as_fd(), nix::sys::stat::Mode::from_bits_truncate(MODE))?;
    Ok(true)
}

/// Makes every one of [`PRIVATE`] below `state` private ([`private_dir`]); returns those it
/// tightened.
///
/// # Errors
/// The first directory that cannot be made private, with its path.
pub fn prepare(state: &Path) -> Result<Vec<PathBuf>, String> {
    let mut tightened = Vec::new();
    for name in PRIVATE {
        let dir = state.join(name);
        match private_dir(&dir) {
            Ok(true) => tightened.push(dir),
            Ok(false) => {}
            Err(e) => return Err(format!("cannot make {} private (mode 0700): {e}", dir.display())),
        }
    }
    Ok(tightened)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn modes_with_group_or_other_bits_are_too_open() {
        for m in [0o755, 0o750, 0o701, 0o710, 0o777, 0o1777] {
            assert!(too_open(m), "{m:o}");
        }
        for m in [0o700, 0o500, 0o000] {
            assert!(!too_open(m), "{m:o}");
        }
    }

    #[test]
    fn new_directories_are_0700_and_old_ones_are_tightened() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        // An older daemon's logs directory, 0755, with a file in it.
        std::fs::create_dir_all(state.join("logs")).unwrap();
        std::fs::set_permissions(state.join("logs"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(state.join("logs/vm-1.serial.log"), b"boot").unwrap();
        let tightened = prepare(&state).unwrap();
        assert_eq!(tightened, vec![state.join("logs")]);
        for name in PRIVATE {
            assert_eq!(mode(&state.join(name)), 0o700, "{name}");
        }
        assert_eq!(std::fs::read(state.join("logs/vm-1.serial.log")).unwrap(), b"boot");
        // Already private: nothing to do.
        assert!(prepare(&state).unwrap().is_empty());
        // A file where a directory belongs is an error naming it.
        std::fs::remove_dir(state.join("seeds")).unwrap();
        std::fs::write(state.join("seeds"), b"").unwrap();
        assert!(prepare(&state).unwrap_err().contains("seeds"));
    }
}
