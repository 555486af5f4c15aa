//! Giving back what a VM holds on the host around its QEMU, written once.
//!
//! Every path that ends a VM's QEMU (stop, destroy, replace, an exit vmhostd did not ask for,
//! a launch that failed, recovery finishing a destroy) calls [`HeldVm::release_host_side`]
//! once no QEMU of the VM can run any more (killed, or seen gone), in this order:
//!
//! 1. the run dir with its sockets (a client of a dead QEMU's socket is refused, not queued);
//! 2. the taps (network owner, [`crate::net`]), then the mirrors into them ([`super::capture`]);
//! 3. the guest agent session;
//! 4. the placement ([`super::placement`]: a dedicated VM's CPUs go back to the shared pool);
//! 5. the passthrough devices back to their host drivers ([`super::vfio`]), last: it needs
//!    QEMU gone, and it is the only step that can fail.
//!
//! A launch that failed keeps the devices ([`Devices::Keep`]): it gives them back itself, only
//! once it knows no QEMU of the VM holds them.
//!
//! A teardown that ends the VM's disk too (destroy, replace, recovery finishing a destroy) then
//! calls [`HeldVm::remove_run_files`]; for a destroy or replace, both are steps of
//! `VmOp::teardown` ([`super::ops`]).
//!
//! They are methods of the held VM ([`super::held`]), not of an operation: the exit cleanup
//! ([`super::exits`]) and recovery ([`super::recover`]) run them without one, the unwind of a
//! failed operation ([`super::op::VmOp::fail`]) and `VmOp::teardown` within one, and one body
//! serves all. This file names no operation type: [`super::undo`] (which [`super::op`] uses)
//! takes [`Devices`] from here, so an `impl VmOp` here would close an import cycle (`layers`
//! test).

use super::errors::LaunchFileError;
use super::held::HeldVm;
use crate::api::ApiError;
use crate::qemu::argv::VmPaths;

/// Where an overlay is written before it is renamed into place.
pub(super) fn partial_overlay(paths: &VmPaths) -> std::path::PathBuf {
    paths.overlay.with_extension("qcow2.partial")
}

/// Whether [`HeldVm::release_host_side`] gives the passthrough devices back too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Devices {
    /// Back to their original drivers.
    Release,
    /// Left bound to vfio-pci (the caller decides).
    Keep,
}

impl HeldVm {
    /// Removes the VM's run dir (sockets, pid file). Errors are logged: nothing depends on it.
    /// A launch clears it before making it again; recovery, of a VM whose QEMU is gone.
    pub(super) fn clean_run_dir(&self) {
        let paths = self.paths();
        match crate::blocking::run(|| std::fs::remove_dir_all(&paths.run_dir)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(dir = %paths.run_dir.display(), error = %e, "cannot remove run dir"),
        }
    }

    /// Releases the VM's run dir, taps, agent session and (with [`Devices::Release`]) its
    /// passthrough devices, in that order. Call only once no QEMU of the VM runs.
    ///
    /// # Errors
    /// A device could not be given back to its driver (the record keeps it, for a retry).
    pub(super) async fn release_host_side(&self, devices: Devices) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        self.clean_run_dir();
        mgr.net.detach_nics(name).await;
        // Its mirrors go with its taps (a VM without monitor NICs has none to remove).
        let monitored = mgr.lock().vms.get(name).is_some_and(super::capture::has_monitors);
        if monitored {
            super::capture::sync_without(mgr, name).await;
        }
        mgr.agents.stop(name);
        // The VM's exec slots entry goes once no call holds a slot (a call still running ends
        // with the session QEMU's exit broke).
        mgr.exec_slots.forget(name);
        // Its CPUs (and hugepages) are free once no QEMU runs on them.
        self.release_placement();
        match devices {
            Devices::Release => self.release_passthrough().await,
            Devices::Keep => Ok(()),
        }
    }

    /// Removes the files the VM's QEMU ran on or wrote beside the record: the overlay (and
    /// a half-made one), a UEFI VM's variables store (and a half-made copy), the seed, the
    /// serial and QEMU logs. The disks the VM owns (root, data) stay: a destroy disposes of
    /// them next, a replace keeps them. The variables store goes with the overlay: its boot
    /// entries name the disk a replace discards, and a new VM of the name must not inherit
    /// them. The TPM's state ([`crate::tpm::remove_state`]) goes for the same reason. Call only
    /// once no QEMU (and so no swtpm) of the VM runs.
    ///
    /// # Errors
    /// 4001 when an overlay, the variables store or the TPM state cannot be removed (a seed or log that
    /// cannot is only logged).
    pub(super) fn remove_run_files(&self) -> Result<(), ApiError> {
        let (name, paths) = (self.name(), self.paths());
        // Copies an interrupted revert left beside the overlay.
        crate::blocking::run(|| crate::images::remove_leftovers_of(&paths.overlay));
        for overlay in [paths.overlay.clone(), partial_overlay(paths)] {
            crate::disk::remove_overlay(&overlay).map_err(crate::disk::OverlayError::Remove)?;
        }
        for vars in crate::qemu::firmware::store_files(&paths.uefi_vars(), &paths.partial_uefi_vars()) {
            match crate::blocking::run(|| std::fs::remove_file(&vars)) {
                Ok(()) => tracing::info!(vm = name, path = %vars.display(), "removed the UEFI variables store"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(LaunchFileError::RemoveVars { path: vars.clone(), source }.into()),
            }
        }
        // The TPM's state goes with the VM, like its variables store.
        crate::blocking::run(|| crate::tpm::remove_state(paths))?;
        for file in [&paths.seed, &paths.serial_log, &paths.qemu_log] {
            match crate::blocking::run(|| std::fs::remove_file(file)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(vm = name, file = %file.display(), error = %e, "cannot remove a file"),
            }
        }
        Ok(())
    }
}
