//! The owner of VM overlay disks: a qcow2 file per VM on top of a shared base image that is
//! never written.
//!
//! Every VM booted from an image gets its own overlay; the guest's writes land there and the
//! base stays byte-for-byte untouched, so many VMs share one base and destroying a VM is deleting
//! one file. The lifecycle uses this module in this order:
//!
//! 1. [`base_info`] probes the base (format and virtual size);
//! 2. [`create_overlay`] creates the overlay with the base's format pinned (`backing-fmt`), so
//!    QEMU never probes the backing file's format again;
//! 3. [`grow_overlay`] grows a stopped VM's overlay (a running one is grown over its own QMP);
//! 4. [`remove_overlay`] deletes it when the VM is destroyed.
//!
//! Probing a format is only safe on a trusted file: base images are put in the image directory
//! by the operator and never written by a guest. The overlay records the base by absolute path;
//! replacing or modifying a base under existing overlays corrupts them.
//!
//! The daemon opens every file itself (overlays root-owned, mode 0600) and the image work is
//! done by QEMU without a guest, running as `qemu.user` on those descriptors
//! ([`offline_qemu`]): no image parser runs as root, and no file is ever made the user's. Each
//! operation is bounded by [`TOOL_TIMEOUT`]; failures carry QEMU's reason and its stderr tail.

pub mod bitmaps;
pub mod data;
pub mod export;
pub mod import;
pub mod internal_snapshots;
pub mod offline_qemu;
pub mod reserve;
pub mod space;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use offline_qemu::Tool;
use offline_qemu::{Input, Session};

/// Bound on one operation (QEMU's start, its work and its exit).
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// One GiB in bytes.
pub(crate) const GIB: u64 = 1 << 30;

/// What can go wrong with overlays.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The overlay file already exists; whether to reuse or remove it is the lifecycle's call.
    #[error("overlay {} already exists", .0.display())]
    Exists(PathBuf),
    /// The requested size is smaller than the base image: the guest would see a truncated disk.
    #[error("overlay of {size_gib} GiB is smaller than base {} ({base_bytes} bytes)", .base.display())]
    TooSmall {
        /// The base image.
        base: PathBuf,
        /// Virtual size of the base in bytes.
        base_bytes: u64,
        /// The requested overlay size in GiB.
        size_gib: u64,
    },
    /// QEMU could not be executed.
    #[error("cannot run {}: {source}", .program.display())]
    Spawn {
        /// The QEMU binary.
        program: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// QEMU ran and refused or failed; its reason, and the tail of its stderr.
    #[error("QEMU could not {operation} the image: {reason}")]
    Tool {
        /// The operation (`probe`, `create`, `grow`).
        operation: &'static str,
        /// QEMU's answer (a QMP error, or how it exited).
        reason: String,
        /// The last bytes of its stderr (lossy UTF-8).
        stderr_tail: String,
    },
    /// The QEMU binary is not the one `qemu.sha256` pins: nothing ran (the 4002 refusal).
    #[error("{0}")]
    Pinned(#[source] crate::qemu::integrity::PinError),
    /// The operation did not finish within [`TOOL_TIMEOUT`]; QEMU was killed.
    #[error("QEMU did not {operation} the image within {after:?}")]
    Timeout {
        /// The operation.
        operation: &'static str,
        /// The bound that expired.
        after: Duration,
    },
    /// QEMU answered something this module does not understand.
    #[error("unexpected answer from QEMU: {0}")]
    Output(String),
    /// A file system operation on an image failed (opening a base, creating an overlay).
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl DiskError {
    /// Whether QEMU ran and refused the file it was given (its answer, not a failure to run
    /// it): the file is at fault, not the host.
    pub fn file_refused(&self) -> bool {
        matches!(self, DiskError::Tool { .. } | DiskError::Output(_))
    }

    /// QEMU's stderr tail, for [`DiskError::Tool`] (the most precise reason a user can read).
    pub fn stderr_tail(&self) -> Option<&str> {
        match self {
            DiskError::Tool { stderr_tail, .. } => Some(stderr_tail),
            _ => None,
        }
    }
}

/// What [`base_info`] learns about a base image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseInfo {
    /// Image format as QEMU names it (`raw`, `qcow2`, ...).
    pub format: String,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
}

/// Why a step of a launch with an overlay failed (the API's `details.step` in brackets).
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// QEMU could not make the overlay (`disk`, with QEMU's stderr).
    #[error("cannot create the overlay disk: {0}")]
    Create(#[source] DiskError),
    /// The new overlay could not be renamed into place (`disk`).
    #[error("cannot move the overlay into place: {0}")]
    Place(#[source] io::Error),
    /// QEMU could not read the base image's format (`qemu_files`).
    #[error("cannot read the base image: {0}")]
    Base(#[source] DiskError),
    /// An overlay no record names could not be removed.
    #[error("cannot remove orphaned overlay: {0}")]
    RemoveOrphan(#[source] DiskError),
    /// The VM's own overlay (or a half-made one) could not be removed at its teardown.
    #[error("cannot remove the overlay: {0}")]
    Remove(#[source] DiskError),
}

/// QEMU could not grow a stopped VM's disk (its overlay, or its imported root disk) to `gib`
/// GiB, for `vm.apply` with a larger `disk_gib` (`disk_grow`, with QEMU's stderr).
#[derive(Debug, thiserror::Error)]
#[error("cannot grow the disk to {gib} GiB: {source}")]
pub struct GrowError {
    /// The size asked for.
    pub gib: u64,
    /// Why.
    #[source]
    pub source: DiskError,
}

/// Format and virtual size of `base`, probed by QEMU as `qemu.user` on a read-only descriptor.
/// Works while VMs run on overlays of it (they hold it read-only).
///
/// # Errors
/// [`DiskError::Io`] when the base cannot be opened (missing, unreadable); [`DiskError::Tool`]
/// when QEMU cannot read it as an image, with its message; [`DiskError::Spawn`],
/// [`DiskError::Timeout`], [`DiskError::Output`].
pub async fn base_info(tool: &Tool, base: &Path) -> Result<BaseInfo, DiskError> {
    let fd = open_read_only(base)?;
    bounded("probe", async {
        let mut session = Session::start(tool, vec![Input::Probe(fd)], "probe").await?;
        let info = session.probe(0).await?;
        session.finish().await?;
        Ok(info)
    })
    .await
}

/// The format of `base` (`raw`, `qcow2`, ...).
///
/// # Errors
/// As [`base_info`].
pub async fn base_format(tool: &Tool, base: &Path) -> Result<String, DiskError> {
    Ok(base_info(tool, base).await?.format)
}

/// Creates the qcow2 overlay `overlay` of `size_gib` GiB on top of `base`, recording `base` as an
/// absolute path (a relative backing path would be resolved against the overlay's directory) with
/// its probed format. One QEMU run probes the base and writes the overlay.
///
/// The overlay's name is claimed first with an exclusive create (mode 0600), so two callers
/// cannot both create it and an existing file is never overwritten. If anything fails afterwards,
/// or the future is dropped, the overlay file is removed again.
///
/// # Errors
/// [`DiskError::Exists`] if `overlay` exists; [`DiskError::TooSmall`] if `size_gib` is below the
/// base's virtual size (the guest would see a truncated disk); [`DiskError::Io`] when the base
/// cannot be opened or the overlay's directory is not writable; the errors of [`base_info`].
pub async fn create_overlay(tool: &Tool, base: &Path, overlay: &Path, size_gib: u64) -> Result<(), DiskError> {
    // Private: only the daemon opens it by name; QEMU gets a descriptor (docs/sandbox.md).
    let file = match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(overlay) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(DiskError::Exists(overlay.to_path_buf()));
        }
        Err(source) => {
            return Err(DiskError::Io { path: overlay.to_path_buf(), source });
        }
    };
    let mut guard = RemoveOnDrop { path: overlay, armed: true };

    let base = std::path::absolute(base).map_err(|source| DiskError::Io { path: base.to_path_buf(), source })?;
    let base_fd = open_read_only(&base)?;
    bounded("create", async {
        let inputs = vec![Input::Probe(base_fd), Input::Image(OwnedFd::from(file))];
        let mut session = Session::start(tool, inputs, "create").await?;
        let info = session.probe(0).await?;
        let bytes = size_gib.checked_mul(GIB).filter(|b| *b >= info.virtual_size);
        let Some(bytes) = bytes else {
            return Err(DiskError::TooSmall { base: base.clone(), base_bytes: info.virtual_size, size_gib });
        };
        session.create_qcow2(1, bytes, Some((&base, &info.format)), false).await?;
        session.finish().await
    })
    .await?;
    guard.armed = false;
    Ok(())
}

/// Deletes the overlay file. Returns `false` if it was already absent.
///
/// # Errors
/// [`DiskError::Io`] if it exists but cannot be removed (e.g. it is a directory, or permissions).
pub fn remove_overlay(overlay: &Path) -> Result<bool, DiskError> {
    // A large overlay takes a while to unlink.
    match crate::blocking::run(|| std::fs::remove_file(overlay)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DiskError::Io { path: overlay.to_path_buf(), source }),
    }
}

/// Grows a stopped VM's overlay to `size_gib`; returns whether it grew. Never shrinks: the caller
/// has refused a smaller size (2001) before anything stopped; a size at or below the current
/// virtual size changes nothing.
///
/// # Errors
/// [`DiskError::Io`] if the overlay cannot be opened; [`DiskError::Tool`] with QEMU's reason;
/// [`DiskError::Spawn`], [`DiskError::Timeout`], [`DiskError::Output`].
pub async fn grow_overlay(tool: &Tool, overlay: &Path, size_gib: u64) -> Result<bool, DiskError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(overlay)
        .map_err(|source| DiskError::Io { path: overlay.to_path_buf(), source })?;
    grow_qcow2(tool, file, size_gib.saturating_mul(GIB)).await
}

/// Grows the qcow2 image open as `file` to `bytes` (its backing file, if any, never opened);
/// returns whether it grew.
pub(crate) async fn grow_qcow2(tool: &Tool, file: File, bytes: u64) -> Result<bool, DiskError> {
    bounded("grow", async {
        let mut session = Session::start(tool, vec![Input::Image(OwnedFd::from(file))], "grow").await?;
        let grew = session.grow_qcow2(0, bytes).await?;
        session.finish().await?;
        Ok(grew)
    })
    .await
}

/// `path` opened read-only, as a descriptor for QEMU.
fn open_read_only(path: &Path) -> Result<OwnedFd, DiskError> {
    File::open(path).map(OwnedFd::from).map_err(|source| DiskError::Io { path: path.to_path_buf(), source })
}

/// `work` bounded by [`TOOL_TIMEOUT`]; on expiry the session is dropped, which kills QEMU.
pub(crate) async fn bounded<T>(
    operation: &'static str,
    work: impl std::future::Future<Output = Result<T, DiskError>>,
) -> Result<T, DiskError> {
    bounded_within(operation, TOOL_TIMEOUT, work).await
}

/// [`bounded`] by `within` plus [`TOOL_TIMEOUT`] (QEMU's start and exit) for work that copies
/// a whole disk.
pub(crate) async fn bounded_within<T>(
    operation: &'static str,
    within: Duration,
    work: impl std::future::Future<Output = Result<T, DiskError>>,
) -> Result<T, DiskError> {
    tokio::time::timeout(within, work).await.map_err(|_| DiskError::Timeout { operation, after: within })?
}

/// Removes a half-made overlay unless disarmed.
pub(crate) struct RemoveOnDrop<'a> {
    /// The overlay.
    pub(crate) path: &'a Path,
    /// Cleared on success.
    pub(crate) armed: bool,
}

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = std::fs::remove_file(self.path) {
                tracing::warn!(path = %self.path.display(), error = %e,
                    "cannot remove a half-made overlay");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::Value;
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const QEMU_IMG: &str = "/usr/bin/qemu-img";

    /// QEMU as `nobody` when the tests run as root (they do in CI): the files below are root's,
    /// mode 0600, in a 0700 directory, so only the descriptors give it access.
    pub(crate) fn tool() -> Tool {
        let root = nix::unistd::Uid::effective().is_root();
        Tool {
            binary: "/usr/bin/qemu-system-x86_64".into(),
            user: root.then_some(crate::config::UserIds { uid: 65534, gid: 65534 }),
            pin: None,
        }
    }

    /// A private directory with a raw base of 1 MiB with some content and an empty 2 GiB qcow2
    /// base, both mode 0600.
    fn bases() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let raw = dir.path().join("base.raw");
        let content: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&raw, content).unwrap();
        let qcow = dir.path().join("base.qcow2");
        let out = std::process::Command::new(QEMU_IMG)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&qcow)
            .arg("2G")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        for f in [&raw, &qcow] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        (dir, raw, qcow)
    }

    fn digest(path: &Path) -> (u64, std::time::SystemTime) {
        let mut h = DefaultHasher::new();
        std::fs::read(path).unwrap().hash(&mut h);
        (h.finish(), std::fs::metadata(path).unwrap().modified().unwrap())
    }

    /// `qemu-img info --output=json` of an image (as root), read independently of the module.
    fn info(path: &Path) -> Value {
        let out = std::process::Command::new(QEMU_IMG).args(["info", "--output=json"]).arg(path).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `qemu-img check` finds no error in `path`.
    fn check_clean(path: &Path) {
        let out = std::process::Command::new(QEMU_IMG).args(["check", "-q"]).arg(path).output().unwrap();
        assert!(out.status.success(), "{out:?}");
    }

    #[tokio::test]
    async fn probes_base_formats() {
        let (_dir, raw, qcow) = bases();
        assert_eq!(base_format(&tool(), &raw).await.unwrap(), "raw");
        assert_eq!(
            base_info(&tool(), &qcow).await.unwrap(),
            BaseInfo { format: "qcow2".to_string(), virtual_size: 2 * GIB }
        );
    }

    #[tokio::test]
    async fn a_base_with_its_own_backing_file_is_probed_without_opening_it() {
        let (dir, _, qcow) = bases();
        let chained = dir.path().join("chained.qcow2");
        let out = std::process::Command::new(QEMU_IMG)
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(&qcow)
            .arg(&chained)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        std::fs::set_permissions(&chained, std::fs::Permissions::from_mode(0o600)).unwrap();
        // The chained base's own backing file is root 0600 and not handed over: opening it would fail.
        assert_eq!(base_info(&tool(), &chained).await.unwrap().format, "qcow2");
    }

    #[tokio::test]
    async fn overlays_record_their_base_and_leave_it_untouched() {
        let (dir, raw, qcow) = bases();
        let before = (digest(&raw), digest(&qcow));

        let ov_raw = dir.path().join("vm1.qcow2");
        create_overlay(&tool(), &raw, &ov_raw, 1).await.unwrap();
        let i = info(&ov_raw);
        assert_eq!(i["format"], "qcow2");
        assert_eq!(i["virtual-size"], GIB);
        assert_eq!(i["backing-filename"], raw.to_str().unwrap());
        assert_eq!(i["backing-filename-format"], "raw");
        check_clean(&ov_raw);
        // Still root's and private: QEMU wrote it through the descriptor only.
        let meta = std::fs::metadata(&ov_raw).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (nix::unistd::Uid::effective().as_raw(), 0o600));

        let ov_qcow = dir.path().join("vm2.qcow2");
        create_overlay(&tool(), &qcow, &ov_qcow, 3).await.unwrap();
        let i = info(&ov_qcow);
        assert_eq!(i["virtual-size"], 3 * GIB);
        assert_eq!(i["backing-filename"], qcow.to_str().unwrap());
        assert_eq!(i["backing-filename-format"], "qcow2");

        assert_eq!((digest(&raw), digest(&qcow)), before);

        assert!(remove_overlay(&ov_raw).unwrap());
        assert!(!ov_raw.exists());
        assert!(!remove_overlay(&ov_raw).unwrap());
    }

    #[tokio::test]
    async fn overlays_grow_and_never_shrink() {
        let (dir, raw, _) = bases();
        let ov = dir.path().join("vm.qcow2");
        create_overlay(&tool(), &raw, &ov, 1).await.unwrap();
        assert!(grow_overlay(&tool(), &ov, 3).await.unwrap());
        assert_eq!(info(&ov)["virtual-size"], 3 * GIB);
        assert_eq!(info(&ov)["backing-filename"], raw.to_str().unwrap(), "the base is still recorded");
        check_clean(&ov);
        assert!(!grow_overlay(&tool(), &ov, 2).await.unwrap());
        assert!(!grow_overlay(&tool(), &ov, 3).await.unwrap());
        assert_eq!(info(&ov)["virtual-size"], 3 * GIB);
    }

    #[tokio::test]
    async fn relative_base_is_recorded_absolute() {
        let (_dir, raw, _) = bases();
        // A relative path to the same base, from the current directory.
        let cwd = std::env::current_dir().unwrap();
        let depth = cwd.components().count() - 1;
        let mut rel = PathBuf::new();
        for _ in 0..depth {
            rel.push("..");
        }
        rel.push(raw.strip_prefix("/").unwrap());
        assert!(rel.is_relative());

        let ov = raw.with_file_name("sub-vm.qcow2");
        create_overlay(&tool(), &rel, &ov, 1).await.unwrap();
        let backing = PathBuf::from(info(&ov)["backing-filename"].as_str().unwrap());
        assert!(backing.is_absolute(), "{}", backing.display());
        // And it opens: `qemu-img info` above resolved the backing file.
        assert_eq!(info(&ov)["full-backing-filename"], backing.to_str().unwrap());
    }

    #[tokio::test]
    async fn missing_base_fails_and_leaves_no_overlay() {
        let (dir, _, _) = bases();
        let missing = dir.path().join("nope.img");
        let ov = dir.path().join("vm.qcow2");
        match create_overlay(&tool(), &missing, &ov, 1).await.unwrap_err() {
            DiskError::Io { path, source } => {
                assert_eq!(path, missing);
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("expected Io, got {other:?}"),
        }
        assert!(!ov.exists());
        assert!(base_format(&tool(), &missing).await.is_err());
    }

    #[tokio::test]
    async fn a_base_that_is_no_image_fails_with_qemus_reason() {
        let (dir, _, _) = bases();
        // Probing calls an empty file raw of size 0; a directory is no image at all.
        let not_image = dir.path().join("subdir");
        std::fs::create_dir(&not_image).unwrap();
        let ov = dir.path().join("vm.qcow2");
        let err = create_overlay(&tool(), &not_image, &ov, 1).await.unwrap_err();
        match &err {
            DiskError::Tool { operation, stderr_tail, .. } => {
                assert_eq!(*operation, "create");
                assert!(!stderr_tail.is_empty(), "{err:?}");
            }
            other => panic!("expected Tool, got {other:?}"),
        }
        assert!(!ov.exists());
    }

    #[tokio::test]
    async fn existing_overlay_is_refused_and_kept() {
        let (dir, raw, _) = bases();
        let ov = dir.path().join("vm.qcow2");
        std::fs::write(&ov, b"precious").unwrap();
        match create_overlay(&tool(), &raw, &ov, 1).await {
            Err(DiskError::Exists(p)) => assert_eq!(p, ov),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(std::fs::read(&ov).unwrap(), b"precious");
    }

    #[tokio::test]
    async fn overlay_smaller_than_base_is_refused() {
        let (dir, _, qcow) = bases();
        let ov = dir.path().join("vm.qcow2");
        match create_overlay(&tool(), &qcow, &ov, 1).await {
            Err(DiskError::TooSmall { base_bytes, size_gib, .. }) => {
                assert_eq!(base_bytes, 2 * GIB);
                assert_eq!(size_gib, 1);
            }
            other => panic!("expected TooSmall, got {other:?}"),
        }
        assert!(!ov.exists());
        // Equal size is fine.
        create_overlay(&tool(), &qcow, &ov, 2).await.unwrap();
    }

    #[tokio::test]
    async fn qemus_rejection_of_create_is_surfaced_and_cleaned_up() {
        let (dir, raw, _) = bases();
        let ov = dir.path().join("vm.qcow2");
        // Far beyond what qcow2 allows: the probe succeeds, the creation fails.
        let err = create_overlay(&tool(), &raw, &ov, u64::MAX / GIB).await.unwrap_err();
        match &err {
            DiskError::Tool { operation, reason, .. } => {
                assert_eq!(*operation, "create");
                assert!(!reason.is_empty());
            }
            other => panic!("expected Tool, got {other:?}"),
        }
        assert!(!ov.exists());
    }

    #[tokio::test]
    async fn missing_qemu_is_a_spawn_error() {
        let (dir, raw, _) = bases();
        let ov = dir.path().join("vm.qcow2");
        let tool = Tool { binary: "/nonexistent/qemu-system-x86_64".into(), user: None, pin: None };
        match create_overlay(&tool, &raw, &ov, 1).await {
            Err(DiskError::Spawn { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound)
            }
            other => panic!("expected Spawn, got {other:?}"),
        }
        assert!(!ov.exists());
    }
}
