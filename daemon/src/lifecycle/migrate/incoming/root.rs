//! The root disk of a `boot.disk` VM received live: the source's disk has no counterpart here
//! (no base image, no file in the import directory), so the destination makes an empty one in
//! the place a create's import puts it, of the format and exact virtual size the source's
//! `Hello` gives, and the source mirrors all of it (`sync: full`) into it over NBD.
//!
//! [`make_root_disk`] runs once, after `Hello` and before QEMU is launched (the launch opens
//! the file the record names). The record names the disk before the file exists, so a crash
//! between the two leaves nothing the abandon does not find: `incoming::abandon` deletes it
//! (`HeldVm::dispose_root_disk`), since a received disk is never an import to give back.

use super::super::super::data_disks::admit_provision;
use super::super::super::op::VmOp;
use super::decide;
use super::errors::IncomingError;
use crate::api::{ApiError, DiskFormat, VmSpec};
use crate::disk::offline_qemu::{Input, Session};
use crate::disk::space::Provision;
use crate::migration::Hello;
use std::fs::OpenOptions;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Makes the empty root disk of a `boot.disk` VM whose source says `hello` (nothing for
/// another boot source): disk space admitted for its whole virtual size (the mirror may fill
/// it), recorded, then made. A file already at its place is refused, never replaced: the
/// create's orphan sweep ran before, so one there is not this VM's.
///
/// # Errors
/// 2001 on `spec` for a `Hello` without a qcow2 or raw root disk; 3002 when it does not fit
/// the state file system; 4001 step `migrate_in` when the record cannot be written or the file
/// cannot be made.
pub(super) async fn make_root_disk(op: &VmOp, spec: &VmSpec, hello: &Hello) -> Result<(), ApiError> {
    let mgr = op.mgr();
    let Some(root) = decide::root_disk_to_make(&spec.boot, &hello.disks, &mgr.config.paths.import_dir())? else {
        return Ok(());
    };
    admit_provision(mgr, Provision { bytes: root.imported_bytes, preallocated: 0, data_disks: false })?;
    let (format, bytes) = (root.format, root.imported_bytes);
    op.update("the root disk to receive", |r| r.root_disk = Some(root))?;
    let paths = op.paths();
    let dir = paths.disk_dir.clone();
    crate::blocking::run(|| crate::state::dirs::private_dir(&dir))
        .map_err(|source| IncomingError::Io { what: "making the VM's disk directory", source })?;
    let target = paths.root_disk(format);
    create_empty(&mgr.disk_tool(), &target, format, bytes).await?;
    tracing::info!(path = %target.display(), format = format.as_str(), bytes, "made the root disk the source mirrors into");
    Ok(())
}

/// Makes `path` (which must not exist) an empty disk of `format` and `bytes` virtual size,
/// 0600: a raw file of that length (sparse), or a qcow2 header written by QEMU as `qemu.user`
/// on a descriptor (as a data disk is made); removed again when that fails.
async fn create_empty(tool: &crate::disk::Tool, path: &Path, format: DiskFormat, bytes: u64) -> Result<(), ApiError> {
    let io = |source| IncomingError::Io { what: "making the root disk", source };
    let file =
        crate::blocking::run(|| OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path))
            .map_err(io)?;
    let made = match format {
        DiskFormat::Raw => file.set_len(bytes).map_err(|e| io(e).into()),
        DiskFormat::Qcow2 => crate::disk::bounded("create", async {
            let mut session = Session::start(tool, vec![Input::Image(OwnedFd::from(file))], "create").await?;
            session.create_qcow2(0, bytes, None, false).await?;
            session.finish().await
        })
        .await
        .map_err(|e| super::super::super::provisioning("migrate_in", format!("making the root disk: {e}"))),
    };
    if made.is_err() {
        let _ = crate::blocking::run(|| std::fs::remove_file(path));
    }
    made
}
