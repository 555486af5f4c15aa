//! `STATE/images.json`: the sha256 each image was imported with, and what the last check of
//! each found (in memory only).

use super::Verdict;
use crate::qemu::boot_files::Version;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

/// What an import recorded of one image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// Its sha256, lower-case hex.
    pub sha256: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its format as QEMU read it.
    pub format: String,
    /// The size of the disk a guest sees, in bytes.
    pub virtual_size: u64,
    /// The URL or path it was copied from (`null` when it was recorded where it was).
    pub source: Option<String>,
    /// When, RFC 3339 UTC.
    pub imported_at: String,
    /// The file as it was when hashed: unchanged, it is not hashed again.
    pub(crate) version: Version,
}

/// The file's content.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Content {
    version: u32,
    images: BTreeMap<String, ImageRecord>,
}

#[derive(Debug, Default)]
struct Inner {
    records: BTreeMap<String, ImageRecord>,
    /// The last check of each image, when it found the file changed since its record.
    checked: HashMap<String, (Version, Verdict)>,
}

/// The records file and its content in memory.
#[derive(Debug)]
pub(super) struct RecordFile {
    path: PathBuf,
    inner: Mutex<Inner>,
    /// Held by a writer across its file write (readers take only `inner`, never across I/O).
    writer: Mutex<()>,
}

impl RecordFile {
    /// Reads `path` (absent: no records).
    pub(super) fn open(path: PathBuf) -> Result<RecordFile, String> {
        let records = match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice::<Content>(&bytes)
                    .map_err(|e| format!("cannot parse {}: {e}", path.display()))?
                    .images
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        Ok(RecordFile { path, inner: Mutex::new(Inner { records, checked: HashMap::new() }), writer: Mutex::new(()) })
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn get(&self, name: &str) -> Option<ImageRecord> {
        self.inner().records.get(name).cloned()
    }

    pub(super) fn all(&self) -> BTreeMap<String, ImageRecord> {
        self.inner().records.clone()
    }

    /// Sets (`Some`) or removes (`None`) the record of `name` and writes the file atomically;
    /// on a write error the records stay as they were.
    pub(super) fn put(&self, name: &str, record: Option<ImageRecord>) -> std::io::Result<()> {
        // One writer at a time, so two cannot lose each other's change; readers go on.
        let _writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let mut records = self.inner().records.clone();
        match record {
            Some(r) => records.insert(name.to_string(), r),
            None => records.remove(name),
        };
        let content = Content { version: 1, images: records };
        let bytes = serde_json::to_vec_pretty(&content).map_err(std::io::Error::other)?;
        crate::blocking::run(|| crate::state::atomic::write_atomic(&self.path, &bytes))?;
        let mut inner = self.inner();
        inner.records = content.images;
        inner.checked.remove(name);
        Ok(())
    }

    /// What the last check of `name` found: its record's version matches by definition.
    pub(super) fn checked(&self, name: &str) -> Option<(Version, Verdict)> {
        let inner = self.inner();
        if let Some(c) = inner.checked.get(name) {
            return Some(c.clone());
        }
        inner.records.get(name).map(|r| (r.version, Verdict::Match))
    }

    pub(super) fn set_checked(&self, name: &str, version: Version, verdict: Verdict) {
        self.inner().checked.insert(name.to_string(), (version, verdict));
    }
}
