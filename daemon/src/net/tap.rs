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
    let flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_TUN_EXCL;
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
    use super::*;

    #[test]
    fn invalid_names_are_refused_before_opening_the_device() {
        for bad in ["", "..", "a/b", "tap 0", "tap%d", "sixteen-bytes-xx"] {
            assert_eq!(create_tap(bad).unwrap_err().code(), "invalid_name", "{bad:?}");
        }
    }
}
