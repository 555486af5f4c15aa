//! The destination's decisions that need no host: which specs `vm.migrate_in` refuses before
//! anything is made ([`refuse_unmovable`]), whether a source's `Hello` matches what was
//! admitted ([`check_hello`], [`check_uefi_vars`]), which root disk a `boot.disk` VM gets here ([`root_disk_to_make`]),
//! what a `Query` is answered from a record ([`outcome_of`]), and what a restart does with an
//! incoming record ([`recover_action`]). Kept apart from the steps that act on them so each
//! rule is unit-tested on its own.
//!
//! Order of use: [`refuse_unmovable`] first in `vm.migrate_in`; [`check_hello`],
//! [`check_uefi_vars`] and [`root_disk_to_make`] when the source's first message arrives; [`outcome_of`] whenever the
//! listener answers a `Query`; [`recover_action`] once per incoming record at daemon start.

use super::errors::IncomingError;
use crate::api::migration::MoveMode;
use crate::api::{BootSpec, DesiredState, DiskFormat, NicMode, VmSpec, VmStatus};
use crate::migration::{Hello, HelloDisk, Outcome};
use crate::state::migration::{MigrationPhase, MigrationRecord, MigrationRole};
use crate::state::RootDisk;
use std::path::Path;

/// Refuses a spec this host cannot receive in `mode` (nothing is made yet): a live migration
/// cannot carry passthrough devices (their state is in the hardware) and needs every bridge
/// NIC's MAC (the guest keeps its interfaces). A `boot.disk` VM moves live: its root disk is
/// made here empty at the source's size once `Hello` says it ([`root_disk_to_make`]) and
/// mirrored whole.
///
/// # Errors
/// [`IncomingError::Passthrough`], [`IncomingError::MacRequired`].
pub(crate) fn refuse_unmovable(spec: &VmSpec, mode: MoveMode) -> Result<(), IncomingError> {
    if mode == MoveMode::Cold {
        // A cold move carries files, not a running guest: nothing here limits it.
        return Ok(());
    }
    if !spec.hardware.is_empty() || !spec.pci.is_empty() {
        return Err(IncomingError::Passthrough);
    }
    if let Some(i) = spec.nics.iter().position(|n| n.mode == NicMode::Bridge && n.mac.is_none()) {
        return Err(IncomingError::MacRequired { index: i });
    }
    Ok(())
}

/// The spec as a destination admits it: the guest runs here once committed, so its desired
/// state is running whatever the source's spec said.
pub(crate) fn admitted_spec(spec: &VmSpec, mode: MoveMode) -> VmSpec {
    let mut spec = spec.clone();
    if mode == MoveMode::Live {
        spec.state = DesiredState::Running;
    }
    spec
}

/// Checks the source's `Hello` against the admitted spec and its NIC MACs (`macs`, in spec
/// order): the QEMU started here must be the source's twin, or the memory stream would be
/// loaded into a different machine. `state` is ignored (a desired state, not hardware). The
/// disk list must be the one QEMU's side mirrors for this spec (`devices`, in order).
///
/// # Errors
/// [`IncomingError::HelloMismatch`] naming what differs.
pub(crate) fn check_hello(
    admitted: &VmSpec,
    macs: &[String],
    devices: &[String],
    hello: &Hello,
) -> Result<(), IncomingError> {
    // The MACs are compared below, from what each side allocated: the source's own spec may
    // leave them to allocation, while the one admitted here names them.
    let without_macs = |spec: &VmSpec| {
        let mut spec = spec.clone();
        spec.state = admitted.state;
        for nic in &mut spec.nics {
            nic.mac = None;
        }
        spec
    };
    if without_macs(&hello.spec) != without_macs(admitted) {
        return Err(IncomingError::HelloMismatch("the source runs another spec than the one admitted here".into()));
    }
    let lower = |v: &[String]| v.iter().map(|m| m.to_ascii_lowercase()).collect::<Vec<_>>();
    if hello.macs.len() != admitted.nics.len() {
        return Err(IncomingError::HelloMismatch(format!(
            "the source names {} NIC MACs for {} NICs",
            hello.macs.len(),
            admitted.nics.len()
        )));
    }
    // Bridge NICs were admitted with the source's MAC; a monitor NIC's may differ here and is
    // taken from the source (the guest keeps the MAC it saw).
    for (i, (nic, (ours, theirs))) in admitted.nics.iter().zip(lower(macs).iter().zip(lower(&hello.macs))).enumerate() {
        if nic.mode == NicMode::Bridge && *ours != theirs {
            return Err(IncomingError::HelloMismatch(format!(
                "NIC {i}: the source's MAC is {theirs}, the spec admitted here says {ours}"
            )));
        }
    }
    let theirs: Vec<&str> = hello.disks.iter().map(|d| d.device.as_str()).collect();
    let ours: Vec<&str> = devices.iter().map(String::as_str).collect();
    if theirs != ours {
        return Err(IncomingError::HelloMismatch(format!(
            "the source sends disks {theirs:?}, this side expects {ours:?}"
        )));
    }
    // A data disk is made here at the spec's size; QEMU mirrors only into one of the same size,
    // so a difference is refused now rather than when the mirror starts.
    for disk in &admitted.disks {
        let device = crate::qemu::hotplug::data_drive(&disk.name);
        let Some(sent) = hello.disks.iter().find(|d| d.device == device) else { continue };
        let made = disk.size_gib << 30;
        if sent.bytes != made {
            return Err(IncomingError::HelloMismatch(format!(
                "data disk {:?}: the source's is {} bytes, the spec's size here is {made}",
                disk.name, sent.bytes
            )));
        }
    }
    Ok(())
}

/// A UEFI VM's variables store is mirrored into one this host copies from its own template
/// (`[firmware] uefi_vars`, `template_bytes` long). QEMU mirrors only into a store of the same
/// size, and another size means another OVMF build, whose code would not read the source's
/// variables after the next restart: refused at `Hello`, before anything is made, rather than
/// when the mirror starts.
///
/// # Errors
/// [`IncomingError::HelloMismatch`] naming both sizes.
pub(crate) fn check_uefi_vars(hello: &Hello, template_bytes: u64) -> Result<(), IncomingError> {
    let node = crate::qemu::argv::UEFI_VARS_NODE;
    match hello.disks.iter().find(|d| d.device == node) {
        Some(sent) if sent.bytes != template_bytes => Err(IncomingError::HelloMismatch(format!(
            "the source's UEFI variables store is {} bytes, this host's template {template_bytes}: \
             the hosts' OVMF builds differ",
            sent.bytes
        ))),
        _ => Ok(()),
    }
}

/// The root disk a live migration of a `boot.disk` VM makes here (`None` for another boot
/// source): where a create would have moved the import to (`STATE/disks/NAME/root.FORMAT`), of
/// the format and exact virtual size the source's QEMU gave in `Hello` (a mirror copies only
/// into a disk of the same size). Nothing is read from the import directory: `boot.disk` names
/// the file the VM was imported from on its first host, and `source` only records where a
/// create here would have taken it from. The disk is this host's from the start (not an
/// import in progress): an abandon deletes it, never moves it to the import directory.
/// `imported_bytes` is the size it arrives with, below which a later `disk_gib` may not go.
///
/// # Errors
/// [`IncomingError::HelloMismatch`] when `Hello` sends no boot disk or one neither qcow2 nor
/// raw.
pub(crate) fn root_disk_to_make(
    boot: &BootSpec,
    disks: &[HelloDisk],
    import_dir: &Path,
) -> Result<Option<RootDisk>, IncomingError> {
    let Some(file) = boot.disk.as_ref() else { return Ok(None) };
    let device = crate::qemu::argv::DISK_DRIVE;
    let sent = disks
        .iter()
        .find(|d| d.device == device)
        .ok_or_else(|| IncomingError::HelloMismatch(format!("the source sends no root disk ({device})")))?;
    let format = match sent.format.as_str() {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        other => {
            return Err(IncomingError::HelloMismatch(format!(
                "the source's root disk is {other:?}: only qcow2 and raw root disks are received"
            )))
        }
    };
    if sent.bytes == 0 {
        return Err(IncomingError::HelloMismatch("the source's root disk has no size".into()));
    }
    Ok(Some(RootDisk { format, imported_bytes: sent.bytes, source: import_dir.join(file), source_mode: 0o600 }))
}

/// What a `Query` for a VM is answered from its record: `None` when the record is not the
/// receiving side of a migration. A committed one is the guest's home now; one being given up
/// (`failed` or `destroying` before the commit) can never commit any more, since the commit
/// is only ever written from `incoming`.
pub(crate) fn outcome_of(status: VmStatus, migration: Option<&MigrationRecord>) -> Option<Outcome> {
    let m = migration.filter(|m| m.role == MigrationRole::Incoming)?;
    Some(match (m.phase, status) {
        (MigrationPhase::Committed, _) => Outcome::Committed,
        (_, VmStatus::Failed | VmStatus::Destroying) => Outcome::Abandoned,
        _ => Outcome::Pending,
    })
}

/// What a restart does with an incoming record ([`recover_action`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecoverAction {
    /// Before the commit: the source cannot have let go of its guest; everything made here
    /// goes (QEMU killed if found), a tombstone stays for the source's `Query`.
    Abandon,
    /// Committed, QEMU found paused (the crash fell between the commit and `cont`): resume it,
    /// then recover it as any running VM.
    ResumeThenOrdinary,
    /// Nothing migration-specific left: recover it as any VM (a committed VM that runs, or
    /// whose QEMU is gone, or that the operator changed since).
    Ordinary,
}

/// The QEMU a restart found for a VM: none, or one whose QMP status is `status` (`None` when
/// QMP did not answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QemuSeen {
    /// No QEMU of the VM runs.
    Gone,
    /// One runs, in this QMP status.
    Running(Option<String>),
}

/// The restart's decision for a record whose `migration` is an incoming one or whose status is
/// `incoming` (pure: the record's status and migration, what runs).
pub(crate) fn recover_action(status: VmStatus, migration: Option<&MigrationRecord>, qemu: &QemuSeen) -> RecoverAction {
    let committed = migration.is_some_and(|m| m.phase == MigrationPhase::Committed);
    if !committed {
        return match status {
            // Still receiving, or being given up when the daemon stopped: finish giving it up.
            VmStatus::Incoming | VmStatus::Destroying | VmStatus::Failed | VmStatus::Creating => RecoverAction::Abandon,
            _ => RecoverAction::Ordinary,
        };
    }
    match (status, qemu) {
        (VmStatus::Running, QemuSeen::Running(Some(s))) if s == "paused" || s == "prelaunch" => {
            RecoverAction::ResumeThenOrdinary
        }
        _ => RecoverAction::Ordinary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NicSpec;
    use crate::migration::HelloDisk;

    fn spec() -> VmSpec {
        let mut s = crate::validate::tests::spec("vm-1");
        s.nics = vec![NicSpec { network: "lan".into(), mac: Some("52:54:00:00:00:01".into()), ..Default::default() }];
        s
    }

    fn record(phase: MigrationPhase, role: MigrationRole) -> MigrationRecord {
        MigrationRecord {
            role,
            mode: MoveMode::Live,
            peer: String::new(),
            secret: "00".repeat(32),
            phase,
            since: "2026-12-06T00:00:00Z".into(),
            stopped: false,
        }
    }

    fn hello(spec: &VmSpec) -> Hello {
        Hello {
            spec: spec.clone(),
            instance_id: Some("i-1".into()),
            macs: vec!["52:54:00:00:00:01".into()],
            disks: vec![HelloDisk { device: "virtio0".into(), bytes: 1 << 30, format: "qcow2".into() }],
            machine: None,
        }
    }

    #[test]
    fn live_passthrough_is_not_movable_but_cold_is() {
        let mut s = spec();
        s.pci = vec!["0000:00:05.0".into()];
        assert!(matches!(refuse_unmovable(&s, MoveMode::Live), Err(IncomingError::Passthrough)));
        assert!(refuse_unmovable(&s, MoveMode::Cold).is_ok());
        let mut s = spec();
        s.hardware.copper = vec![0];
        assert!(matches!(refuse_unmovable(&s, MoveMode::Live), Err(IncomingError::Passthrough)));
    }

    #[test]
    fn a_bridge_nic_without_mac_is_refused_naming_it() {
        let mut s = spec();
        s.nics.push(NicSpec { network: "lan".into(), ..Default::default() });
        match refuse_unmovable(&s, MoveMode::Live) {
            Err(e @ IncomingError::MacRequired { index: 1 }) => {
                let api: crate::api::ApiError = e.into();
                assert_eq!(api.field.as_deref(), Some("spec.nics[1].mac"));
                assert_eq!(api.code, crate::api::Code::InvalidSpec);
            }
            other => panic!("{other:?}"),
        }
        assert!(refuse_unmovable(&spec(), MoveMode::Live).is_ok());
    }

    #[test]
    fn a_boot_disk_vm_is_received_live() {
        let mut s = spec();
        s.boot = BootSpec { disk: Some("root.qcow2".into()), ..Default::default() };
        assert!(refuse_unmovable(&s, MoveMode::Live).is_ok());
    }

    #[test]
    fn a_uefi_store_of_another_size_is_refused() {
        let mut h = hello(&spec());
        h.disks.push(HelloDisk { device: "uefi-vars".into(), bytes: 540_672, format: "raw".into() });
        assert!(check_uefi_vars(&h, 540_672).is_ok());
        // OVMF's 2 MiB build's store beside the 4 MiB one's.
        assert!(matches!(check_uefi_vars(&h, 131_072), Err(IncomingError::HelloMismatch(m)) if m.contains("131072")));
        // A BIOS VM sends none.
        assert!(check_uefi_vars(&hello(&spec()), 131_072).is_ok());
    }

    #[test]
    fn a_boot_disk_vm_gets_a_root_disk_of_the_sources_format_and_size() {
        let boot = BootSpec { disk: Some("old.img".into()), ..Default::default() };
        let sent = |format: &str, bytes| {
            vec![
                HelloDisk { device: "virtio0".into(), bytes, format: format.into() },
                HelloDisk { device: "data-x".into(), bytes: 1 << 30, format: "qcow2".into() },
            ]
        };
        let imp = Path::new("/var/lib/vmhost/import");
        // Not a GiB multiple: an imported disk keeps any size, and the mirror needs it exact.
        let root = root_disk_to_make(&boot, &sent("raw", 1_000_000_512), imp).unwrap().unwrap();
        assert_eq!((root.format, root.imported_bytes), (DiskFormat::Raw, 1_000_000_512));
        assert_eq!(root.source, imp.join("old.img"));
        let root = root_disk_to_make(&boot, &sent("qcow2", 4 << 30), imp).unwrap().unwrap();
        assert_eq!(root.format, DiskFormat::Qcow2);
        assert!(matches!(root_disk_to_make(&boot, &sent("vmdk", 1 << 30), imp), Err(IncomingError::HelloMismatch(_))));
        assert!(matches!(root_disk_to_make(&boot, &sent("raw", 0), imp), Err(IncomingError::HelloMismatch(_))));
        assert!(matches!(
            root_disk_to_make(&boot, &sent("raw", 1 << 30)[1..], imp),
            Err(IncomingError::HelloMismatch(_))
        ));
        // An image or kernel VM makes no root disk.
        let image = BootSpec { image: Some("deb.qcow2".into()), ..Default::default() };
        assert!(root_disk_to_make(&image, &sent("qcow2", 1 << 30), imp).unwrap().is_none());
    }

    #[test]
    fn refusals_are_4097_with_their_reason() {
        let api: crate::api::ApiError = IncomingError::Passthrough.into();
        assert_eq!((api.code, api.details["reason"].as_str()), (crate::api::Code::NotMovable, Some("passthrough")));
    }

    #[test]
    fn hello_must_match_but_not_its_state() {
        let admitted = admitted_spec(&spec(), MoveMode::Live);
        let macs = vec!["52:54:00:00:00:01".to_string()];
        let devices = vec!["virtio0".to_string()];
        let mut h = hello(&spec());
        h.spec.state = DesiredState::Stopped;
        assert!(check_hello(&admitted, &macs, &devices, &h).is_ok());
        // The source's spec left its MAC to allocation; the admitted one names it.
        let mut h = hello(&spec());
        h.spec.nics[0].mac = None;
        assert!(check_hello(&admitted, &macs, &devices, &h).is_ok());
        let mut h = hello(&spec());
        h.spec.memory_mib += 1;
        assert!(check_hello(&admitted, &macs, &devices, &h).is_err());
        let mut h = hello(&spec());
        h.macs = vec!["52:54:00:00:00:02".into()];
        assert!(check_hello(&admitted, &macs, &devices, &h).is_err());
        let mut h = hello(&spec());
        h.macs.clear();
        assert!(check_hello(&admitted, &macs, &devices, &h).is_err());
        let mut h = hello(&spec());
        h.disks.push(HelloDisk { device: "data-x".into(), bytes: 1, format: "raw".into() });
        assert!(check_hello(&admitted, &macs, &devices, &h).is_err());
    }

    #[test]
    fn a_data_disk_of_another_size_is_refused() {
        let mut s = spec();
        s.disks = vec![serde_json::from_value(serde_json::json!({ "name": "x", "size_gib": 2 })).unwrap()];
        let admitted = admitted_spec(&s, MoveMode::Live);
        let macs = vec!["52:54:00:00:00:01".to_string()];
        let devices = vec!["virtio0".to_string(), "data-x".to_string()];
        let mut h = hello(&s);
        h.disks.push(HelloDisk { device: "data-x".into(), bytes: 2 << 30, format: "raw".into() });
        assert!(check_hello(&admitted, &macs, &devices, &h).is_ok());
        h.disks[1].bytes = 3 << 30;
        assert!(check_hello(&admitted, &macs, &devices, &h).is_err());
    }

    #[test]
    fn a_monitor_nic_takes_the_sources_mac() {
        let mut s = spec();
        s.nics.push(NicSpec { mode: NicMode::Monitor, source: Some("eth1".into()), ..Default::default() });
        let admitted = admitted_spec(&s, MoveMode::Live);
        let mut h = hello(&s);
        h.macs.push("52:54:00:aa:bb:cc".into());
        let ours = vec!["52:54:00:00:00:01".to_string(), "52:54:00:11:22:33".to_string()];
        assert!(check_hello(&admitted, &ours, &["virtio0".to_string()], &h).is_ok());
    }

    #[test]
    fn outcomes_from_records() {
        let incoming = |p| Some(record(p, MigrationRole::Incoming));
        assert_eq!(outcome_of(VmStatus::Incoming, incoming(MigrationPhase::Sending).as_ref()), Some(Outcome::Pending));
        assert_eq!(
            outcome_of(VmStatus::Running, incoming(MigrationPhase::Committed).as_ref()),
            Some(Outcome::Committed)
        );
        // Stopped later by the operator: still committed here.
        assert_eq!(
            outcome_of(VmStatus::Stopped, incoming(MigrationPhase::Committed).as_ref()),
            Some(Outcome::Committed)
        );
        assert_eq!(
            outcome_of(VmStatus::Destroying, incoming(MigrationPhase::Sending).as_ref()),
            Some(Outcome::Abandoned)
        );
        assert_eq!(outcome_of(VmStatus::Failed, incoming(MigrationPhase::Sending).as_ref()), Some(Outcome::Abandoned));
        let outgoing = record(MigrationPhase::Committed, MigrationRole::Outgoing);
        assert_eq!(outcome_of(VmStatus::Migrating, Some(&outgoing)), None);
        assert_eq!(outcome_of(VmStatus::Running, None), None);
    }

    #[test]
    fn recovery_abandons_everything_before_the_commit() {
        let sending = record(MigrationPhase::Sending, MigrationRole::Incoming);
        for status in [VmStatus::Incoming, VmStatus::Destroying, VmStatus::Failed] {
            for qemu in [QemuSeen::Gone, QemuSeen::Running(Some("inmigrate".into())), QemuSeen::Running(None)] {
                assert_eq!(recover_action(status, Some(&sending), &qemu), RecoverAction::Abandon, "{status} {qemu:?}");
            }
        }
        // `incoming` without a migration (a record hand-edited or from a crash mid-write).
        assert_eq!(recover_action(VmStatus::Incoming, None, &QemuSeen::Gone), RecoverAction::Abandon);
    }

    #[test]
    fn recovery_resumes_a_committed_guest_left_paused() {
        let committed = record(MigrationPhase::Committed, MigrationRole::Incoming);
        let c = Some(&committed);
        assert_eq!(
            recover_action(VmStatus::Running, c, &QemuSeen::Running(Some("paused".into()))),
            RecoverAction::ResumeThenOrdinary
        );
        assert_eq!(
            recover_action(VmStatus::Running, c, &QemuSeen::Running(Some("running".into()))),
            RecoverAction::Ordinary
        );
        assert_eq!(recover_action(VmStatus::Running, c, &QemuSeen::Running(None)), RecoverAction::Ordinary);
        // QEMU gone after the commit: the guest was here; recovery records it dead as any VM.
        assert_eq!(recover_action(VmStatus::Running, c, &QemuSeen::Gone), RecoverAction::Ordinary);
        // Later operations on a committed VM are ordinary.
        assert_eq!(recover_action(VmStatus::Stopped, c, &QemuSeen::Gone), RecoverAction::Ordinary);
        assert_eq!(recover_action(VmStatus::Destroying, c, &QemuSeen::Gone), RecoverAction::Ordinary);
    }
}
