//! Whether the destination's QEMU gives a live guest the machine it runs on the source: the
//! same machine type (device layout and migration format), accelerator and CPU model, and under
//! KVM every CPU feature the guest saw at boot. A guest moved onto fewer features would fault
//! on its next use of one (an instruction gone), long after the source's copy is gone, so the
//! destination refuses before a byte of the guest moves (docs/moving.md).
//!
//! Order: the source fills [`crate::migration::Hello::machine`] with [`facts`] of its running
//! QEMU (asked of QEMU, not taken from the config: the config may have changed since the guest
//! was launched); the destination, once its own QEMU is up (waiting for the stream), takes its
//! [`facts`] and [`check`]s the two before it answers `Ready`. [`check`] and the parsers are
//! pure.

use crate::migration::MachineFacts;
use crate::qemu::qmp::{Qmp, QmpError};
use serde_json::{json, Value};

/// Why the destination cannot run the source's guest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Mismatch {
    /// Another machine type, accelerator or CPU model (4097 reason `machine`).
    #[error("the source runs {what} {source_has:?}, this host {here:?}: the guest's machine would change")]
    Machine {
        /// `machine type`, `accelerator` or `CPU model`.
        what: &'static str,
        /// The source's.
        source_has: String,
        /// This host's.
        here: String,
    },
    /// CPU features the guest saw that this host lacks (4097 reason `cpu`).
    #[error("this host's CPU lacks features the guest uses: {}", .0.join(", "))]
    CpuFeatures(Vec<String>),
}

impl Mismatch {
    /// The `details.reason` of its 4097.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Mismatch::Machine { .. } => "machine",
            Mismatch::CpuFeatures(_) => "cpu",
        }
    }
}

/// The machine facts of the running QEMU behind `qmp`, as QEMU itself says them (not the
/// daemon's config, which may have changed since the guest was launched).
///
/// # Errors
/// When QEMU does not answer.
pub(crate) async fn facts(qmp: &mut Qmp) -> Result<MachineFacts, QmpError> {
    let machine = qmp.execute("qom-get", Some(json!({ "path": "/machine", "property": "type" }))).await?;
    let kvm = qmp.execute("query-kvm", None).await?;
    let cpus = qmp.execute("query-cpus-fast", None).await?;
    let cpu = match cpus.pointer("/0/qom-path").and_then(Value::as_str) {
        Some(path) => qmp.execute("qom-get", Some(json!({ "path": path, "property": "type" }))).await?,
        None => Value::Null,
    };
    let accel = if kvm.get("enabled").and_then(Value::as_bool) == Some(true) { "kvm" } else { "tcg" };
    let cpu = model_of_type(cpu.as_str().unwrap_or_default()).to_string();
    // Under TCG QEMU emulates every feature of a model on any host; under KVM they come from
    // the host's CPU, and only the expansion says which.
    let cpu_features = if accel == "kvm" && !cpu.is_empty() {
        let args = json!({ "type": "full", "model": { "name": cpu } });
        enabled_features(&qmp.execute("query-cpu-model-expansion", Some(args)).await?)
    } else {
        Vec::new()
    };
    Ok(MachineFacts {
        machine: machine_of_type(machine.as_str().unwrap_or_default()).to_string(),
        accel: accel.to_string(),
        cpu,
        cpu_features,
    })
}

/// The machine type of QOM type `t` (`pc-q35-7.2-machine` -> `pc-q35-7.2`), pure.
pub(crate) fn machine_of_type(t: &str) -> &str {
    t.strip_suffix("-machine").unwrap_or(t)
}

/// The CPU model of QOM type `t` (`host-x86_64-cpu` -> `host`, `qemu64-x86_64-cpu` ->
/// `qemu64`), pure.
pub(crate) fn model_of_type(t: &str) -> &str {
    t.strip_suffix("-x86_64-cpu").unwrap_or(t)
}

/// The features a `query-cpu-model-expansion` answer enables, sorted (pure).
pub(crate) fn enabled_features(expansion: &Value) -> Vec<String> {
    let props = expansion.pointer("/model/props").and_then(Value::as_object);
    let mut on: Vec<String> =
        props.into_iter().flatten().filter(|(_, v)| v.as_bool() == Some(true)).map(|(k, _)| k.clone()).collect();
    on.sort();
    on
}

/// Whether this host (`here`) runs what the source (`source`) runs (pure).
///
/// # Errors
/// The first difference: machine type, accelerator, CPU model, then the CPU features the
/// source enabled and this host does not (all of them, named).
pub(crate) fn check(source: &MachineFacts, here: &MachineFacts) -> Result<(), Mismatch> {
    for (what, a, b) in [
        ("machine type", &source.machine, &here.machine),
        ("accelerator", &source.accel, &here.accel),
        ("CPU model", &source.cpu, &here.cpu),
    ] {
        if a != b {
            return Err(Mismatch::Machine { what, source_has: a.clone(), here: b.clone() });
        }
    }
    let missing: Vec<String> =
        source.cpu_features.iter().filter(|f| here.cpu_features.binary_search(f).is_err()).cloned().collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Mismatch::CpuFeatures(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcg() -> MachineFacts {
        MachineFacts { machine: "pc-q35-7.2".into(), accel: "tcg".into(), cpu: String::new(), cpu_features: vec![] }
    }

    fn kvm(features: &[&str]) -> MachineFacts {
        let mut f: Vec<String> = features.iter().map(|s| s.to_string()).collect();
        f.sort();
        MachineFacts { accel: "kvm".into(), cpu: "host".into(), cpu_features: f, ..tcg() }
    }

    #[test]
    fn qom_types_name_the_machine_and_the_model() {
        assert_eq!(machine_of_type("pc-q35-7.2-machine"), "pc-q35-7.2");
        assert_eq!(machine_of_type("microvm"), "microvm");
        assert_eq!(model_of_type("host-x86_64-cpu"), "host");
        assert_eq!(model_of_type("Skylake-Server-v4-x86_64-cpu"), "Skylake-Server-v4");
        assert_eq!(model_of_type(""), "");
    }

    #[test]
    fn only_enabled_features_count() {
        let e = json!({"model": {"name": "host", "props": {"avx2": true, "sse4.2": true, "avx512f": false, "vendor": "GenuineIntel"}}});
        assert_eq!(enabled_features(&e), ["avx2", "sse4.2"]);
        assert!(enabled_features(&json!({})).is_empty());
    }

    #[test]
    fn the_same_machine_passes_and_each_difference_is_named() {
        assert_eq!(check(&tcg(), &tcg()), Ok(()));
        let other = MachineFacts { machine: "pc-q35-8.0".into(), ..tcg() };
        let e = check(&tcg(), &other).unwrap_err();
        assert_eq!(e.reason(), "machine");
        assert!(e.to_string().contains("pc-q35-7.2") && e.to_string().contains("pc-q35-8.0"), "{e}");
        assert!(matches!(check(&tcg(), &kvm(&[])), Err(Mismatch::Machine { what: "accelerator", .. })));
        let model = MachineFacts { cpu: "Skylake-Server".into(), ..tcg() };
        assert!(matches!(check(&tcg(), &model), Err(Mismatch::Machine { what: "CPU model", .. })));
    }

    #[test]
    fn a_host_with_more_features_takes_the_guest_and_one_with_fewer_does_not() {
        let source = kvm(&["avx2", "sse4.2", "aes"]);
        assert_eq!(check(&source, &kvm(&["avx2", "sse4.2", "aes", "avx512f"])), Ok(()));
        let e = check(&source, &kvm(&["sse4.2"])).unwrap_err();
        assert_eq!(e, Mismatch::CpuFeatures(vec!["aes".into(), "avx2".into()]));
        assert_eq!(e.reason(), "cpu");
    }
}
