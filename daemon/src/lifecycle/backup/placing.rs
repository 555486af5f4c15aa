//! The one window of an import that a crash could leave half done: the VM is created (stopped)
//! and its TPM state and UEFI variables store are not in place yet. A create clears a new VM's
//! directory of strangers' files, so they cannot go in before it; a start without them would
//! make a new TPM or copy the template, silently. So the import names the VM in a marker
//! (`IMPORT/.NAME.placing`) before the create and removes it once the files are in (or the
//! import's VM is gone); at start, [`recover_at_start`] removes the VM of every marker left,
//! as the failed import would have: the backup still holds everything, and the operator imports
//! it again. Order: [`begin`] before the create, [`end`] after, [`recover_at_start`] once the
//! records are recovered.

use super::super::Manager;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a marker's file name has after the VM's name.
const SUFFIX: &str = ".placing";

/// The marker of VM `name` in `import_dir`.
fn marker(import_dir: &Path, name: &str) -> PathBuf {
    import_dir.join(format!(".{name}{SUFFIX}"))
}

/// The VM a marker's file name names, if it is one.
fn marked_vm(file_name: &str) -> Option<&str> {
    let name = file_name.strip_prefix('.')?.strip_suffix(SUFFIX)?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

/// Records, durably, that an import of `backup` is about to create VM `name` and then place
/// its TPM state or variables store.
///
/// # Errors
/// The write's I/O error (the import then fails before its create).
pub(super) fn begin(import_dir: &Path, name: &str, backup: &str) -> std::io::Result<()> {
    crate::state::atomic::write_atomic(&marker(import_dir, name), backup.as_bytes())
}

/// Removes `name`'s marker: the files are in place, or the import's VM is gone.
pub(super) fn end(import_dir: &Path, name: &str) {
    if let Err(e) = crate::state::atomic::remove_durable(&marker(import_dir, name)) {
        tracing::warn!(vm = %name, error = %e, "cannot remove an import's marker");
    }
}

/// At start: the VM of every marker an interrupted import left is removed (a destroy: its data
/// disks are kept as a destroy keeps them), then the marker.
pub(in crate::lifecycle) async fn recover_at_start(mgr: &Arc<Manager>) {
    let dir = mgr.config.paths.import_dir();
    let names: Vec<String> = crate::blocking::run(|| {
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries.flatten().filter_map(|e| e.file_name().to_str().and_then(marked_vm).map(str::to_string)).collect()
    });
    for name in names {
        if mgr.record(&name).is_ok() {
            tracing::warn!(vm = %name, "an import was interrupted before the VM's TPM state or UEFI variables were in place: removing its VM (import the backup again)");
            if let Err(e) = super::super::ops::destroy(mgr, &name).await {
                tracing::warn!(vm = %name, error = %e, "cannot remove the VM of an interrupted import; the marker stays");
                continue;
            }
        }
        end(&dir, &name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_markers_name_a_vm() {
        let dir = Path::new("/srv/vmhost/import");
        let m = marker(dir, "db");
        assert_eq!(m, Path::new("/srv/vmhost/import/.db.placing"));
        assert_eq!(marked_vm(".db.placing"), Some("db"));
        for other in [".placing", "db.placing", ".db.placing.tmp.7", ".db-root.qcow2.import-1", "..placing", ".db"] {
            assert_eq!(marked_vm(other), None, "{other}");
        }
    }

    #[test]
    fn a_marker_is_written_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        begin(dir.path(), "db", "db-1").unwrap();
        assert_eq!(std::fs::read(marker(dir.path(), "db")).unwrap(), b"db-1");
        end(dir.path(), "db");
        assert!(!marker(dir.path(), "db").exists());
    }
}
