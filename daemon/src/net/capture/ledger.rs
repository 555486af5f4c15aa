//! The per-source ledger: what vmhostd found on a source before it changed anything there.
//!
//! [`super::Capture::sync`] reads every ledger ([`read_all`]) before planning, writes one
//! ([`write`]) before the first change to its source and removes it ([`remove`]) after the
//! source is given back. The file `STATE/capture/<source>.json` is replaced atomically (mode
//! 0600), so after a crash it is either the old or the new content. A file that cannot be read
//! or parsed anyway (a disk error, an edit by hand) is treated as absent and logged: without it
//! the source's promiscuous flag and clsact qdisc are left as they are, never cleared on a
//! guess, while our filters are still found by their cookie.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::state::atomic::{remove_durable, write_atomic};

/// The directory under the state dir that holds the ledgers.
pub const DIR: &str = "capture";

/// What a monitored source looked like before vmhostd changed it, and on which link and boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    /// The source's name (also the file's name).
    pub source: String,
    /// The source's ifindex when the ledger was written; another one means another link.
    pub ifindex: u32,
    /// `/proc/sys/kernel/random/boot_id` when the ledger was written; another one means the
    /// settings it describes died with that boot.
    pub boot_id: String,
    /// The user-set promiscuous flag was on before vmhostd set it.
    pub promisc_was: bool,
    /// vmhostd added the clsact qdisc (there was none).
    pub clsact_made: bool,
}

/// The file of `source`'s ledger in `dir` (`STATE/capture`).
pub fn path_of(dir: &Path, source: &str) -> PathBuf {
    dir.join(format!("{source}.json"))
}

/// What [`read_all`] found: readable ledgers by source, and the sources whose file is unreadable.
#[derive(Debug, Default)]
pub struct Ledgers {
    /// Parsed ledgers by source name.
    pub ok: BTreeMap<String, Ledger>,
    /// Sources with a ledger file that cannot be used (treated as absent).
    pub unreadable: Vec<String>,
}

/// Reads every ledger in `dir`. An absent directory is no ledger.
///
/// A file that cannot be read or parsed, or whose `source` is not its name, counts as absent
/// (logged, listed in [`Ledgers::unreadable`]).
pub fn read_all(dir: &Path) -> Ledgers {
    let mut out = Ledgers::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return out,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list capture ledgers; treating them as absent");
            return out;
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // Temp files of an interrupted atomic write start with '.' and do not end in .json.
        let Some(source) = name.strip_suffix(".json").filter(|s| !s.starts_with('.') && !s.is_empty()) else {
            continue;
        };
        let parsed = std::fs::read(entry.path())
            .map_err(|e| e.to_string())
            .and_then(|bytes| serde_json::from_slice::<Ledger>(&bytes).map_err(|e| e.to_string()))
            .and_then(|l| if l.source == source { Ok(l) } else { Err(format!("names source {:?}", l.source)) });
        match parsed {
            Ok(l) => {
                out.ok.insert(source.to_string(), l);
            }
            Err(e) => {
                tracing::warn!(file = %entry.path().display(), error = %e, "unreadable capture ledger; treating it as absent");
                out.unreadable.push(source.to_string());
            }
        }
    }
    out
}

/// Writes `ledger` to `dir` (made 0700 if absent), atomically.
///
/// # Errors
/// The directory cannot be made or the file cannot be written.
pub fn write(dir: &Path, ledger: &Ledger) -> io::Result<()> {
    if !dir.is_dir() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let bytes = serde_json::to_vec_pretty(ledger).map_err(io::Error::other)?;
    write_atomic(&path_of(dir, &ledger.source), &bytes)
}

/// Removes `source`'s ledger from `dir`, durably; absent is fine.
///
/// # Errors
/// The file exists and cannot be removed.
pub fn remove(dir: &Path, source: &str) -> io::Result<()> {
    remove_durable(&path_of(dir, source)).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn sample(source: &str) -> Ledger {
        Ledger {
            source: source.to_string(),
            ifindex: 7,
            boot_id: "b".to_string(),
            promisc_was: false,
            clsact_made: true,
        }
    }

    #[test]
    fn write_read_remove_round_trip_with_mode_0600() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        assert!(read_all(&dir).ok.is_empty(), "an absent directory is no ledger");
        write(&dir, &sample("eth1")).unwrap();
        write(&dir, &sample("bond0")).unwrap();
        let mode = std::fs::metadata(path_of(&dir, "eth1")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let all = read_all(&dir);
        assert_eq!(all.ok.len(), 2);
        assert_eq!(all.ok["eth1"], sample("eth1"));
        remove(&dir, "eth1").unwrap();
        remove(&dir, "eth1").unwrap();
        assert_eq!(read_all(&dir).ok.keys().collect::<Vec<_>>(), ["bond0"]);
    }

    #[test]
    fn torn_or_mismatched_files_count_as_absent() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        write(dir, &sample("eth1")).unwrap();
        std::fs::write(path_of(dir, "eth2"), b"{\"source\": \"eth2\", \"ifind").unwrap();
        std::fs::write(path_of(dir, "eth3"), serde_json::to_vec(&sample("eth4")).unwrap()).unwrap();
        std::fs::write(dir.join(".eth5.json.tmp.42"), b"half").unwrap();
        let all = read_all(dir);
        assert_eq!(all.ok.keys().collect::<Vec<_>>(), ["eth1"]);
        let mut bad = all.unreadable.clone();
        bad.sort();
        assert_eq!(bad, ["eth2", "eth3"]);
    }
}
