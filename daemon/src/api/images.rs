//! The image store's wire types (`image.import`, `image.list`, `image.delete`; docs/images.md).
//!
//! An image is a file in `paths.images` that VMs boot from (`boot.image`): each VM gets a
//! qcow2 overlay over it, so an image must never change while a VM uses it. The store records
//! the sha256 an image was imported with; images put there by hand have none and still work.

use serde::{Deserialize, Serialize};

/// Params of `image.import`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportParams {
    /// The image's file name in `paths.images` (what `boot.image` names).
    pub name: String,
    /// The sha256 the file must have, 64 hex digits.
    pub sha256: String,
    /// Where to copy it from: an `http://` or `https://` URL, or a file in `paths.import`
    /// (its name, or an absolute path beneath it). Absent: the file is in `paths.images`
    /// already (put there by hand) and is checked and recorded where it is.
    #[serde(default)]
    pub source: Option<String>,
    /// Longest a download may take, in seconds (default 3600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// Params of `image.delete`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageNameParams {
    /// The image's file name in `paths.images`.
    pub name: String,
}

/// One image, as `image.list` and `image.import` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageView {
    /// File name in `paths.images`.
    pub name: String,
    /// Size of the file in bytes.
    pub bytes: u64,
    /// Format as QEMU reads it (`qcow2`, `raw`, ...); `null` when QEMU could not read it.
    pub format: Option<String>,
    /// Size of the disk a guest sees, in bytes; `null` as `format`.
    pub virtual_size: Option<u64>,
    /// The sha256 it was imported with; `null` for a file put there by hand.
    pub sha256: Option<String>,
    /// Where it was imported from (`null` as `sha256`).
    pub source: Option<String>,
    /// When it was imported, RFC 3339 UTC (`null` as `sha256`).
    pub imported_at: Option<String>,
    /// The VMs whose boot disk is an overlay over it (spec or running spec), by name.
    pub used_by: Vec<String>,
}

/// Result of `image.import`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportResult {
    /// False when the image was there with this sha256 already.
    pub changed: bool,
    /// The image.
    pub image: ImageView,
}

/// Result of `image.delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteResult {
    /// False when there was no such image (and no record of one).
    pub changed: bool,
    /// The image's name.
    pub name: String,
}
