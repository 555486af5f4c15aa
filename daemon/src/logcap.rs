//! Caps each VM's logs (the serial console and QEMU's stderr, `STATE/logs/*.log`) at
//! `logs.max_bytes`, so a guest printing to its console in a loop cannot fill the state file
//! system.
//!
//! Why from the side: QEMU keeps writing each log directly, through the O_APPEND descriptor it
//! was handed, so the guest's console never waits for vmhostd and keeps working while vmhostd is
//! down or restarting (VMs outlive the daemon). A pipe read by the daemon would put the daemon in
//! the console's data path: with the daemon gone, a full pipe either blocks QEMU's serial backend
//! (and the guest code writing to its console) or loses the output. Instead the daemon trims the
//! files: at start (VMs that survived a daemon restart, logs that grew while it was down) and
//! every [`CHECK_EVERY`] after, it looks at every log, and one past the cap loses its oldest part
//! with `fallocate(FALLOC_FL_COLLAPSE_RANGE)`, keeping about the newest half of the cap. On ext4
//! and XFS a collapse holds the inode lock that every O_APPEND write takes too, so no write of
//! QEMU is lost or lands at a stale offset, and the log stays the same file (readers that hold it
//! open keep reading it). A collapse needs whole file-system blocks; a file system without it
//! (tmpfs, btrfs, NFS: `EOPNOTSUPP`) gets the log truncated to zero instead, older half and all.
//!
//! Limits: the cap holds while vmhostd runs; between two checks a log grows by what its guest
//! writes in that time, and while vmhostd is down without bound until its next start. A trimmed
//! log may start in the middle of a line or of a UTF-8 character.
//!
//! Order: [`spawn`] once at daemon start; each check runs [`trim_dir`], which runs [`trim_file`]
//! on every log, which follows [`plan`] (pure).

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often the logs are checked while the daemon runs.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What to do with a log of a given size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trim {
    /// Drop the first `len` bytes (a whole number of blocks).
    Collapse {
        /// Bytes dropped from the start.
        len: u64,
    },
    /// Empty the file: the file system cannot collapse, or there are no whole blocks to drop.
    Truncate,
}

/// What [`trim_file`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trimmed {
    /// Size before.
    pub before: u64,
    /// Size right after (QEMU may have appended since).
    pub after: u64,
    /// How.
    pub how: Trim,
}

/// How to bring a log of `size` bytes back under `max` on a file system with `block`-byte
/// blocks: `None` when it is not over the cap, else drop the oldest whole blocks so that about
/// `max / 2` bytes remain (at least that many: the cut is rounded down to a block).
pub fn plan(size: u64, max: u64, block: u64) -> Option<Trim> {
    if size <= max {
        return None;
    }
    let drop = size - max / 2;
    let len = match block {
        0 => 0,
        b => drop - drop % b,
    };
    // A collapse must end before the end of the file; `drop < size` because `max / 2 > 0`.
    if len == 0 || len >= size {
        return Some(Trim::Truncate);
    }
    Some(Trim::Collapse { len })
}

/// Trims the log at `path` to the cap when it is over it; `None` when it was not (or is not a
/// regular file: a symlink is not followed).
///
/// # Errors
/// The I/O error of opening, inspecting or trimming the file (the file is left as it was, or
/// truncated when collapsing is not supported).
pub fn trim_file(path: &Path, max: u64) -> io::Result<Option<Trimmed>> {
    let file = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Ok(None);
    }
    let before = meta.len();
    let Some(mut how) = plan(before, max, meta.blksize()) else { return Ok(None) };
    if let Trim::Collapse { len } = how {
        let flags = nix::fcntl::FallocateFlags::FALLOC_FL_COLLAPSE_RANGE;
        match nix::fcntl::fallocate(&file, flags, 0, len as libc::off_t) {
            Ok(()) => {}
            // No collapse on this file system (or for this file): the documented fallback.
            Err(nix::errno::Errno::EOPNOTSUPP | nix::errno::Errno::EINVAL) => how = Trim::Truncate,
            Err(e) => return Err(e.into()),
        }
    }
    if how == Trim::Truncate {
        file.set_len(0)?;
    }
    let after = file.metadata()?.len();
    Ok(Some(Trimmed { before, after, how }))
}

/// Trims every `*.log` file in `dir` over `max`; returns what was trimmed or failed, by path.
/// A missing directory is nothing to trim.
pub fn trim_dir(dir: &Path, max: u64) -> Vec<(PathBuf, io::Result<Trimmed>)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        match trim_file(&path, max) {
            Ok(None) => {}
            // Removed between the listing and the open (a VM destroyed): nothing to trim.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Ok(Some(t)) => out.push((path, Ok(t))),
            Err(e) => out.push((path, Err(e))),
        }
    }
    out
}

/// Starts checking the logs in `dir` at once and then every [`CHECK_EVERY`], for the daemon's
/// lifetime. Each log's first trim and first failure are logged at info and warn, later ones at
/// debug, so a guest that floods its console does not flood the daemon's log in turn.
pub fn spawn(dir: PathBuf, max: u64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut told: HashSet<PathBuf> = HashSet::new();
        loop {
            let d = dir.clone();
            let done = tokio::task::spawn_blocking(move || trim_dir(&d, max)).await.unwrap_or_default();
            for (path, outcome) in done {
                let first = told.insert(path.clone());
                match outcome {
                    Ok(t) if first => tracing::info!(
                        log = %path.display(), before = t.before, after = t.after, how = ?t.how, max_bytes = max,
                        "log over logs.max_bytes trimmed (its oldest part dropped; told once per log)"
                    ),
                    Ok(t) => tracing::debug!(log = %path.display(), before = t.before, after = t.after, "log trimmed"),
                    Err(e) if first => tracing::warn!(log = %path.display(), error = %e, "cannot trim a log"),
                    Err(e) => tracing::debug!(log = %path.display(), error = %e, "cannot trim a log"),
                }
            }
            tokio::time::sleep(CHECK_EVERY).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_plan_keeps_about_half_the_cap_in_whole_blocks() {
        let max = 256 * 1024;
        assert_eq!(plan(max, max, 4096), None, "at the cap is fine");
        assert_eq!(plan(0, max, 4096), None);
        assert_eq!(plan(max + 1, max, 4096), Some(Trim::Collapse { len: 128 * 1024 }));
        // 1 MiB + 100 bytes: drop to 128 KiB + 100, rounded down to a block.
        assert_eq!(plan(1024 * 1024 + 100, max, 4096), Some(Trim::Collapse { len: 896 * 1024 }));
        for size in [max + 1, max + 4095, 3 * max + 17, 100 * max] {
            let Some(Trim::Collapse { len }) = plan(size, max, 4096) else { panic!("{size}") };
            assert_eq!(len % 4096, 0);
            let kept = size - len;
            assert!(kept >= max / 2 && kept < max / 2 + 4096, "{size}: kept {kept}");
        }
        assert_eq!(plan(max + 1, max, 0), Some(Trim::Truncate), "no block size known");
        assert_eq!(plan(max + 1, max, 1 << 20), Some(Trim::Truncate), "no whole block to drop");
    }

    fn line(i: usize) -> String {
        format!("line {i:08} {}\n", "x".repeat(100))
    }

    /// A log written by an O_APPEND writer (as QEMU does) in `dir`, `n` numbered lines.
    fn appending_log(dir: &Path, n: usize) -> (PathBuf, std::fs::File) {
        let path = dir.join("vm.serial.log");
        let mut w = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
        for i in 0..n {
            w.write_all(line(i).as_bytes()).unwrap();
        }
        (path, w)
    }

    #[test]
    fn a_log_over_the_cap_keeps_its_newest_half_and_the_writer_keeps_appending() {
        // The state directory's file system here is ext4 (the temp dir is on it, as in the tests).
        let d = tempfile::tempdir().unwrap();
        let (path, mut w) = appending_log(d.path(), 10_000);
        let before = std::fs::read(&path).unwrap();
        let max = 256 * 1024;
        let t = trim_file(&path, max).unwrap().unwrap();
        assert!(matches!(t.how, Trim::Collapse { .. }), "{t:?}");
        assert_eq!(t.before, before.len() as u64);
        assert!(t.after <= max && t.after >= max / 2, "{t:?}");
        let after = std::fs::read(&path).unwrap();
        assert!(before.ends_with(&after), "the newest bytes are kept, in order");
        // The writer's next append lands at the new end, not at its old offset (no hole).
        w.write_all(line(10_000).as_bytes()).unwrap();
        let text = std::fs::read(&path).unwrap();
        assert_eq!(text.len() as u64, t.after + line(0).len() as u64);
        assert!(text.ends_with(format!("{}{}", line(9_999), line(10_000)).as_bytes()));
        assert!(!text.contains(&0), "no hole of zeros");
        assert_eq!(trim_file(&path, max).unwrap(), None, "under the cap now");
    }

    #[test]
    fn without_collapse_the_log_is_emptied_and_symlinks_are_not_followed() {
        // tmpfs has no COLLAPSE_RANGE: the documented fallback.
        if let Ok(d) = tempfile::tempdir_in("/dev/shm") {
            let (path, mut w) = appending_log(d.path(), 5_000);
            let t = trim_file(&path, 64 * 1024).unwrap().unwrap();
            assert_eq!((t.how, t.after), (Trim::Truncate, 0));
            w.write_all(b"next\n").unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b"next\n");
        }
        let d = tempfile::tempdir().unwrap();
        let (target, _w) = appending_log(d.path(), 5_000);
        let link = d.path().join("other.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(trim_file(&link, 64 * 1024).is_err(), "O_NOFOLLOW");
        let size = std::fs::metadata(&target).unwrap().len();
        // The directory pass trims the real log once and only logs.
        std::fs::write(d.path().join("notes.txt"), vec![b'n'; 200_000]).unwrap();
        let done = trim_dir(d.path(), 64 * 1024);
        let trimmed: Vec<_> = done.iter().filter(|(_, r)| r.is_ok()).map(|(p, _)| p.clone()).collect();
        assert_eq!(trimmed, vec![target.clone()]);
        assert!(std::fs::metadata(&target).unwrap().len() < size);
        assert_eq!(std::fs::metadata(d.path().join("notes.txt")).unwrap().len(), 200_000);
    }
}
