//! The spawner's requests besides `run`: opening a boot file, probing `/dev/kvm` as QEMU's
//! user, handing a VFIO group node to QEMU's group and back, and reading and putting back a
//! TPM's state files ([`tpm_state_file`], [`tpm_state_place`]: snapshots, backups, reverts,
//! imports).
//!
//! Each is one async function for the lifecycle and preflight to call: [`boot_file`] (the
//! check before a launch, then the sealed copy QEMU gets), [`kvm_access`] (at start), and
//! [`vfio_node`] (before a passthrough VM starts, and on release). Each sends its request over
//! [`super::wire`] when there is a spawner and does the same work in-process without one, so
//! the answer does not depend on whether the sandbox is on. The work itself belongs to the
//! resource's owner ([`crate::qemu::boot_files`], [`crate::qemu::kvm`], [`crate::pci::bind`]);
//! the spawner's server ([`super::server`]) calls the same functions.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::wire::{next_message, reply_error, send_request, spawner, utf8, NodeAccess, Request};
use crate::config::UserIds;

/// The most a VFIO group node may be opened up to: read and write for its owner and group,
/// never for others.
pub const VFIO_NODE_MODES: u32 = 0o660;

/// Sets group and mode of `/dev/vfio/GROUP`, in whichever process may (the spawner, or the
/// daemon without one): only a character device, by a path made from the number, with at most
/// [`VFIO_NODE_MODES`]. Returns what it had before.
pub(super) fn set_vfio_node(group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    set_node(&crate::pci::bind::vfio_group_dev(group), group, gid, mode)
}

/// [`set_vfio_node`] on `node` (a test's node in a temporary directory).
fn set_node(node: &Path, group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    if mode & !VFIO_NODE_MODES != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("mode {mode:o} opens a VFIO group node beyond {VFIO_NODE_MODES:o}"),
        ));
    }
    let meta = std::fs::symlink_metadata(node)?;
    if !meta.file_type().is_char_device() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a device node", node.display())));
    }
    let before = NodeAccess { group, gid: meta.gid(), mode: meta.mode() & 0o7777 };
    std::os::unix::fs::lchown(node, None, Some(gid))?;
    std::fs::set_permissions(node, std::fs::Permissions::from_mode(mode))?;
    Ok(before)
}

/// Gives `/dev/vfio/GROUP` group `gid` and mode `mode` (at most [`VFIO_NODE_MODES`]), through
/// the spawner when there is one: the daemon's seccomp table has no path-based chmod or chown.
/// Returns the node's group and mode before.
///
/// # Errors
/// `NotFound` when the node does not exist, `PermissionDenied` for a mode beyond
/// [`VFIO_NODE_MODES`], `InvalidInput` when it is not a device node, the OS error of the
/// change, or the spawner is gone.
pub async fn vfio_node(group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    let Some(control) = spawner() else {
        return tokio::task::spawn_blocking(move || set_vfio_node(group, gid, mode)).await.map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::VfioNode { group, gid, mode }, Vec::new()).await?;
    let (answer, _) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    answer.node.ok_or_else(|| io::Error::other("spawner reply without node"))
}

/// The daemon's own copies when it has no spawner.
static LOCAL_COPIES: Mutex<crate::qemu::boot_files::CopyCache> = Mutex::new(crate::qemu::boot_files::CopyCache::new());

/// Opens a kernel or initrd ([`crate::qemu::boot_files`]): through the spawner, which may read
/// where the daemon's Landlock rules do not reach, or in-process without one. With `copy`
/// returns the sealed copy QEMU gets; without, only checks that it opens.
///
/// # Errors
/// As [`crate::qemu::boot_files::open_under`] and [`crate::qemu::boot_files::sealed_copy`]
/// (their kinds are kept across the spawner), or the spawner is gone. `boot_dirs` is
/// `paths.boot` for the in-process open; the spawner has its own copy ([`super::Allowlist`]).
pub async fn boot_file(boot_dirs: &[PathBuf], path: &Path, copy: bool) -> io::Result<Option<OwnedFd>> {
    use crate::qemu::boot_files;
    let Some(control) = spawner() else {
        let path = path.to_path_buf();
        let dirs = boot_dirs.to_vec();
        return tokio::task::spawn_blocking(move || {
            let file = boot_files::open_under(&dirs, &path)?;
            if !copy {
                return Ok(None);
            }
            let mut cache = LOCAL_COPIES.lock().map_err(|_| io::Error::other("copy cache lock poisoned"))?;
            cache.copy(file, &path).map(Some)
        })
        .await
        .map_err(io::Error::other)?;
    };
    let req = Request::BootFile { path: utf8("path", path.as_os_str())?, copy };
    let reply = send_request(control, &req, Vec::new()).await?;
    let (answer, mut fds) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    match (copy, fds.pop()) {
        (true, None) => Err(io::Error::other("the spawner sent no copy")),
        (_, fd) => Ok(fd.filter(|_| copy)),
    }
}

/// Whether `qemu.user` (`user`; `None`: QEMU runs as the daemon's user), with the groups QEMU
/// gets under `accel = "kvm"`, can open `/dev/kvm`: asked of the spawner, which starts QEMU,
/// or probed in-process without one.
///
/// # Errors
/// The probe could not run, or the spawner is gone.
pub async fn kvm_access(user: Option<UserIds>) -> io::Result<crate::qemu::kvm::Access> {
    let Some(control) = spawner() else {
        return tokio::task::spawn_blocking(move || crate::qemu::kvm::probe_as_qemu(user))
            .await
            .map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::KvmAccess, Vec::new()).await?;
    let (answer, _) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    answer.access.ok_or_else(|| io::Error::other("spawner reply without access"))
}

/// Opens TPM state file `name` in the state directory `dir` for reading
/// ([`crate::tpm::open_state_file`]): in the spawner, which raises `CAP_DAC_READ_SEARCH` for
/// that open (the file is `qemu.user`'s, mode 0600), or in-process without one.
///
/// # Errors
/// As [`crate::tpm::open_state_file`] (`NotFound` when there is no such file), or the
/// spawner is gone.
pub async fn tpm_state_file(dir: OwnedFd, name: &str) -> io::Result<OwnedFd> {
    let Some(control) = spawner() else {
        let name = name.to_string();
        return tokio::task::spawn_blocking(move || {
            use std::os::fd::AsFd;
            crate::tpm::open_state_file(dir.as_fd(), &name)
        })
        .await
        .map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::TpmStateFile { name: name.to_string() }, vec![dir]).await?;
    let (answer, mut fds) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    fds.pop().ok_or_else(|| io::Error::other("the spawner sent no TPM state file"))
}

/// Writes the bytes of `data` as TPM state file `name` in the state directory `dir`, a file
/// `user` owns ([`crate::tpm::write_state_file`]): in the spawner by a child that becomes
/// `qemu.user` first, or in-process without one (chowned to `user`).
///
/// # Errors
/// As [`crate::tpm::write_state_file`], or the spawner is gone.
pub async fn tpm_state_place(dir: OwnedFd, name: &str, data: OwnedFd, user: Option<UserIds>) -> io::Result<()> {
    let Some(control) = spawner() else {
        let name = name.to_string();
        return tokio::task::spawn_blocking(move || {
            use std::os::fd::AsFd;
            crate::tpm::write_state_file(dir.as_fd(), &name, data.as_fd(), user)
        })
        .await
        .map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::TpmStatePlace { name: name.to_string() }, vec![dir, data]).await?;
    let (answer, _) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vfio_node_is_handed_over_and_put_back_within_its_limits() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("7");
        let c = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mknod with a valid path (the tests run as root); /dev/null's numbers.
        assert_eq!(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) }, 0);
        let before = set_node(&node, 7, 4321, 0o660).unwrap();
        assert_eq!(before, NodeAccess { group: 7, gid: 0, mode: 0o600 });
        let meta = std::fs::metadata(&node).unwrap();
        assert_eq!((meta.gid(), meta.mode() & 0o7777), (4321, 0o660));
        // Release puts back what was recorded.
        assert_eq!(set_node(&node, 7, before.gid, before.mode).unwrap().mode, 0o660);
        let meta = std::fs::metadata(&node).unwrap();
        assert_eq!((meta.gid(), meta.mode() & 0o7777), (0, 0o600));
        // Never for others, never setuid or executable; never a regular file.
        for mode in [0o666, 0o4660, 0o770] {
            assert_eq!(set_node(&node, 7, 0, mode).unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        }
        let file = dir.path().join("8");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(set_node(&file, 8, 0, 0o660).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(std::fs::metadata(&node).unwrap().mode() & 0o7777, 0o600);
    }
}
