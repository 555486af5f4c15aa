//! Moving PCI functions to vfio-pci for a VM and giving them back to their host drivers.
//!
//! A device handed to QEMU must be bound to vfio-pci; when the VM is gone it must go back to the
//! driver it had, even if vmhostd crashed in between. So the lifecycle uses this module in this
//! order:
//!
//! 1. [`plan_bindings`] reads each device's current driver into a [`Binding`]; the caller
//!    persists these in the VM record *before* step 2, so a crash at any later point leaves a
//!    record of what to restore;
//! 2. [`bind_vfio`] binds each device: write `vfio-pci` to its `driver_override`, unbind it from
//!    its current driver, write its address to `bus/pci/drivers_probe`, and wait (bounded,
//!    polling every [`POLL_INTERVAL`]) until its `driver` link names vfio-pci. The override goes
//!    first (as libvirt does): from then on no reprobe can hand the device back to a host driver.
//!    If any step fails, every device already changed is released again before the error returns;
//! 3. [`release`] (on stop, on destroy, and at start-up for records whose VM is gone) unbinds
//!    each device from vfio-pci, clears `driver_override`, writes the address to the original
//!    driver's `bind` file (falling back to `bus/pci/drivers_probe` if the driver refuses it
//!    there), then waits until the original driver holds it again; a device that had no driver is
//!    left driverless. It carries on past failures and reports them all, and releasing a released
//!    device changes nothing.
//!
//! A device found already on vfio-pci (`original_driver` is vfio-pci) is left there by both:
//! vmhostd gives back exactly what it took.
//!
//! Both call a hook after each device, so a caller can act between two devices (the lifecycle's
//! test crash points) without this module knowing why.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::check::Assignment;
use super::{Pci, PciError, VFIO_PCI};
use crate::hardware::PciAddress;

/// A sensible bound on each wait for a driver to take a device. `drivers_probe` and `bind` probe
/// synchronously, so a successful bind is normally visible at the first look; the bound is what a
/// failed one costs.
pub const BIND_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a wait looks at the `driver` link.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// A device vmhostd moves to vfio-pci, and the driver to give it back to. Persisted in the VM
/// record (the address as `"0000:c7:00.0"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The device.
    #[serde(with = "address_text")]
    pub address: PciAddress,
    /// The driver it had before binding; `None` when it had none.
    pub original_driver: Option<String>,
    /// Its IOMMU group's node (`/dev/vfio/GROUP`) before it was handed to QEMU's group:
    /// recorded before the change, put back on release ([`crate::sandbox::spawn::vfio_node`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_before: Option<crate::sandbox::spawn::NodeAccess>,
}

/// Serde for [`PciAddress`] as its canonical text.
mod address_text {
    use super::PciAddress;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(a: &PciAddress, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(a)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PciAddress, D::Error> {
        let text = String::deserialize(d)?;
        PciAddress::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// One step of binding or releasing a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Reading the current driver or `driver_override`.
    Read,
    /// Writing `vfio-pci` to `driver_override`.
    SetOverride,
    /// Unbinding from the current driver.
    Unbind,
    /// Writing the address to `bus/pci/drivers_probe`.
    Probe,
    /// Waiting for vfio-pci to hold the device.
    WaitBound,
    /// Clearing `driver_override`.
    ClearOverride,
    /// Reprobing for the original driver.
    Reprobe,
    /// Waiting for the original driver to hold the device again.
    WaitRestored,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Read => "reading its driver state",
            Step::SetOverride => "writing vfio-pci to driver_override",
            Step::Unbind => "unbinding it from its driver",
            Step::Probe => "writing it to drivers_probe",
            Step::WaitBound => "waiting for vfio-pci to bind it",
            Step::ClearOverride => "clearing driver_override",
            Step::Reprobe => "reprobing it for its original driver",
            Step::WaitRestored => "waiting for its original driver to bind it",
        })
    }
}

/// What failed on one device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{address}: {step}: {reason}")]
pub struct StepFailure {
    /// The device.
    pub address: PciAddress,
    /// The step that failed.
    pub step: Step,
    /// Why (the kernel's error, or what the device's driver was instead).
    pub reason: String,
}

impl StepFailure {
    fn new(address: PciAddress, step: Step, reason: impl fmt::Display) -> StepFailure {
        StepFailure { address, step, reason: reason.to_string() }
    }
}

/// Lists failures for a message.
fn join(failures: &[StepFailure]) -> String {
    failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// What the restore after a failed bind achieved, for the message.
fn restore_summary(restored: &[PciAddress], failures: &[StepFailure]) -> String {
    let list = |v: &[PciAddress]| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    match (restored.is_empty(), failures.is_empty()) {
        (true, true) => "nothing had been changed".to_string(),
        (false, true) => format!("restored {}", list(restored)),
        (_, false) => {
            let ok = if restored.is_empty() { String::new() } else { format!("restored {}; ", list(restored)) };
            format!("{ok}restoring failed: {}", join(failures))
        }
    }
}

/// What can go wrong binding or releasing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// vfio-pci is not registered (call [`super::load_vfio_pci`] first); nothing was changed.
    #[error("the vfio-pci driver is not loaded (no /sys/bus/pci/drivers/vfio-pci); nothing was changed")]
    NoVfioPci,
    /// Binding failed at `failure`; the devices already changed were released again.
    #[error("binding {} to vfio-pci failed while {}: {}; {}",
        .failure.address, .failure.step, .failure.reason, restore_summary(.restored, .restore_failures))]
    Bind {
        /// The step that failed.
        failure: StepFailure,
        /// Devices given back to their original state.
        restored: Vec<PciAddress>,
        /// Devices that could not be given back (the VM record still lists them; release again).
        restore_failures: Vec<StepFailure>,
    },
    /// Releasing failed for these devices (the others were released).
    #[error("releasing PCI devices failed: {}", join(.failures))]
    Release {
        /// One failure per device that was not restored.
        failures: Vec<StepFailure>,
    },
}

/// `/dev/vfio/N`, the device node QEMU opens for IOMMU group `group`.
pub fn vfio_group_dev(group: u32) -> PathBuf {
    PathBuf::from(format!("/dev/vfio/{group}"))
}

/// The bindings for `assignment`: each device to bind with its current driver. Persist them
/// before calling [`bind_vfio`].
///
/// # Errors
/// [`PciError::Io`] when a `driver` link cannot be read.
pub fn plan_bindings(pci: &Pci, assignment: &Assignment) -> Result<Vec<Binding>, PciError> {
    assignment
        .to_bind
        .iter()
        .map(|&address| Ok(Binding { address, original_driver: pci.driver(address)?, node_before: None }))
        .collect()
}

/// `bus/pci/devices/BDF/ATTR`.
fn attr(address: PciAddress, name: &str) -> PathBuf {
    PathBuf::from(format!("bus/pci/devices/{address}/{name}"))
}

/// One sysfs write as a step.
fn write(pci: &Pci, address: PciAddress, step: Step, rel: &Path, data: &str) -> Result<(), StepFailure> {
    pci.io().write(rel, data).map_err(|e| StepFailure::new(address, step, format!("{}: {e}", rel.display())))
}

/// A driver for messages.
fn describe(driver: Option<&str>) -> String {
    match driver {
        Some(d) => format!("bound to {d}"),
        None => "without a driver".to_string(),
    }
}

/// Polls the `driver` link every [`POLL_INTERVAL`] until it names `want`, up to `timeout`.
/// Gives up at once if another driver takes the device. The error says what was seen last.
fn wait_for(pci: &Pci, address: PciAddress, want: &str, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match pci.driver(address) {
            Ok(Some(d)) if d == want => return Ok(()),
            Ok(Some(other)) => return Err(format!("{} instead of {want}", describe(Some(&other)))),
            Ok(None) => describe(None),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(format!("still {seen} after {timeout:?}"));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Binds each device to vfio-pci (see the module documentation), each wait bounded by
/// `timeout`. Devices already on vfio-pci are left as they are.
///
/// Calls `after_each` once per binding, in order, as soon as that device is on vfio-pci (also
/// when it was there already) and before the next one is touched. It is not called for a device
/// that fails, nor while a failed bind restores the others. The hook is where the lifecycle puts
/// its test crash points between two devices, without this module knowing about crash points.
///
/// # Errors
/// [`BindError::NoVfioPci`] before touching anything; [`BindError::Bind`] naming the device and
/// step that failed, after releasing every device already changed (with what that achieved).
pub fn bind_vfio(
    pci: &Pci,
    bindings: &[Binding],
    timeout: Duration,
    mut after_each: impl FnMut(&Binding),
) -> Result<(), BindError> {
    if !pci.vfio_pci_present() {
        return Err(BindError::NoVfioPci);
    }
    let mut touched: Vec<&Binding> = Vec::new();
    for b in bindings {
        if let Err(failure) = bind_one(pci, b, timeout, &mut touched) {
            let mut restored = Vec::new();
            let mut restore_failures = Vec::new();
            for t in touched.iter().rev() {
                match release_one(pci, t, timeout) {
                    Ok(()) => restored.push(t.address),
                    Err(f) => restore_failures.push(f),
                }
            }
            tracing::warn!(%failure, "binding to vfio-pci failed; restored what was changed");
            return Err(BindError::Bind { failure, restored, restore_failures });
        }
        after_each(b);
    }
    Ok(())
}

/// Binds one device; records it in `touched` before its first write.
fn bind_one<'a>(
    pci: &Pci,
    b: &'a Binding,
    timeout: Duration,
    touched: &mut Vec<&'a Binding>,
) -> Result<(), StepFailure> {
    let a = b.address;
    let current = pci.driver(a).map_err(|e| StepFailure::new(a, Step::Read, e))?;
    if current.as_deref() == Some(VFIO_PCI) {
        return Ok(());
    }
    touched.push(b);
    write(pci, a, Step::SetOverride, &attr(a, "driver_override"), VFIO_PCI)?;
    if current.is_some() {
        write(pci, a, Step::Unbind, &attr(a, "driver/unbind"), &a.to_string())?;
    }
    write(pci, a, Step::Probe, Path::new("bus/pci/drivers_probe"), &a.to_string())?;
    wait_for(pci, a, VFIO_PCI, timeout).map_err(|reason| StepFailure::new(a, Step::WaitBound, reason))
}

/// Gives each device back to its original driver (see the module documentation), each wait
/// bounded by `timeout`. Carries on past failures.
///
/// Calls `after_each` once per binding, in order, as soon as that device is back in its original
/// state (also when it needed nothing) and before the next one is touched. It is not called for a
/// device that could not be restored.
///
/// # Errors
/// [`BindError::Release`] listing every device that could not be restored, with the step.
pub fn release(
    pci: &Pci,
    bindings: &[Binding],
    timeout: Duration,
    mut after_each: impl FnMut(&Binding),
) -> Result<(), BindError> {
    let mut failures = Vec::new();
    for b in bindings {
        match release_one(pci, b, timeout) {
            Ok(()) => after_each(b),
            Err(f) => failures.push(f),
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(BindError::Release { failures })
    }
}

/// Releases one device; stops at its first failing step.
fn release_one(pci: &Pci, b: &Binding, timeout: Duration) -> Result<(), StepFailure> {
    let a = b.address;
    let original = b.original_driver.as_deref();
    if original == Some(VFIO_PCI) {
        return Ok(());
    }
    if !pci.exists(a) {
        // Hot-removed: there is nothing left to give back.
        tracing::warn!(address = %a, "PCI device to release is gone");
        return Ok(());
    }
    let read = |e: PciError| StepFailure::new(a, Step::Read, e);
    match pci.driver(a).map_err(read)? {
        Some(d) if d == VFIO_PCI => write(pci, a, Step::Unbind, &attr(a, "driver/unbind"), &a.to_string())?,
        Some(d) if Some(d.as_str()) == original => {}
        Some(d) => {
            return Err(StepFailure::new(
                a,
                Step::Unbind,
                format!("bound to {d}, which is neither vfio-pci nor its original driver; left alone"),
            ));
        }
        None => {}
    }
    if pci.driver_override(a).map_err(read)?.is_some() {
        write(pci, a, Step::ClearOverride, &attr(a, "driver_override"), "\n")?;
    }
    let Some(original) = original else { return Ok(()) };
    if pci.driver(a).map_err(read)?.as_deref() == Some(original) {
        return Ok(());
    }
    // The driver's own bind file names exactly the original driver; drivers_probe would take the
    // first driver whose id table matches, which need not be it. The bind file refuses a device
    // outside the driver's (static or new_id) table; then drivers_probe is the fallback.
    let bind = PathBuf::from(format!("bus/pci/drivers/{original}/bind"));
    if !pci.io().exists(&bind) {
        return Err(StepFailure::new(
            a,
            Step::Reprobe,
            format!("driver {original} is not loaded; left without a driver"),
        ));
    }
    let bind_error = pci.io().write(&bind, &a.to_string()).err();
    if bind_error.is_some() {
        write(pci, a, Step::Reprobe, Path::new("bus/pci/drivers_probe"), &a.to_string())?;
    }
    wait_for(pci, a, original, timeout).map_err(|reason| {
        let reason = match bind_error {
            Some(e) => format!("{reason} (writing to {}: {e})", bind.display()),
            None => reason,
        };
        StepFailure::new(a, Step::WaitRestored, reason)
    })
}

#[cfg(test)]
mod tests {
    use super::super::fake::{addr, FakeDevice, FakeSysfs};
    use super::super::sysfs::SysfsIo;
    use super::*;
    use crate::api::Code;
    use serde_json::json;
    use std::sync::Arc;

    const NIC1: &str = "0000:00:05.0";
    const NIC2: &str = "0000:00:05.1";
    const NVME: &str = "0000:01:00.0";
    const SHORT: Duration = Duration::from_millis(100);

    /// Two e1000e functions in group 7, an NVMe drive without a driver in group 8, vfio-pci loaded.
    fn setup() -> (Arc<FakeSysfs>, Pci) {
        let f = Arc::new(FakeSysfs::new());
        f.add_driver("e1000e", &[(0x8086, 0x10d3)]).add_driver("nvme", &[(0x1b36, 0x0010)]).add_driver(VFIO_PCI, &[]);
        f.add_device(FakeDevice::endpoint(NIC1, 0x8086, 0x10d3, 0x020000, 7).driver("e1000e"));
        f.add_device(FakeDevice::endpoint(NIC2, 0x8086, 0x10d3, 0x020000, 7).driver("e1000e"));
        f.add_device(FakeDevice::endpoint(NVME, 0x1b36, 0x0010, 0x010802, 8));
        let pci = Pci::new(Box::new(Arc::clone(&f)));
        (f, pci)
    }

    fn assignment(list: &[&str]) -> Assignment {
        let devices: Vec<PciAddress> = list.iter().map(|s| addr(s)).collect();
        Assignment { to_bind: devices.clone(), devices, groups: vec![] }
    }

    fn binding(address: &str, driver: Option<&str>) -> Binding {
        Binding { address: addr(address), original_driver: driver.map(str::to_string), node_before: None }
    }

    #[test]
    fn plans_record_current_drivers() {
        let (_, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NVME])).unwrap();
        assert_eq!(plan, [binding(NIC1, Some("e1000e")), binding(NVME, None)]);
    }

    #[test]
    fn bindings_persist_with_text_addresses() {
        let b = binding(NIC1, Some("e1000e"));
        let j = serde_json::to_value(&b).unwrap();
        assert_eq!(j, json!({"address": "0000:00:05.0", "original_driver": "e1000e"}));
        assert_eq!(serde_json::from_value::<Binding>(j).unwrap(), b);
        let none: Binding = serde_json::from_str(r#"{"address":"0000:01:00.0","original_driver":null}"#).unwrap();
        assert_eq!(none, binding(NVME, None));
        assert!(serde_json::from_str::<Binding>(r#"{"address":"nope","original_driver":null}"#).is_err());
    }

    #[test]
    fn binds_a_whole_group_then_releases_it() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NIC2])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        for d in [NIC1, NIC2] {
            assert_eq!(f.driver_of(d).as_deref(), Some(VFIO_PCI));
            assert_eq!(f.override_of(d).as_deref(), Some(VFIO_PCI));
        }
        // The steps, in order, for the first device: override, unbind, probe.
        let w = f.writes();
        assert_eq!(
            w[..3],
            [
                (format!("bus/pci/devices/{NIC1}/driver_override"), VFIO_PCI.to_string()),
                (format!("bus/pci/devices/{NIC1}/driver/unbind"), NIC1.to_string()),
                ("bus/pci/drivers_probe".to_string(), NIC1.to_string()),
            ]
        );
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        for d in [NIC1, NIC2] {
            assert_eq!(f.driver_of(d).as_deref(), Some("e1000e"));
            assert_eq!(f.override_of(d), None);
        }
    }

    /// Where each device stands when a hook runs: (device, NIC1's driver, NVME's driver, NVME's
    /// override).
    type Seen = (String, Option<String>, Option<String>, Option<String>);

    fn snapshot(f: &FakeSysfs, b: &Binding) -> Seen {
        (b.address.to_string(), f.driver_of(NIC1), f.driver_of(NVME), f.override_of(NVME))
    }

    fn s(v: &str) -> Option<String> {
        Some(v.to_string())
    }

    #[test]
    fn the_bind_hook_runs_once_per_device_in_order_before_the_next_is_touched() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NVME])).unwrap();
        let mut seen: Vec<Seen> = Vec::new();
        bind_vfio(&pci, &plan, SHORT, |b| seen.push(snapshot(&f, b))).unwrap();
        assert_eq!(
            seen,
            [
                // NIC1 is bound; NVME has not been written to yet.
                (NIC1.to_string(), s(VFIO_PCI), None, None),
                (NVME.to_string(), s(VFIO_PCI), s(VFIO_PCI), s(VFIO_PCI)),
            ]
        );
    }

    #[test]
    fn the_bind_hook_counts_a_device_already_on_vfio_pci() {
        // The hook numbers positions in the binding list, so a device left as it was counts too.
        let (f, pci) = setup();
        f.write(Path::new("bus/pci/devices/0000:01:00.0/driver_override"), VFIO_PCI).unwrap();
        f.write(Path::new("bus/pci/drivers_probe"), NVME).unwrap();
        let plan = plan_bindings(&pci, &assignment(&[NVME, NIC1])).unwrap();
        let mut seen = Vec::new();
        bind_vfio(&pci, &plan, SHORT, |b| seen.push(b.address)).unwrap();
        assert_eq!(seen, [addr(NVME), addr(NIC1)]);
    }

    #[test]
    fn the_bind_hook_skips_a_failed_device_and_the_restore() {
        let (f, pci) = setup();
        f.refuse_probe(NIC2, VFIO_PCI);
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NIC2])).unwrap();
        let mut seen = Vec::new();
        let e = bind_vfio(&pci, &plan, SHORT, |b| seen.push(b.address)).unwrap_err();
        assert!(matches!(e, BindError::Bind { .. }), "{e:?}");
        assert_eq!(seen, [addr(NIC1)]);
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
    }

    #[test]
    fn without_vfio_pci_the_bind_hook_never_runs() {
        let f = Arc::new(FakeSysfs::new());
        f.add_device(FakeDevice::endpoint(NIC1, 0x8086, 0x10d3, 0x020000, 7).driver("e1000e"));
        let pci = Pci::new(Box::new(Arc::clone(&f)));
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        let mut calls = 0;
        assert_eq!(bind_vfio(&pci, &plan, SHORT, |_| calls += 1), Err(BindError::NoVfioPci));
        assert_eq!(calls, 0);
    }

    #[test]
    fn the_release_hook_runs_once_per_device_in_order_before_the_next_is_touched() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NVME])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        let mut seen: Vec<Seen> = Vec::new();
        release(&pci, &plan, SHORT, |b| seen.push(snapshot(&f, b))).unwrap();
        assert_eq!(
            seen,
            [
                // NIC1 is back on e1000e; NVME is still held by vfio-pci.
                (NIC1.to_string(), s("e1000e"), s(VFIO_PCI), s(VFIO_PCI)),
                (NVME.to_string(), s("e1000e"), None, None),
            ]
        );
    }

    #[test]
    fn the_release_hook_skips_a_device_that_was_not_restored() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NVME])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        f.fail_writes_to("bus/pci/devices/0000:00:05.0/driver/unbind");
        let mut seen = Vec::new();
        let e = release(&pci, &plan, SHORT, |b| seen.push(b.address)).unwrap_err();
        let BindError::Release { failures } = e else { panic!("expected Release") };
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].address, addr(NIC1));
        // Release carries on past NIC1, so NVME still gets its call.
        assert_eq!(seen, [addr(NVME)]);
    }

    #[test]
    fn a_driverless_device_is_bound_and_released_to_no_driver() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NVME])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NVME).as_deref(), Some(VFIO_PCI));
        // No unbind was needed.
        assert!(!f.writes().iter().any(|(p, _)| p.ends_with("unbind")));
        f.clear_writes();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NVME), None);
        assert_eq!(f.override_of(NVME), None);
        // Unbound and the override cleared, but not reprobed: the nvme driver would take it, and
        // it had no driver before.
        assert_eq!(
            f.writes(),
            [
                (format!("bus/pci/devices/{NVME}/driver/unbind"), NVME.to_string()),
                (format!("bus/pci/devices/{NVME}/driver_override"), "\n".to_string()),
            ]
        );
    }

    #[test]
    fn second_device_failing_to_bind_restores_the_first() {
        let (f, pci) = setup();
        f.refuse_probe(NIC2, VFIO_PCI);
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NIC2])).unwrap();
        let e = bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap_err();
        match &e {
            BindError::Bind { failure, restored, restore_failures } => {
                assert_eq!(failure.address, addr(NIC2));
                assert_eq!(failure.step, Step::WaitBound);
                assert!(failure.reason.contains("without a driver"), "{}", failure.reason);
                assert_eq!(restored, &[addr(NIC2), addr(NIC1)]);
                assert!(restore_failures.is_empty());
            }
            other => panic!("expected Bind, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains(NIC2) && msg.contains("waiting for vfio-pci"), "{msg}");
        for d in [NIC1, NIC2] {
            assert_eq!(f.driver_of(d).as_deref(), Some("e1000e"), "{d}");
            assert_eq!(f.override_of(d), None, "{d}");
        }
        let api = crate::api::ApiError::from(&e);
        assert_eq!(api.code, Code::ProvisioningFailed);
        assert_eq!(api.details["failures"][0]["step"], "wait_bound");
        assert_eq!(api.details["restored"], json!([NIC2, NIC1]));
    }

    #[test]
    fn a_failed_write_part_way_restores_everything_changed() {
        // Writes: NIC1 override, unbind, probe (3), NIC2 override (4), NIC2 unbind fails (5).
        let (f, pci) = setup();
        f.fail_nth_write(5);
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NIC2])).unwrap();
        match bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap_err() {
            BindError::Bind { failure, restore_failures, .. } => {
                assert_eq!((failure.address, failure.step), (addr(NIC2), Step::Unbind));
                assert!(failure.reason.contains("driver/unbind"), "{}", failure.reason);
                assert!(restore_failures.is_empty(), "{restore_failures:?}");
            }
            other => panic!("expected Bind, got {other:?}"),
        }
        for d in [NIC1, NIC2] {
            assert_eq!(f.driver_of(d).as_deref(), Some("e1000e"), "{d}");
            assert_eq!(f.override_of(d), None, "{d}");
        }
    }

    #[test]
    fn a_failed_first_write_changes_nothing() {
        let (f, pci) = setup();
        f.fail_nth_write(1);
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        match bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap_err() {
            BindError::Bind { failure, restored, restore_failures } => {
                assert_eq!(failure.step, Step::SetOverride);
                // The device was released (a no-op) and counts as restored.
                assert_eq!(restored, [addr(NIC1)]);
                assert!(restore_failures.is_empty());
            }
            other => panic!("expected Bind, got {other:?}"),
        }
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert!(f.writes().is_empty(), "{:?}", f.writes());
    }

    #[test]
    fn without_vfio_pci_nothing_is_touched() {
        let f = Arc::new(FakeSysfs::new());
        f.add_device(FakeDevice::endpoint(NIC1, 0x8086, 0x10d3, 0x020000, 7).driver("e1000e"));
        let pci = Pci::new(Box::new(Arc::clone(&f)));
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        assert_eq!(bind_vfio(&pci, &plan, SHORT, |_| {}), Err(BindError::NoVfioPci));
        assert!(f.writes().is_empty());
        assert_eq!(crate::api::ApiError::from(&BindError::NoVfioPci).code, Code::ProvisioningFailed);
    }

    #[test]
    fn binding_and_releasing_twice_is_harmless() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NVME])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        f.clear_writes();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        assert!(f.writes().is_empty(), "{:?}", f.writes());
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        f.clear_writes();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert!(f.writes().is_empty(), "{:?}", f.writes());
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert_eq!(f.driver_of(NVME), None);
    }

    #[test]
    fn release_finishes_a_half_done_bind() {
        // A crash after the override and unbind, before the probe: driverless, override set.
        let (f, pci) = setup();
        f.write(Path::new("bus/pci/devices/0000:00:05.0/driver_override"), VFIO_PCI).unwrap();
        f.write(Path::new("bus/pci/devices/0000:00:05.0/driver/unbind"), NIC1).unwrap();
        release(&pci, &[binding(NIC1, Some("e1000e"))], SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert_eq!(f.override_of(NIC1), None);
    }

    #[test]
    fn a_device_found_on_vfio_pci_stays_there() {
        let (f, pci) = setup();
        f.write(Path::new("bus/pci/devices/0000:01:00.0/driver_override"), VFIO_PCI).unwrap();
        f.write(Path::new("bus/pci/drivers_probe"), NVME).unwrap();
        f.clear_writes();
        let plan = plan_bindings(&pci, &assignment(&[NVME])).unwrap();
        assert_eq!(plan, [binding(NVME, Some(VFIO_PCI))]);
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert!(f.writes().is_empty(), "{:?}", f.writes());
        assert_eq!(f.driver_of(NVME).as_deref(), Some(VFIO_PCI));
    }

    #[test]
    fn release_returns_the_device_to_exactly_its_original_driver() {
        // Two drivers match the drive; the operator had given it to the second one. A reprobe
        // would pick nvme, the first: release uses the original driver's bind file instead.
        let (f, pci) = setup();
        f.add_driver("nvme_alt", &[(0x1b36, 0x0010)]);
        f.write(Path::new("bus/pci/drivers/nvme_alt/bind"), NVME).unwrap();
        let plan = plan_bindings(&pci, &assignment(&[NVME])).unwrap();
        assert_eq!(plan, [binding(NVME, Some("nvme_alt"))]);
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        f.clear_writes();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NVME).as_deref(), Some("nvme_alt"));
        assert_eq!(f.writes().last(), Some(&("bus/pci/drivers/nvme_alt/bind".to_string(), NVME.to_string())));
        assert!(!f.writes().iter().any(|(p, _)| p == "bus/pci/drivers_probe"));
    }

    #[test]
    fn release_falls_back_to_drivers_probe() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        f.fail_writes_to("bus/pci/drivers/e1000e/bind");
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert_eq!(f.writes().last(), Some(&("bus/pci/drivers_probe".to_string(), NIC1.to_string())));
    }

    #[test]
    fn release_carries_on_and_reports_every_failure() {
        let (f, pci) = setup();
        let plan = plan_bindings(&pci, &assignment(&[NIC1, NIC2, NVME])).unwrap();
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        // NIC1 cannot be unbound; NIC2's driver refuses it; NVME releases fine.
        f.fail_writes_to("bus/pci/devices/0000:00:05.0/driver/unbind");
        f.refuse_probe(NIC2, "e1000e");
        let e = release(&pci, &plan, SHORT, |_| {}).unwrap_err();
        let BindError::Release { failures } = &e else { panic!("expected Release, got {e:?}") };
        let got: Vec<(PciAddress, Step)> = failures.iter().map(|x| (x.address, x.step)).collect();
        assert_eq!(got, [(addr(NIC1), Step::Unbind), (addr(NIC2), Step::WaitRestored)]);
        assert!(failures[1].reason.contains("without a driver"), "{}", failures[1].reason);
        assert_eq!(f.driver_of(NVME), None);
        assert_eq!(crate::api::ApiError::from(&e).details["failures"].as_array().map(Vec::len), Some(2));
        // Once the faults are gone, releasing again finishes the job.
        f.heal();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert_eq!(f.driver_of(NIC2).as_deref(), Some("e1000e"));
    }

    #[test]
    fn release_reports_a_missing_original_driver_and_leaves_the_device_driverless() {
        let (f, pci) = setup();
        let plan = vec![binding(NIC1, Some("gone_driver"))];
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        let e = release(&pci, &plan, SHORT, |_| {}).unwrap_err();
        let BindError::Release { failures } = e else { panic!("expected Release") };
        assert_eq!(failures[0].step, Step::Reprobe);
        assert!(failures[0].reason.contains("gone_driver is not loaded"), "{}", failures[0].reason);
        assert_eq!(f.driver_of(NIC1), None);
        assert_eq!(f.override_of(NIC1), None);
    }

    #[test]
    fn release_reports_the_wrong_driver_taking_the_device() {
        // The recorded driver is loaded but refuses the device; drivers_probe hands it to e1000e.
        let (f, pci) = setup();
        f.add_driver("igb", &[]);
        let plan = vec![binding(NIC1, Some("igb"))];
        bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap();
        let e = release(&pci, &plan, SHORT, |_| {}).unwrap_err();
        let BindError::Release { failures } = e else { panic!("expected Release") };
        assert_eq!(failures[0].step, Step::WaitRestored);
        assert!(failures[0].reason.contains("bound to e1000e instead of igb"), "{}", failures[0].reason);
        assert!(failures[0].reason.contains("drivers/igb/bind"), "{}", failures[0].reason);
    }

    #[test]
    fn release_leaves_a_device_on_some_other_driver_alone() {
        let (f, pci) = setup();
        f.add_driver("pci-stub", &[]);
        f.write(Path::new("bus/pci/devices/0000:00:05.0/driver/unbind"), NIC1).unwrap();
        f.write(Path::new("bus/pci/devices/0000:00:05.0/driver_override"), "pci-stub").unwrap();
        f.write(Path::new("bus/pci/drivers/pci-stub/bind"), NIC1).unwrap();
        let e = release(&pci, &[binding(NIC1, Some("e1000e"))], SHORT, |_| {}).unwrap_err();
        let BindError::Release { failures } = e else { panic!("expected Release") };
        assert!(failures[0].reason.contains("neither vfio-pci nor its original driver"), "{}", failures[0].reason);
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("pci-stub"));
    }

    #[test]
    fn a_slow_probe_is_waited_for() {
        let (f, pci) = setup();
        f.probe_lag(NIC1, 5);
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        let start = Instant::now();
        bind_vfio(&pci, &plan, Duration::from_secs(5), |_| {}).unwrap();
        assert!(start.elapsed() >= POLL_INTERVAL * 4, "{:?}", start.elapsed());
        assert_eq!(f.driver_of(NIC1).as_deref(), Some(VFIO_PCI));
    }

    #[test]
    fn a_bind_that_never_completes_times_out_in_bounded_time() {
        let (f, pci) = setup();
        f.refuse_probe(NIC1, VFIO_PCI);
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        let timeout = Duration::from_millis(150);
        let start = Instant::now();
        let e = bind_vfio(&pci, &plan, timeout, |_| {}).unwrap_err();
        let took = start.elapsed();
        assert!(took >= timeout && took < timeout * 2 + Duration::from_secs(1), "{took:?}");
        let BindError::Bind { failure, .. } = e else { panic!("expected Bind") };
        assert!(failure.reason.contains("after 150ms"), "{}", failure.reason);
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
    }

    #[test]
    fn a_restore_that_fails_is_reported_and_a_later_release_finishes_it() {
        // vfio-pci binds, but so slowly that the wait gives up; the restore then cannot see the
        // binding either and fails. The record still lists the device, so a later release works.
        let (f, pci) = setup();
        f.probe_lag(NIC1, 10_000);
        let plan = plan_bindings(&pci, &assignment(&[NIC1])).unwrap();
        let e = bind_vfio(&pci, &plan, Duration::from_millis(50), |_| {}).unwrap_err();
        let BindError::Bind { restored, restore_failures, .. } = &e else { panic!("expected Bind") };
        assert!(restored.is_empty());
        assert_eq!(restore_failures.len(), 1);
        assert!(e.to_string().contains("restoring failed"), "{e}");
        f.heal();
        release(&pci, &plan, SHORT, |_| {}).unwrap();
        assert_eq!(f.driver_of(NIC1).as_deref(), Some("e1000e"));
        assert_eq!(f.override_of(NIC1), None);
    }

    #[test]
    fn vfio_pci_refuses_a_device_without_an_iommu_group() {
        let (f, pci) = setup();
        f.add_device(FakeDevice::endpoint("0000:00:07.0", 0x8086, 0x10d3, 0x020000, 0).driver("e1000e").no_group());
        let plan = plan_bindings(&pci, &assignment(&["0000:00:07.0"])).unwrap();
        let e = bind_vfio(&pci, &plan, SHORT, |_| {}).unwrap_err();
        let BindError::Bind { failure, restored, .. } = e else { panic!("expected Bind") };
        assert_eq!(failure.step, Step::WaitBound);
        assert_eq!(restored, [addr("0000:00:07.0")]);
        assert_eq!(f.driver_of("0000:00:07.0").as_deref(), Some("e1000e"));
    }

    #[test]
    fn a_vanished_device_needs_no_release() {
        let (_, pci) = setup();
        release(&pci, &[binding("0000:0a:00.0", Some("e1000e"))], SHORT, |_| {}).unwrap();
    }

    #[test]
    fn group_device_nodes() {
        assert_eq!(vfio_group_dev(14), PathBuf::from("/dev/vfio/14"));
    }
}
