//! UEFI firmware files (OVMF): whether the configured pair can be used, and each VM's own copy
//! of the variables store.
//!
//! A VM with `boot.firmware = "uefi"` runs with two flash devices ([`crate::qemu::argv`]):
//! OVMF's code (`firmware.uefi_code`), shared by every VM and read-only, and a variables store
//! (NVRAM: boot entries, boot order, settings) that the guest's firmware writes. The store must
//! be the VM's own, so each UEFI VM gets a copy of the template (`firmware.uefi_vars`) at its
//! first start ([`copy_vars`]), kept in its disk directory until it is destroyed. The daemon
//! opens both files and hands QEMU descriptors, like every other file (docs/images.md).
//!
//! A `boot.secure_boot` VM runs the secure pair instead ([`Pair::of`]: an SMM build of the code
//! and a template with the keys enrolled). Its store must pair with the code it runs: a store
//! made from the plain template has no Platform Key, so OVMF would boot it in setup mode with
//! nothing checked; a store from the secure template keeps enforcing the keys under the plain
//! code, without SMM's protection. Which kind a store is follows from its content
//! ([`platform_key`], the `PK` variable), so it holds whichever way the store arrived (a copy,
//! a revert, an import, a move). At each start [`ensure_store`] keeps a store that pairs
//! ([`pairs`]); one that does not is set aside ([`aside_path`], one per kind, so switching back
//! finds the guest's settings) and the store of the right kind set aside earlier comes back, or
//! a fresh copy of the template is made. Order of use: [`Pair::of`], [`check_pair`] (before
//! anything is made), [`ensure_store`] (the launch), [`store_files`] (the destroy).

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
        /// The config key (`firmware.uefi_code`, `.uefi_vars` or their `uefi_secure_` pair).
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
        /// The config key (`firmware.uefi_code`, `.uefi_vars` or their `uefi_secure_` pair).
        key: &'static str,
        /// The configured path.
        path: PathBuf,
        /// Why the open failed.
        source: io::Error,
    },
    /// It is a directory or a device rather than a firmware image.
    #[error("{} is not a regular file", path.display())]
    NotAFile {
        /// The config key (`firmware.uefi_code`, `.uefi_vars` or their `uefi_secure_` pair).
        key: &'static str,
        /// The configured path.
        path: PathBuf,
    },
    /// The secure variables template holds no Platform Key: VMs would start in setup mode,
    /// Secure Boot off.
    #[error(
        "{} has no Platform Key enrolled: Secure Boot would be off (use an enrolled-keys template such as \
         OVMF_VARS_4M.ms.fd, or set {key})",
        path.display()
    )]
    NoKeys {
        /// `firmware.uefi_secure_vars`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
    },
    /// The secure variables template is not an OVMF variables store.
    #[error("{} is not an OVMF variables store: {problem}", path.display())]
    NotAStore {
        /// `firmware.uefi_secure_vars`.
        key: &'static str,
        /// The configured path.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
}

impl FirmwareError {
    /// The config key of the file.
    pub fn key(&self) -> &'static str {
        match self {
            FirmwareError::Missing { key, .. }
            | FirmwareError::Unreadable { key, .. }
            | FirmwareError::NotAFile { key, .. }
            | FirmwareError::NoKeys { key, .. }
            | FirmwareError::NotAStore { key, .. } => key,
        }
    }

    /// The configured path of the file.
    pub fn path(&self) -> &Path {
        match self {
            FirmwareError::Missing { path, .. }
            | FirmwareError::Unreadable { path, .. }
            | FirmwareError::NotAFile { path, .. }
            | FirmwareError::NoKeys { path, .. }
            | FirmwareError::NotAStore { path, .. } => path,
        }
    }
}

/// The firmware pair a VM runs: the plain one or, for `boot.secure_boot`, the secure one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair<'a> {
    /// OVMF's code.
    pub code: &'a Path,
    /// The variables template.
    pub vars: &'a Path,
    /// The config key of `code`.
    pub code_key: &'static str,
    /// The config key of `vars`.
    pub vars_key: &'static str,
    /// True for the secure pair.
    pub secure: bool,
}

impl<'a> Pair<'a> {
    /// The pair of `config` a VM with `secure_boot` (or without) runs.
    pub fn of(config: &'a FirmwareConfig, secure_boot: bool) -> Pair<'a> {
        if secure_boot {
            Pair {
                code: &config.uefi_secure_code,
                vars: &config.uefi_secure_vars,
                code_key: "firmware.uefi_secure_code",
                vars_key: "firmware.uefi_secure_vars",
                secure: true,
            }
        } else {
            Pair {
                code: &config.uefi_code,
                vars: &config.uefi_vars,
                code_key: "firmware.uefi_code",
                vars_key: "firmware.uefi_vars",
                secure: false,
            }
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
    check_pair(Pair::of(config, false))
}

/// Whether vmhostd can open both files of `pair`, as [`check`] does for the plain one. The
/// secure template must also hold a Platform Key: one without would start every VM in setup
/// mode, Secure Boot off.
///
/// # Errors
/// [`FirmwareError`] for the first file that cannot be used, code first.
pub fn check_pair(pair: Pair<'_>) -> Result<Present, FirmwareError> {
    let code_bytes = readable(pair.code_key, pair.code)?;
    let vars_bytes = readable(pair.vars_key, pair.vars)?;
    if pair.secure {
        let bytes = fs::read(pair.vars).map_err(|source| FirmwareError::Unreadable {
            key: pair.vars_key,
            path: pair.vars.to_path_buf(),
            source,
        })?;
        match platform_key(&bytes) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(FirmwareError::NoKeys { key: pair.vars_key, path: pair.vars.to_path_buf() }),
            Err(e) => {
                return Err(FirmwareError::NotAStore { key: pair.vars_key, path: pair.vars.to_path_buf(), problem: e })
            }
        }
    }
    Ok(Present { code_bytes, vars_bytes })
}

/// The `EFI_GLOBAL_VARIABLE` vendor GUID (8be4df61-93ca-11d2-aa0d-00e098032b8c) as stored.
const GLOBAL_VARIABLE: [u8; 16] =
    [0x61, 0xdf, 0xe4, 0x8b, 0xca, 0x93, 0xd2, 0x11, 0xaa, 0x0d, 0x00, 0xe0, 0x98, 0x03, 0x2b, 0x8c];

/// The size of an `AUTHENTICATED_VARIABLE_HEADER` (every OVMF store since Secure Boot support).
const VAR_HEADER: usize = 60;

/// A variable's `State` once written and not deleted; `& !1` still counts (a deletion begun
/// whose replacement never followed: edk2 keeps it).
const VAR_ADDED: u8 = 0x3f;

/// The value of the live `PK` variable (the Platform Key) of OVMF variables store `store`, or
/// None when it has none (setup mode: nothing is checked). Walks the firmware volume's
/// variable store as edk2's VariableRuntimeDxe does: the volume header's length, the store
/// header (28 bytes), then 4-byte-aligned variables until the first without the start mark.
///
/// # Errors
/// A message when `store` is not an OVMF variables store (no `_FVH` volume, a short one).
pub fn platform_key(store: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let u16_at = |at: usize| store.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at: usize| store.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    if store.get(40..44) != Some(b"_FVH".as_slice()) {
        return Err("no firmware volume header (_FVH) at offset 40".into());
    }
    let header = u16_at(48).ok_or("a short volume header")? as usize;
    let size = u32_at(header + 16).ok_or("no variable store header")? as usize;
    let end = (header + size).min(store.len());
    let mut at = header + 28;
    let mut found = None;
    while at + VAR_HEADER <= end && u16_at(at) == Some(0x55aa) {
        let state = store[at + 2];
        let name_size = u32_at(at + 36).ok_or("a short variable header")? as usize;
        let data_size = u32_at(at + 40).ok_or("a short variable header")? as usize;
        let name_at = at + VAR_HEADER;
        let data_at = name_at.checked_add(name_size).ok_or("a variable's name is too long")?;
        let next = data_at.checked_add(data_size).ok_or("a variable's data is too long")?;
        if next > end {
            return Err(format!("the variable at offset {at} runs past the store"));
        }
        let live = state == VAR_ADDED || state == VAR_ADDED & !1;
        if live && store[at + 44..at + 60] == GLOBAL_VARIABLE && &store[name_at..data_at] == b"P\0K\0\0\0" {
            found = Some(store[data_at..next].to_vec());
        }
        at = (next + 3) & !3;
    }
    Ok(found.filter(|pk| !pk.is_empty()))
}

/// Whether a store whose Platform Key is `store_pk` pairs with the code of a `secure` VM:
/// under Secure Boot it must hold one (else nothing is checked); without, it must not hold
/// the secure template's (`secure_template_pk`, None when that cannot be read), which plain
/// OVMF would enforce without SMM's protection. A key of the guest's own enrolling under plain
/// OVMF is the guest's business and stays.
pub fn pairs(secure: bool, store_pk: Option<&[u8]>, secure_template_pk: Option<&[u8]>) -> bool {
    match (secure, store_pk) {
        (true, pk) => pk.is_some(),
        (false, None) => true,
        (false, Some(pk)) => secure_template_pk != Some(pk),
    }
}

/// Where a store of the `secure` kind (or the plain one) is set aside beside `store`
/// (`uefi-vars.secure.fd`, `uefi-vars.plain.fd`): one per kind, so that switching
/// `boot.secure_boot` back finds the guest's settings of before.
pub fn aside_path(store: &Path, secure: bool) -> PathBuf {
    let kind = if secure { "secure" } else { "plain" };
    let stem = store.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    store.with_file_name(format!("{stem}.{kind}.fd"))
}

/// Every file of a VM's store ([`crate::qemu::argv::VmPaths::uefi_vars`]): the store, its
/// partial copy and both set-aside stores, which a destroy removes.
pub fn store_files(store: &Path, partial: &Path) -> [PathBuf; 4] {
    [store.to_path_buf(), partial.to_path_buf(), aside_path(store, false), aside_path(store, true)]
}

/// What [`ensure_store`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOutcome {
    /// The store was there and pairs with the code.
    Kept,
    /// A fresh copy of the template (the first start, or no store of this kind set aside).
    Copied,
    /// The store set aside earlier for this kind came back.
    Restored,
}

/// Gives a VM running `pair` a store at `store` that pairs with its code ([`pairs`]): keeps
/// one that does; sets one that does not aside as its kind ([`aside_path`], replacing an older
/// one set aside); then brings back the store set aside earlier for `pair`'s kind when it
/// pairs, else copies the template ([`copy_vars`] through `partial`). Each step is a rename or
/// an atomic copy, so a crash leaves at most a missing store, which the next start completes
/// the same way (the set-aside one comes back before any copy).
///
/// # Errors
/// Any I/O error; a store that is not an OVMF variables store counts as the plain kind.
pub fn ensure_store(pair: Pair<'_>, secure_template: &Path, store: &Path, partial: &Path) -> io::Result<StoreOutcome> {
    let pk_of = |p: &Path| -> io::Result<Option<Option<Vec<u8>>>> {
        match fs::read(p) {
            Ok(bytes) => Ok(Some(platform_key(&bytes).unwrap_or(None))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    // Read only when it matters: a plain VM's store with a key of its own.
    let template_pk = || pk_of(secure_template).ok().flatten().flatten();
    let fits = |pk: &Option<Vec<u8>>| {
        let template = if !pair.secure && pk.is_some() { template_pk() } else { None };
        pairs(pair.secure, pk.as_deref(), template.as_deref())
    };
    if let Some(pk) = pk_of(store)? {
        if fits(&pk) {
            return Ok(StoreOutcome::Kept);
        }
        // It is the other kind's: kept aside as that kind for a switch back.
        fs::rename(store, aside_path(store, !pair.secure))?;
        sync_dir(store);
    }
    let aside = aside_path(store, pair.secure);
    if let Some(pk) = pk_of(&aside)? {
        if fits(&pk) {
            fs::rename(&aside, store)?;
            sync_dir(store);
            return Ok(StoreOutcome::Restored);
        }
    }
    copy_vars(pair.vars, store, partial)?;
    Ok(StoreOutcome::Copied)
}

/// Fsyncs the directory of `file` after a rename in it; a failure is only logged (the rename
/// happened).
fn sync_dir(file: &Path) {
    if let Some(dir) = file.parent() {
        if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %dir.display(), error = %e, "directory fsync failed after rename");
        }
    }
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
        let config = FirmwareConfig { uefi_code: code.clone(), uefi_vars: vars.clone(), ..FirmwareConfig::default() };
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

    /// A minimal OVMF variables store: the volume header (72 bytes), the store header, then
    /// `vars` as (state, vendor GUID, UTF-16 name, data).
    fn store(vars: &[(u8, [u8; 16], &str, &[u8])]) -> Vec<u8> {
        let mut b = vec![0u8; 72];
        b[40..44].copy_from_slice(b"_FVH");
        b[48..50].copy_from_slice(&72u16.to_le_bytes());
        let mut body = Vec::new();
        for (state, guid, name, data) in vars {
            let name: Vec<u8> = name.encode_utf16().chain([0]).flat_map(u16::to_le_bytes).collect();
            let mut h = vec![0u8; VAR_HEADER];
            h[0..2].copy_from_slice(&0x55aau16.to_le_bytes());
            h[2] = *state;
            h[36..40].copy_from_slice(&(name.len() as u32).to_le_bytes());
            h[40..44].copy_from_slice(&(data.len() as u32).to_le_bytes());
            h[44..60].copy_from_slice(guid);
            body.extend(h);
            body.extend(name);
            body.extend(*data);
            while body.len() % 4 != 0 {
                body.push(0xff);
            }
        }
        let mut header = vec![0u8; 28];
        header[16..20].copy_from_slice(&((28 + body.len() + 64) as u32).to_le_bytes());
        b.extend(header);
        b.extend(body);
        b.extend([0xffu8; 64]);
        b
    }

    #[test]
    fn the_platform_key_is_the_live_pk_of_the_global_vendor() {
        let other = [7u8; 16];
        assert_eq!(platform_key(&store(&[])).unwrap(), None, "an empty store: setup mode");
        let s = store(&[
            (VAR_ADDED, GLOBAL_VARIABLE, "PKX", b"no"),
            (VAR_ADDED, other, "PK", b"another vendor's"),
            (0x3c, GLOBAL_VARIABLE, "PK", b"deleted"),
            (VAR_ADDED, GLOBAL_VARIABLE, "KEK", b"kek"),
        ]);
        assert_eq!(platform_key(&s).unwrap(), None);
        let s = store(&[(0x3c, GLOBAL_VARIABLE, "PK", b"old"), (VAR_ADDED, GLOBAL_VARIABLE, "PK", b"the key")]);
        assert_eq!(platform_key(&s).unwrap().as_deref(), Some(b"the key".as_slice()));
        let s = store(&[(VAR_ADDED & !1, GLOBAL_VARIABLE, "PK", b"mid-update")]);
        assert_eq!(platform_key(&s).unwrap().as_deref(), Some(b"mid-update".as_slice()));
        assert!(platform_key(b"not a store").is_err());
        let mut short = store(&[(VAR_ADDED, GLOBAL_VARIABLE, "PK", b"k")]);
        short[72 + 28 + 40..72 + 28 + 44].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(platform_key(&short).is_err(), "a data size past the end is refused, not followed");
    }

    #[test]
    fn debians_templates_have_a_key_where_secure_boot_is_on() {
        let read = |f: &str| fs::read(Path::new("/usr/share/OVMF").join(f)).ok();
        let (Some(plain), Some(ms)) = (read("OVMF_VARS_4M.fd"), read("OVMF_VARS_4M.ms.fd")) else {
            eprintln!("OVMF is not installed: skipped");
            return;
        };
        assert_eq!(platform_key(&plain).unwrap(), None);
        let pk = platform_key(&ms).unwrap().expect("the ms template enrolls a PK");
        assert!(pk.len() > 100, "an EFI signature list with a certificate");
        if let Some(snakeoil) = read("OVMF_VARS_4M.snakeoil.fd") {
            assert_ne!(platform_key(&snakeoil).unwrap().as_deref(), Some(pk.as_slice()));
        }
    }

    #[test]
    fn a_store_pairs_with_the_code_by_its_platform_key() {
        let (t, mine) = (b"template".as_slice(), b"the guest's".as_slice());
        assert!(pairs(true, Some(t), Some(t)));
        assert!(pairs(true, Some(mine), None), "any enrolled key is enforced");
        assert!(!pairs(true, None, Some(t)), "a plain store under Secure Boot checks nothing");
        assert!(pairs(false, None, Some(t)));
        assert!(!pairs(false, Some(t), Some(t)), "the secure template's keys leave a plain VM");
        assert!(pairs(false, Some(mine), Some(t)), "keys the guest enrolled are its own");
        assert!(pairs(false, Some(t), None), "unknown template: kept");
    }

    #[test]
    fn switching_secure_boot_sets_the_store_aside_and_brings_the_other_back() {
        let d = tempfile::tempdir().unwrap();
        let (plain_t, secure_t) = (d.path().join("VARS.fd"), d.path().join("VARS.ms.fd"));
        fs::write(&plain_t, store(&[])).unwrap();
        fs::write(&secure_t, store(&[(VAR_ADDED, GLOBAL_VARIABLE, "PK", b"vendor pk")])).unwrap();
        let config = FirmwareConfig {
            uefi_vars: plain_t.clone(),
            uefi_secure_vars: secure_t.clone(),
            ..FirmwareConfig::default()
        };
        let (st, partial) = (d.path().join("uefi-vars.fd"), d.path().join("uefi-vars.fd.partial"));
        let ensure = |secure: bool| ensure_store(Pair::of(&config, secure), &secure_t, &st, &partial).unwrap();
        assert_eq!(
            store_files(&st, &partial)[2..],
            [d.path().join("uefi-vars.plain.fd"), d.path().join("uefi-vars.secure.fd")]
        );

        // A plain VM's store, with the guest's own boot entry.
        assert_eq!(ensure(false), StoreOutcome::Copied);
        let plain_of_guest = store(&[(VAR_ADDED, [1; 16], "Boot0001", b"entry")]);
        fs::write(&st, &plain_of_guest).unwrap();
        assert_eq!(ensure(false), StoreOutcome::Kept);
        // Secure Boot on: the plain store goes aside, a fresh secure copy comes.
        assert_eq!(ensure(true), StoreOutcome::Copied);
        assert_eq!(fs::read(&st).unwrap(), fs::read(&secure_t).unwrap());
        assert_eq!(fs::read(aside_path(&st, false)).unwrap(), plain_of_guest);
        assert_eq!(ensure(true), StoreOutcome::Kept);
        // Off again: the secure store goes aside and the guest's plain one is back.
        let secure_of_guest =
            store(&[(VAR_ADDED, GLOBAL_VARIABLE, "PK", b"vendor pk"), (VAR_ADDED, [1; 16], "X", b"y")]);
        fs::write(&st, &secure_of_guest).unwrap();
        assert_eq!(ensure(false), StoreOutcome::Restored);
        assert_eq!(fs::read(&st).unwrap(), plain_of_guest);
        assert!(!aside_path(&st, false).exists());
        // On: the secure one comes back.
        assert_eq!(ensure(true), StoreOutcome::Restored);
        assert_eq!(fs::read(&st).unwrap(), secure_of_guest);
        // A crash between setting aside and restoring leaves no store: the next start restores.
        fs::rename(&st, aside_path(&st, true)).unwrap();
        assert_eq!(ensure(true), StoreOutcome::Restored);
        // A plain guest that enrolled a key of its own keeps it.
        let own = store(&[(VAR_ADDED, GLOBAL_VARIABLE, "PK", b"the owner's pk")]);
        fs::write(&st, &own).unwrap();
        fs::remove_file(aside_path(&st, true)).ok();
        assert_eq!(ensure(false), StoreOutcome::Kept);
        assert_eq!(fs::read(&st).unwrap(), own);
        // A template that cannot be read leaves no store and no partial.
        fs::remove_file(&st).unwrap();
        fs::remove_file(aside_path(&st, false)).ok();
        fs::remove_file(&secure_t).unwrap();
        assert!(ensure_store(Pair::of(&config, true), &secure_t, &st, &partial).is_err());
        assert!(!st.exists() && !partial.exists());
    }

    #[test]
    fn the_secure_template_must_hold_a_platform_key() {
        let d = tempfile::tempdir().unwrap();
        let (code, vars) = (d.path().join("CODE.secboot.fd"), d.path().join("VARS.ms.fd"));
        fs::write(&code, [0u8; 64]).unwrap();
        fs::write(&vars, store(&[])).unwrap();
        let config =
            FirmwareConfig { uefi_secure_code: code, uefi_secure_vars: vars.clone(), ..FirmwareConfig::default() };
        let e = check_pair(Pair::of(&config, true)).unwrap_err();
        assert!(matches!(e, FirmwareError::NoKeys { key: "firmware.uefi_secure_vars", .. }), "{e}");
        fs::write(&vars, b"garbage").unwrap();
        assert!(matches!(check_pair(Pair::of(&config, true)).unwrap_err(), FirmwareError::NotAStore { .. }));
        let good = store(&[(VAR_ADDED, GLOBAL_VARIABLE, "PK", b"k")]);
        fs::write(&vars, &good).unwrap();
        assert_eq!(
            check_pair(Pair::of(&config, true)).unwrap(),
            Present { code_bytes: 64, vars_bytes: good.len() as u64 }
        );
    }
}
