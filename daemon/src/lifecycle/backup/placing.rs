//! The one window of an import that a crash could leave half done: the VM is created (stopped)
//! and its TPM state and UEFI variables store are not in place yet. A create clears a new VM's
//! directory of strangers' files, so they cannot go in before it; a start without them would
//! make a new TPM or copy the template, silently. So the import names the VM in a marker
//! (`IMPORT/.NAME.placing`) before the create and removes it once the files are in (or the
//! import's VM is gone); at start, [`recover_at_start`] removes the VM of every marker left,
//! as the failed import would have: the backup still holds everything, and the operator imports
//! it again. The import holds the VM's operation from its create until the files are in, so
//! nothing starts it in between; the marker holds the created spec, so a restart removes only
//! the VM this import made. Order: [`begin`] before the create, [`end`] once the files are in
//! (before any start) or the VM is gone, [`recover_at_start`] once the records are recovered.

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

/// Records, durably, that an import is about to create VM `spec` and then place its TPM state
/// or variables store: the marker holds the spec, so that a restart removes only the VM this
/// import made (another client may create a VM of the name meanwhile).
///
/// # Errors
/// `AlreadyExists` when another import of the name holds the marker; the write's I/O error
/// (the import then fails before its create).
pub(super) fn begin(import_dir: &Path, spec: &crate::api::VmSpec) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let bytes = serde_json::to_vec(spec).map_err(std::io::Error::other)?;
    let path = marker(import_dir, &spec.name);
    // Exclusive: one import of a name at a time owns its marker.
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
    let written = file
        .write_all(&bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::File::open(import_dir)?.sync_all());
    if written.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    written
}

/// Removes `name`'s marker: the files are in place, or the import's VM is gone (or was never
/// made).
///
/// # Errors
/// The removal's I/O error: the caller must not start the VM (a restart would remove it).
pub(super) fn end(import_dir: &Path, name: &str) -> std::io::Result<()> {
    crate::state::atomic::remove_durable(&marker(import_dir, name)).map(drop)
}

/// The spec a marker holds, `None` when it cannot be read (a crash while it was written:
/// before the create).
fn marked_spec(path: &Path) -> Option<crate::api::VmSpec> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// At start: the VM of every marker an interrupted import left is removed when it is the VM
/// that import made (its spec the marker's; a destroy: data disks with `keep_on_destroy` are
/// kept as a destroy keeps them), then the marker.
pub(in crate::lifecycle) async fn recover_at_start(mgr: &Arc<Manager>) {
    let dir = mgr.config.paths.import_dir();
    let markers: Vec<(String, Option<crate::api::VmSpec>)> = crate::blocking::run(|| {
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str().and_then(marked_vm).map(str::to_string)?;
                Some((name, marked_spec(&e.path())))
            })
            .collect()
    });
    for (name, spec) in markers {
        let made_here = mgr.record(&name).is_ok_and(|r| spec.as_ref() == Some(&r.spec));
        if made_here {
            tracing::warn!(vm = %name, "an import was interrupted before the VM's TPM state or UEFI variables were in place: removing its VM (import the backup again)");
            if let Err(e) = super::super::ops::destroy(mgr, &name).await {
                tracing::warn!(vm = %name, error = %e, "cannot remove the VM of an interrupted import; the marker stays");
                continue;
            }
        }
        if let Err(e) = end(&dir, &name) {
            tracing::warn!(vm = %name, error = %e, "cannot remove an interrupted import's marker");
        }
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
    fn a_marker_holds_the_spec_is_exclusive_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::validate::tests::spec("db");
        begin(dir.path(), &spec).unwrap();
        assert_eq!(marked_spec(&marker(dir.path(), "db")), Some(spec.clone()));
        let again = begin(dir.path(), &spec).unwrap_err();
        assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists, "a second import of the name");
        end(dir.path(), "db").unwrap();
        assert!(!marker(dir.path(), "db").exists());
        end(dir.path(), "db").unwrap();
        std::fs::write(marker(dir.path(), "db"), b"{trunc").unwrap();
        assert_eq!(marked_spec(&marker(dir.path(), "db")), None, "a marker cut short names no VM");
    }
}
