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
//! Order of use: [`Backups::open`] at start; per export [`Backups::begin`], files written into
//! [`Partial::dir`], [`Partial::finish`]; per import [`Backups::read`].

use crate::api::backup::{BackupDisk, DiskRole, Manifest};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `Manifest::format` of every backup.
pub const FORMAT: &str = "vmhost-backup";

/// Largest `manifest.json` read.
const MAX_MANIFEST: u64 = 1 << 20;

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
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') && name.ends_with(".partial") {
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
        Ok((dir, manifest))
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
    if m.format != FORMAT || m.version != 1 {
        return Err(format!("format {:?} version {}, not {FORMAT:?} version 1", m.format, m.version));
    }
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
        let json = serde_json::to_vec_pretty(manifest).map_err(BackupError::Encode)?;
        let sums: String = manifest.disks.iter().map(|d| format!("{}  {}\n", d.sha256, d.file)).collect();
        let final_dir = self.dir.with_file_name(&self.name);
        crate::blocking::run(|| {
            for d in &manifest.disks {
                std::fs::File::open(self.dir.join(&d.file))?.sync_all()?;
            }
            write_synced(&self.dir.join("SHA256SUMS"), sums.as_bytes())?;
            write_synced(&self.dir.join("manifest.json"), &json)?;
            std::fs::File::open(&self.dir)?.sync_all()?;
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
mod tests {
    use super::*;
    use crate::api::disks::DiskFormat;
    use crate::api::{ApiError, Code};

    fn manifest() -> Manifest {
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
