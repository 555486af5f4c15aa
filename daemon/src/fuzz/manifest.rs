//! A backup's `manifest.json` as the cargo fuzz target `manifest` drives it: arbitrary bytes as
//! the manifest `vm.import` reads from a backup directory (docs/backup.md: a backup is untrusted
//! input, all of it).
//!
//! [`manifest_bytes`] runs [`crate::backup::parse_manifest`], the same pure parse and checks the
//! import runs before it copies anything, and panics when a promise breaks: a refusal is 2001 or
//! 2003 (never a panic, never another code); an accepted manifest names only the files its
//! disks have (`root.qcow2`, `NAME.FORMAT`: no path), at most one root disk, exactly the spec's
//! data disks, and without a root disk no `boot.disk` or `boot.image`; and it is accepted again
//! as the same value once written back (an export writes what an import reads).

use crate::api::backup::DiskRole;
use crate::api::Code;
use crate::backup::{file_of, parse_manifest};

/// Parses `data` as a backup's `manifest.json`.
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn manifest_bytes(data: &[u8]) {
    let manifest = match parse_manifest(data) {
        Ok(m) => m,
        Err(why) => {
            // The code a client gets: the same mapping `vm.import` goes through.
            let code = crate::api::ApiError::from(crate::backup::BackupError::Manifest {
                path: "manifest.json".into(),
                source: why.clone(),
            })
            .code;
            assert!(matches!(code, Code::InvalidSpec | Code::ChecksumMismatch), "refused with {code:?}: {why}");
            return;
        }
    };
    for d in &manifest.disks {
        assert_eq!(d.file, file_of(d), "a file name is the one its disk has");
        assert!(!d.file.contains('/') && !d.file.starts_with('.'), "a file name is no path: {:?}", d.file);
    }
    let roots = manifest.disks.iter().filter(|d| d.role == DiskRole::Root).count();
    assert!(roots <= 1, "at most one root disk");
    if roots == 0 {
        assert!(
            manifest.spec.boot.disk.is_none() && manifest.spec.boot.image.is_none(),
            "a root-less VM boots no disk"
        );
    }
    // Version 2's files (the variables store, the TPM state) are no paths either, and an
    // increment names a parent that is a backup's name, never itself.
    let others =
        manifest.uefi_vars.iter().map(|v| &v.file).chain(manifest.tpm.iter().flat_map(|t| &t.files).map(|f| &f.file));
    for file in others {
        assert!(!file.contains('/') && !file.starts_with('.') && !file.is_empty(), "a file name is no path: {file:?}");
    }
    match &manifest.parent {
        Some(p) => {
            assert_eq!(manifest.version, 2, "only version 2 has a parent");
            assert!(
                crate::images::is_image_name(&p.dir) && !p.dir.contains('/'),
                "a parent is a backup's name: {:?}",
                p.dir
            );
            assert_ne!(Some(&p.id), manifest.id.as_ref(), "a backup is not its own parent");
        }
        None => assert!(manifest.changes.iter().all(|c| c.kind != crate::api::backup::BackupKind::Incremental)),
    }
    let data_disks = manifest.disks.iter().filter(|d| d.role == DiskRole::Data).count();
    assert_eq!(data_disks, manifest.spec.disks.len(), "the spec's data disks, each once");
    let written =
        serde_json::to_vec_pretty(&manifest).unwrap_or_else(|e| panic!("an accepted manifest serializes: {e}"));
    let again = parse_manifest(&written).unwrap_or_else(|e| panic!("accepted once, refused written back: {e}"));
    assert_eq!(again, manifest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("manifest", manifest_bytes) >= 7, "the seed corpus is committed");
    }

    /// The version 2 seed is accepted (so the fuzzer starts from an increment with a TPM state
    /// and a variables store, not only from refusals), and each of its v2 promises, broken,
    /// is refused.
    #[test]
    fn the_version_2_seed_is_accepted_and_breaking_it_is_refused() {
        let seed =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/manifest/v2-incremental-tpm-vars");
        let bytes = std::fs::read(seed).unwrap();
        let m = parse_manifest(&bytes).unwrap();
        assert!(m.parent.is_some() && m.tpm.is_some() && m.uefi_vars.is_some());
        let text = String::from_utf8(bytes).unwrap();
        for (from, to) in [
            ("\"tpm-tpm2-00.permall\"", "\"../tpm2-00.permall\""),
            ("\"uefi-vars.fd\"", "\"/etc/shadow\""),
            ("\"v-20261204-000000\"", "\"../v\""),
            ("\"fedcba9876543210\"", "\"0123456789abcdef\""),
            ("\"kind\": \"incremental\",\n", "\"kind\": \"full\",\n"),
        ] {
            assert!(text.contains(from), "{from}");
            let broken = text.replacen(from, to, 1);
            assert!(parse_manifest(broken.as_bytes()).is_err(), "{from} -> {to} accepted");
            manifest_bytes(broken.as_bytes());
        }
    }
}
