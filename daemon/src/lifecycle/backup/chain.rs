//! Restoring an incremental backup (docs/backup.md "Importing a chain"): each disk of the
//! last backup is the file of the newest backup in the chain that copied it whole, with the
//! increments after it laid over it in order ([`layers_of`]). Every file of every layer is
//! checked against its manifest's sha256 before anything is written ([`verify`]); a disk of
//! more than one layer is then made by QEMU without a guest: each increment a qcow2 node whose
//! backing is the node below, the top copied whole into the new disk ([`restore`]). The UEFI
//! variables store goes in once the VM is defined and before it first starts ([`place_vars`]).
//!
//! Order: [`layers_of`], [`verify`], per disk [`restore`] (or the single-file copy of
//! [`super`]), [`place_vars`]. Retention's merge ([`super::retention`]) uses the same steps.

use super::super::copies::{copy_checked, copy_timeout, CheckedFrom};
use super::super::errors::{DiskStepError, FileError};
use super::super::Manager;
use crate::api::backup::{BackupDisk, BackupKind, VarsCopy};
use crate::api::{ApiError, Code};
use crate::backup::ReadBackup;
use serde_json::json;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One file of a disk's chain: the backup directory it is in and its entry there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Layer {
    /// The backup's directory.
    pub dir: PathBuf,
    /// The disk's entry in that backup's manifest.
    pub disk: BackupDisk,
}

impl Layer {
    /// The file's path.
    pub(super) fn path(&self) -> PathBuf {
        self.dir.join(&self.disk.file)
    }
}

/// Per disk of `chain`'s last backup (in its order), the files that make it, bottom (a full
/// copy) first.
///
/// # Errors
/// Why the chain does not hold a disk whole (a backup lacks it; no full copy below).
pub(super) fn layers_of(chain: &[ReadBackup]) -> Result<Vec<Vec<Layer>>, String> {
    let Some(last) = chain.last() else { return Err("an empty chain".into()) };
    let mut out = Vec::new();
    for d in &last.manifest.disks {
        let mut layers = Vec::new();
        let mut whole = false;
        for b in chain.iter().rev() {
            let m = &b.manifest;
            let Some(i) = m.disks.iter().position(|e| e.role == d.role && e.name == d.name) else {
                return Err(format!("backup {} has no disk {:?}", b.name, d.name));
            };
            layers.push(Layer { dir: b.dir.clone(), disk: m.disks[i].clone() });
            // A version 1 manifest has no changes: every disk whole.
            if m.changes.get(i).is_none_or(|c| c.kind != BackupKind::Incremental) {
                whole = true;
                break;
            }
        }
        if !whole {
            return Err(format!("no backup of the chain holds disk {:?} whole", d.name));
        }
        layers.reverse();
        out.push(layers);
    }
    Ok(out)
}

/// 2003 on `backup`: its chain does not hold its disks (`why`).
pub(super) fn broken(backup: &str, why: String) -> ApiError {
    ApiError::new(Code::ChecksumMismatch, format!("backup {backup:?} cannot be restored: {why}; nothing was imported"))
        .field("backup")
}

/// Reads every file of `layers` (and the vars store in `vars`' directory) and checks it
/// against its manifest's sha256, before anything is written.
///
/// # Errors
/// 2003 on `backup` (`details: {file, expected, found}`) for the first that differs; 4001
/// `step: import` for one that cannot be read.
pub(super) fn verify(layers: &[Vec<Layer>], vars: Option<(&Path, &VarsCopy)>) -> Result<(), ApiError> {
    let mut files: Vec<(PathBuf, String, String)> =
        layers.iter().flatten().map(|l| (l.path(), l.disk.file.clone(), l.disk.sha256.clone())).collect();
    if let Some((dir, v)) = vars {
        files.push((dir.join(&v.file), v.file.clone(), v.sha256.clone()));
    }
    for (path, file, expected) in files {
        let found = crate::blocking::run(|| {
            let mut f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path)?;
            crate::qemu::integrity::sha256_of(&mut f)
        })
        .map_err(|source| FileError::CopyOut {
            step: "import".into(),
            file: file.clone(),
            place: "in the backup".into(),
            source,
        })?;
        if found != expected {
            let dir = path.parent().and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned());
            return Err(ApiError::new(
                Code::ChecksumMismatch,
                format!(
                    "{file} in backup {} has sha256 {found}, not {expected} as recorded; nothing was imported",
                    dir.as_deref().unwrap_or("?")
                ),
            )
            .field("backup")
            .details(json!({ "file": file, "backup": dir, "expected": expected, "found": found })));
        }
    }
    Ok(())
}

/// Makes a temp file in the import directory (the caller places it) from `layers` of backup
/// disk `disk`: each layer probed as an
/// import's copy is (a qcow2 naming no backing or data file, no larger than `spec` says),
/// then QEMU without a guest lays the increments over the full copy and copies the top whole
/// into `dest`.
///
/// # Errors
/// 2003 on `backup` for a layer that is not such a qcow2; 4001 `step: import`.
pub(super) async fn restore(
    mgr: &Arc<Manager>,
    layers: &[Layer],
    disk: &BackupDisk,
    spec: &crate::api::VmSpec,
) -> Result<crate::images::Temp, ApiError> {
    let mut opened = Vec::new();
    for layer in layers {
        let path = layer.path();
        let open = || {
            crate::blocking::run(|| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path))
                .map(OwnedFd::from)
                .map_err(FileError::file("import", "open", &path))
        };
        super::inspect_copy(mgr, &layer.disk, open()?, spec).await?;
        opened.push((open()?, "qcow2".to_string()));
    }
    // Made under a temp name in the import directory (removed at the next start if a crash
    // interrupts it), placed whole by the caller: a half-made disk is never where a VM takes
    // kept disks from.
    let failed =
        |source: std::io::Error| FileError::PlaceOut { step: "import".into(), file: disk.file.clone(), source };
    let name = format!("{}-{}", spec.name, disk.file);
    let temp = crate::images::Temp::create(&mgr.config.paths.import_dir(), &name).map_err(failed)?;
    let target = OwnedFd::from(temp.reopen_rw().map_err(failed)?);
    let flat =
        crate::disk::export::FlatDisk { layers: opened, target, format: "qcow2", virtual_size: disk.virtual_size };
    crate::disk::export::flatten(&mgr.disk_tool(), vec![flat], copy_timeout(None)?)
        .await
        .map_err(|source| DiskStepError::Flatten { source })?;
    crate::blocking::run(|| temp.reopen_rw().and_then(|f| f.sync_all())).map_err(failed)?;
    mgr.crashpoint("import:restored");
    Ok(temp)
}

/// Puts the backup's UEFI variables store `vars` (in `dir`, checked against its sha256 as it
/// is copied) in place for imported VM `name` (created, stopped).
///
/// # Errors
/// 2003 on `backup`, 4001 `step: import`.
pub(super) fn place_vars(mgr: &Manager, name: &str, dir: &Path, vars: &VarsCopy) -> Result<(), ApiError> {
    let paths = mgr.paths(name);
    let from =
        CheckedFrom { dir, field: "backup", place: "in the backup", undone: "imported", step: "import", until: None };
    let disk = BackupDisk {
        role: crate::api::backup::DiskRole::Data,
        name: "uefi-vars".into(),
        file: vars.file.clone(),
        format: crate::api::disks::DiskFormat::Raw,
        virtual_size: vars.bytes,
        bytes: vars.bytes,
        sha256: vars.sha256.clone(),
    };
    let temp = copy_checked(&from, &disk, &mgr.config.paths.import_dir(), &format!("{name}-uefi-vars.fd"))?;
    let store = paths.uefi_vars();
    crate::blocking::run(|| {
        crate::state::dirs::private_dir(&paths.disk_dir)?;
        temp.place(&store).map(drop)
    })
    .map_err(FileError::file("import", "place the UEFI variables store", &store))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::backup::DiskChange;

    fn backup(name: &str, kinds: &[BackupKind]) -> ReadBackup {
        let mut m = crate::backup::tests::manifest();
        m.version = 2;
        m.changes = m
            .disks
            .iter()
            .zip(kinds)
            .map(|(d, k)| DiskChange { name: d.name.clone(), kind: *k, full_reason: None })
            .collect();
        ReadBackup { name: name.into(), dir: format!("/b/{name}").into(), manifest: m, manifest_sha256: String::new() }
    }

    #[test]
    fn each_disk_is_its_last_whole_copy_then_the_increments_after_it() {
        use BackupKind::{Full, Incremental};
        let chain = [backup("a", &[Full, Full]), backup("b", &[Full, Full]), backup("c", &[Incremental, Full])];
        // root: whole in b (a revert between a and b made it full), then c's increment; nsm
        // (raw) whole in c.
        let layers = layers_of(&chain).unwrap();
        let dirs = |l: &[Layer]| l.iter().map(|x| x.dir.display().to_string()).collect::<Vec<_>>();
        assert_eq!(dirs(&layers[0]), ["/b/b", "/b/c"]);
        assert_eq!(dirs(&layers[1]), ["/b/c"]);
        let chain = [backup("a", &[Full, Full]), backup("b", &[Incremental, Full]), backup("c", &[Incremental, Full])];
        assert_eq!(dirs(&layers_of(&chain).unwrap()[0]), ["/b/a", "/b/b", "/b/c"]);
        let chain = [backup("b", &[Incremental, Full])];
        assert!(layers_of(&chain).unwrap_err().contains("whole"));
        let mut lacking = backup("a", &[Full]);
        lacking.manifest.disks.truncate(1);
        let chain = [lacking, backup("b", &[Full, Incremental])];
        assert!(layers_of(&chain).unwrap_err().contains("no disk \"nsm\""));
    }

    #[test]
    fn a_changed_file_anywhere_in_the_chain_is_refused_before_anything_is_written() {
        let d = tempfile::tempdir().unwrap();
        let layer = |dir: &str, file: &str, data: &[u8]| {
            let dir = d.path().join(dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(file), data).unwrap();
            let mut disk = crate::backup::tests::manifest().disks[0].clone();
            disk.sha256 = crate::qemu::integrity::sha256_of(&mut &data[..]).unwrap();
            Layer { dir, disk }
        };
        let good = vec![vec![layer("a", "root.qcow2", b"full"), layer("b", "root.qcow2", b"inc")]];
        assert!(verify(&good, None).is_ok());
        std::fs::write(good[0][0].path(), b"fulL").unwrap();
        let e = verify(&good, None).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::ChecksumMismatch, Some("backup")));
        assert_eq!(e.details["backup"], "a", "{e:?}");
    }
}
