//! Binary integrity: the QEMU vmhostd launches is the one the operator pinned by its sha256
//! (`qemu.sha256`), as the uvm lifecycle manager checks its hypervisor against a manifest.
//!
//! Order of use: [`Integrity::of`] once from the config; [`Integrity::log_at_start`] when the
//! daemon starts (a mismatch is logged, the daemon still starts so it can keep managing the
//! VMs that run); [`Pinned::verify`] before every run of the QEMU binary, which refuses with
//! 4002 on a mismatch: a VM's launch ([`Integrity::verify_qemu`]), every run without a guest that
//! inspects, creates, grows or copies an image file (the [`Integrity::qemu_pin`] that
//! [`crate::disk::Tool`] carries, checked by [`crate::disk::offline_qemu::Session::start`], the one
//! place such a run begins), and `host.check`'s `--version` probe (not run on a mismatch);
//! [`Integrity::items`] for `host.check`.
//!
//! `qemu.img_sha256` pins `qemu.img_binary` (qemu-img) for `host.check` and the start's log only:
//! vmhostd never runs qemu-img (the spawner refuses it; image files are QEMU's work, see
//! [`crate::disk::offline_qemu`]), so there is no run to refuse.
//!
//! Hashing a 20 MB binary takes tens of milliseconds, so a verdict is kept with the file's
//! identity and times (device, inode, size, mtime, ctime; the ctime cannot be set back by
//! anyone) and the file is hashed again only when one of them changed. The file is opened
//! once per check and both stat and hash read that descriptor. Limit: the spawner starts the
//! binary by path after the check, so a binary swapped in between is caught at the next
//! launch, not this one; the binary's directory is root's.

use super::boot_files::Version;
use crate::api::{CheckItem, CheckStatus};
use crate::config::Config;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What a check of a pinned binary found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Its sha256 is the pinned one.
    Match,
    /// Its sha256 is another (`found`).
    Mismatch {
        /// The sha256 the file has, hex.
        found: String,
    },
    /// It cannot be opened or read.
    Unreadable(String),
}

impl Verdict {
    /// What hashing `file` to its end finds against `expected` (lower-case hex).
    pub fn of(file: &mut impl Read, expected: &str) -> Verdict {
        match sha256_of(file) {
            Ok(found) if found == expected => Verdict::Match,
            Ok(found) => Verdict::Mismatch { found },
            Err(e) => Verdict::Unreadable(e.to_string()),
        }
    }
}

/// A run of a pinned binary refused: it is not the binary the config pins, or it cannot be read
/// to check it. Nothing was started. The API code (4002 on the pin's key) is given at the
/// boundary (`crate::owner_errors`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is not the binary {key} pins ({expected}): {}; nothing was started", .path.display(), why(.verdict))]
pub struct PinError {
    /// The config key that pins it (`qemu.sha256`).
    pub key: &'static str,
    /// The binary.
    pub path: PathBuf,
    /// The pinned sha256, lower-case hex.
    pub expected: String,
    /// What the check found: [`Verdict::Mismatch`] or [`Verdict::Unreadable`].
    pub verdict: Verdict,
}

impl PinError {
    /// The sha256 the file has (`None` when it cannot be read).
    pub fn found(&self) -> Option<&str> {
        match &self.verdict {
            Verdict::Mismatch { found } => Some(found),
            Verdict::Match | Verdict::Unreadable(_) => None,
        }
    }
}

fn why(verdict: &Verdict) -> String {
    match verdict {
        Verdict::Mismatch { found } => format!("its sha256 is {found}"),
        Verdict::Unreadable(e) => format!("it cannot be read to check it ({e})"),
        Verdict::Match => "it matches".to_string(),
    }
}

/// One binary and the sha256 it must have.
#[derive(Debug)]
pub struct Pinned {
    /// The config key that pins it (`qemu.sha256`).
    key: &'static str,
    path: PathBuf,
    expected: String,
    last: Mutex<Option<(Version, Verdict)>>,
}

impl Pinned {
    /// `path` pinned to `expected` (hex, lower case) by config key `key`.
    pub fn new(key: &'static str, path: &Path, expected: &str) -> Pinned {
        Pinned { key, path: path.to_path_buf(), expected: expected.to_ascii_lowercase(), last: Mutex::new(None) }
    }

    /// Checks the file now: hashed again only when it is not the file last hashed.
    pub fn check(&self) -> Verdict {
        crate::blocking::run(|| {
            let mut file = match std::fs::File::open(&self.path) {
                Ok(f) => f,
                Err(e) => return Verdict::Unreadable(e.to_string()),
            };
            let stamp = match file.metadata() {
                Ok(m) => Version::of(&m),
                Err(e) => return Verdict::Unreadable(e.to_string()),
            };
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((seen, verdict)) = last.as_ref() {
                if *seen == stamp {
                    return verdict.clone();
                }
            }
            let verdict = Verdict::of(&mut file, &self.expected);
            *last = Some((stamp, verdict.clone()));
            verdict
        })
    }

    /// Checks the binary before a run of it: the one check every run goes through.
    ///
    /// # Errors
    /// [`PinError`] (4002 on the pin's key) when the binary's sha256 is not the pinned one or it
    /// cannot be read.
    pub fn verify(&self) -> Result<(), PinError> {
        self.refusal(&self.check()).map_or(Ok(()), Err)
    }

    /// The error a launch gets for `verdict` (`None` when it matches).
    fn refusal(&self, verdict: &Verdict) -> Option<PinError> {
        match verdict {
            Verdict::Match => None,
            Verdict::Mismatch { .. } | Verdict::Unreadable(_) => Some(PinError {
                key: self.key,
                path: self.path.clone(),
                expected: self.expected.clone(),
                verdict: verdict.clone(),
            }),
        }
    }

    /// `host.check`'s item for this binary.
    fn item(&self) -> CheckItem {
        let (status, detail) = match self.check() {
            Verdict::Match => (CheckStatus::Ok, format!("{}: sha256 {} as pinned", self.path.display(), self.expected)),
            Verdict::Mismatch { found } => (
                CheckStatus::Error,
                format!("{}: sha256 {found}, but {} pins {}", self.path.display(), self.key, self.expected),
            ),
            Verdict::Unreadable(e) => (CheckStatus::Missing, format!("{}: cannot be read ({e})", self.path.display())),
        };
        CheckItem { name: self.key.to_string(), status, detail }
    }
}

/// The pinned binaries of a config.
#[derive(Debug)]
pub struct Integrity {
    /// Shared with every [`crate::disk::Tool`], so offline runs and launches keep one verdict.
    qemu: Option<Arc<Pinned>>,
    img: Option<Pinned>,
}

impl Integrity {
    /// The binaries `config` pins (none when neither `qemu.sha256` nor `qemu.img_sha256` is set).
    pub fn of(config: &Config) -> Integrity {
        let q = &config.qemu;
        Integrity {
            qemu: q.sha256.as_deref().map(|h| Arc::new(Pinned::new("qemu.sha256", &q.binary, h))),
            img: q.img_sha256.as_deref().map(|h| Pinned::new("qemu.img_sha256", &q.img_binary, h)),
        }
    }

    /// Checks every pinned binary and logs what does not match.
    pub fn log_at_start(&self) {
        for pinned in self.qemu.iter().map(|p| &**p).chain(&self.img) {
            match pinned.check() {
                Verdict::Match => tracing::info!(binary = %pinned.path.display(), "binary matches its sha256"),
                other => {
                    let err = pinned.refusal(&other).map(|e| e.to_string()).unwrap_or_default();
                    tracing::error!(key = pinned.key, "{err}: launches will be refused");
                }
            }
        }
    }

    /// Checks the QEMU binary before it is launched.
    ///
    /// # Errors
    /// [`PinError`] (4002 on `qemu.sha256`) when the binary's sha256 is not the pinned one or it
    /// cannot be read.
    pub fn verify_qemu(&self) -> Result<(), PinError> {
        self.qemu.as_deref().map_or(Ok(()), Pinned::verify)
    }

    /// The QEMU binary's pin (`None` without `qemu.sha256`), for the runs without a guest.
    pub fn qemu_pin(&self) -> Option<Arc<Pinned>> {
        self.qemu.clone()
    }

    /// `host.check`'s items: one per pinned binary, or one saying QEMU runs unverified.
    pub fn items(&self, config: &Config) -> Vec<CheckItem> {
        let mut items: Vec<CheckItem> = self.qemu.iter().map(|p| &**p).chain(&self.img).map(Pinned::item).collect();
        if self.qemu.is_none() {
            items.insert(
                0,
                CheckItem {
                    name: "qemu.sha256".into(),
                    status: CheckStatus::Ok,
                    detail: format!("not set: {} runs unverified", config.qemu.binary.display()),
                },
            );
        }
        items
    }
}

/// The sha256 of what `file` holds from its current position, hex.
/// The sha256 of what `file` reads to its end, lower-case hex.
///
/// # Errors
/// A read error.
pub(crate) fn sha256_of(file: &mut impl Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf)? {
            0 => break,
            n => hasher.update(&buf[..n]),
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// `digest` as lower-case hex.
pub(crate) fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Code;
    use serde_json::json;

    /// sha256 of "abc" (FIPS 180-2's example).
    const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn hashes_as_fips_180_says() {
        assert_eq!(sha256_of(&mut &b"abc"[..]).unwrap(), ABC);
    }

    #[test]
    fn a_changed_file_is_hashed_again_and_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qemu");
        std::fs::write(&path, b"abc").unwrap();
        let pinned = Pinned::new("qemu.sha256", &path, &ABC.to_ascii_uppercase());
        assert_eq!(pinned.check(), Verdict::Match);
        assert!(pinned.refusal(&Verdict::Match).is_none());
        // Same size, new content: the times (and ctime) changed, so it is hashed again.
        std::fs::write(&path, b"abd").unwrap();
        let verdict = pinned.check();
        let Verdict::Mismatch { found } = &verdict else { panic!("{verdict:?}") };
        assert_ne!(found, ABC);
        let err = crate::api::ApiError::from(pinned.refusal(&verdict).unwrap());
        assert_eq!((err.code, err.field.as_deref()), (Code::BinaryMismatch, Some("qemu.sha256")));
        assert_eq!(err.details["found"], json!(found));
        assert!(err.message.contains(&path.display().to_string()), "{}", err.message);
        // A file swapped in under the same name is another inode.
        let other = dir.path().join("new");
        std::fs::write(&other, b"abc").unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(pinned.check(), Verdict::Match);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(pinned.check(), Verdict::Unreadable(_)));
    }

    #[test]
    fn an_unchanged_file_keeps_its_verdict_without_being_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qemu");
        std::fs::write(&path, b"abc").unwrap();
        let pinned = Pinned::new("qemu.sha256", &path, ABC);
        assert_eq!(pinned.check(), Verdict::Match);
        // A verdict planted for the file's current stamp is what the next check returns: the
        // file was not hashed again.
        let stamp = pinned.last.lock().unwrap().as_ref().map(|(s, _)| *s).unwrap();
        *pinned.last.lock().unwrap() = Some((stamp, Verdict::Mismatch { found: "planted".into() }));
        assert_eq!(pinned.check(), Verdict::Mismatch { found: "planted".into() });
    }

    #[test]
    fn without_a_pin_launches_are_not_checked_and_host_check_says_so() {
        let config = crate::validate::tests::config();
        let integrity = Integrity::of(&config);
        assert!(integrity.verify_qemu().is_ok());
        let items = integrity.items(&config);
        assert_eq!(items.len(), 1);
        assert!(items[0].detail.contains("unverified"), "{:?}", items[0]);
    }
}
