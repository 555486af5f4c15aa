//! The owner of VM overlay disks: a qcow2 file per VM on top of a shared base image that is
//! never written.
//!
//! Every VM booted from an image gets its own overlay; the guest's writes land there and the
//! base stays byte-for-byte untouched, so many VMs share one base and destroying a VM is deleting
//! one file. The lifecycle uses this module in this order:
//!
//! 1. [`base_info`] (or [`base_format`]) probes the base once, with `qemu-img info`;
//! 2. [`create_overlay`] creates the overlay with the base's format pinned (`-F`), so QEMU never
//!    probes the backing file's format again;
//! 3. [`remove_overlay`] deletes it when the VM is destroyed.
//!
//! Probing a format is only safe on a trusted file: base images are put in the image directory
//! by the operator and never written by a guest. The overlay records the base by absolute path;
//! replacing or modifying a base under existing overlays corrupts them.
//!
//! All work is done by the `qemu-img` binary (no shell), bounded by [`QEMU_IMG_TIMEOUT`]; its
//! failures carry the tail of its stderr. It runs only as one of the fixed operations of
//! [`ImgOp`], whose command lines [`ImgOp::argv`] builds from templates: with a sandbox the
//! daemon sends the spawner the operation (typed parameters), never an argv, and the spawner
//! refuses a `qemu-img` argv and any operation on a file outside the image and overlay
//! directories ([`ImgOp::confined_to`]).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use serde_json::Value;

use crate::process::lossy_tail;

/// Bound on one `qemu-img` run.
pub const QEMU_IMG_TIMEOUT: Duration = Duration::from_secs(60);

/// How many bytes at the end of `qemu-img`'s stderr errors keep.
const STDERR_TAIL: usize = 4096;

/// One GiB in bytes.
const GIB: u64 = 1 << 30;

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
    /// `qemu-img` could not be executed (or waited for).
    #[error("cannot run {}: {source}", .program.display())]
    Spawn {
        /// The `qemu-img` path used.
        program: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `qemu-img` ran and failed; its reason is in the stderr tail.
    #[error("qemu-img {command} failed ({status}): {stderr_tail}")]
    QemuImg {
        /// The subcommand (`info`, `create`).
        command: &'static str,
        /// Its exit status.
        status: ExitStatus,
        /// The last bytes of its stderr (lossy UTF-8).
        stderr_tail: String,
    },
    /// `qemu-img` did not finish within [`QEMU_IMG_TIMEOUT`] and was killed.
    #[error("qemu-img {command} did not finish within {after:?}")]
    Timeout {
        /// The subcommand.
        command: &'static str,
        /// The bound that expired.
        after: Duration,
    },
    /// `qemu-img` succeeded but printed something this module does not understand.
    #[error("unexpected qemu-img output: {0}")]
    Output(String),
    /// A file system operation on the overlay failed.
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
    /// `qemu-img`'s stderr tail, for [`DiskError::QemuImg`].
    pub fn stderr_tail(&self) -> Option<&str> {
        match self {
            DiskError::QemuImg { stderr_tail, .. } => Some(stderr_tail),
            _ => None,
        }
    }
}

/// One `qemu-img` operation with typed parameters: the only ways `qemu-img` runs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ImgOp {
    /// `qemu-img --version` (host.check).
    Version,
    /// `qemu-img info --output=json IMAGE`.
    Info {
        /// The image (a base, or an overlay whose size is read).
        image: PathBuf,
    },
    /// `qemu-img create -q -f qcow2 -F FORMAT -b BASE OVERLAY SIZEG`.
    Create {
        /// The base, absolute (the overlay records it).
        base: PathBuf,
        /// The base's format, as [`base_info`] found it.
        base_format: String,
        /// The overlay to write.
        overlay: PathBuf,
        /// Its virtual size in GiB.
        size_gib: u64,
    },
    /// `qemu-img resize -q -f qcow2 OVERLAY BYTES`.
    Resize {
        /// The overlay to grow.
        overlay: PathBuf,
        /// Its new virtual size in bytes.
        bytes: u64,
    },
}

impl ImgOp {
    /// The name used in errors (`info`, `create`, `resize`).
    pub fn command(&self) -> &'static str {
        match self {
            ImgOp::Version => "--version",
            ImgOp::Info { .. } => "info",
            ImgOp::Create { .. } => "create",
            ImgOp::Resize { .. } => "resize",
        }
    }

    /// The arguments after the program: the fixed template with the parameters filled in.
    /// Paths that start with `-` are made `./-...`; a format is refused unless it is a plain
    /// word (a letter or digit, then letters, digits, `-`, `_`), so no parameter can become an
    /// option.
    ///
    /// # Errors
    /// [`DiskError::Output`] for a format that is not a plain word.
    pub fn argv(&self) -> Result<Vec<std::ffi::OsString>, DiskError> {
        Ok(match self {
            ImgOp::Version => vec!["--version".into()],
            ImgOp::Info { image } => vec!["info".into(), "--output=json".into(), path_arg(image)],
            ImgOp::Create { base, base_format, overlay, size_gib } => {
                let plain = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
                let starts_plain = base_format.starts_with(|c: char| c.is_ascii_alphanumeric());
                if !starts_plain || !base_format.chars().all(plain) {
                    return Err(DiskError::Output(format!("unexpected base format {base_format:?}")));
                }
                vec![
                    "create".into(),
                    "-q".into(),
                    "-f".into(),
                    "qcow2".into(),
                    "-F".into(),
                    base_format.into(),
                    "-b".into(),
                    path_arg(base),
                    path_arg(overlay),
                    format!("{size_gib}G").into(),
                ]
            }
            ImgOp::Resize { overlay, bytes } => {
                vec![
                    "resize".into(),
                    "-q".into(),
                    "-f".into(),
                    "qcow2".into(),
                    path_arg(overlay),
                    bytes.to_string().into(),
                ]
            }
        })
    }

    /// Whether every file of the operation lies where it may: images it reads under one of
    /// `read` or `write`, overlays it writes under one of `write`. Paths must be absolute and
    /// free of `..`, so the check on the text is the check on the file (symbolic links inside
    /// those directories are the operator's).
    pub fn confined_to(&self, read: &[PathBuf], write: &[PathBuf]) -> bool {
        let under = |p: &Path, roots: &[PathBuf]| {
            p.is_absolute()
                && !p.components().any(|c| matches!(c, std::path::Component::ParentDir))
                && roots.iter().any(|r| p.starts_with(r) && p != r.as_path())
        };
        let readable = |p: &Path| under(p, read) || under(p, write);
        match self {
            ImgOp::Version => true,
            ImgOp::Info { image } => readable(image),
            ImgOp::Create { base, overlay, .. } => readable(base) && under(overlay, write),
            ImgOp::Resize { overlay, .. } => under(overlay, write),
        }
    }
}

/// What [`base_info`] learns about a base image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseInfo {
    /// Image format as `qemu-img` names it (`raw`, `qcow2`, ...).
    pub format: String,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
}

/// Format and virtual size of `base`, from `qemu-img info --output=json`. Works while VMs run
/// on overlays of it (they hold it read-only).
///
/// # Errors
/// [`DiskError::QemuImg`] when the base cannot be opened (missing, unreadable, corrupt), with
/// `qemu-img`'s message; [`DiskError::Spawn`], [`DiskError::Timeout`]; [`DiskError::Output`]
/// when the JSON lacks `format` or `virtual-size`.
pub async fn base_info(qemu_img: &Path, base: &Path) -> Result<BaseInfo, DiskError> {
    let base = std::path::absolute(base).map_err(|source| DiskError::Io { path: base.to_path_buf(), source })?;
    let stdout = run_qemu_img(qemu_img, ImgOp::Info { image: base }).await?;
    let json: Value =
        serde_json::from_slice(&stdout).map_err(|e| DiskError::Output(format!("qemu-img info is not JSON: {e}")))?;
    let format = json
        .get("format")
        .and_then(Value::as_str)
        .ok_or_else(|| DiskError::Output("qemu-img info has no \"format\"".to_string()))?;
    let virtual_size = json
        .get("virtual-size")
        .and_then(Value::as_u64)
        .ok_or_else(|| DiskError::Output("qemu-img info has no \"virtual-size\"".to_string()))?;
    Ok(BaseInfo { format: format.to_string(), virtual_size })
}

/// The format of `base` (`raw`, `qcow2`, ...), from `qemu-img info --output=json`.
///
/// # Errors
/// As [`base_info`].
pub async fn base_format(qemu_img: &Path, base: &Path) -> Result<String, DiskError> {
    Ok(base_info(qemu_img, base).await?.format)
}

/// Creates the qcow2 overlay `overlay` of `size_gib` GiB on top of `base`:
/// `qemu-img create -f qcow2 -F FORMAT -b BASE OVERLAY SIZEG`, with `BASE` made absolute (a
/// relative backing path would be resolved against the overlay's directory) and `FORMAT`
/// probed by [`base_info`].
///
/// The overlay's name is claimed first with an exclusive create, so two callers cannot both
/// create it and an existing file is never overwritten. If anything fails afterwards, or the
/// future is dropped, the overlay file is removed again.
///
/// # Errors
/// [`DiskError::Exists`] if `overlay` exists; [`DiskError::TooSmall`] if `size_gib` is below the
/// base's virtual size (qemu-img 7.2 would accept it and hand the guest a truncated disk);
/// [`DiskError::QemuImg`] with `qemu-img`'s stderr tail when probing or creating fails (e.g. the
/// base is missing); [`DiskError::Io`] when the overlay's directory is not writable; the errors
/// of [`base_info`].
pub async fn create_overlay(qemu_img: &Path, base: &Path, overlay: &Path, size_gib: u64) -> Result<(), DiskError> {
    // Private: only the daemon opens it; QEMU gets a descriptor (docs/sandbox.md).
    match OpenOptions::new().write(true).create_new(true).mode(0o600).open(overlay) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(DiskError::Exists(overlay.to_path_buf()));
        }
        Err(source) => {
            return Err(DiskError::Io { path: overlay.to_path_buf(), source });
        }
    }
    let mut guard = RemoveOnDrop { path: overlay, armed: true };

    let base = std::path::absolute(base).map_err(|source| DiskError::Io { path: base.to_path_buf(), source })?;
    let info = base_info(qemu_img, &base).await?;
    let too_small = size_gib.checked_mul(GIB).is_some_and(|bytes| bytes < info.virtual_size);
    if too_small {
        return Err(DiskError::TooSmall { base, base_bytes: info.virtual_size, size_gib });
    }
    let overlay_abs =
        std::path::absolute(overlay).map_err(|source| DiskError::Io { path: overlay.to_path_buf(), source })?;
    run_qemu_img(qemu_img, ImgOp::Create { base, base_format: info.format, overlay: overlay_abs, size_gib }).await?;
    guard.armed = false;
    Ok(())
}

/// Deletes the overlay file. Returns `false` if it was already absent.
///
/// # Errors
/// [`DiskError::Io`] if it exists but cannot be removed (e.g. it is a directory, or permissions).
pub fn remove_overlay(overlay: &Path) -> Result<bool, DiskError> {
    match std::fs::remove_file(overlay) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DiskError::Io { path: overlay.to_path_buf(), source }),
    }
}

/// Removes a half-made overlay unless disarmed.
struct RemoveOnDrop<'a> {
    /// The overlay.
    path: &'a Path,
    /// Cleared on success.
    armed: bool,
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

/// A path as a `qemu-img` argument: a relative path starting with `-` gets a `./` so it is not
/// taken for an option.
fn path_arg(path: &Path) -> std::ffi::OsString {
    if path.as_os_str().as_encoded_bytes().starts_with(b"-") {
        Path::new(".").join(path).into_os_string()
    } else {
        path.as_os_str().to_os_string()
    }
}

/// Grows a stopped VM's overlay to `size_gib` (`qemu-img resize`). Never shrinks: the caller
/// has refused a smaller size (2001) before anything stopped; a size at or below the current
/// virtual size changes nothing.
///
/// # Errors
/// [`DiskError::QemuImg`] with qemu-img's stderr tail, or the errors of [`base_info`] (used to
/// read the current size).
pub async fn grow_overlay(qemu_img: &Path, overlay: &Path, size_gib: u64) -> Result<bool, DiskError> {
    let bytes = size_gib.saturating_mul(GIB);
    if base_info(qemu_img, overlay).await?.virtual_size >= bytes {
        return Ok(false);
    }
    let overlay =
        std::path::absolute(overlay).map_err(|source| DiskError::Io { path: overlay.to_path_buf(), source })?;
    run_qemu_img(qemu_img, ImgOp::Resize { overlay, bytes }).await?;
    Ok(true)
}

/// Runs `qemu-img` for `op` (stdin null, output captured, killed after [`QEMU_IMG_TIMEOUT`])
/// and returns its stdout.
async fn run_qemu_img(qemu_img: &Path, op: ImgOp) -> Result<Vec<u8>, DiskError> {
    let command = op.command();
    let spawn_error = |source| DiskError::Spawn { program: qemu_img.to_path_buf(), source };
    let run = crate::sandbox::spawn::Command::qemu_img(qemu_img, op)?;
    // On timeout the child is dropped, which kills it.
    let output = tokio::time::timeout(QEMU_IMG_TIMEOUT, run.output())
        .await
        .map_err(|_| DiskError::Timeout { command, after: QEMU_IMG_TIMEOUT })?
        .map_err(spawn_error)?;
    if !output.status.success() {
        return Err(DiskError::QemuImg {
            command,
            status: output.status,
            stderr_tail: lossy_tail(&output.stderr, STDERR_TAIL),
        });
    }
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{DefaultHasher, Hash, Hasher};

    const QEMU_IMG: &str = "/usr/bin/qemu-img";

    fn qemu_img() -> &'static Path {
        Path::new(QEMU_IMG)
    }

    /// A raw base of 1 MiB with some content and an empty 2 GiB qcow2 base.
    fn bases(dir: &Path) -> (PathBuf, PathBuf) {
        let raw = dir.join("base.raw");
        let content: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&raw, content).unwrap();
        let qcow = dir.join("base.qcow2");
        let out = std::process::Command::new(QEMU_IMG)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&qcow)
            .arg("2G")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        (raw, qcow)
    }

    fn digest(path: &Path) -> (u64, std::time::SystemTime) {
        let mut h = DefaultHasher::new();
        std::fs::read(path).unwrap().hash(&mut h);
        (h.finish(), std::fs::metadata(path).unwrap().modified().unwrap())
    }

    /// `qemu-img info --output=json` of an overlay, read independently of the module.
    fn info(path: &Path) -> Value {
        let out = std::process::Command::new(QEMU_IMG).args(["info", "--output=json"]).arg(path).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[tokio::test]
    async fn probes_base_formats() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, qcow) = bases(dir.path());
        assert_eq!(base_format(qemu_img(), &raw).await.unwrap(), "raw");
        assert_eq!(
            base_info(qemu_img(), &qcow).await.unwrap(),
            BaseInfo { format: "qcow2".to_string(), virtual_size: 2 * GIB }
        );
    }

    #[tokio::test]
    async fn overlays_record_their_base_and_leave_it_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, qcow) = bases(dir.path());
        let before = (digest(&raw), digest(&qcow));

        let ov_raw = dir.path().join("vm1.qcow2");
        create_overlay(qemu_img(), &raw, &ov_raw, 1).await.unwrap();
        let i = info(&ov_raw);
        assert_eq!(i["format"], "qcow2");
        assert_eq!(i["virtual-size"], GIB);
        assert_eq!(i["backing-filename"], raw.to_str().unwrap());
        assert_eq!(i["backing-filename-format"], "raw");

        let ov_qcow = dir.path().join("vm2.qcow2");
        create_overlay(qemu_img(), &qcow, &ov_qcow, 3).await.unwrap();
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
    async fn relative_base_is_recorded_absolute() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, _) = bases(dir.path());
        // A relative path to the same base, from the current directory.
        let cwd = std::env::current_dir().unwrap();
        let depth = cwd.components().count() - 1;
        let mut rel = PathBuf::new();
        for _ in 0..depth {
            rel.push("..");
        }
        rel.push(raw.strip_prefix("/").unwrap());
        assert!(rel.is_relative());

        let ov = dir.path().join("sub-vm.qcow2");
        create_overlay(qemu_img(), &rel, &ov, 1).await.unwrap();
        let backing = PathBuf::from(info(&ov)["backing-filename"].as_str().unwrap());
        assert!(backing.is_absolute(), "{}", backing.display());
        // And it opens: `qemu-img info` above resolved the backing file.
        assert_eq!(info(&ov)["full-backing-filename"], backing.to_str().unwrap());
    }

    #[tokio::test]
    async fn missing_base_fails_with_stderr_and_leaves_no_overlay() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.img");
        let ov = dir.path().join("vm.qcow2");
        let err = create_overlay(qemu_img(), &missing, &ov, 1).await.unwrap_err();
        match &err {
            DiskError::QemuImg { command, stderr_tail, .. } => {
                assert_eq!(*command, "info");
                assert!(stderr_tail.contains("nope.img"), "{stderr_tail}");
                assert!(stderr_tail.contains("No such file"), "{stderr_tail}");
            }
            other => panic!("expected QemuImg, got {other:?}"),
        }
        assert!(err.stderr_tail().is_some());
        assert!(!ov.exists());
        assert!(base_format(qemu_img(), &missing).await.is_err());
    }

    #[tokio::test]
    async fn existing_overlay_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, _) = bases(dir.path());
        let ov = dir.path().join("vm.qcow2");
        std::fs::write(&ov, b"precious").unwrap();
        match create_overlay(qemu_img(), &raw, &ov, 1).await {
            Err(DiskError::Exists(p)) => assert_eq!(p, ov),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(std::fs::read(&ov).unwrap(), b"precious");
    }

    #[tokio::test]
    async fn overlay_smaller_than_base_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, qcow) = bases(dir.path());
        let ov = dir.path().join("vm.qcow2");
        match create_overlay(qemu_img(), &qcow, &ov, 1).await {
            Err(DiskError::TooSmall { base_bytes, size_gib, .. }) => {
                assert_eq!(base_bytes, 2 * GIB);
                assert_eq!(size_gib, 1);
            }
            other => panic!("expected TooSmall, got {other:?}"),
        }
        assert!(!ov.exists());
        // Equal size is fine.
        create_overlay(qemu_img(), &qcow, &ov, 2).await.unwrap();
    }

    #[tokio::test]
    async fn qemu_img_rejection_of_create_is_surfaced_and_cleaned_up() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, _) = bases(dir.path());
        let ov = dir.path().join("vm.qcow2");
        // Far beyond what qcow2 allows: info succeeds, create fails.
        let err = create_overlay(qemu_img(), &raw, &ov, u64::MAX / GIB).await.unwrap_err();
        match &err {
            DiskError::QemuImg { command, stderr_tail, .. } => {
                assert_eq!(*command, "create");
                assert!(!stderr_tail.is_empty());
            }
            other => panic!("expected QemuImg, got {other:?}"),
        }
        assert!(!ov.exists());
    }

    #[tokio::test]
    async fn missing_qemu_img_is_a_spawn_error() {
        let dir = tempfile::tempdir().unwrap();
        let (raw, _) = bases(dir.path());
        let ov = dir.path().join("vm.qcow2");
        match create_overlay(Path::new("/nonexistent/qemu-img"), &raw, &ov, 1).await {
            Err(DiskError::Spawn { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound)
            }
            other => panic!("expected Spawn, got {other:?}"),
        }
        assert!(!ov.exists());
    }

    #[test]
    fn operations_fill_fixed_templates() {
        let argv = |op: ImgOp| op.argv().unwrap().into_iter().map(|a| a.into_string().unwrap()).collect::<Vec<_>>();
        assert_eq!(argv(ImgOp::Info { image: "/i/b.raw".into() }), ["info", "--output=json", "/i/b.raw"]);
        let create =
            ImgOp::Create { base: "/i/b".into(), base_format: "qcow2".into(), overlay: "/d/-o".into(), size_gib: 3 };
        assert_eq!(argv(create), ["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", "/i/b", "/d/-o", "3G"]);
        assert_eq!(
            argv(ImgOp::Resize { overlay: "-o".into(), bytes: 1 << 30 }),
            ["resize", "-q", "-f", "qcow2", "./-o", "1073741824"]
        );
        // A format cannot smuggle an option or a second argument.
        for bad in ["", "raw -o x", "--help", "raw,backing_file=/etc/shadow"] {
            let op =
                ImgOp::Create { base: "/i/b".into(), base_format: bad.into(), overlay: "/d/o".into(), size_gib: 1 };
            assert!(op.argv().is_err(), "{bad:?}");
        }
        // Confinement: absolute, no `..`, inside, never the directory itself.
        let (read, write) = (vec![PathBuf::from("/i")], vec![PathBuf::from("/d")]);
        assert!(ImgOp::Info { image: "/d/o".into() }.confined_to(&read, &write));
        for outside in ["i/b", "/i/../etc/shadow", "/i", "/etc/shadow", "/id"] {
            assert!(!ImgOp::Info { image: outside.into() }.confined_to(&read, &write), "{outside}");
        }
        assert!(!ImgOp::Resize { overlay: "/i/b".into(), bytes: 1 }.confined_to(&read, &write));
    }

    #[test]
    fn dash_paths_are_not_options() {
        assert_eq!(path_arg(Path::new("-x.img")), "./-x.img");
        assert_eq!(path_arg(Path::new("/a/-x.img")), "/a/-x.img");
        assert_eq!(path_arg(Path::new("x.img")), "x.img");
    }
}
