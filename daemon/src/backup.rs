//! The owner of `paths.backups`: one directory per backup, made whole or not at all
//! (docs/backup.md).
//!
//! A backup is written into a hidden `.VM-TIME.partial` directory (mode 0700) and renamed to
//! `VM-TIME` only once every disk is in it, fsynced, and its `manifest.json` and `SHA256SUMS`
//! are written; a crash leaves a `.partial` directory, removed at the next start. Reading one
//! back trusts nothing in it: the manifest is bounded and of closed types, its file names must
//! be the ones its disks would have, and every file is checked against its sha256 as it is
//! copied out ([`crate::lifecycle`] `vm.import`).
//!
//! Version 2 manifests (incremental backups) add the backup's `id`, its `kind`, its `parent`
//! (directory, id and the sha256 of the parent's `manifest.json`) and per disk how it was
//! copied ([`crate::api::backup::DiskChange`]); a chain is walked back to its full backup by
//! [`Backups::chain`], every link checked.
//!
//! Order of use: [`Backups::open`] at start; per export [`Backups::newest_of`] (the default
//! parent), [`Backups::begin`], files written into [`Partial::dir`], [`Partial::finish`]; per
//! import [`Backups::chain`] (or [`Backups::read`]); per prune [`Backups::of_vm`].

use crate::api::backup::{BackupDisk, BackupKind, DiskRole, Manifest};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `Manifest::format` of every backup.
pub const FORMAT: &str = "vmhost-backup";

/// Largest `manifest.json` read.
const MAX_MANIFEST: u64 = 1 << 20;

/// Manifest version written.
pub const VERSION: u32 = 2;

/// The file a UEFI VM's variables store has in a backup.
pub const VARS_FILE: &str = "uefi-vars.fd";

/// Longest chain of increments read (a loop of parents ends here too).
pub const MAX_CHAIN: usize = 256;

/// Prefix of every dirty bitmap a backup leaves on a disk: `vmhost-backup-ID`.
pub const BITMAP_PREFIX: &str = "vmhost-backup-";

/// The dirty bitmap of backup `id`.
pub fn bitmap_of(id: &str) -> String {
    format!("{BITMAP_PREFIX}{id}")
}

/// A new backup id: 16 random hex digits.
///
/// # Errors
/// When the kernel gives no random bytes.
pub fn new_id() -> Result<String, std::io::Error> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(crate::qemu::integrity::hex(&b))
}

/// One backup as read: its directory name and path, its manifest and the sha256 of the
/// manifest's bytes.
#[derive(Debug, Clone)]
pub struct ReadBackup {
    /// Directory name in `paths.backups`.
    pub name: String,
    /// Its path.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// sha256 of `manifest.json`.
    pub manifest_sha256: String,
}

/// Why a backup cannot be written or read. The API codes are given at the boundary
/// (`crate::owner_errors`); the texts here are the messages users read.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The name asked for is not a backup's directory name.
    #[error("{0:?} is not a backup's directory name")]
    NotAName(String),
    /// No such backup.
    #[error("no backup {backup:?} in {} (no manifest.json)", .dir.display())]
    NoSuchBackup {
        /// The name asked for.
        backup: String,
        /// The backups directory.
        dir: PathBuf,
    },
    /// `manifest.json` is not a regular file (a symbolic link, a FIFO, a directory, ...).
    #[error("{} is {what}, not a regular file", .path.display())]
    NotAFile {
        /// The manifest's path.
        path: PathBuf,
        /// What it is instead.
        what: &'static str,
    },
    /// `manifest.json` cannot be read.
    #[error("cannot read {}: {source}", .path.display())]
    Unreadable {
        /// The manifest's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `manifest.json` is not a manifest vmhost imports.
    #[error("{}: {source}", .path.display())]
    Manifest {
        /// The manifest's path.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: ManifestError,
    },
    /// The partial directory of a new backup cannot be made.
    #[error("cannot create {}: {source}", .dir.display())]
    Create {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Every name a backup of the VM could have this second is taken.
    #[error("no free backup name for {vm} in {}", .dir.display())]
    NoFreeName {
        /// The VM.
        vm: String,
        /// The backups directory.
        dir: PathBuf,
    },
    /// The manifest cannot be encoded.
    #[error("{0}")]
    Encode(#[source] serde_json::Error),
    /// A chain of backups is not whole ([`ChainError`]).
    #[error("{0}")]
    Chain(#[source] ChainError),
    /// A backup directory cannot be removed or renamed (pruning, merging).
    #[error("cannot {what} {}: {source}", .dir.display())]
    Prune {
        /// What was done.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The files cannot be synced or the directory renamed into place; the partial directory
    /// is removed.
    #[error("cannot finish the backup in {}: {source}", .dir.display())]
    Finish {
        /// The partial directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Why a chain of backups cannot be restored; checked before anything is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The parent named is not in `paths.backups`.
    #[error("backup {child:?} builds on {parent:?}, which is not in {dir} (import it there first)")]
    MissingParent {
        /// The backup whose parent is missing.
        child: String,
        /// The parent's directory name.
        parent: String,
        /// The backups directory.
        dir: String,
    },
    /// The parent found is not the one the child was made on.
    #[error("backup {child:?} builds on {parent:?} {what}: the chain is broken")]
    WrongParent {
        /// The backup.
        child: String,
        /// Its parent's directory name.
        parent: String,
        /// What differs.
        what: String,
    },
    /// More than [`MAX_CHAIN`] links (or a loop).
    #[error("backup {0:?} has a chain of more than {MAX_CHAIN} backups")]
    TooLong(String),
}

/// Why a manifest's bytes are not a manifest vmhost imports ([`parse_manifest`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Not a vmhost backup manifest of version 1, or inconsistent in itself.
    #[error("{0}")]
    Invalid(String),
    /// Its content would take a file that is not the backup's (a disk staged for another VM,
    /// an image of this host).
    #[error("{0}")]
    TakesOthers(String),
}

/// The backups directory.
#[derive(Debug)]
pub struct Backups {
    dir: PathBuf,
}

/// A backup being written; removed when dropped unless finished.
#[derive(Debug)]
pub struct Partial {
    dir: PathBuf,
    name: String,
    done: bool,
}

/// The file a disk of a backup has: `root.qcow2`, or `NAME.FORMAT`.
pub fn file_of(disk: &BackupDisk) -> String {
    match disk.role {
        DiskRole::Root => "root.qcow2".to_string(),
        DiskRole::Data => format!("{}.{}", disk.name, disk.format.as_str()),
    }
}

impl Backups {
    /// The backups of `config`, with the partial backups a crash left removed.
    pub fn open(config: &crate::config::Config) -> Backups {
        let dir = config.paths.backups_dir();
        recover_merges(&dir);
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let leftover = [".partial", ".deleting", ".merging"].iter().any(|s| name.ends_with(s));
                if name.starts_with('.') && leftover {
                    match std::fs::remove_dir_all(e.path()) {
                        Ok(()) => tracing::info!(dir = %e.path().display(), "removed an interrupted export"),
                        Err(err) => {
                            tracing::warn!(dir = %e.path().display(), error = %err, "cannot remove an interrupted export")
                        }
                    }
                }
            }
        }
        // vm.import copies disks out through temp files in the import directory.
        crate::images::remove_leftovers(&config.paths.import_dir());
        Backups { dir }
    }

    /// Starts a backup of VM `vm` named after it and the time (`VM-20261204T135959Z`, with
    /// `-2`, `-3`, ... when taken).
    ///
    /// # Errors
    /// [`BackupError::Create`] or [`BackupError::NoFreeName`] (4001 `step: export`) when the
    /// directory cannot be made.
    pub fn begin(&self, vm: &str) -> Result<Partial, BackupError> {
        let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().replace([':', '-'], "");
        crate::blocking::run(|| {
            for n in 1..1000 {
                let name = if n == 1 { format!("{vm}-{stamp}") } else { format!("{vm}-{stamp}-{n}") };
                if self.dir.join(&name).exists() {
                    continue;
                }
                let dir = self.dir.join(format!(".{name}.partial"));
                use std::os::unix::fs::DirBuilderExt;
                match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                    Ok(()) => return Ok(Partial { dir, name, done: false }),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(source) => return Err(BackupError::Create { dir, source }),
                }
            }
            Err(BackupError::NoFreeName { vm: vm.to_string(), dir: self.dir.clone() })
        })
    }

    /// Starts the full copy that will replace increment `name` (retention):
    /// `.NAME.merging`, a leftover of an earlier attempt removed first.
    ///
    /// # Errors
    /// [`BackupError::Create`].
    pub fn begin_merge(&self, name: &str) -> Result<Partial, BackupError> {
        let dir = self.dir.join(format!(".{name}.merging"));
        crate::blocking::run(|| {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(BackupError::Create { dir: dir.clone(), source }),
            }
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|source| BackupError::Create { dir: dir.clone(), source })
        })?;
        Ok(Partial { dir, name: name.to_string(), done: false })
    }

    /// Removes backup `name`: renamed to `.NAME.deleting` first (a crash never leaves half a
    /// backup under its name), `between()` (a crash point), then removed.
    ///
    /// # Errors
    /// [`BackupError::NotAName`], [`BackupError::Prune`].
    pub fn delete(&self, name: &str, between: impl FnOnce()) -> Result<(), BackupError> {
        if !crate::images::is_image_name(name) {
            return Err(BackupError::NotAName(name.to_string()));
        }
        let (dir, gone) = (self.dir.join(name), self.dir.join(format!(".{name}.deleting")));
        crate::blocking::run(|| std::fs::rename(&dir, &gone)).map_err(|source| BackupError::Prune {
            what: "rename",
            dir: dir.clone(),
            source,
        })?;
        between();
        crate::blocking::run(|| std::fs::remove_dir_all(&gone)).map_err(|source| BackupError::Prune {
            what: "remove",
            dir: gone.clone(),
            source,
        })
    }

    /// The directory of backup `backup` and its manifest.
    ///
    /// `manifest.json` is opened without following a symbolic link and without blocking (a
    /// FIFO would otherwise hang the call until something wrote to it), and must be a regular
    /// file, checked on the descriptor opened.
    ///
    /// # Errors
    /// [`BackupError::NotAName`] (2001 on `backup`), [`BackupError::NoSuchBackup`] (4040),
    /// [`BackupError::Unreadable`] (2001) for a manifest that cannot be read,
    /// [`BackupError::NotAFile`] (2003) for a `manifest.json` that is not a regular file (a
    /// symbolic link, a FIFO, a directory), [`BackupError::Manifest`] for one that is not a
    /// vmhost backup of version 1 (2001) or whose content would take what is not the backup's
    /// (2003, [`parse_manifest`]).
    pub fn read(&self, backup: &str) -> Result<(PathBuf, Manifest), BackupError> {
        let b = self.read_full(backup)?;
        Ok((b.dir, b.manifest))
    }

    /// [`Backups::read`] with the sha256 of the manifest's bytes.
    ///
    /// # Errors
    /// As [`Backups::read`].
    pub fn read_full(&self, backup: &str) -> Result<ReadBackup, BackupError> {
        if !crate::images::is_image_name(backup) {
            return Err(BackupError::NotAName(backup.to_string()));
        }
        let dir = self.dir.join(backup);
        let path = dir.join("manifest.json");
        let read = crate::blocking::run(|| read_manifest_file(&path));
        let bytes = match read {
            Ok(ManifestFile::Bytes(bytes)) => bytes,
            Ok(ManifestFile::NotRegular(what)) => return Err(BackupError::NotAFile { path, what }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(BackupError::NoSuchBackup { backup: backup.to_string(), dir: self.dir.clone() })
            }
            // O_NOFOLLOW on a symbolic link.
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(BackupError::NotAFile { path, what: "a symbolic link" })
            }
            Err(source) => return Err(BackupError::Unreadable { path, source }),
        };
        let manifest = match parse_manifest(&bytes) {
            Ok(m) => m,
            Err(source) => return Err(BackupError::Manifest { path, source }),
        };
        let manifest_sha256 = crate::qemu::integrity::sha256_of(&mut &bytes[..])
            .map_err(|source| BackupError::Unreadable { path: path.clone(), source })?;
        Ok(ReadBackup { name: backup.to_string(), dir, manifest, manifest_sha256 })
    }

    /// The backups directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every readable backup of VM `vm` (its manifest's `vm`), oldest first (by `created_at`,
    /// then name); one that cannot be read is skipped with a warning.
    pub fn of_vm(&self, vm: &str) -> Vec<ReadBackup> {
        let names: Vec<String> = crate::blocking::run(|| {
            std::fs::read_dir(&self.dir)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| !n.starts_with('.'))
                        .collect()
                })
                .unwrap_or_default()
        });
        let mut out: Vec<ReadBackup> = names
            .iter()
            .filter_map(|n| match self.read_full(n) {
                Ok(b) => Some(b),
                Err(e) => {
                    tracing::debug!(backup = %n, error = %e, "not a readable backup");
                    None
                }
            })
            .filter(|b| b.manifest.vm == vm)
            .collect();
        out.sort_by(|a, b| (&a.manifest.created_at, &a.name).cmp(&(&b.manifest.created_at, &b.name)));
        out
    }

    /// The newest backup of VM `vm` that has an id (a version 2 backup): the default parent
    /// of an incremental backup.
    pub fn newest_of(&self, vm: &str) -> Option<ReadBackup> {
        self.of_vm(vm).into_iter().rev().find(|b| b.manifest.id.is_some())
    }

    /// Backup `backup` and every backup it builds on, the full backup first and `backup`
    /// last; each parent checked against what its child recorded (directory, id, manifest
    /// sha256, VM, the same disks and formats). Files are not read here.
    ///
    /// # Errors
    /// As [`Backups::read`] for each; [`BackupError::Chain`] for a missing or different
    /// parent, or a chain longer than [`MAX_CHAIN`].
    pub fn chain(&self, backup: &str) -> Result<Vec<ReadBackup>, BackupError> {
        let mut chain = vec![self.read_full(backup)?];
        while let Some((child, parent)) = chain.last().and_then(|c| Some((c, c.manifest.parent.clone()?))) {
            if chain.len() > MAX_CHAIN {
                return Err(BackupError::Chain(ChainError::TooLong(backup.to_string())));
            }
            let read = match self.read_full(&parent.dir) {
                Ok(b) => b,
                Err(BackupError::NoSuchBackup { .. }) => {
                    return Err(BackupError::Chain(ChainError::MissingParent {
                        child: child.name.clone(),
                        parent: parent.dir.clone(),
                        dir: self.dir.display().to_string(),
                    }))
                }
                Err(e) => return Err(e),
            };
            check_link(child, &parent, &read).map_err(BackupError::Chain)?;
            chain.push(read);
        }
        chain.reverse();
        Ok(chain)
    }
}

/// `parent_read` is the parent `child` recorded as `parent`: its id, manifest bytes, VM and
/// disks (names, roles, formats; a disk may have grown since, never shrunk).
fn check_link(
    child: &ReadBackup,
    parent: &crate::api::backup::ParentRef,
    parent_read: &ReadBackup,
) -> Result<(), ChainError> {
    let wrong = |what: String| ChainError::WrongParent { child: child.name.clone(), parent: parent.dir.clone(), what };
    if parent_read.manifest.id.as_deref() != Some(parent.id.as_str()) {
        return Err(wrong(format!("whose id is {:?}, not {:?}", parent_read.manifest.id, parent.id)));
    }
    // A merged full backup (retention) stands in for the increment it was made from.
    let merged = parent_read.manifest.merged_from.as_deref() == Some(parent.manifest_sha256.as_str());
    if parent_read.manifest_sha256 != parent.manifest_sha256 && !merged {
        return Err(wrong(format!(
            "whose manifest.json has sha256 {}, not {} as recorded",
            parent_read.manifest_sha256, parent.manifest_sha256
        )));
    }
    if parent_read.manifest.vm != child.manifest.vm {
        return Err(wrong(format!("of VM {:?}, not {:?}", parent_read.manifest.vm, child.manifest.vm)));
    }
    for (d, c) in child.manifest.disks.iter().zip(&child.manifest.changes) {
        if c.kind != BackupKind::Incremental {
            continue;
        }
        let below = parent_read.manifest.disks.iter().find(|p| p.role == d.role && p.name == d.name);
        match below {
            Some(p) if p.format == d.format && p.virtual_size <= d.virtual_size => {}
            Some(_) => return Err(wrong(format!("whose disk {:?} is another format or larger", d.name))),
            None => return Err(wrong(format!("which has no disk {:?}", d.name))),
        }
    }
    Ok(())
}

/// Finishes what a crash left of a merge ([`Partial::replace`]): a `.NAME.replaced` whose
/// full copy `.NAME.merging` was sealed but not renamed in gets it renamed in; the replaced
/// increment is removed once `NAME` is there (or put back when nothing else is).
fn recover_merges(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(name) = file.strip_prefix('.').and_then(|f| f.strip_suffix(".replaced")) else { continue };
        let (whole, merging) = (dir.join(name), dir.join(format!(".{name}.merging")));
        let outcome = if whole.exists() {
            std::fs::remove_dir_all(e.path())
        } else if merging.join("manifest.json").exists() {
            std::fs::rename(&merging, &whole).and_then(|()| std::fs::remove_dir_all(e.path()))
        } else {
            std::fs::rename(e.path(), &whole)
        };
        match outcome {
            Ok(()) => tracing::info!(backup = name, "finished an interrupted merge"),
            Err(err) => tracing::warn!(backup = name, error = %err, "cannot finish an interrupted merge"),
        }
    }
}

/// What opening `manifest.json` found.
enum ManifestFile {
    /// A regular file's first [`MAX_MANIFEST`] + 1 bytes.
    Bytes(Vec<u8>),
    /// Something else, named.
    NotRegular(&'static str),
}

/// Opens `path` with `O_NOFOLLOW | O_NONBLOCK` (a symbolic link is `ELOOP`, a FIFO opens at
/// once) and reads it if the descriptor is a regular file's.
fn read_manifest_file(path: &Path) -> std::io::Result<ManifestFile> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    let kind = f.metadata()?.file_type();
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device"
        };
        return Ok(ManifestFile::NotRegular(what));
    }
    let mut bytes = Vec::new();
    f.take(MAX_MANIFEST + 1).read_to_end(&mut bytes)?;
    Ok(ManifestFile::Bytes(bytes))
}

/// `manifest.json`'s bytes as a manifest vmhost imports: at most [`MAX_MANIFEST`] bytes of
/// the closed [`Manifest`], checked ([`check`]). Pure: the fuzz target `manifest` drives it.
///
/// # Errors
/// [`ManifestError::Invalid`] (2001) for what is not a vmhost backup manifest of version 1 or
/// is inconsistent in itself, [`ManifestError::TakesOthers`] (2003) for a manifest whose
/// content would take a file that is not the backup's.
pub fn parse_manifest(bytes: &[u8]) -> Result<Manifest, ManifestError> {
    if bytes.len() as u64 > MAX_MANIFEST {
        return Err(ManifestError::Invalid(format!("larger than {MAX_MANIFEST} bytes")));
    }
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|e| ManifestError::Invalid(format!("not a backup manifest: {e}")))?;
    check(&manifest).map_err(ManifestError::Invalid)?;
    check_takes_only_its_own(&manifest).map_err(ManifestError::TakesOthers)?;
    Ok(manifest)
}

/// What a manifest must hold to be read: the format and version, one root disk at most, the
/// spec's data disks each once, file names as [`file_of`] gives them, hex sha256s.
fn check(m: &Manifest) -> Result<(), String> {
    if m.format != FORMAT || !(1..=VERSION).contains(&m.version) {
        return Err(format!("format {:?} version {}, not {FORMAT:?} version 1 or {VERSION}", m.format, m.version));
    }
    check_v2(m)?;
    let roots = m.disks.iter().filter(|d| d.role == DiskRole::Root).count();
    if roots > 1 {
        return Err("more than one root disk".into());
    }
    let mut data: Vec<(&str, &str)> =
        m.disks.iter().filter(|d| d.role == DiskRole::Data).map(|d| (d.name.as_str(), d.format.as_str())).collect();
    let mut declared: Vec<(&str, &str)> = m.spec.disks.iter().map(|d| (d.name.as_str(), d.format.as_str())).collect();
    data.sort();
    declared.sort();
    if data != declared {
        return Err("its data disks are not the spec's".into());
    }
    for d in &m.disks {
        if d.file != file_of(d) {
            return Err(format!("disk {:?} is in {:?}, not {:?}", d.name, d.file, file_of(d)));
        }
        if d.role == DiskRole::Root && (d.name != "root" || d.format != crate::api::disks::DiskFormat::Qcow2) {
            return Err("the root disk is `root`, a qcow2".into());
        }
        if d.sha256.len() != 64 || !d.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("disk {:?} has no sha256", d.name));
        }
    }
    Ok(())
}

/// What version 2 adds: an id, a kind agreeing with the disks' changes (one per disk, same
/// order; incremental only for a qcow2), a parent exactly when incremental, the vars store's
/// file. A version 1 manifest has none of them.
fn check_v2(m: &Manifest) -> Result<(), String> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if let Some(v) = &m.uefi_vars {
        if v.file != VARS_FILE || !hex(&v.sha256, 64) {
            return Err(format!("the UEFI variables store is {:?} with no sha256, not {VARS_FILE:?}", v.file));
        }
    }
    for f in m.tpm.iter().flat_map(|t| &t.files) {
        if !crate::tpm::names_a_state_copy(f) || !hex(&f.sha256, 64) {
            return Err(format!(
                "the TPM state file {:?} ({:?}) is not one vmhost writes, or has no sha256",
                f.file, f.name
            ));
        }
    }
    if m.version == 1 {
        if m.id.is_some() || m.kind.is_some() || m.parent.is_some() || !m.changes.is_empty() || m.merged_from.is_some()
        {
            return Err("a version 1 manifest has no id, kind, parent or changes".into());
        }
        return Ok(());
    }
    let id = m.id.as_deref().unwrap_or_default();
    if !hex(id, 16) {
        return Err("no id of 16 hex digits".into());
    }
    if m.changes.len() != m.disks.len() || m.changes.iter().zip(&m.disks).any(|(c, d)| c.name != d.name) {
        return Err("its changes are not one per disk in the disks' order".into());
    }
    let incremental = m.changes.iter().any(|c| c.kind == BackupKind::Incremental);
    for (c, d) in m.changes.iter().zip(&m.disks) {
        if c.kind == BackupKind::Incremental && d.format != crate::api::disks::DiskFormat::Qcow2 {
            return Err(format!("disk {:?} is incremental but not a qcow2", d.name));
        }
    }
    match (m.kind, &m.parent, incremental) {
        (Some(BackupKind::Full), None, false) => Ok(()),
        (Some(BackupKind::Incremental), Some(p), true) => {
            if !crate::images::is_image_name(&p.dir) || !hex(&p.id, 16) || !hex(&p.manifest_sha256, 64) {
                return Err("its parent is not a backup's name, id and manifest sha256".into());
            }
            if p.id == id {
                return Err("it is its own parent".into());
            }
            Ok(())
        }
        _ => Err("its kind, parent and disk changes disagree".into()),
    }
}

/// A backup's VM boots from what the backup holds: its root disk (which the import names
/// `boot.disk` itself), or a kernel. A manifest without a root disk whose spec names
/// `boot.disk` or `boot.image` would have the import take a disk staged in `paths.import` for
/// another VM, or an image of this host, that no backup checksum covers.
fn check_takes_only_its_own(m: &Manifest) -> Result<(), String> {
    if m.disks.iter().any(|d| d.role == DiskRole::Root) {
        return Ok(());
    }
    if let Some(disk) = &m.spec.boot.disk {
        return Err(format!("the backup has no root disk, but its spec boots from boot.disk {disk:?}"));
    }
    if let Some(image) = &m.spec.boot.image {
        return Err(format!("the backup has no root disk, but its spec boots from boot.image {image:?}"));
    }
    Ok(())
}

impl Partial {
    /// The directory files are written into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `manifest.json` and `SHA256SUMS` (`sha256sum -c` reads it), fsyncs the files and
    /// the directory, and renames it to its final name; returns that path.
    ///
    /// # Errors
    /// [`BackupError::Encode`] or [`BackupError::Finish`] (4001 `step: export`); the partial
    /// directory is removed.
    pub fn finish(mut self, manifest: &Manifest) -> Result<PathBuf, BackupError> {
        let final_dir = self.dir.with_file_name(&self.name);
        crate::blocking::run(|| {
            self.seal_files(manifest)?;
            std::fs::rename(&self.dir, &final_dir)?;
            if let Some(parent) = final_dir.parent() {
                std::fs::File::open(parent)?.sync_all()?;
            }
            Ok::<_, std::io::Error>(())
        })
        .map_err(|source| BackupError::Finish { dir: self.dir.clone(), source })?;
        self.done = true;
        Ok(final_dir)
    }

    /// Writes `manifest.json` and `SHA256SUMS` and fsyncs every file and the directory.
    fn seal_files(&self, manifest: &Manifest) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(manifest).map_err(std::io::Error::other)?;
        let mut sums: String = manifest.disks.iter().map(|d| format!("{}  {}\n", d.sha256, d.file)).collect();
        if let Some(v) = &manifest.uefi_vars {
            sums.push_str(&format!("{}  {}\n", v.sha256, v.file));
        }
        let tpm = manifest.tpm.iter().flat_map(|t| &t.files);
        for f in tpm.clone() {
            sums.push_str(&format!("{}  {}\n", f.sha256, f.file));
        }
        let files = manifest.disks.iter().map(|d| &d.file).chain(manifest.uefi_vars.iter().map(|v| &v.file));
        for file in files.chain(tpm.map(|f| &f.file)) {
            std::fs::File::open(self.dir.join(file))?.sync_all()?;
        }
        write_synced(&self.dir.join("SHA256SUMS"), sums.as_bytes())?;
        write_synced(&self.dir.join("manifest.json"), &json)?;
        std::fs::File::open(&self.dir)?.sync_all()
    }

    /// A merge's end ([`Backups::begin_merge`]): seals the new full backup, then puts it in
    /// place of the increment of the same name: the increment renamed to `.NAME.replaced`,
    /// `between()` (a crash point), the full copy renamed to `NAME`, the increment removed. A
    /// crash anywhere leaves either the increment or its full copy in place
    /// ([`Backups::open`]).
    ///
    /// # Errors
    /// [`BackupError::Finish`]; the increment is back in place.
    pub fn replace(mut self, manifest: &Manifest, between: impl FnOnce()) -> Result<PathBuf, BackupError> {
        let final_dir = self.dir.with_file_name(&self.name);
        let old = self.dir.with_file_name(format!(".{}.replaced", self.name));
        fn failed(dir: &Path) -> impl FnOnce(std::io::Error) -> BackupError + '_ {
            move |source| BackupError::Finish { dir: dir.to_path_buf(), source }
        }
        crate::blocking::run(|| self.seal_files(manifest)).map_err(failed(&self.dir))?;
        crate::blocking::run(|| std::fs::rename(&final_dir, &old)).map_err(failed(&final_dir))?;
        between();
        if let Err(e) = crate::blocking::run(|| std::fs::rename(&self.dir, &final_dir)) {
            let _ = std::fs::rename(&old, &final_dir);
            return Err(failed(&self.dir)(e));
        }
        self.done = true;
        crate::blocking::run(|| {
            if let Some(parent) = final_dir.parent() {
                let _ = std::fs::File::open(parent).and_then(|d| d.sync_all());
            }
            std::fs::remove_dir_all(&old)
        })
        .map_err(|source| BackupError::Prune { what: "remove", dir: old.clone(), source })?;
        Ok(final_dir)
    }

    /// The backup's directory name once finished.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove an unfinished backup");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::api::disks::DiskFormat;
    use crate::api::{ApiError, Code};

    /// A version 1 manifest of VM `v` with a root disk and a raw data disk `nsm`.
    pub(crate) fn manifest() -> Manifest {
        let mut spec = crate::validate::tests::spec("v");
        spec.disks = vec![crate::validate::tests::data_disk("nsm", 1, DiskFormat::Raw)];
        let disk = |role, name: &str, format| {
            let mut d = BackupDisk {
                role,
                name: name.into(),
                file: String::new(),
                format,
                virtual_size: 1 << 30,
                bytes: 5,
                sha256: "a".repeat(64),
            };
            d.file = file_of(&d);
            d
        };
        Manifest {
            format: FORMAT.into(),
            version: 1,
            created_at: "2026-12-04T00:00:00Z".into(),
            vmhost_version: "0".into(),
            vm: "v".into(),
            spec,
            live: false,
            consistency: Some(crate::api::snapshots::Consistency::Stopped),
            reason: None,
            frozen: Vec::new(),
            skipped: Vec::new(),
            disks: vec![disk(DiskRole::Root, "root", DiskFormat::Qcow2), disk(DiskRole::Data, "nsm", DiskFormat::Raw)],
            id: None,
            kind: None,
            parent: None,
            merged_from: None,
            changes: Vec::new(),
            uefi_vars: None,
            tpm: None,
        }
    }

    #[test]
    fn consistency_is_recorded_and_a_manifest_from_before_it_is_still_read() {
        let mut json = serde_json::to_value(manifest()).expect("serializes");
        assert_eq!(json["consistency"], "stopped");
        assert!(json.get("reason").is_none() && json.get("skipped").is_none(), "{json}");
        if let Some(m) = json.as_object_mut() {
            m.remove("consistency");
        }
        let old: Manifest = serde_json::from_value(json).expect("parses");
        assert_eq!(old.consistency, None);
    }

    #[test]
    fn a_manifest_is_read_only_when_its_files_are_the_ones_its_disks_have() {
        assert_eq!(check(&manifest()), Ok(()));
        let mut m = manifest();
        m.disks[1].file = "../../etc/shadow".into();
        assert!(check(&m).unwrap_err().contains("not \"nsm.raw\""));
        let mut m = manifest();
        m.disks[0].file = "root.raw".into();
        m.disks[0].format = DiskFormat::Raw;
        assert!(check(&m).is_err(), "the root is a qcow2");
        let mut m = manifest();
        m.disks.pop();
        assert!(check(&m).unwrap_err().contains("not the spec's"));
        let mut m = manifest();
        m.disks.push(m.disks[0].clone());
        assert!(check(&m).is_err(), "one root");
        let mut m = manifest();
        m.version = 2;
        assert!(check(&m).is_err());
        let mut m = manifest();
        m.disks[1].sha256 = "zz".into();
        assert!(check(&m).is_err());
    }

    #[test]
    fn a_manifest_without_a_root_disk_cannot_take_a_staged_disk_or_an_image() {
        let mut m = manifest();
        m.disks.remove(0);
        m.spec.boot = crate::api::BootSpec { kernel: Some("/boot/vmlinuz".into()), ..Default::default() };
        let json = serde_json::to_vec(&m).unwrap();
        assert_eq!(parse_manifest(&json), Ok(m.clone()), "a kernel VM has no root disk");
        for boot in [
            crate::api::BootSpec { disk: Some("other-root.qcow2".into()), ..Default::default() },
            crate::api::BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(1), ..Default::default() },
        ] {
            let mut m = m.clone();
            m.spec.boot = boot;
            let e = parse_manifest(&serde_json::to_vec(&m).unwrap()).unwrap_err();
            assert!(matches!(e, ManifestError::TakesOthers(_)), "{e}");
            assert_eq!(
                ApiError::from(BackupError::Manifest { path: "m".into(), source: e.clone() }).code,
                Code::ChecksumMismatch
            );
            assert!(e.to_string().contains("has no root disk"), "{e}");
        }
        // With its root disk, the import names boot.disk itself.
        let mut m = manifest();
        m.spec.boot = crate::api::BootSpec { disk: Some("other-root.qcow2".into()), ..Default::default() };
        assert!(parse_manifest(&serde_json::to_vec(&m).unwrap()).is_ok());
        assert!(matches!(parse_manifest(&vec![b' '; MAX_MANIFEST as usize + 1]), Err(ManifestError::Invalid(_))));
        assert!(matches!(parse_manifest(b"{}"), Err(ManifestError::Invalid(_))));
    }

    /// A backups directory with backup `v-1` whose `manifest.json` is made by `make`.
    fn backups_with(make: impl FnOnce(&Path)) -> (tempfile::TempDir, Backups) {
        let d = tempfile::tempdir().unwrap();
        let mut c = crate::validate::tests::config();
        c.paths.state = d.path().to_path_buf();
        let dir = c.paths.backups_dir().join("v-1");
        std::fs::create_dir_all(&dir).unwrap();
        make(&dir.join("manifest.json"));
        let backups = Backups::open(&c);
        (d, backups)
    }

    #[test]
    fn a_manifest_that_is_a_fifo_is_refused_at_once() {
        let (_d, backups) = backups_with(|p| nix::unistd::mkfifo(p, nix::sys::stat::Mode::S_IRWXU).unwrap());
        // A plain open would wait for a writer forever: the call runs in a thread and must end.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(backups.read("v-1")).unwrap());
        let e = ApiError::from(
            rx.recv_timeout(std::time::Duration::from_secs(10)).expect("no hang on a FIFO").unwrap_err(),
        );
        assert_eq!((e.code, e.field.as_deref()), (Code::ChecksumMismatch, Some("backup")), "{e:?}");
        assert!(e.message.contains("a FIFO, not a regular file"), "{}", e.message);
    }

    #[test]
    fn a_manifest_that_is_a_symlink_or_a_directory_is_refused() {
        let real = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(real.path(), serde_json::to_vec(&manifest()).unwrap()).unwrap();
        let target = real.path().to_path_buf();
        let (_d, backups) = backups_with(|p| std::os::unix::fs::symlink(&target, p).unwrap());
        let e = ApiError::from(backups.read("v-1").unwrap_err());
        assert_eq!((e.code, e.field.as_deref()), (Code::ChecksumMismatch, Some("backup")), "{e:?}");
        assert!(e.message.contains("a symbolic link"), "{}", e.message);
        let (_d, backups) = backups_with(|p| std::fs::create_dir(p).unwrap());
        assert_eq!(ApiError::from(backups.read("v-1").unwrap_err()).code, Code::ChecksumMismatch);
        // The same manifest as a file is read.
        let (_d, backups) = backups_with(|p| std::fs::copy(&target, p).map(drop).unwrap());
        assert_eq!(backups.read("v-1").unwrap().1, manifest());
    }

    #[test]
    fn a_backup_is_in_place_whole_or_not_at_all() {
        let d = tempfile::tempdir().unwrap();
        let mut c = crate::validate::tests::config();
        c.paths.state = d.path().to_path_buf();
        std::fs::create_dir_all(c.paths.backups_dir()).unwrap();
        let backups = Backups::open(&c);
        let dropped = backups.begin("v").unwrap();
        let partial_dir = dropped.dir().to_path_buf();
        assert!(partial_dir.is_dir());
        drop(dropped);
        assert!(!partial_dir.exists(), "an unfinished backup goes");

        let mut m = manifest();
        let p = backups.begin("v").unwrap();
        for disk in &mut m.disks {
            std::fs::write(p.dir().join(&disk.file), b"disk!").unwrap();
            disk.sha256 = crate::qemu::integrity::sha256_of(&mut &b"disk!"[..]).unwrap();
        }
        let name = p.name().to_string();
        let dir = p.finish(&m).unwrap();
        assert_eq!(dir, c.paths.backups_dir().join(&name));
        let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).unwrap();
        assert!(sums.contains(&format!("{}  nsm.raw\n", m.disks[1].sha256)), "{sums}");
        let (read_dir, read) = backups.read(&name).unwrap();
        assert_eq!((read_dir, read), (dir.clone(), m));
        assert_eq!(ApiError::from(backups.read("none").unwrap_err()).code, Code::NotFound);
        assert_eq!(ApiError::from(backups.read("../x").unwrap_err()).field.as_deref(), Some("backup"));

        // A crash's leftover is removed at the next open.
        let left = backups.begin("v").unwrap();
        let left_dir = left.dir().to_path_buf();
        std::mem::forget(left);
        Backups::open(&c);
        assert!(!left_dir.exists());
        assert!(dir.is_dir(), "finished backups stay");
    }
}
