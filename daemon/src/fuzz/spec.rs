//! VM spec validation as the cargo fuzz target `spec` drives it: arbitrary bytes as the `spec` of
//! `vm.create` / `vm.apply`, or as the `vms` of `host.reconcile`, on a host with hardware classes
//! and networks.
//!
//! [`spec_json`] deserializes into the closed [`VmSpec`] exactly as the RPC layer does, then runs
//! [`validate_spec`], NIC allocation and, for a desired set, [`plan_reconcile`]. It panics when a
//! promise breaks: a refusal carries a 2xxx/3xxx code (and a field for 2001), an accepted spec
//! gets its NICs allocated or a coded refusal, and a plan has one entry per desired VM.

use crate::api::{Code, VmSpec};
use crate::config::Config;
use crate::plan::plan_reconcile;
use crate::validate::validate_spec;
use std::collections::BTreeMap;
use std::path::Path;

/// The host the specs are validated against: hardware classes, two networks, and `/boot` as its
/// boot directory (the corpus's kernels are there).
const HOST: &str = r#"
[paths]
boot = ["/boot"]
[qemu]
accel = "tcg"
[hardware]
cpu = 16
memory_gib = 32
reserved_cpu = 2
reserved_memory_gib = 4
allow_raw_pci = true
[hardware.disk]
1 = "0000:c7:00.0"
2 = "0000:c7:00.1"
[hardware.copper]
1 = "0000:c8:00.0"
[hardware.sfp]
5 = "0000:ca:00.0"
6 = "0000:ca:00.1"
[networks.lan]
bridge = "br0"
subnet = "10.0.0.0/24"
[networks.mgmt]
bridge = "br1"
create = true
uplink = "eno2"
vlan_filtering = true
trunk = [20, 30]
"#;

/// Runs `data` as one spec (a JSON object) or as a desired set (a JSON array of specs).
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn spec_json(data: &[u8]) {
    let config = Config::parse(HOST, Path::new("fuzz-host.toml")).unwrap_or_else(|e| panic!("{e}"));
    if let Ok(set) = serde_json::from_slice::<Vec<VmSpec>>(data) {
        let plan = plan_reconcile(&config, &set, &BTreeMap::new(), false, false);
        assert_eq!(plan.len(), set.len(), "one plan entry per desired VM");
        return;
    }
    let Ok(spec) = serde_json::from_slice::<VmSpec>(data) else { return };
    match validate_spec(&spec, &config) {
        Ok(valid) => {
            if let Err(e) = crate::nic::allocate(&valid.spec, &config, &[], &[]) {
                assert!(is_refusal(e.code), "NIC allocation failed with {:?}: {}", e.code, e.message);
            }
        }
        Err(e) => {
            assert!(is_refusal(e.code), "validation failed with {:?}: {}", e.code, e.message);
            if e.code == Code::InvalidSpec {
                assert!(e.field.is_some(), "an invalid spec names its field: {}", e.message);
            }
        }
    }
}

/// A refusal of the request (2xxx) or of what the host holds (3xxx), not an internal error.
fn is_refusal(code: Code) -> bool {
    (2000..4000).contains(&code.as_i32())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("spec", spec_json) >= 5, "the seed corpus is committed");
    }
}
