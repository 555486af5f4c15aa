//! Crash-safe file replacement: after a crash a reader sees either the old or the new content,
//! never a mix or an empty file.
//!
//! The order matters and is the whole point: write a temp file in the same directory, fsync it,
//! rename it over the target, then fsync the directory so the rename itself is durable.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Atomically replaces `path` with `data` (mode 0600).
///
/// # Errors
/// Any I/O error (ENOSPC included); the temp file is removed and the old content stays intact.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
        .to_string_lossy();
    let tmp = dir.join(format!(".{file_name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    // The new content is in place once the rename succeeded; reporting a failed directory fsync
    // as a failed write would make callers believe the old content is still there.
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), error = %e, "directory fsync failed after rename");
    }
    Ok(())
}

/// Removes `path` and makes the removal durable. Absent is fine. Returns whether it was there.
///
/// # Errors
/// I/O errors other than "not found".
pub fn remove_durable(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        remove_durable(&p).unwrap();
        remove_durable(&p).unwrap();
        assert!(!p.exists());
    }

    #[test]
    fn failed_write_keeps_old_content() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        write_atomic(&p, b"old").unwrap();
        // A directory squatting on the temp name makes the write fail part-way.
        fs::create_dir(d.path().join(format!(".a.json.tmp.{}", std::process::id()))).unwrap();
        assert!(write_atomic(&p, b"new").is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
    }
}
