//! The image store: the owner of the files in `paths.images` and of the sha256 each was
//! imported with (docs/images.md).
//!
//! VMs boot from an image through a qcow2 overlay that names it, so an image must never change
//! under a VM: it is only ever added whole (a hidden temp file in the same directory, hashed as
//! it is written, fsynced, renamed into place without replacing anything, the directory
//! fsynced) and removed whole. Images put there by hand have no record and still work.
//!
//! Order of use: [`Store::open`] once at start (it removes temp files a crash left); per
//! import: [`check_import`] (pure), [`Store::begin`] (one operation per name), [`Store::temp`],
//! fill it ([`copy`] or [`download`]), [`Temp::place`], then [`Store::put`] the record; per
//! delete: [`Store::begin`], [`Store::remove`]. [`Store::verify`] for `host.check`.
//!
//! The records are one file, `STATE/images.json` (not in `paths.images`: that is
//! `STATE/images` by default, and every file there is an image), written atomically. A crash
//! between the rename and the record leaves an image without a record, as if put there by
//! hand; importing it again with its sha256 records it.

pub mod address;
pub mod download;
mod records;
mod temp;
pub mod url;

use crate::config::Config;
use crate::qemu::boot_files::Version;
pub use records::ImageRecord;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
pub(crate) use temp::read_full;
pub use temp::{copy, copy_until, Temp};

/// Default longest download (`image.import` `timeout_s`).
pub const DEFAULT_DOWNLOAD_TIMEOUT_S: u64 = 3600;

pub use url::MAX_URL;

/// Where an import copies from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The file is in `paths.images` already (put there by hand): check and record it.
    InPlace,
    /// A file in `paths.import`.
    File(PathBuf),
    /// An `http(s)` URL, fetched by curl as `qemu.user` ([`download`]).
    Url(url::SourceUrl),
}

/// Why the image store refuses a request. The API codes and fields are given at the boundary
/// (`crate::owner_errors`); the texts here are the messages users read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The image name is not a plain file name.
    #[error("{0:?} is not a plain file name (1-255 of A-Z a-z 0-9 . _ - +, not starting with a dot)")]
    NotAName(String),
    /// The sha256 asked for is not 64 hex digits.
    #[error("the sha256 must be 64 hex digits")]
    BadSha256,
    /// The download timeout asked for is 0.
    #[error("the timeout must be at least 1 second")]
    ZeroTimeout,
    /// An http(s) URL the strict parser refuses.
    #[error("{0}")]
    BadUrl(#[source] url::UrlError),
    /// A URL of another scheme.
    #[error("only http:// and https:// URLs are fetched")]
    NotFetched,
    /// A source that is neither a URL nor a file in the import directory.
    #[error(
        "{given:?} is neither an http(s) URL nor a file in the import directory {} \
         (its name, or its absolute path)",
        .dir.display()
    )]
    NotImportable {
        /// The source as given.
        given: String,
        /// The import directory.
        dir: PathBuf,
    },
    /// Another import or delete holds the name.
    #[error("another import or delete of image {0:?} is in progress")]
    Busy(String),
    /// A file does not have the sha256 asked for; nothing was kept.
    #[error("{what} has sha256 {found}, not {expected} as asked; nothing was kept")]
    Mismatch {
        /// The file, as the request named it (never a URL's query string).
        what: String,
        /// The sha256 asked for.
        expected: String,
        /// The sha256 it has.
        found: String,
        /// Its length.
        bytes: u64,
    },
    /// A recorded image's file no longer has the sha256 it was recorded with: the name is at
    /// fault, not the sha256 asked for.
    #[error("{what} has sha256 {found}, not {expected} as asked; nothing was kept")]
    Changed {
        /// The file.
        what: String,
        /// The sha256 asked for (and recorded).
        expected: String,
        /// The sha256 it has.
        found: String,
        /// Its length.
        bytes: u64,
    },
}

/// Why a step of the image store failed on the host, or the file it was given is not an image
/// it takes. The API codes, fields and steps are given at the boundary
/// (`crate::owner_errors`); the texts here are the messages users read.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The images directory cannot be listed.
    #[error("cannot read {}: {source}", .dir.display())]
    List {
        /// The images directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No temp file can be made in the images directory.
    #[error("cannot create a file in {}: {source}", .dir.display())]
    Create {
        /// The images directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file to import is absent or not a file: the request is at fault.
    #[error("cannot read {}: {source}", .from.display())]
    SourceUnreadable {
        /// The file to import.
        from: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file to import is a symbolic link, which an import never follows.
    #[error("{} is a symbolic link", .from.display())]
    SourceLink {
        /// The file to import.
        from: PathBuf,
        /// `ELOOP`.
        #[source]
        source: std::io::Error,
    },
    /// Copying the file to import failed on the host.
    #[error("cannot copy {}: {source}", .from.display())]
    Copy {
        /// The file to import.
        from: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The temp file could not be finished (written out, hashed, synced).
    #[error("cannot write the image: {0}")]
    Write(#[source] std::io::Error),
    /// The finished temp file could not be opened again for QEMU to read.
    #[error("cannot reopen the image: {0}")]
    Reopen(#[source] std::io::Error),
    /// Another image of the name was placed while this one was copied: nothing is replaced.
    #[error("an image {name:?} appeared meanwhile")]
    Appeared {
        /// The image name.
        name: String,
        /// `EEXIST`.
        #[source]
        source: std::io::Error,
    },
    /// The temp file could not be renamed into place.
    #[error("cannot move the image into place at {}: {source}", .path.display())]
    Place {
        /// The image's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An image file already in the directory cannot be read (to hash or inspect it).
    #[error("cannot read {}: {source}", .path.display())]
    Unreadable {
        /// The image's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The name holds something other than a regular file.
    #[error("{} is not a regular file", .path.display())]
    NotAFile {
        /// The image's path.
        path: PathBuf,
    },
    /// QEMU cannot read the file as a disk image: the request's file is at fault.
    #[error("QEMU cannot read {what} as a disk image: {source}")]
    NotAnImage {
        /// The file, as the request named it.
        what: String,
        /// QEMU's answer.
        #[source]
        source: crate::disk::DiskError,
    },
    /// QEMU could not be run to read the file (or is not the pinned binary).
    #[error("cannot inspect {what}: {source}")]
    Inspect {
        /// The file, as the request named it.
        what: String,
        /// Why.
        #[source]
        source: crate::disk::DiskError,
    },
    /// The image names a backing or data file: an overlay over it would reach a file vmhostd
    /// does not manage.
    #[error("{what} names another file ({other:?}) as its backing or data file: flatten it first (qemu-img convert)")]
    NamesAnotherFile {
        /// The file, as the request named it.
        what: String,
        /// The file it names.
        other: String,
    },
    /// The image is in place but its record could not be written.
    #[error("the image {name:?} is in place, but its record cannot be written ({source}); import it again")]
    Record {
        /// The image name.
        name: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The image's file or record could not be removed.
    #[error("cannot delete image {name:?}: {source}")]
    Delete {
        /// The image name.
        name: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// A failed [`copy`] of the file to import: the request's fault when the file is absent,
    /// not a file or a symbolic link, else the host's.
    pub fn copying(from: &Path, source: std::io::Error) -> StoreError {
        let from = from.to_path_buf();
        match source.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidInput => {
                StoreError::SourceUnreadable { from, source }
            }
            _ if source.raw_os_error() == Some(libc::ELOOP) => StoreError::SourceLink { from, source },
            _ => StoreError::Copy { from, source },
        }
    }

    /// A failed [`Temp::place`] of image `name` at `path`.
    pub fn placing(name: &str, path: &Path, source: std::io::Error) -> StoreError {
        if source.kind() == std::io::ErrorKind::AlreadyExists {
            StoreError::Appeared { name: name.to_string(), source }
        } else {
            StoreError::Place { path: path.to_path_buf(), source }
        }
    }

    /// QEMU's failure to read `what`: the file's fault when QEMU ran and refused it.
    pub fn inspecting(what: &str, source: crate::disk::DiskError) -> StoreError {
        let what = what.to_string();
        if source.file_refused() {
            StoreError::NotAnImage { what, source }
        } else {
            StoreError::Inspect { what, source }
        }
    }
}

/// A checked `image.import` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportRequest {
    /// File name in `paths.images`.
    pub name: String,
    /// Expected sha256, lower-case hex.
    pub sha256: String,
    /// Where from.
    pub source: Source,
    /// Longest download.
    pub timeout: std::time::Duration,
}

/// Checks an `image.import` request against the config: nothing is touched.
///
/// # Errors
/// [`ImageError::NotAName`], [`ImageError::BadSha256`], [`ImageError::ZeroTimeout`], or for the
/// source [`ImageError::BadUrl`] (a URL [`url::parse`] refuses: user information, spaces,
/// quotes, control or non-ASCII characters, an ambiguous host), [`ImageError::NotFetched`]
/// (not http(s)) or [`ImageError::NotImportable`] (a path outside `paths.import`): all 2001 on
/// the field at fault.
pub fn check_import(
    config: &Config,
    name: &str,
    sha256: &str,
    source: Option<&str>,
    timeout_s: Option<u64>,
) -> Result<ImportRequest, ImageError> {
    if !is_image_name(name) {
        return Err(ImageError::NotAName(name.to_string()));
    }
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ImageError::BadSha256);
    }
    let timeout_s = timeout_s.unwrap_or(DEFAULT_DOWNLOAD_TIMEOUT_S);
    if timeout_s == 0 {
        return Err(ImageError::ZeroTimeout);
    }
    let source = match source {
        None => Source::InPlace,
        Some(s) if s.starts_with("http://") || s.starts_with("https://") => {
            Source::Url(url::parse(s).map_err(ImageError::BadUrl)?)
        }
        Some(s) if s.contains("://") => {
            return Err(ImageError::NotFetched);
        }
        Some(s) => Source::File(import_path(config, s)?),
    };
    Ok(ImportRequest {
        name: name.to_string(),
        sha256: sha256.to_ascii_lowercase(),
        source,
        timeout: std::time::Duration::from_secs(timeout_s),
    })
}

/// `source` as a path in `paths.import`: a plain file name there, or an absolute path whose
/// parent is that directory (lexically; the open does not follow a symlink).
fn import_path(config: &Config, source: &str) -> Result<PathBuf, ImageError> {
    let dir = config.paths.import_dir();
    let path = Path::new(source);
    let file = if path.is_absolute() {
        path.parent().filter(|p| *p == dir).and(path.file_name()).and_then(|f| f.to_str())
    } else {
        Some(source)
    };
    match file {
        Some(f) if is_image_name(f) => Ok(dir.join(f)),
        _ => Err(ImageError::NotImportable { given: source.to_string(), dir }),
    }
}

/// A name an image may have: what `boot.image` accepts ([`crate::validate`]).
pub fn is_image_name(name: &str) -> bool {
    crate::validate::is_plain_file_name(name)
}

/// Removes the [`Temp`] files an interrupted copy left in `dir`.
pub fn remove_leftovers(dir: &Path) {
    for leftover in temp::leftovers(dir) {
        match std::fs::remove_file(&leftover) {
            Ok(()) => tracing::info!(path = %leftover.display(), "removed an interrupted copy"),
            Err(e) => tracing::warn!(path = %leftover.display(), error = %e, "cannot remove an interrupted copy"),
        }
    }
}

/// Removes the [`Temp`] files an interrupted copy to `file` left beside it.
pub fn remove_leftovers_of(file: &Path) {
    let (Some(dir), Some(name)) = (file.parent(), file.file_name().and_then(|n| n.to_str())) else { return };
    for leftover in temp::leftovers(dir) {
        let ours = leftover.file_name().and_then(|n| n.to_str()).is_some_and(|n| temp::is_temp_of(n, name));
        if ours {
            if let Err(e) = std::fs::remove_file(&leftover) {
                tracing::warn!(path = %leftover.display(), error = %e, "cannot remove an interrupted copy");
            }
        }
    }
}

/// What [`Store::verify`] found for one recorded image: what a check of a pinned binary finds.
pub use crate::qemu::integrity::Verdict;

/// The image store of one `paths.images`.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    records: records::RecordFile,
    /// Names an import or delete is working on.
    busy: Arc<Mutex<HashSet<String>>>,
}

/// Holds one name of the store for one operation (see [`Store::begin`]).
#[derive(Debug)]
pub struct NameGuard {
    busy: Arc<Mutex<HashSet<String>>>,
    name: String,
}

impl Drop for NameGuard {
    fn drop(&mut self) {
        self.busy.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.name);
    }
}

impl Store {
    /// The store of `config.paths.images`, its records read from `STATE/images.json`, and the
    /// temp files an interrupted import left removed.
    ///
    /// # Errors
    /// The records file exists but cannot be read or parsed.
    pub fn open(config: &Config) -> Result<Store, String> {
        let dir = config.paths.images.clone();
        let records = records::RecordFile::open(config.paths.state.join("images.json"))?;
        remove_leftovers(&dir);
        Ok(Store { dir, records, busy: Arc::default() })
    }

    /// The path of image `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Takes `name` for one import or delete.
    ///
    /// # Errors
    /// [`ImageError::Busy`] (4090) when another import or delete of that name is in progress.
    pub fn begin(&self, name: &str) -> Result<NameGuard, ImageError> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if !busy.insert(name.to_string()) {
            return Err(ImageError::Busy(name.to_string()));
        }
        Ok(NameGuard { busy: Arc::clone(&self.busy), name: name.to_string() })
    }

    /// The record of `name`.
    pub fn record(&self, name: &str) -> Option<ImageRecord> {
        self.records.get(name)
    }

    /// Every record.
    pub fn records(&self) -> BTreeMap<String, ImageRecord> {
        self.records.all()
    }

    /// Records `name` (the guard shows the caller holds it).
    ///
    /// # Errors
    /// [`StoreError::Record`]: the records file cannot be written (the previous records stay).
    pub fn put(&self, _held: &NameGuard, name: &str, record: ImageRecord) -> Result<(), StoreError> {
        self.records.put(name, Some(record)).map_err(|source| StoreError::Record { name: name.to_string(), source })
    }

    /// A new hidden temp file for image `name`, removed when dropped unless placed.
    ///
    /// # Errors
    /// [`StoreError::Create`]: it cannot be created.
    pub fn temp(&self, _held: &NameGuard, name: &str) -> Result<Temp, StoreError> {
        Temp::create(&self.dir, name).map_err(|source| StoreError::Create { dir: self.dir.clone(), source })
    }

    /// Removes image `name` and its record. Returns whether there was either.
    ///
    /// # Errors
    /// [`StoreError::Delete`]: the file cannot be removed (the record stays), or the records
    /// cannot be written.
    pub fn remove(&self, _held: &NameGuard, name: &str) -> Result<bool, StoreError> {
        let delete = |source| StoreError::Delete { name: name.to_string(), source };
        let file = crate::blocking::run(|| crate::state::atomic::remove_durable(&self.path(name))).map_err(delete)?;
        let recorded = self.records.get(name).is_some();
        if recorded {
            self.records.put(name, None).map_err(delete)?;
        }
        Ok(file || recorded)
    }

    /// The image files: regular files of the directory not starting with a dot, by name.
    ///
    /// # Errors
    /// [`StoreError::List`]: the directory cannot be read.
    pub fn files(&self) -> Result<BTreeMap<String, std::fs::Metadata>, StoreError> {
        crate::blocking::run(|| {
            let mut out = BTreeMap::new();
            let entries = match std::fs::read_dir(&self.dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
                Err(e) => return Err(e),
            };
            for entry in entries {
                let entry = entry?;
                let Ok(name) = entry.file_name().into_string() else { continue };
                if name.starts_with('.') {
                    continue;
                }
                // Not followed: a symlink is not an image the store manages.
                let meta = entry.metadata()?;
                if meta.file_type().is_file() {
                    out.insert(name, meta);
                }
            }
            Ok(out)
        })
        .map_err(|source| StoreError::List { dir: self.dir.clone(), source })
    }

    /// Checks recorded image `name` against its record: a file whose identity and times are
    /// those recorded at import (or at the last check) is not read again.
    pub fn verify(&self, name: &str) -> Option<Verdict> {
        let record = self.records.get(name)?;
        let path = self.path(name);
        Some(crate::blocking::run(|| {
            let mut file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) => return Verdict::Unreadable(e.to_string()),
            };
            let version = match file.metadata() {
                Ok(m) => Version::of(&m),
                Err(e) => return Verdict::Unreadable(e.to_string()),
            };
            if let Some(checked) = self.records.checked(name) {
                if checked.0 == version {
                    return checked.1;
                }
            }
            let verdict = Verdict::of(&mut file, &record.sha256);
            self.records.set_checked(name, version, verdict.clone());
            verdict
        }))
    }
}

/// 2003 on `sha256`: `what` does not have the sha256 `expected`.
pub fn mismatch(what: &str, expected: &str, found: &str, bytes: u64) -> ImageError {
    ImageError::Mismatch { what: what.to_string(), expected: expected.to_string(), found: found.to_string(), bytes }
}

/// 2003 on `name`: the recorded image `what` changed on disk since it was recorded.
pub fn changed(what: &str, expected: &str, found: &str, bytes: u64) -> ImageError {
    ImageError::Changed { what: what.to_string(), expected: expected.to_string(), found: found.to_string(), bytes }
}

#[cfg(test)]
mod tests;
