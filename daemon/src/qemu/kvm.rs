//! `/dev/kvm` for QEMU's user: the one supplementary group QEMU keeps, and whether that user,
//! with exactly the groups QEMU gets, can open the device.
//!
//! QEMU runs as `qemu.user` with every supplementary group dropped (docs/sandbox.md), so on a
//! host where udev makes `/dev/kvm` `0660 root:kvm` it could not open the accelerator. With
//! `accel = "kvm"` the program that starts QEMU (the spawner, or the daemon without a sandbox)
//! therefore calls [`qemu_groups`] right before each start: the group that owns `/dev/kvm`
//! *now*, if `qemu.user` is a member of it in the group database, and nothing else. The
//! Debian package makes `vmhost-qemu` a member of `kvm` (docs/packaging.md).
//!
//! `host.check` asks [`probe`] (run where QEMU would be started) to open the device as that
//! user with those groups in a forked child: the kernel's answer, with ACLs and LSMs, never a
//! guess from mode bits.

use crate::config::UserIds;
use std::os::unix::fs::MetadataExt;

/// The accelerator device.
pub const KVM_DEV: &str = "/dev/kvm";

/// The supplementary group QEMU keeps: `dev_gid` (the group owning `/dev/kvm`) when QEMU's
/// user is a member of it and it is neither the user's primary group (kept anyway) nor root's
/// group 0 (which would open far more than the accelerator).
pub fn keep_group(dev_gid: u32, user: UserIds, member: bool) -> Option<u32> {
    (member && dev_gid != user.gid && dev_gid != 0).then_some(dev_gid)
}

/// The supplementary groups QEMU gets as `user` when it uses KVM: at most one, see
/// [`keep_group`]. Reads `/dev/kvm` and the group database now, so a group set after vmhostd
/// started counts. Empty when there is no `/dev/kvm` or the lookup fails.
pub fn qemu_groups(user: UserIds) -> Vec<u32> {
    let Ok(meta) = std::fs::metadata(KVM_DEV) else { return Vec::new() };
    let member = is_member(user.uid, meta.gid());
    keep_group(meta.gid(), user, member).into_iter().collect()
}

/// Whether the user with `uid` is listed as a member of group `gid`.
fn is_member(uid: u32, gid: u32) -> bool {
    let name = match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => u.name,
        _ => return false,
    };
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => g.mem.contains(&name),
        _ => false,
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Access {
    /// QEMU's user opened `/dev/kvm` read-write.
    Usable,
    /// There is no `/dev/kvm` (no KVM module, or no hardware virtualisation).
    Missing,
    /// The open failed with this errno (`EACCES`: the user may not use it).
    Denied(i32),
}

impl Access {
    /// From a wait status of the probe child: exit 0 is usable, else the exit code is the errno.
    fn from_exit(code: i32) -> Access {
        match code {
            0 => Access::Usable,
            libc::ENOENT | libc::ENODEV | libc::ENXIO => Access::Missing,
            e => Access::Denied(e),
        }
    }
}

/// [`probe`] as QEMU would run: as `user` (`None`: the caller's user) with [`qemu_groups`].
///
/// # Errors
/// As [`probe`].
pub fn probe_as_qemu(user: Option<UserIds>) -> std::io::Result<Access> {
    let groups = user.map(qemu_groups).unwrap_or_default();
    probe(user, &groups)
}

/// Opens `/dev/kvm` read-write in a forked child that first becomes `user` (when `Some`) with
/// exactly `groups` as its supplementary groups, as QEMU would. Needs CAP_SETUID and
/// CAP_SETGID to change user (the spawner has them; so does root without a sandbox).
///
/// # Errors
/// fork or wait failed; the probe's own outcome is in [`Access`].
pub fn probe(user: Option<UserIds>, groups: &[u32]) -> std::io::Result<Access> {
    let path = c"/dev/kvm";
    // SAFETY: the child only makes async-signal-safe calls (setgroups, setgid, setuid, open,
    // _exit) and allocates nothing, so forking a multi-threaded process is fine.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EPERM);
        // SAFETY: see above; every path ends in _exit.
        unsafe {
            if let Some(u) = user {
                if crate::sandbox::spawn::become_user(u, groups).is_err() {
                    libc::_exit(errno().clamp(1, 255));
                }
            }
            let fd = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            libc::_exit(if fd < 0 { errno().clamp(1, 255) } else { 0 });
        }
    }
    let mut status = 0;
    loop {
        // SAFETY: waitpid on the child we just forked, into our int.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
    if libc::WIFEXITED(status) {
        Ok(Access::from_exit(libc::WEXITSTATUS(status)))
    } else {
        Err(std::io::Error::other(format!("the /dev/kvm probe ended with wait status {status}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: UserIds = UserIds { uid: 990, gid: 990 };

    #[test]
    fn keeps_only_the_device_group_of_a_member() {
        assert_eq!(keep_group(105, U, true), Some(105));
        assert_eq!(keep_group(105, U, false), None, "not a member: nothing");
        assert_eq!(keep_group(990, U, true), None, "its primary group: kept anyway");
        assert_eq!(keep_group(0, U, true), None, "never root's group");
    }

    #[test]
    fn exit_codes_map_to_access() {
        assert_eq!(Access::from_exit(0), Access::Usable);
        assert_eq!(Access::from_exit(libc::ENOENT), Access::Missing);
        assert_eq!(Access::from_exit(libc::ENXIO), Access::Missing);
        assert_eq!(Access::from_exit(libc::EACCES), Access::Denied(libc::EACCES));
    }

    #[test]
    fn probe_as_nobody_is_refused_a_root_only_node_and_root_is_not() {
        // This machine's /dev/kvm is 0600 root:root (tests/tests/kvm.rs changes it; this only
        // reads it).
        let Ok(meta) = std::fs::metadata(KVM_DEV) else { return };
        if meta.mode() & 0o006 != 0 || meta.gid() == 65534 {
            return;
        }
        let nobody = UserIds { uid: 65534, gid: 65534 };
        assert_eq!(probe(Some(nobody), &[]).unwrap(), Access::Denied(libc::EACCES));
        assert_eq!(probe(None, &[]).unwrap(), Access::Usable);
    }
}
