//! UEFI firmware files (OVMF): whether the configured pair can be used, and each VM's own copy
//! of the variables store.
//!
//! A VM with `boot.firmware = "uefi"` runs with two flash devices ([`crate::qemu::argv`]):
//! OVMF's code (`firmware.uefi_code`), shared by every VM and read-only, and a variables store
//! (NVRAM: boot entries, boot order, settings) that the guest's firmware writes. The store must
//! be the VM's own, so each UEFI VM gets a copy of the template (`firmware.uefi_vars`) at its
//! first start ([`copy_vars`]), kept in its disk directory until it is destroyed. The daemon
//! opens both files and hands QEMU descriptors, like every other file (docs/images.md).

use crate::config::FirmwareConfig;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A configured firmware file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FirmwareError {
    /// The file does not exist (OVMF is not installed, or the config names another file).
    #[error("{} does not exist (install OVMF: Debian package ovmf; or set {key} in the config)", path.display())]
    Missing {
        /// `firmware.uefi_code` or `firmware.uefi_vars`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
    },
    /// It exists but vmhostd may not read it: under the sandbox, most likely because it was
    /// installed after vmhostd started (Landlock grants the directory only if it exists then).
    #[error(
        "vmhostd cannot read {}: {source} (if OVMF was installed after vmhostd started, restart vmhostd: \
         its sandbox grants the firmware directory at start)",
        path.display()
    )]
    Unreadable {
        /// `firmware.uefi_code` or `firmware.uefi_vars`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
        /// Why the open failed.
        source: io::Error,
    },
    /// It is a directory or a device rather than a firmware image.
    #[error("{} is not a regular file", path.display())]
    NotAFile {
        /// `firmware.uefi_code` or `firmware.uefi_vars`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
    },
}

impl FirmwareError {
    /// The config key of the file.
    pub fn key(&self) -> &'static str {
        match self {
            FirmwareError::Missing { key, .. }
            | FirmwareError::Unreadable { key, .. }
            | FirmwareError::NotAFile { key, .. } => key,
        }
    }

    /// The configured path of the file.
    pub fn path(&self) -> &Path {
        match self {
            FirmwareError::Missing { path, .. }
            | FirmwareError::Unreadable { path, .. }
            | FirmwareError::NotAFile { path, .. } => path,
        }
    }
}

/// What [`check`] found: the two files' sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Present {
    /// `firmware.uefi_code`'s size in bytes.
    pub code_bytes: u64,
    /// `firmware.uefi_vars`'s size in bytes.
    pub vars_bytes: u64,
}

/// Opens `path` (config key `key`) for reading as the daemon would and returns its size.
fn readable(key: &'static str, path: &Path) -> Result<u64, FirmwareError> {
    let file = File::open(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => FirmwareError::Missing { key, path: path.to_path_buf() },
        _ => FirmwareError::Unreadable { key, path: path.to_path_buf(), source },
    })?;
    let meta = file.metadata().map_err(|source| FirmwareError::Unreadable { key, path: path.to_path_buf(), source })?;
    if !meta.is_file() {
        return Err(FirmwareError::NotAFile { key, path: path.to_path_buf() });
    }
    Ok(meta.len())
}

/// Whether vmhostd can open both configured files, as a UEFI VM's launch does. Opening (not
/// just looking) matters: under the sandbox a file that exists may still be out of reach.
///
/// # Errors
/// [`FirmwareError`] for the first file that cannot be used, code first.
pub fn check(config: &FirmwareConfig) -> Result<Present, FirmwareError> {
    let code_bytes = readable("firmware.uefi_code", &config.uefi_code)?;
    let vars_bytes = readable("firmware.uefi_vars", &config.uefi_vars)?;
    Ok(Present { code_bytes, vars_bytes })
}

/// Copies the variables template to `to` (mode 0600) through `partial` in the same directory:
/// written, fsynced, renamed into place, then the directory fsynced, so a crash leaves either no
/// store or a whole one, never a short one OVMF would reject or reformat. A stale `partial` is
/// replaced.
///
/// # Errors
/// Any I/O error; `partial` is removed and `to` is not touched.
pub fn copy_vars(template: &Path, to: &Path, partial: &Path) -> io::Result<()> {
    match fs::remove_file(partial) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let result = (|| {
        let mut src = File::open(template)?;
        let mut dst = OpenOptions::new().write(true).create_new(true).mode(0o600).open(partial)?;
        io::copy(&mut src, &mut dst)?;
        dst.sync_all()?;
        fs::rename(partial, to)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(partial);
        return Err(e);
    }
    // The store is in place once the rename succeeded: a failed directory fsync is not a failed
    // copy (as in crate::state::atomic).
    if let Some(dir) = to.parent() {
        if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %dir.display(), error = %e, "directory fsync failed after rename");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn check_opens_both_files_and_names_the_one_that_fails() {
        let d = tempfile::tempdir().unwrap();
        let code = d.path().join("CODE.fd");
        let vars = d.path().join("VARS.fd");
        let config = FirmwareConfig { uefi_code: code.clone(), uefi_vars: vars.clone() };
        let e = check(&config).unwrap_err();
        assert!(matches!(e, FirmwareError::Missing { .. }), "{e}");
        assert_eq!((e.key(), e.path()), ("firmware.uefi_code", code.as_path()));
        assert!(e.to_string().contains("ovmf"), "{e}");
        fs::write(&code, vec![0u8; 4096]).unwrap();
        let e = check(&config).unwrap_err();
        assert_eq!((e.key(), e.path()), ("firmware.uefi_vars", vars.as_path()));
        fs::create_dir(&vars).unwrap();
        assert!(matches!(check(&config).unwrap_err(), FirmwareError::NotAFile { key: "firmware.uefi_vars", .. }));
        fs::remove_dir(&vars).unwrap();
        fs::write(&vars, vec![0u8; 512]).unwrap();
        assert_eq!(check(&config).unwrap(), Present { code_bytes: 4096, vars_bytes: 512 });
    }

    #[test]
    fn a_vars_copy_is_private_whole_and_leaves_no_partial() {
        let d = tempfile::tempdir().unwrap();
        let template = d.path().join("VARS.fd");
        let data: Vec<u8> = (0..540_672u32).map(|i| (i % 251) as u8).collect();
        fs::write(&template, &data).unwrap();
        fs::set_permissions(&template, fs::Permissions::from_mode(0o644)).unwrap();
        let vm = d.path().join("vm");
        fs::create_dir(&vm).unwrap();
        let (to, partial) = (vm.join("uefi-vars.fd"), vm.join("uefi-vars.fd.partial"));
        // A partial left by a crash is replaced, not appended to.
        fs::write(&partial, b"stale").unwrap();
        copy_vars(&template, &to, &partial).unwrap();
        assert_eq!(fs::read(&to).unwrap(), data);
        assert_eq!(fs::metadata(&to).unwrap().permissions().mode() & 0o7777, 0o600);
        assert!(!partial.exists());
        // A template that cannot be read leaves nothing behind and the store as it was.
        fs::write(&to, b"the guest's boot entries").unwrap();
        assert!(copy_vars(&d.path().join("absent.fd"), &to, &partial).is_err());
        assert!(!partial.exists());
        assert_eq!(fs::read(&to).unwrap(), b"the guest's boot entries");
    }
}
