//! A direct-kernel VM's kernel and initrd, handed to QEMU as sealed in-memory copies.
//!
//! QEMU runs as the unprivileged `qemu.user` and opens no VM file by path (docs/sandbox.md).
//! Its `-kernel` and `-initrd` loaders take only a path, not a descriptor or an fd set, so
//! each file is copied (once per file version, see [`CopyCache`]) into a memfd that is then sealed
//! against any change
//! and passed to QEMU, which opens it as `/proc/self/fd/N`. A memfd belongs to nobody's
//! directory and its inode is readable by anyone who holds it, so the file's own mode and
//! the modes of its parent directories no longer matter: whatever vmhostd can read boots. The
//! copy is also a snapshot: a kernel rewritten on disk while the VM runs does not change it.
//!
//! The daemon itself may not read arbitrary paths (its Landlock rules, docs/sandbox.md), so
//! with the sandbox on the spawner does both steps ([`crate::sandbox::spawn::boot_file`]);
//! without it the daemon calls them in-process. In order:
//!
//! 0. [`boot_dir_of`] (pure, from [`crate::validate`]): the path must lie, lexically, in one of
//!    the configured boot directories (`paths.boot`), so a client cannot use vmhostd to learn
//!    whether any file on the host exists: a path elsewhere is a 2001 before any file is touched.
//! 1. [`open_under`]: open read-only *beneath* that directory (`openat2` with `RESOLVE_BENEATH`
//!    relative to the directory: a symlink or `..` that leads out of it is refused, one that
//!    stays inside is followed), refuse anything but a regular file of at most
//!    [`MAX_BOOT_FILE`] bytes. `vm.create`/`vm.start` do this alone first, so a missing or
//!    unreadable file is a 2001 before anything is started ([`crate::lifecycle`]).
//! 2. [`CopyCache::copy`]: a sealed copy of the open file, made by [`sealed_copy`] (into a
//!    memfd, in the kernel: `copy_file_range`/`sendfile`; sealed against writing, growing,
//!    shrinking and new seals), or the copy made earlier of the very same file version. The
//!    launch does this.
//!
//! Copying 27 MiB costs about 20 ms here (docs/performance.md), more than a create may add, and
//! every copy held by a QEMU is memory that cannot be reclaimed. So the copies are kept and
//! shared: a file whose device, inode, size, modification and change times are unchanged gets a
//! descriptor of the copy already made (the seals make sharing safe: no QEMU can change what
//! another reads). Any write, truncation, replacement or `chmod` changes the change time, so a
//! changed file always gets a new copy; VMs already running keep the one they were given. The
//! cache holds at most [`CACHED_COPIES`] copies, least recently used first out.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

/// Largest kernel or initrd accepted: far above any real one (a distribution initrd is tens of
/// MiB), low enough that a wrong path cannot make the daemon copy a disk image into memory.
pub const MAX_BOOT_FILE: u64 = 1 << 30;

/// The boot directory `path` lies in, and `path` relative to it: the first of `dirs` that is a
/// proper ancestor of `path`, compared component by component (so `/boot2/x` is not in `/boot`).
/// Both must be absolute without `.` or `..` components (the config and the spec are checked
/// for that); a path that has them is in no directory.
pub fn boot_dir_of<'a>(dirs: &'a [PathBuf], path: &'a Path) -> Option<(&'a Path, &'a Path)> {
    let plain =
        |p: &Path| p.is_absolute() && p.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    // Path::components() hides an interior "." ("a/./b"), so look at the text as well.
    let dotted = |p: &Path| p.as_os_str().as_bytes().split(|b| *b == b'/').any(|c| c == b"." || c == b"..");
    if !plain(path) || dotted(path) {
        return None;
    }
    dirs.iter().filter(|d| plain(d) && !dotted(d)).find_map(|d| {
        let rel = path.strip_prefix(d).ok()?;
        (!rel.as_os_str().is_empty()).then_some((d.as_path(), rel))
    })
}

/// `struct open_how` of openat2(2) (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens `path` read-only for copying, beneath the boot directory it lies in ([`boot_dir_of`]).
///
/// # Errors
/// `PermissionDenied` when `path` is in none of `dirs`, or when resolving it leaves its
/// directory (a symlink pointing elsewhere, an absolute symlink); `NotFound`,
/// `PermissionDenied` from the open; `InvalidInput` when it is not a regular file (a FIFO or
/// device is never read) or larger than [`MAX_BOOT_FILE`].
pub fn open_under(dirs: &[PathBuf], path: &Path) -> io::Result<File> {
    let Some((dir, rel)) = boot_dir_of(dirs, path) else {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not in a boot directory (paths.boot)", path.display()),
        ));
    };
    let base = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_DIRECTORY).open(dir)?;
    let rel_c = std::ffi::CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
    // O_NONBLOCK: opening a FIFO must not wait for a writer; regular-file reads ignore it.
    let how = OpenHow {
        flags: (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 with a descriptor we hold, a NUL-terminated path and an open_how of the
    // size passed; it returns a new descriptor or -1.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            base.as_raw_fd(),
            rel_c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if ret < 0 {
        let e = io::Error::last_os_error();
        if matches!(e.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EPERM)) {
            // No openat2: a kernel before 5.6, or a service manager's system-call filter that
            // answers it ENOSYS/EPERM (systemd does for calls its tables do not know).
            return open_beneath_without_openat2(&base, rel, path, dir).and_then(|f| check_file(f, path));
        }
        return Err(match e.raw_os_error() {
            Some(libc::EXDEV) | Some(libc::ELOOP) => io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} leads out of the boot directory {} (a symlink)", path.display(), dir.display()),
            ),
            _ => e,
        });
    }
    let fd = i32::try_from(ret).map_err(|_| io::Error::other("openat2 returned a bad descriptor"))?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    check_file(file, path)
}

/// [`open_under`] without `openat2`: walks `rel` one component at a time from `base` with
/// `O_NOFOLLOW`, so no symlink is followed at all (stricter than `RESOLVE_BENEATH`, which follows
/// those that stay inside) and `..` is refused.
fn open_beneath_without_openat2(base: &File, rel: &Path, path: &Path, dir: &Path) -> io::Result<File> {
    use std::path::Component;
    let refused = || {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a plain path beneath the boot directory {} (no symlinks without openat2)",
                path.display(),
                dir.display()
            ),
        )
    };
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(p) => Ok(p),
            _ => Err(refused()),
        })
        .collect::<io::Result<_>>()?;
    let Some((last, dirs)) = parts.split_last() else { return Err(refused()) };
    let mut cur = base.try_clone()?;
    let at = |from: &File, name: &std::ffi::OsStr, flags: i32| -> io::Result<File> {
        let c = std::ffi::CString::new(name.as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
        // SAFETY: openat with a descriptor we hold and a NUL-terminated name.
        let fd = unsafe { libc::openat(from.as_raw_fd(), c.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)) {
                refused()
            } else {
                e
            });
        }
        // SAFETY: the kernel just returned this descriptor and nothing else owns it.
        Ok(unsafe { File::from_raw_fd(fd) })
    };
    for name in dirs {
        cur = at(&cur, name, libc::O_PATH | libc::O_DIRECTORY)?;
    }
    at(&cur, last, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY)
}

/// Opens `path` read-only for copying, wherever it is (tests; the daemon uses [`open_under`]).
#[cfg(test)]
fn open(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    check_file(file, path)
}

/// Refuses anything but a regular file of at most [`MAX_BOOT_FILE`] bytes.
fn check_file(file: File, path: &Path) -> io::Result<File> {
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_block_device() || kind.is_char_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is {what}", path.display())));
    }
    if meta.len() > MAX_BOOT_FILE {
        return Err(too_large(path, meta.len()));
    }
    Ok(file)
}

fn too_large(path: &Path, len: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} has {len} bytes; a kernel or initrd may have at most {MAX_BOOT_FILE}", path.display()),
    )
}

/// Copies `file` (from [`open`]) into a new sealed memfd named `vmhost:NAME` (the cache's copies:
/// `vmhost:boot:FILE`) and returns it.
/// The copy has the size the file had while it was read; a file that grows past
/// [`MAX_BOOT_FILE`] meanwhile is refused.
///
/// # Errors
/// memfd_create, the copy or sealing failed; `InvalidInput` as in [`open`].
pub fn sealed_copy(mut file: File, path: &Path, name: &str) -> io::Result<OwnedFd> {
    let label: Vec<u8> = format!("vmhost:{name}").bytes().filter(|b| *b != 0).take(200).chain([0]).collect();
    // SAFETY: memfd_create with a NUL-terminated name and flags; returns a new fd or -1.
    let raw = unsafe { libc::memfd_create(label.as_ptr().cast(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this new descriptor; nothing else owns it.
    let mut copy = unsafe { File::from_raw_fd(raw) };
    let copied = io::copy(&mut io::Read::take(&mut file, MAX_BOOT_FILE + 1), &mut copy)?;
    if copied > MAX_BOOT_FILE {
        return Err(too_large(path, copied));
    }
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl(F_ADD_SEALS) with an integer argument on a memfd we own.
    if unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OwnedFd::from(copy))
}

/// How many sealed copies [`CopyCache`] keeps for reuse.
pub const CACHED_COPIES: usize = 8;

/// What identifies one version of a file: if any of it changed, the content may have (also
/// what [`super::integrity`] keeps a binary's verdict with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Version {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Version {
    /// The version `meta` describes.
    pub(crate) fn of(meta: &std::fs::Metadata) -> Version {
        use std::os::unix::fs::MetadataExt;
        Version {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// Sealed copies of boot files, shared by every launch of the same file version (see the
/// module doc). One per process that copies (the spawner, or the daemon without one).
#[derive(Debug, Default)]
pub struct CopyCache {
    /// (version, copy), most recently used last.
    entries: Vec<(Version, OwnedFd)>,
}

impl CopyCache {
    /// An empty cache.
    pub const fn new() -> CopyCache {
        CopyCache { entries: Vec::new() }
    }

    /// A descriptor of the sealed copy of `file` (from [`open`]): the cached one when this
    /// version of the file was copied before, else a new copy (cached, evicting the least
    /// recently used beyond [`CACHED_COPIES`]).
    ///
    /// # Errors
    /// As [`sealed_copy`], or duplicating the descriptor failed.
    pub fn copy(&mut self, file: File, path: &Path) -> io::Result<OwnedFd> {
        let version = Version::of(&file.metadata()?);
        if let Some(i) = self.entries.iter().position(|(v, _)| *v == version) {
            let entry = self.entries.remove(i);
            let fd = entry.1.try_clone();
            self.entries.push(entry);
            return fd;
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let same_file = file.try_clone()?;
        let copy = sealed_copy(file, path, &format!("boot:{name}"))?;
        if Version::of(&same_file.metadata()?) != version {
            // Written to while it was copied: this copy may be torn; used once, never shared.
            return Ok(copy);
        }
        let fd = copy.try_clone()?;
        self.entries.push((version, copy));
        if self.entries.len() > CACHED_COPIES {
            self.entries.remove(0);
        }
        Ok(fd)
    }

    /// How many copies are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no copy is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The path under which QEMU opens passed descriptor `fd` of its own.
pub fn proc_path(fd: i32) -> String {
    format!("/proc/self/fd/{fd}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::PermissionsExt;

    fn seals(fd: &OwnedFd) -> i32 {
        // SAFETY: fcntl(F_GET_SEALS) on a descriptor we own.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }
    }

    #[test]
    fn copy_is_sealed_complete_and_a_snapshot() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vmlinuz");
        let content: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &content).unwrap();
        let fd = sealed_copy(open(&p).unwrap(), &p, "vm-1").unwrap();
        let s = seals(&fd);
        for seal in [libc::F_SEAL_SEAL, libc::F_SEAL_SHRINK, libc::F_SEAL_GROW, libc::F_SEAL_WRITE] {
            assert_ne!(s & seal, 0, "seal {seal:#x} missing from {s:#x}");
        }
        // Rewriting the file on disk does not change the copy.
        std::fs::write(&p, b"changed").unwrap();
        let mut copy = File::from(fd);
        copy.rewind().unwrap();
        let mut back = Vec::new();
        copy.read_to_end(&mut back).unwrap();
        assert_eq!(back, content);
        // Nobody can write it, not even its owner.
        assert!(copy.write_all(b"x").is_err());
        assert!(copy.set_len(1).is_err());
        let link = std::fs::read_link(format!("/proc/self/fd/{}", copy.as_raw_fd())).unwrap();
        assert!(link.to_string_lossy().starts_with("/memfd:vmhost:vm-1"), "{link:?}");
    }

    #[test]
    fn the_copy_is_readable_through_proc_whatever_the_source_mode() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("initrd");
        std::fs::write(&p, b"initrd bytes").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o000)).unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        // Root reads a mode 0000 file as its owner only with CAP_DAC_OVERRIDE; unit tests run as root.
        let Ok(file) = open(&p) else { return };
        let fd = sealed_copy(file, &p, "x").unwrap();
        let mode = std::fs::metadata(proc_path(fd.as_raw_fd())).unwrap().permissions().mode();
        assert_eq!(mode & 0o004, 0o004, "a memfd is world-readable: {mode:o}");
        assert_eq!(std::fs::read(proc_path(fd.as_raw_fd())).unwrap(), b"initrd bytes");
    }

    #[test]
    fn only_regular_files_are_opened() {
        let d = tempfile::tempdir().unwrap();
        let err = open(d.path()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("is a directory"), "{err}");
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = open(&fifo).unwrap_err();
        assert!(err.to_string().contains("is a FIFO"), "{err}");
        let err = open(Path::new("/dev/null")).unwrap_err();
        assert!(err.to_string().contains("is a device"), "{err}");
        assert_eq!(open(&d.path().join("absent")).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn oversized_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("huge");
        let f = File::create(&p).unwrap();
        f.set_len(MAX_BOOT_FILE + 1).unwrap(); // sparse: no disk space used
        let err = open(&p).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("at most"), "{err}");
    }

    fn inode_of(fd: &OwnedFd) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(proc_path(fd.as_raw_fd())).unwrap().ino()
    }

    #[test]
    fn the_same_file_version_shares_one_copy_and_a_change_gets_a_new_one() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vmlinuz");
        std::fs::write(&p, b"kernel v1").unwrap();
        let mut cache = CopyCache::default();
        let a = cache.copy(open(&p).unwrap(), &p).unwrap();
        let b = cache.copy(open(&p).unwrap(), &p).unwrap();
        assert_eq!(inode_of(&a), inode_of(&b), "one copy, shared");
        assert_eq!(cache.len(), 1);
        // Rewritten (even with the same length): a new copy; the old one is unchanged.
        std::fs::write(&p, b"kernel v2").unwrap();
        let c = cache.copy(open(&p).unwrap(), &p).unwrap();
        assert_ne!(inode_of(&a), inode_of(&c));
        assert_eq!(std::fs::read(proc_path(a.as_raw_fd())).unwrap(), b"kernel v1");
        assert_eq!(std::fs::read(proc_path(c.as_raw_fd())).unwrap(), b"kernel v2");
        // A chmod changes the change time: a new copy too (the content might have been swapped
        // in with a rename, or not; a copy too many is cheap, a stale one is wrong).
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = cache.copy(open(&p).unwrap(), &p).unwrap();
        assert_ne!(inode_of(&c), inode_of(&e));
        let link = std::fs::read_link(proc_path(e.as_raw_fd())).unwrap();
        assert!(link.to_string_lossy().starts_with("/memfd:vmhost:boot:vmlinuz"), "{link:?}");
    }

    #[test]
    fn the_cache_is_bounded_least_recently_used_first_out() {
        let d = tempfile::tempdir().unwrap();
        let mut cache = CopyCache::default();
        let paths: Vec<_> = (0..=CACHED_COPIES).map(|i| d.path().join(format!("k{i}"))).collect();
        for (i, p) in paths.iter().enumerate() {
            std::fs::write(p, format!("kernel {i}")).unwrap();
        }
        let first = cache.copy(open(&paths[0]).unwrap(), &paths[0]).unwrap();
        for p in &paths[1..CACHED_COPIES] {
            cache.copy(open(p).unwrap(), p).unwrap();
        }
        // Using k0 again makes k1 the least recently used.
        cache.copy(open(&paths[0]).unwrap(), &paths[0]).unwrap();
        cache.copy(open(&paths[CACHED_COPIES]).unwrap(), &paths[CACHED_COPIES]).unwrap();
        assert_eq!(cache.len(), CACHED_COPIES);
        let again = cache.copy(open(&paths[0]).unwrap(), &paths[0]).unwrap();
        assert_eq!(inode_of(&first), inode_of(&again), "k0 stayed");
        // A descriptor handed out stays valid after its copy left the cache.
        assert_eq!(std::fs::read(proc_path(first.as_raw_fd())).unwrap(), b"kernel 0");
    }

    #[test]
    fn boot_dir_of_is_lexical_and_component_wise() {
        let dirs: Vec<PathBuf> = vec!["/var/lib/vmhost/images".into(), "/boot".into(), "relative".into()];
        let of = |p: &str| boot_dir_of(&dirs, Path::new(p)).map(|(d, r)| (d.to_path_buf(), r.to_path_buf()));
        assert_eq!(of("/boot/vmlinuz"), Some(("/boot".into(), "vmlinuz".into())));
        assert_eq!(of("/boot//sub/initrd.img"), Some(("/boot".into(), "sub/initrd.img".into())));
        assert_eq!(of("/var/lib/vmhost/images/k"), Some(("/var/lib/vmhost/images".into(), "k".into())));
        for outside in [
            "/boot",
            "/boot/",
            "/boot2/vmlinuz",
            "/etc/shadow",
            "/boot/../etc/shadow",
            "/boot/./vmlinuz",
            "/boot/sub/../../etc/shadow",
            "boot/vmlinuz",
            "relative/vmlinuz",
            "/var/lib/vmhost/images",
        ] {
            assert_eq!(of(outside), None, "{outside}");
        }
        // A configured directory with dots is no directory at all.
        let dotted: Vec<PathBuf> = vec!["/srv/../etc".into()];
        assert_eq!(boot_dir_of(&dotted, Path::new("/srv/../etc/shadow")), None);
        assert_eq!(boot_dir_of(&[], Path::new("/boot/vmlinuz")), None);
    }

    #[test]
    fn without_openat2_no_symlink_is_followed() {
        let root = tempfile::tempdir().unwrap();
        let boot = root.path().join("boot");
        std::fs::create_dir_all(boot.join("sub")).unwrap();
        std::fs::write(boot.join("sub/vmlinuz"), b"kernel").unwrap();
        std::fs::write(root.path().join("secret"), b"secret").unwrap();
        std::os::unix::fs::symlink("sub/vmlinuz", boot.join("current")).unwrap();
        std::os::unix::fs::symlink("../secret", boot.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.path(), boot.join("dirlink")).unwrap();
        let base = File::open(&boot).unwrap();
        let open = |rel: &str| open_beneath_without_openat2(&base, Path::new(rel), &boot.join(rel), &boot);
        let mut out = Vec::new();
        io::Read::read_to_end(&mut open("sub/vmlinuz").unwrap(), &mut out).unwrap();
        assert_eq!(out, b"kernel");
        for refused in ["current", "escape", "dirlink/secret", "sub/../sub/vmlinuz", ""] {
            let e = open(refused).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{refused}: {e}");
        }
        assert_eq!(open("absent").unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn open_under_stays_beneath_the_boot_directory() {
        let root = tempfile::tempdir().unwrap();
        let boot = root.path().join("boot");
        std::fs::create_dir_all(boot.join("sub")).unwrap();
        std::fs::write(boot.join("vmlinuz"), b"kernel").unwrap();
        std::fs::write(root.path().join("secret"), b"secret").unwrap();
        // Links that stay inside are followed; links that leave are refused, even to a file
        // root can read.
        std::os::unix::fs::symlink("vmlinuz", boot.join("current")).unwrap();
        std::os::unix::fs::symlink("../vmlinuz", boot.join("sub/up")).unwrap();
        std::os::unix::fs::symlink("../secret", boot.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.path().join("secret"), boot.join("absolute")).unwrap();
        std::os::unix::fs::symlink(boot.join("vmlinuz"), boot.join("absolute-inside")).unwrap();
        std::os::unix::fs::symlink(root.path(), boot.join("dirlink")).unwrap();
        let dirs = vec![boot.clone()];
        let read = |name: &str| -> io::Result<Vec<u8>> {
            let mut f = open_under(&dirs, &boot.join(name))?;
            let mut out = Vec::new();
            io::Read::read_to_end(&mut f, &mut out)?;
            Ok(out)
        };
        assert_eq!(read("vmlinuz").unwrap(), b"kernel");
        assert_eq!(read("current").unwrap(), b"kernel");
        assert_eq!(read("sub/up").unwrap(), b"kernel");
        for out in ["escape", "absolute", "absolute-inside", "dirlink/secret"] {
            let e = read(out).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{out}: {e}");
        }
        assert_eq!(read("absent").unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(read("sub").unwrap_err().kind(), io::ErrorKind::InvalidInput, "a directory");
        let e = open_under(&dirs, &root.path().join("secret")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("paths.boot"), "{e}");
    }

    #[test]
    fn proc_path_names_the_descriptor() {
        assert_eq!(proc_path(9), "/proc/self/fd/9");
    }
}
