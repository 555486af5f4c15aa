//! Retention (`keep` on `vm.export`, `vm.backups_prune`; docs/backup.md "Retention"): a VM's
//! newest N backups stay, older ones go, and no kept backup ever loses its chain: a kept
//! increment whose parent would go is first merged with the backups below it into a new full
//! backup of the same name ([`merge`]), which stands in for it for the increments built on it
//! (its manifest's `merged_from`).
//!
//! Order: [`plan`] (pure: what goes, what is merged), each merge (the chain checked file by
//! file, the full copy made in `.NAME.merging`, sealed, swapped in: [`crate::backup::Partial::replace`]),
//! then each removal ([`crate::backup::Backups::delete`]), oldest first. Every step is
//! crash-safe: the backups directory is put right at the next start ([`crate::backup::Backups::open`]).

use super::super::copies::{copy_timeout, seal_copies};
use super::super::errors::{DiskStepError, FileError};
use super::super::Manager;
use super::chain;
use crate::api::backup::{BackupKind, DiskChange, PruneParams, PruneResult};
use crate::api::ApiError;
use crate::backup::ReadBackup;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;

/// One prune at a time: a merge reads chains another prune could be removing.
static PRUNING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a prune of `backups` (oldest first) keeping `keep` does: the backups that go, and the
/// kept ones to merge first (their parent goes).
pub(super) fn plan(backups: &[ReadBackup], keep: usize) -> (Vec<String>, Vec<String>) {
    let cut = backups.len().saturating_sub(keep);
    let gone: Vec<String> = backups[..cut].iter().map(|b| b.name.clone()).collect();
    let merge = backups[cut..]
        .iter()
        .filter(|b| b.manifest.parent.as_ref().is_some_and(|p| gone.contains(&p.dir)))
        .map(|b| b.name.clone())
        .collect();
    (gone, merge)
}

/// `vm.backups_prune`: [`prune`] while holding the VM's operation, as an export does, so that
/// no export of the VM runs beside it (an incremental export reads the parent a prune could
/// be removing or merging). Backups of a VM that no longer exists are pruned without one.
///
/// # Errors
/// 2001 on `keep` (0); 4090 (another operation on the VM: an export, a start...); 2003 on
/// `backup` for a chain that does not check (nothing removed); 4001 `step: prune` or `step:
/// import`.
pub(crate) async fn prune_vm(mgr: &Arc<Manager>, p: PruneParams) -> Result<PruneResult, ApiError> {
    if p.keep == 0 {
        return Err(ApiError::invalid("keep", "keep at least 1 backup"));
    }
    let _op = match mgr.begin_op(&p.name).await {
        Ok((op, _)) => Some(op),
        Err(e) if e.code == crate::api::Code::NotFound => None,
        Err(e) => return Err(e),
    };
    prune(mgr, &p.name, p.keep).await
}

/// Keeps VM `vm`'s newest `keep` backups (module doc). The caller holds the VM's operation
/// ([`prune_vm`], or the export that just made a backup).
///
/// # Errors
/// As [`prune_vm`], but 4090.
pub(super) async fn prune(mgr: &Arc<Manager>, vm: &str, keep: u32) -> Result<PruneResult, ApiError> {
    if keep == 0 {
        return Err(ApiError::invalid("keep", "keep at least 1 backup"));
    }
    let _one = PRUNING.lock().await;
    let all = mgr.backups.of_vm(vm);
    let (gone, to_merge) = plan(&all, usize::try_from(keep).unwrap_or(usize::MAX));
    let mut merged = Vec::new();
    for name in &to_merge {
        merge(mgr, name).await?;
        merged.push((name.clone(), name.clone()));
    }
    for name in &gone {
        mgr.backups.delete(name, || mgr.crashpoint("prune:deleting"))?;
        tracing::info!(vm, backup = %name, "pruned a backup");
    }
    let kept = all.iter().map(|b| b.name.clone()).filter(|n| !gone.contains(n)).collect();
    Ok(PruneResult { removed: gone, merged, kept })
}

/// Replaces increment `name` by a full backup of the same content and id: every disk made
/// whole from its chain (checked first), the rest copied (a raw one made sparse again).
///
/// # Errors
/// 2003 on `backup` for a chain that does not check; 4001.
async fn merge(mgr: &Arc<Manager>, name: &str) -> Result<(), ApiError> {
    let chain = mgr.backups.chain(name)?;
    let layers = chain::layers_of(&chain).map_err(|why| chain::broken(name, why))?;
    let Some(last) = chain.last() else { return Err(chain::broken(name, "no backup".into())) };
    chain::verify(&layers, last.manifest.uefi_vars.as_ref().map(|v| (last.dir.as_path(), v)))?;
    // The room the merged copy takes is admitted first, as for any copy (3002, nothing
    // written), and held while the copy is made: a chain flattened holds at most what its
    // layers hold; a single file is copied whole (its holes written until the copy is sealed),
    // so its length counts; the other files are small.
    let mut whole: Vec<PathBuf> = layers.iter().filter(|l| l.len() == 1).flatten().map(|l| l.path()).collect();
    whole.extend(last.manifest.uefi_vars.iter().map(|v| last.dir.join(&v.file)));
    whole.extend(last.manifest.tpm.iter().flat_map(|t| &t.files).map(|f| last.dir.join(&f.file)));
    let chained: Vec<PathBuf> = layers.iter().filter(|l| l.len() > 1).flatten().map(|l| l.path()).collect();
    let needed: u64 = crate::blocking::run(|| {
        use std::os::unix::fs::MetadataExt;
        let meta = |f: &PathBuf| std::fs::metadata(f).ok();
        let whole: u64 = whole.iter().filter_map(meta).map(|m| m.len()).sum();
        let chained: u64 = chained.iter().filter_map(meta).map(|m| m.blocks().saturating_mul(512)).sum();
        whole.saturating_add(chained)
    });
    let _room = crate::disk::space::reserve_bytes(&mgr.reservations, &mgr.config.paths.backups_dir(), needed, "keep")?;
    let partial = mgr.backups.begin_merge(name)?;
    let mut manifest = last.manifest.clone();
    for (disk, layers) in manifest.disks.iter_mut().zip(&layers) {
        let to = partial.dir().join(&disk.file);
        if layers.len() == 1 {
            // Copied, not linked: the daemon's Landlock rules refuse links across directories.
            let from = layers[0].path();
            crate::blocking::run(|| std::fs::copy(&from, &to)).map_err(FileError::file("prune", "copy", &to))?;
            seal_copies(partial.dir(), std::slice::from_mut(disk), "prune")?;
            continue;
        }
        let mut opened = Vec::new();
        for l in layers {
            let path = l.path();
            let fd = crate::blocking::run(|| {
                std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path)
            })
            .map(OwnedFd::from)
            .map_err(FileError::file("prune", "open", &path))?;
            opened.push((fd, "qcow2".to_string()));
        }
        let target = super::super::copies::create_target(&to, 0, "prune")?;
        let flat =
            crate::disk::export::FlatDisk { layers: opened, target, format: "qcow2", virtual_size: disk.virtual_size };
        crate::disk::export::flatten(&mgr.disk_tool(), vec![flat], copy_timeout(None)?)
            .await
            .map_err(|source| DiskStepError::Flatten { source })?;
        seal_copies(partial.dir(), std::slice::from_mut(disk), "prune")?;
    }
    if let Some(v) = &manifest.uefi_vars {
        let (from, to) = (last.dir.join(&v.file), partial.dir().join(&v.file));
        crate::blocking::run(|| std::fs::copy(&from, &to)).map_err(FileError::file("prune", "copy", &to))?;
    }
    // The TPM state is whole in every backup, incremental ones too: the increment's own copy.
    for f in manifest.tpm.iter().flat_map(|t| &t.files) {
        let (from, to) = (last.dir.join(&f.file), partial.dir().join(&f.file));
        crate::blocking::run(|| std::fs::copy(&from, &to)).map_err(FileError::file("prune", "copy", &to))?;
    }
    manifest.kind = Some(BackupKind::Full);
    manifest.parent = None;
    manifest.merged_from = Some(last.manifest_sha256.clone());
    manifest.changes = manifest
        .disks
        .iter()
        .map(|d| DiskChange { name: d.name.clone(), kind: BackupKind::Full, full_reason: None })
        .collect();
    mgr.crashpoint("prune:merged");
    partial.replace(&manifest, || mgr.crashpoint("prune:replaced"))?;
    tracing::info!(backup = %name, "merged an increment with the backups below it into a full backup");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::backup::ParentRef;

    fn b(name: &str, parent: Option<&str>) -> ReadBackup {
        let mut m = crate::backup::tests::manifest();
        m.parent = parent.map(|p| ParentRef { dir: p.into(), id: "0".repeat(16), manifest_sha256: "0".repeat(64) });
        ReadBackup { name: name.into(), dir: name.into(), manifest: m, manifest_sha256: String::new() }
    }

    #[test]
    fn a_kept_increment_whose_parent_goes_is_merged_first() {
        let all = [b("a", None), b("b", Some("a")), b("c", Some("b")), b("d", Some("c"))];
        assert_eq!(plan(&all, 2), (vec!["a".to_string(), "b".into()], vec!["c".to_string()]));
        assert_eq!(plan(&all, 4), (vec![], vec![]));
        assert_eq!(plan(&all, 9), (vec![], vec![]));
        // Two increments on one parent (since): both merged.
        let all = [b("a", None), b("b", Some("a")), b("c", Some("a"))];
        assert_eq!(plan(&all, 2), (vec!["a".to_string()], vec!["b".to_string(), "c".into()]));
        // A full backup kept needs nothing.
        let all = [b("a", None), b("b", Some("a")), b("c", None)];
        assert_eq!(plan(&all, 1), (vec!["a".to_string(), "b".into()], vec![]));
    }
}
