//! `image.import`, `image.list`, `image.delete`: the image store ([`crate::images`]) with what
//! only the lifecycle knows, which VMs boot from an image.
//!
//! An import: check the request (nothing touched), take the name, and either record a file
//! already there (hashed where it is) or copy it (a file in `paths.import`, or a URL through
//! curl) into a temp file hashed as it is written; a wrong sha256 removes the temp file (2003);
//! QEMU as `qemu.user` reads its format (an image naming a backing or data file is refused);
//! it is renamed into place, never over a file, and recorded. A delete: the name taken, the
//! image marked as going under the table lock in the same step that finds no VM using it (a
//! create admitted after that is refused until it is gone), then file and record removed.

use super::Manager;
use crate::api::images::{DeleteResult, ImageView, ImportParams, ImportResult};
use crate::api::{ApiError, Code};
use crate::images::{ImageRecord, ImportRequest, NameGuard, Source, StoreError};
use crate::qemu::boot_files::Version;
use serde_json::json;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

/// What fills the images directory fills the state directory by default: an import (a copy or
/// a download) may take at most this share of its free space, 10 % kept.
const PERCENT: u64 = crate::disk::space::PREALLOCATE_PERCENT;

fn failed(message: String) -> ApiError {
    super::provisioning("image_import", message)
}

/// Marks an image as going for as long as its delete runs.
struct Going<'a> {
    mgr: &'a Manager,
    name: String,
}

impl Drop for Going<'_> {
    fn drop(&mut self) {
        self.mgr.lock().images_going.remove(&self.name);
    }
}

/// The VMs that boot from image `name` ([`boots_from`]) by their spec or running spec,
/// by name.
fn image_users(mgr: &Manager, t: &super::Table, name: &str) -> Vec<String> {
    let dir = &mgr.config.paths.images;
    t.vms
        .values()
        .filter(|r| std::iter::once(&r.spec).chain(r.running_spec.as_ref()).any(|s| boots_from(&s.boot, dir, name)))
        .map(|r| r.spec.name.clone())
        .collect()
}

/// 4090 on `spec.boot.image` (or `.kernel`, `.initrd`) when `spec` boots from an image
/// being deleted (admission, under the table lock).
pub(super) fn check_image_staying(mgr: &Manager, t: &super::Table, spec: &crate::api::VmSpec) -> Result<(), ApiError> {
    let dir = &mgr.config.paths.images;
    for image in &t.images_going {
        if let Some(field) = boot_field_using(&spec.boot, dir, image) {
            return Err(ApiError::new(Code::Busy, format!("image {image:?} is being deleted"))
                .field(format!("spec.boot.{field}")));
        }
    }
    Ok(())
}

/// `image.list`: every image file, with its record and users.
///
/// # Errors
/// 4001 when the directory cannot be read; 4002 on `qemu.sha256` when a file without a record
/// must be read by QEMU and the binary is not the pinned one.
pub(crate) async fn image_list(mgr: &Manager) -> Result<Vec<ImageView>, ApiError> {
    let files = mgr.images.files()?;
    let records = mgr.images.records();
    let mut out = Vec::with_capacity(files.len());
    for (name, meta) in files {
        let (format, virtual_size) = match records.get(&name) {
            Some(r) => (Some(r.format.clone()), Some(r.virtual_size)),
            None => probe_unrecorded(mgr, &name, &meta).await?,
        };
        out.push(ImageView {
            used_by: Vec::new(),
            bytes: meta.len(),
            format,
            virtual_size,
            sha256: records.get(&name).map(|r| r.sha256.clone()),
            source: records.get(&name).and_then(|r| r.source.as_deref().map(crate::images::url::redact_text)),
            imported_at: records.get(&name).map(|r| r.imported_at.clone()),
            name,
        });
    }
    let t = mgr.lock();
    for view in &mut out {
        view.used_by = image_users(mgr, &t, &view.name);
    }
    Ok(out)
}

/// Format and virtual size of an image without a record: QEMU reads it (once per version
/// of the file); `None`s when it cannot.
///
/// # Errors
/// 4002 when the QEMU binary is not the pinned one (nothing ran, nothing is remembered).
async fn probe_unrecorded(
    mgr: &Manager,
    name: &str,
    meta: &std::fs::Metadata,
) -> Result<(Option<String>, Option<u64>), ApiError> {
    let version = Version::of(meta);
    if let Some((v, found)) = mgr.image_probes.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
        if *v == version {
            return Ok(found.clone());
        }
    }
    let path = mgr.images.path(name);
    let found = match crate::blocking::run(|| std::fs::File::open(&path)) {
        Ok(f) => match crate::disk::import::inspect(&mgr.disk_tool(), OwnedFd::from(f)).await {
            Ok(info) => (Some(info.format), Some(info.virtual_size)),
            Err(crate::disk::DiskError::Pinned(refusal)) => return Err(refusal.into()),
            Err(e) => {
                tracing::debug!(image = name, error = %e, "QEMU cannot read an image");
                (None, None)
            }
        },
        Err(_) => (None, None),
    };
    mgr.image_probes.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), (version, found.clone()));
    Ok(found)
}

/// `image.import` (module doc).
///
/// # Errors
/// 2001 (a bad name, sha256, source or timeout; an image QEMU cannot read or that names a
/// backing or data file), 2003 (another sha256; nothing kept), 4093 (another image of that
/// name), 4040 (no source and no such image), 3002 on `source` (a local file or a download
/// larger than 90 % of the images directory's free space less what other imports,
/// snapshots and exports hold there), 4090 (another import or delete of the name), 4001
/// (a download or file step).
pub(crate) async fn image_import(mgr: &Manager, p: ImportParams) -> Result<ImportResult, ApiError> {
    let req = crate::images::check_import(&mgr.config, &p.name, &p.sha256, p.source.as_deref(), p.timeout_s)?;
    let held = mgr.images.begin(&req.name)?;
    let path = mgr.images.path(&req.name);
    let there = crate::blocking::run(|| std::fs::symlink_metadata(&path)).ok();
    if let Some(meta) = there {
        return import_existing(mgr, &held, &req, &meta).await;
    }
    let source_text = match &req.source {
        Source::InPlace => {
            return Err(ApiError::new(
                Code::NotFound,
                format!(
                    "no image {:?} in {}: give a source (a URL or a file in the import directory)",
                    req.name,
                    mgr.config.paths.images.display()
                ),
            )
            .field("source"));
        }
        Source::File(path) => path.display().to_string(),
        // Never the query string: a signed URL's token is a secret (download module doc).
        Source::Url(url) => url.redacted(),
    };
    // Where a URL leads is checked before anything is made or fetched.
    let first_hop = match &req.source {
        Source::Url(url) => Some(
            crate::images::download::check_hop(
                url.clone(),
                &mgr.config.images.allow_private,
                &crate::images::download::SystemResolver,
                None,
            )
            .await?,
        ),
        _ => None,
    };
    // The room it will take, reserved before a byte is written ([`crate::disk::reserve`]).
    let room = match &req.source {
        Source::File(from) => reserve_image_file(mgr, from)?,
        _ => mgr.reservations.reserve_rest(&mgr.config.paths.images, PERCENT).map_err(|e| {
            crate::disk::space::refusal(e, &mgr.config.paths.images, "the download", "source", "image_bytes")
        })?,
    };
    let max_bytes = room.bytes();
    let mut temp = mgr.images.temp(&held, &req.name)?;
    temp.hold(room);
    match &req.source {
        Source::File(from) => {
            crate::images::copy(from, &mut temp).map_err(|e| StoreError::copying(from, e))?;
        }
        Source::Url(_) => {
            let Some(first_hop) = first_hop else {
                return Err(failed("a URL import without its checked address".into()));
            };
            crate::images::download::fetch(
                &mgr.config.images.curl,
                mgr.config.qemu_user,
                first_hop,
                &mgr.config.images.allow_private,
                &crate::images::download::SystemResolver,
                req.timeout,
                max_bytes,
                &mut temp,
            )
            .await?;
        }
        Source::InPlace => {}
    }
    let found = temp.finish().map_err(StoreError::Write)?;
    if found != req.sha256 {
        return Err(crate::images::mismatch(&source_text, &req.sha256, &found, temp.bytes()).into());
    }
    crate::crashpoint::hit(&mgr.config.paths.run, "image:hashed");
    let file = temp.reopen().map_err(StoreError::Reopen)?;
    let (format, virtual_size) = inspect_image(mgr, file, &source_text).await?;
    let bytes = temp.bytes();
    let meta = temp.place(&path).map_err(|e| StoreError::placing(&req.name, &path, e))?;
    crate::crashpoint::hit(&mgr.config.paths.run, "image:placed");
    let record = ImageRecord {
        sha256: req.sha256.clone(),
        bytes,
        format,
        virtual_size,
        source: Some(source_text),
        imported_at: crate::api::now_rfc3339(),
        version: Version::of(&meta),
    };
    record_image(mgr, &held, &req.name, record.clone())?;
    tracing::info!(image = %req.name, sha256 = %req.sha256, bytes, "image imported");
    Ok(ImportResult { changed: true, image: view_of(mgr, &req.name, &record) })
}

/// An import of a name that has a file: the same sha256 is recorded (or was: no change),
/// another is refused; the file is never replaced.
async fn import_existing(
    mgr: &Manager,
    held: &NameGuard,
    req: &ImportRequest,
    meta: &std::fs::Metadata,
) -> Result<ImportResult, ApiError> {
    let path = mgr.images.path(&req.name);
    if !meta.file_type().is_file() {
        return Err(StoreError::NotAFile { path }.into());
    }
    let recorded = mgr.images.record(&req.name);
    let exists = |sha256: &str| {
        ApiError::new(
            Code::ImageExists,
            format!(
                "image {:?} is there with sha256 {sha256}, not {}: delete it first (VMs using it keep \
                 overlays over it, so it is never replaced)",
                req.name, req.sha256
            ),
        )
        .field("name")
        .details(json!({ "sha256": sha256 }))
    };
    let verdict = match &recorded {
        Some(r) if r.sha256 != req.sha256 => return Err(exists(&r.sha256)),
        Some(_) => mgr.images.verify(&req.name),
        None => None,
    };
    match (&recorded, verdict) {
        (Some(r), Some(crate::images::Verdict::Match)) => {
            return Ok(ImportResult { changed: false, image: view_of(mgr, &req.name, r) });
        }
        (Some(_), Some(crate::images::Verdict::Mismatch { found })) => {
            return Err(crate::images::changed(&path.display().to_string(), &req.sha256, &found, meta.len()).into());
        }
        _ => {}
    }
    // No record (put there by hand, or a crash before the record): hash it where it is.
    let (found, version) = crate::blocking::run(|| {
        let mut file = std::fs::File::open(&path)?;
        let version = Version::of(&file.metadata()?);
        crate::qemu::integrity::sha256_of(&mut file).map(|found| (found, version))
    })
    .map_err(|source| StoreError::Unreadable { path: path.clone(), source })?;
    if found != req.sha256 {
        return Err(match req.source {
            Source::InPlace => {
                crate::images::mismatch(&path.display().to_string(), &req.sha256, &found, meta.len()).into()
            }
            _ => exists(&found),
        });
    }
    let file = crate::blocking::run(|| std::fs::File::open(&path))
        .map_err(|source| StoreError::Unreadable { path: path.clone(), source })?;
    let (format, virtual_size) = inspect_image(mgr, file, &path.display().to_string()).await?;
    let record = ImageRecord {
        sha256: found,
        bytes: meta.len(),
        format,
        virtual_size,
        source: None,
        imported_at: crate::api::now_rfc3339(),
        version,
    };
    record_image(mgr, held, &req.name, record.clone())?;
    tracing::info!(image = %req.name, sha256 = %req.sha256, "image recorded where it was");
    Ok(ImportResult { changed: true, image: view_of(mgr, &req.name, &record) })
}

/// QEMU (as `qemu.user`, on a descriptor) reads the image's format and size.
///
/// # Errors
/// 2001 on `source` when QEMU cannot read it as an image or it names a backing or data
/// file (an overlay over it would reach a file vmhostd does not manage).
async fn inspect_image(mgr: &Manager, file: std::fs::File, what: &str) -> Result<(String, u64), ApiError> {
    let info = crate::disk::import::inspect(&mgr.disk_tool(), OwnedFd::from(file))
        .await
        .map_err(|e| StoreError::inspecting(what, e))?;
    if let Some(other) = info.backing.as_ref().or(info.data_file.as_ref()) {
        return Err(StoreError::NamesAnotherFile { what: what.to_string(), other: other.clone() }.into());
    }
    Ok((info.format, info.virtual_size))
}

/// Reserves room for a copy of the file at `from` in the images directory: its size, with
/// [`PERCENT`] of the free space the most it may take next to what other operations hold
/// there, the margin a download keeps. An unreadable file reserves nothing (its copy then
/// fails with the reason).
///
/// # Errors
/// 3002 on `source` (`resource: image_bytes`); 4001 when the free space cannot be read.
fn reserve_image_file(mgr: &Manager, from: &std::path::Path) -> Result<crate::disk::reserve::Reservation, ApiError> {
    let len = crate::blocking::run(|| std::fs::metadata(from)).map_or(0, |m| m.len());
    let images = &mgr.config.paths.images;
    mgr.reservations.reserve(images, len, PERCENT).map_err(|e| {
        crate::disk::space::refusal(e, images, &from.display().to_string(), "source", "image_bytes").into()
    })
}

fn record_image(mgr: &Manager, held: &NameGuard, name: &str, record: ImageRecord) -> Result<(), ApiError> {
    Ok(mgr.images.put(held, name, record)?)
}

fn view_of(mgr: &Manager, name: &str, r: &ImageRecord) -> ImageView {
    ImageView {
        name: name.to_string(),
        bytes: r.bytes,
        format: Some(r.format.clone()),
        virtual_size: Some(r.virtual_size),
        sha256: Some(r.sha256.clone()),
        source: r.source.as_deref().map(crate::images::url::redact_text),
        imported_at: Some(r.imported_at.clone()),
        used_by: image_users(mgr, &mgr.lock(), name),
    }
}

/// `image.delete` (module doc).
///
/// # Errors
/// 2001 (a bad name), 4092 (VMs use it; `details.vms`), 4090 (another import or delete
/// of it), 4001 (the file cannot be removed).
pub(crate) async fn image_delete(mgr: &Manager, name: &str) -> Result<DeleteResult, ApiError> {
    if !crate::images::is_image_name(name) {
        return Err(ApiError::invalid("name", format!("{name:?} is not an image name")));
    }
    let held = mgr.images.begin(name)?;
    let _going = {
        let mut t = mgr.lock();
        let users = image_users(mgr, &t, name);
        if !users.is_empty() {
            return Err(ApiError::new(
                Code::ImageInUse,
                format!(
                    "image {name:?} is the base image, kernel or initrd of VMs {users:?}: destroy them (or \
                     change what they boot from) first"
                ),
            )
            .field("name")
            .details(json!({ "vms": users })));
        }
        t.images_going.insert(name.to_string());
        Going { mgr, name: name.to_string() }
    };
    let changed = mgr.images.remove(&held, name)?;
    if changed {
        tracing::info!(image = name, "image deleted");
    }
    Ok(DeleteResult { changed, name: name.to_string() })
}

/// What `host.check` says of the recorded images (`images` item); each check does its file
/// I/O off the runtime workers ([`crate::images::Store::verify`]).
pub(crate) fn image_check(mgr: &Manager) -> crate::api::CheckItem {
    use crate::api::CheckStatus;
    let records: BTreeMap<String, ImageRecord> = mgr.images.records();
    let mut bad = Vec::new();
    for name in records.keys() {
        match mgr.images.verify(name) {
            Some(crate::images::Verdict::Match) | None => {}
            Some(crate::images::Verdict::Mismatch { found }) => {
                bad.push(format!("{name}: sha256 {found}, recorded {}", records[name].sha256))
            }
            Some(crate::images::Verdict::Unreadable(e)) => bad.push(format!("{name}: cannot be read ({e})")),
        }
    }
    let (status, detail) = if bad.is_empty() {
        (CheckStatus::Ok, format!("{} recorded images match their sha256", records.len()))
    } else {
        (CheckStatus::Error, bad.join("; "))
    };
    crate::api::CheckItem { name: "images".into(), status, detail }
}

/// Whether a VM booting with `boot` uses image `name` of `images_dir`: as its base image
/// (`boot.image`), or as its kernel or initrd (`boot.kernel`, `boot.initrd` naming a file of
/// the images directory: the image store's files are boot files when `paths.boot` includes
/// it, as it does by default). Lexical, as the boot-directory rule is ([`crate::qemu::boot_files::boot_dir_of`]).
pub(super) fn boots_from(boot: &crate::api::BootSpec, images_dir: &std::path::Path, name: &str) -> bool {
    boot_field_using(boot, images_dir, name).is_some()
}

/// The first of `boot`'s fields ([`boots_from`]) that uses image `name`: `image`, `kernel` or
/// `initrd`.
fn boot_field_using(boot: &crate::api::BootSpec, images_dir: &std::path::Path, name: &str) -> Option<&'static str> {
    let in_dir = |p: &std::path::Path| {
        p.file_name().and_then(|f| f.to_str()) == Some(name) && p.parent().is_some_and(|d| d == images_dir)
    };
    if boot.image.as_deref() == Some(name) {
        Some("image")
    } else if boot.kernel.as_deref().is_some_and(in_dir) {
        Some("kernel")
    } else if boot.initrd.as_deref().is_some_and(in_dir) {
        Some("initrd")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::boots_from;
    use crate::api::BootSpec;
    use std::path::Path;

    #[test]
    fn an_image_is_used_as_a_base_image_kernel_or_initrd() {
        let dir = Path::new("/var/lib/vmhost/images");
        let image = BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(4), ..BootSpec::default() };
        assert!(boots_from(&image, dir, "base.qcow2"));
        assert!(!boots_from(&image, dir, "other.qcow2"));
        let kernel = |k: &str, i: Option<&str>| BootSpec {
            kernel: Some(k.into()),
            initrd: i.map(Into::into),
            ..BootSpec::default()
        };
        let k = kernel("/var/lib/vmhost/images/vmlinuz", Some("/var/lib/vmhost/images/initrd.img"));
        assert!(boots_from(&k, dir, "vmlinuz"));
        assert!(boots_from(&k, dir, "initrd.img"));
        assert!(!boots_from(&k, dir, "base.qcow2"));
        assert!(boots_from(&kernel("/var/lib/vmhost/images//vmlinuz", None), dir, "vmlinuz"), "however it is spelled");
        assert!(boots_from(&kernel("/boot/vmlinuz", Some("/var/lib/vmhost/images/initrd.img")), dir, "initrd.img"));
        assert!(!boots_from(&kernel("/boot/vmlinuz", None), dir, "vmlinuz"), "another directory's file");
        assert!(!boots_from(&kernel("/var/lib/vmhost/images/sub/vmlinuz", None), dir, "vmlinuz"), "not an image");
        assert!(!boots_from(&kernel("/var/lib/vmhost/images", None), Path::new("/var/lib/vmhost"), "vmlinuz"));
        assert!(boots_from(
            &kernel("/var/lib/vmhost/images/vmlinuz", None),
            Path::new("/var/lib/vmhost/images/"),
            "vmlinuz"
        ));
    }
}
