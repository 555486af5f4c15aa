//! Taps: one per VM NIC, created through the `/dev/net/tun` ioctl and handed to QEMU as a
//! descriptor.
//!
//! [`create_tap`] opens `/dev/net/tun` and asks for a tap with `TUNSETIFF`. The returned
//! descriptor *is* the tap: QEMU gets it with `-netdev tap,fd=N` and needs no `CAP_NET_ADMIN`
//! of its own, since the privileged step (creating the link) is already done.
//!
//! The tap is deliberately **not persistent** (no `TUNSETPERSIST`): the kernel deletes the link
//! when the last descriptor to it is closed. That is the cleanup guarantee. Once the daemon has
//! passed the descriptor to QEMU and closed its own copy, the tap lives exactly as long as that
//! QEMU, whether it exits, crashes or is killed; if the daemon dies before handing it over, its own
//! descriptor closes and the tap goes with it. No orphan tap can outlive both. (A persistent tap
//! would survive every crash and need an explicit cleanup pass that a crash could skip.)
//!
//! Next steps are netlink's: mark the tap with its owner, give it the bridge's MTU, attach it and
//! bring it up (see [`super::link::Netlink`]). The tap comes with `IFF_VNET_HDR`, so QEMU can pass
//! checksum and segmentation offloads through (QEMU checks the flag with `TUNGETIFF`), and
//! `IFF_NO_PI`, so frames carry no extra packet-information header.
//!
//! A NIC with more than one queue pair gets a multiqueue tap ([`create_tap_queues`]): one
//! descriptor per queue, all of the same link, so the host spreads its packets over as many
//! QEMU (or vhost-net) threads as the guest has queues.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::{validate_link_name, NetError};

/// The tun/tap control device.
pub const TUN_DEVICE: &str = "/dev/net/tun";

/// Creates the tap `name` and returns the descriptor that keeps it alive.
///
/// The link exists as long as this descriptor (or a duplicate, e.g. in QEMU) is open; it starts
/// down, unattached and without an alias. The descriptor is close-on-exec: to give it to QEMU,
/// `dup2` it onto the number named in `-netdev tap,fd=N` in the child (which clears the flag).
///
/// `IFF_TUN_EXCL` makes the call fail instead of attaching to an existing persistent tap of the
/// same name, which might not be vmhostd's.
///
/// # Errors
/// [`NetError::InvalidName`] for a name the kernel would refuse ([`validate_link_name`]);
/// [`NetError::Exists`] when a link with this name exists (of any kind); [`NetError::Io`] when
/// `/dev/net/tun` cannot be opened (missing `tun` module, no permission) or `TUNSETIFF` fails
/// otherwise (e.g. `EPERM` without `CAP_NET_ADMIN`).
pub fn create_tap(name: &str) -> Result<OwnedFd, NetError> {
    validate_link_name(name)?;
    tun_set_iff(name, libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_TUN_EXCL)
}

/// Creates the tap `name` with `queues` queues and returns one descriptor per queue, queue 0
/// first: with one queue exactly [`create_tap`]; with more a multiqueue tap (`IFF_MULTI_QUEUE`),
/// each further descriptor attached by another `TUNSETIFF` with the same name. QEMU gets them as
/// `-netdev tap,fds=A:B:...` and spreads the guest's virtio-net queue pairs over them. The link
/// lives while any of them is open, as with one.
///
/// Only the first `TUNSETIFF` carries `IFF_TUN_EXCL` (the kernel refuses any attach to an
/// existing tap with it); the others attach to the tap the first one made a moment ago. On any
/// failure the descriptors made so far are closed, so the tap goes.
///
/// # Errors
/// As [`create_tap`]; `queues` of 0 is [`NetError::Io`] with `EINVAL` (validation keeps specs at
/// 1-16).
pub fn create_tap_queues(name: &str, queues: u8) -> Result<Vec<OwnedFd>, NetError> {
    if queues <= 1 {
        if queues == 0 {
            return Err(NetError::Io { op: "TUNSETIFF", source: io::Error::from_raw_os_error(libc::EINVAL) });
        }
        return create_tap(name).map(|fd| vec![fd]);
    }
    validate_link_name(name)?;
    let flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_MULTI_QUEUE;
    let mut fds = Vec::with_capacity(usize::from(queues));
    fds.push(tun_set_iff(name, flags | libc::IFF_TUN_EXCL)?);
    for _ in 1..queues {
        fds.push(tun_set_iff(name, flags)?);
    }
    Ok(fds)
}

/// Opens `/dev/net/tun` and asks for the tap `name` with `flags` (`TUNSETIFF`).
fn tun_set_iff(name: &str, flags: libc::c_int) -> Result<OwnedFd, NetError> {
    // std opens with O_CLOEXEC.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(TUN_DEVICE)
        .map_err(|source| NetError::Io { op: "open /dev/net/tun", source })?;
    let fd = OwnedFd::from(file);

    // SAFETY: `ifreq` is plain old data (a name array and a union of integers and pointers);
    // all-zero bytes are a valid value of it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    // `validate_link_name` bounds the name to 15 bytes, so the array keeps its NUL terminator.
    for (slot, byte) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *slot = *byte as libc::c_char;
    }
    // The flags all fit in 16 bits (the highest is IFF_TUN_EXCL, 0x8000); the kernel reads them as
    // an unsigned short, so the sign of the c_short does not matter.
    req.ifr_ifru.ifru_flags = flags as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is and which outlives the
    // call; `fd` is an open /dev/net/tun descriptor.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut libc::ifreq) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::EBUSY) => NetError::Exists(format!("link {name}")),
            _ => NetError::Io { op: "TUNSETIFF", source: err },
        });
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::super::link::Netlink;
    use super::super::testing::in_netns;
    use super::super::{owner_alias, parse_owner, Owner};
    use super::*;

    /// Waits up to two seconds for the link `name` to be gone.
    async fn gone(nl: &Netlink, name: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if nl.link_by_name(name).await.unwrap().is_none() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[test]
    fn tap_is_marked_attached_with_the_bridge_mtu_and_up() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, &owner_alias(&Owner::Network("lan".into()))).await.unwrap();
            nl.set_mtu(br.index, 1400).await.unwrap();
            nl.set_up(br.index).await.unwrap();
            let br = nl.link_by_index(br.index).await.unwrap().unwrap();

            let fd = create_tap("vmt-web1-0").unwrap();
            let tap = nl.link_by_name("vmt-web1-0").await.unwrap().expect("tap exists while its fd is open");
            assert_eq!(tap.kind.as_deref(), Some("tun"));
            assert_eq!(tap.alias, None);
            assert_eq!(tap.master, None);
            assert!(!tap.up);
            assert!(tap.mac.is_some());

            nl.set_alias(tap.index, &owner_alias(&Owner::Vm("web1".into()))).await.unwrap();
            nl.set_mtu(tap.index, br.mtu).await.unwrap();
            nl.set_master(tap.index, br.index).await.unwrap();
            nl.set_up(tap.index).await.unwrap();

            let tap = nl.link_by_index(tap.index).await.unwrap().unwrap();
            assert_eq!(parse_owner(tap.alias.as_deref().unwrap()), Some(Owner::Vm("web1".into())));
            assert_eq!(tap.mtu, 1400);
            assert_eq!(tap.master, Some(br.index));
            assert!(tap.up);
            // Attaching did not change the bridge's MTU.
            assert_eq!(nl.link_by_index(br.index).await.unwrap().unwrap().mtu, 1400);
            drop(fd);
        });
    }

    #[test]
    fn tap_disappears_when_its_fd_is_closed() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            let fd = create_tap("vmt0").unwrap();
            let tap = nl.link_by_name("vmt0").await.unwrap().unwrap();
            nl.set_master(tap.index, br.index).await.unwrap();
            nl.set_up(tap.index).await.unwrap();

            drop(fd);
            assert!(gone(&nl, "vmt0").await, "a non-persistent tap must vanish with its last fd");
            // The bridge it was attached to stays.
            assert!(nl.link_by_index(br.index).await.unwrap().is_some());
        });
    }

    #[test]
    fn an_existing_name_is_refused() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let _fd = create_tap("vmt0").unwrap();
            let err = create_tap("vmt0").unwrap_err();
            assert!(matches!(err, NetError::Exists(_)), "{err:?}");
            // A non-tun link of that name too: the tun driver never takes it over.
            nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            let err = create_tap("vmbr0").unwrap_err();
            assert!(matches!(err, NetError::Exists(_)), "{err:?}");
            assert_eq!(nl.link_by_name("vmbr0").await.unwrap().unwrap().kind.as_deref(), Some("bridge"));
        });
    }

    /// The fd number QEMU is told about.
    const QEMU_TAP_FD: i32 = 3;

    /// The unprivileged uid and gid QEMU runs as in the fd-passing test.
    const NOBODY: u32 = 65534;

    #[test]
    fn qemu_opens_the_tap_through_an_inherited_fd() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            let fd = create_tap("vmt-q0").unwrap();
            let tap = nl.link_by_name("vmt-q0").await.unwrap().unwrap();
            nl.set_master(tap.index, br.index).await.unwrap();
            nl.set_up(tap.index).await.unwrap();

            let raw = fd.as_raw_fd();
            let mut cmd = Command::new("qemu-system-x86_64");
            cmd.args(["-accel", "tcg", "-M", "q35", "-m", "64", "-nodefaults", "-display", "none"])
                .args(["-netdev", &format!("tap,id=n0,fd={QEMU_TAP_FD}")])
                .args(["-device", "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56", "-S"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                // As nobody, without capabilities: the fd is all QEMU needs, no CAP_NET_ADMIN.
                .uid(NOBODY)
                .gid(NOBODY);
            // SAFETY: between fork and exec the closure calls only dup2 and fcntl, which are
            // async-signal-safe, and touches no memory but its copied integers.
            unsafe {
                cmd.pre_exec(move || {
                    if raw == QEMU_TAP_FD {
                        // dup2 onto itself is a no-op that would keep close-on-exec set.
                        if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                            return Err(io::Error::last_os_error());
                        }
                    } else if libc::dup2(raw, QEMU_TAP_FD) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let mut child = cmd.spawn().expect("spawn qemu-system-x86_64");
            // The daemon's copy goes away: from now on QEMU alone keeps the tap alive.
            drop(fd);

            tokio::time::sleep(Duration::from_secs(1)).await;
            let status = child.try_wait().unwrap();
            if let Some(status) = status {
                let mut stderr = String::new();
                child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
                panic!("QEMU exited early ({status}): {stderr}");
            }
            let held = nl.link_by_name("vmt-q0").await.unwrap().expect("QEMU holds the tap");
            assert_eq!(held.master, Some(br.index));

            child.kill().unwrap();
            child.wait().unwrap();
            assert!(gone(&nl, "vmt-q0").await, "the tap must vanish with QEMU");
        });
    }

    /// The queue directories (`rx-0`, `tx-0`, ...) of `link` in the calling thread's network
    /// namespace. /sys shows the namespace of whoever mounted it, so the thread moves into a mount
    /// namespace of its own (private: nothing propagates to the host) and mounts a sysfs of its
    /// network namespace on a temporary directory.
    fn queue_dirs(link: &str) -> Vec<String> {
        use std::ffi::CString;
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS)");
        let root = CString::new("/").unwrap();
        // SAFETY: mount(2) with valid NUL-terminated strings and null data; only changes the
        // propagation of this thread's own mount namespace.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "make / private: {}", io::Error::last_os_error());
        let dir = tempfile::tempdir().unwrap();
        let target = CString::new(dir.path().to_str().unwrap()).unwrap();
        let sysfs = CString::new("sysfs").unwrap();
        // SAFETY: as above; a fresh sysfs on a directory of this private namespace.
        let r = unsafe { libc::mount(sysfs.as_ptr(), target.as_ptr(), sysfs.as_ptr(), 0, std::ptr::null()) };
        assert_eq!(r, 0, "mount sysfs: {}", io::Error::last_os_error());
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("class/net").join(link).join("queues"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // SAFETY: unmounts what was mounted above.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        names
    }

    #[test]
    fn a_multiqueue_tap_has_one_descriptor_and_one_queue_pair_per_queue() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let fds = create_tap_queues("vmt-mq", 4).unwrap();
            assert_eq!(fds.len(), 4);
            let tap = nl.link_by_name("vmt-mq").await.unwrap().expect("one link for every queue");
            assert_eq!(tap.kind.as_deref(), Some("tun"));
            assert_eq!(
                queue_dirs("vmt-mq"),
                ["rx-0", "rx-1", "rx-2", "rx-3", "tx-0", "tx-1", "tx-2", "tx-3"],
                "the kernel counts a queue per attached descriptor"
            );
            // The link lives while any queue's descriptor is open.
            let mut fds = fds;
            let last = fds.pop().unwrap();
            drop(fds);
            assert!(nl.link_by_name("vmt-mq").await.unwrap().is_some());
            drop(last);
            assert!(gone(&nl, "vmt-mq").await);
            // One queue is the single-queue tap of create_tap, not a multiqueue one.
            let one = create_tap_queues("vmt-1q", 1).unwrap();
            assert_eq!(one.len(), 1);
            assert_eq!(queue_dirs("vmt-1q"), ["rx-0", "tx-0"]);
            // Exclusive like create_tap: a second multiqueue tap of the same name is refused.
            let err = create_tap_queues("vmt-1q", 2).unwrap_err();
            assert!(matches!(err, NetError::Exists(_)), "{err:?}");
            assert!(create_tap_queues("vmt-0q", 0).is_err());
        });
    }

    #[test]
    fn invalid_names_are_refused_before_opening_the_device() {
        for bad in ["", "..", "a/b", "tap 0", "tap%d", "sixteen-bytes-xx"] {
            assert_eq!(create_tap(bad).unwrap_err().code(), "invalid_name", "{bad:?}");
        }
    }
}
