//! An image being imported: a hidden temp file next to the images, written and hashed in one
//! pass, then renamed into place whole or removed.

use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What temp file names have after the image name.
const MARK: &str = ".import-";

/// Copy and hash block size.
pub(super) const BLOCK: usize = 1 << 20;

/// The temp files an interrupted import left in `dir`.
pub(super) fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.contains(MARK)))
        .map(|e| e.path())
        .collect()
}

/// Whether `file_name` is a temp file [`Temp::create`] made for `name`.
pub(super) fn is_temp_of(file_name: &str, name: &str) -> bool {
    file_name.strip_prefix('.').and_then(|r| r.strip_prefix(name)).is_some_and(|r| r.starts_with(MARK))
}

/// A temp file for one image, removed when dropped unless [`Temp::place`]d.
#[derive(Debug)]
pub struct Temp {
    path: PathBuf,
    file: File,
    hasher: Sha256,
    bytes: u64,
    /// Bytes actually written to disk (blocks of zeros are skipped over): what the reservation
    /// was told.
    on_disk: u64,
    placed: bool,
    /// The disk space held for it, told what is written ([`crate::disk::reserve`]).
    room: Option<crate::disk::reserve::Reservation>,
}

impl Temp {
    /// Creates `DIR/.NAME.import-PID-N` (mode 0600, never an existing file).
    pub(crate) fn create(dir: &Path, name: &str) -> io::Result<Temp> {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(".{name}{MARK}{}-{n}", std::process::id()));
        let file = crate::blocking::run(|| {
            OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(&path)
        })?;
        Ok(Temp { path, file, hasher: Sha256::new(), bytes: 0, on_disk: 0, placed: false, room: None })
    }

    /// Holds `room` for as long as the file is unplaced, telling it each block written.
    pub fn hold(&mut self, room: crate::disk::reserve::Reservation) {
        self.room = Some(room);
    }

    /// Appends `data` and hashes it. A block of zeros is skipped over, not written, so a
    /// sparse raw image stays sparse.
    ///
    /// # Errors
    /// A write error (ENOSPC included).
    pub fn write(&mut self, data: &[u8]) -> io::Result<()> {
        self.hasher.update(data);
        if data.iter().all(|b| *b == 0) {
            self.file.seek(SeekFrom::Current(data.len() as i64))?;
        } else {
            self.file.write_all(data)?;
            self.on_disk += data.len() as u64;
            if let Some(room) = &self.room {
                room.wrote(data.len() as u64);
            }
        }
        self.bytes += data.len() as u64;
        Ok(())
    }

    /// Empties the file and its hash: what was written (a redirect's body) is not the image.
    /// The reservation holds those bytes again: the space they took is free, and the image
    /// still has to fit in what was reserved.
    ///
    /// # Errors
    /// The file cannot be truncated.
    pub fn reset(&mut self) -> io::Result<()> {
        self.file.set_len(0)?;
        self.file.seek(SeekFrom::Start(0))?;
        self.hasher = Sha256::new();
        self.bytes = 0;
        if let Some(room) = &self.room {
            room.freed(self.on_disk);
        }
        self.on_disk = 0;
        Ok(())
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Ends the content (its length set where the last skipped zeros end), syncs it and
    /// returns its sha256, lower-case hex.
    ///
    /// # Errors
    /// The length cannot be set or the sync fails.
    pub fn finish(&mut self) -> io::Result<String> {
        crate::blocking::run(|| {
            self.file.set_len(self.bytes)?;
            self.file.sync_all()
        })?;
        Ok(crate::qemu::integrity::hex(&std::mem::take(&mut self.hasher).finalize()))
    }

    /// A read-only descriptor of the file (for QEMU to read its format).
    ///
    /// # Errors
    /// It cannot be reopened.
    pub fn reopen(&self) -> io::Result<File> {
        crate::blocking::run(|| File::open(&self.path))
    }

    /// A read-write descriptor of the file (for QEMU to write a restored disk into it).
    ///
    /// # Errors
    /// It cannot be reopened.
    pub fn reopen_rw(&self) -> io::Result<File> {
        crate::blocking::run(|| {
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(&self.path)
        })
    }

    /// Renames the file to `to` (never replacing a file there) and syncs the directory.
    /// Returns the placed file's metadata.
    ///
    /// # Errors
    /// `AlreadyExists` when `to` exists; other rename errors. The temp file is then removed.
    pub fn place(self, to: &Path) -> io::Result<std::fs::Metadata> {
        self.rename_to(to, false)?;
        crate::blocking::run(|| std::fs::symlink_metadata(to))
    }

    /// Renames the file over `to` (replacing what is there: a revert) and syncs the directory.
    ///
    /// # Errors
    /// Rename errors; the temp file is then removed.
    pub fn replace(self, to: &Path) -> io::Result<()> {
        self.rename_to(to, true)
    }

    /// Renames the file to `to`, over a file there only with `replace`, then syncs the
    /// directory so the rename is durable.
    fn rename_to(mut self, to: &Path, replace: bool) -> io::Result<()> {
        use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
        let flags = if replace { RenameFlags::empty() } else { RenameFlags::RENAME_NOREPLACE };
        crate::blocking::run(|| {
            renameat2(AT_FDCWD, &self.path, AT_FDCWD, to, flags).map_err(io::Error::from)?;
            self.placed = true;
            if let Some(dir) = to.parent() {
                File::open(dir)?.sync_all()?;
            }
            Ok(())
        })
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.placed {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot remove an unfinished copy's temp file");
            }
        }
    }
}

/// Copies the regular file at `source` (never through a symlink) into `temp`.
///
/// # Errors
/// `source` cannot be opened or is not a regular file (`InvalidInput`), or a read or write error.
pub fn copy(source: &Path, temp: &mut Temp) -> io::Result<()> {
    copy_until(source, temp, None)
}

/// [`copy`], given up (`TimedOut`) once `until` has passed: checked between blocks, so the
/// operation that asked for the copy (its `timeout_s`) ends within a block of its bound.
///
/// # Errors
/// As [`copy`]; `TimedOut` after `until`.
pub fn copy_until(source: &Path, temp: &mut Temp, until: Option<std::time::Instant>) -> io::Result<()> {
    crate::blocking::run(|| {
        let mut file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(source)?;
        if !file.metadata()?.file_type().is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        let mut buf = vec![0u8; BLOCK];
        loop {
            if until.is_some_and(|t| std::time::Instant::now() >= t) {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the operation's timeout_s passed"));
            }
            let n = read_full(&mut file, &mut buf)?;
            if n == 0 {
                return Ok(());
            }
            temp.write(&buf[..n])?;
        }
    })
}

/// Reads until `buf` is full or the end: whole blocks, so zero blocks are found as such.
pub(crate) fn read_full(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
