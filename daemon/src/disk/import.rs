//! What an existing disk offered for import (`boot.disk`) is: its format, size and whether it
//! depends on other files, read by QEMU as `qemu.user` on a read-only descriptor (the same probe
//! as a base image's, [`super::offline_qemu`]). The lifecycle decides what to refuse
//! (`crate::lifecycle`'s `root_disk`).
//!
//! The probe trusts the file's header as a base image's is trusted: the operator put it in the
//! import directory. Once imported the format is recorded and pinned on QEMU's command line, so
//! what a guest later writes into a raw disk is never probed.

use std::os::fd::OwnedFd;

use serde_json::Value;

use super::offline_qemu::{image_info, Input, Session, Tool};
use super::{bounded, DiskError};

/// What [`inspect`] learns about a disk to import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportInfo {
    /// Format as QEMU names it (`raw`, `qcow2`, `vmdk`, ...).
    pub format: String,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
    /// The backing file its header names (a qcow2 overlay), if any: never opened.
    pub backing: Option<String>,
    /// The external data file its header names (qcow2 `data_file`), if any.
    pub data_file: Option<String>,
}

/// Probes the disk open as `fd` (read-only) with QEMU as `tool.user`, bounded by
/// [`super::TOOL_TIMEOUT`].
///
/// # Errors
/// [`DiskError::Tool`] when QEMU cannot read it as an image, with its message;
/// [`DiskError::Spawn`], [`DiskError::Timeout`], [`DiskError::Output`].
pub async fn inspect(tool: &Tool, fd: OwnedFd) -> Result<ImportInfo, DiskError> {
    bounded("probe", async {
        let mut session = Session::start(tool, vec![Input::Probe(fd)], "probe").await?;
        let image = session.probe_image(0).await?;
        session.finish().await?;
        parse(&image)
    })
    .await
}

/// [`ImportInfo`] from a QMP `ImageInfo`.
fn parse(image: &Value) -> Result<ImportInfo, DiskError> {
    let base = image_info(image)?;
    let text = |v: Option<&Value>| v.and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string);
    Ok(ImportInfo {
        format: base.format,
        virtual_size: base.virtual_size,
        backing: text(image.get("backing-filename")),
        data_file: text(image.pointer("/format-specific/data/data-file")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    const QEMU_IMG: &str = "/usr/bin/qemu-img";

    use crate::disk::tests::tool;

    /// Runs `qemu-img ARGS...` (as root, fixtures only) and makes `file` root-only.
    fn qemu_img(args: &[&std::ffi::OsStr], file: &Path) {
        let out = std::process::Command::new(QEMU_IMG).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    async fn inspect_file(path: &Path) -> ImportInfo {
        inspect(&tool(), OwnedFd::from(std::fs::File::open(path).unwrap())).await.unwrap()
    }

    /// Root-only files in a root-only directory: QEMU (as `nobody` under root) reads them
    /// through the descriptor alone, and reports the backing file a qcow2 names without opening
    /// it.
    #[tokio::test]
    async fn formats_sizes_and_backing_files_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let plain = dir.path().join("plain.qcow2");
        qemu_img(
            &["create".as_ref(), "-q".as_ref(), "-f".as_ref(), "qcow2".as_ref(), plain.as_ref(), "2G".as_ref()],
            &plain,
        );
        assert_eq!(
            inspect_file(&plain).await,
            ImportInfo { format: "qcow2".into(), virtual_size: 2 << 30, backing: None, data_file: None }
        );
        let raw = dir.path().join("disk.raw");
        std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
        assert_eq!(inspect_file(&raw).await.format, "raw");
        let overlay = dir.path().join("overlay.qcow2");
        let args: [&std::ffi::OsStr; 9] = [
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-F".as_ref(),
            "qcow2".as_ref(),
            "-b".as_ref(),
            plain.as_ref(),
            overlay.as_ref(),
        ];
        qemu_img(&args, &overlay);
        let info = inspect_file(&overlay).await;
        assert_eq!((info.format.as_str(), info.backing.as_deref()), ("qcow2", plain.to_str()));
    }

    #[test]
    fn an_external_data_file_is_reported() {
        let image = serde_json::json!({
            "format": "qcow2", "virtual-size": 1024,
            "format-specific": {"type": "qcow2", "data": {"data-file": "/srv/data.raw"}}
        });
        let info = parse(&image).unwrap();
        assert_eq!((info.data_file.as_deref(), info.backing), (Some("/srv/data.raw"), None));
    }
}
