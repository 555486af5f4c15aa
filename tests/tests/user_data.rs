//! `spec.user_data` end to end: a direct-kernel VM named as Security Onion names its VMs
//! (`<hostname>_<role>`) gets a cloud-init seed holding its user_data; the test guest mounts it
//! and prints the file on the serial console (tests/guest/init.sh), which must be the user_data
//! byte for byte. A user_data change alone is recorded without a restart and reaches the guest
//! at its next start; one over 64 KiB is refused before anything is made.

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{argv_of, HostOptions, TestHost, GUEST_READY};

const BOOT: Duration = Duration::from_secs(120);

/// Every line a shell could mangle: a `#cloud-config` header, JSON and YAML quoting, `{`, `"`,
/// `'`, a backslash, `$` and backticks, leading and trailing blanks, a tab, an empty line, a
/// `%` (printf's format character) and a line that looks like the guest's end marker; no final
/// newline.
const USER_DATA: &str = "#cloud-config\n\
hostname: sensor1-sensor\n\
write_files:\n  - path: /etc/so.json\n    content: '{\"role\": \"sensor\", \"it''s\": [1, 2]}'\n\
runcmd:\n  - [ sh, -c, \"echo \\\"hi\\\" && echo 'x' | tr a-z A-Z > /dev/null\" ]\n\
\n\
\t# a tab, $HOME, `date`, 100% and a backslash \\n   \n\
VMHOST-USERDATA-END vdz bytes=0 newline=no\n\
last line without a newline";

/// The user-data blocks the guest printed, in order: (text, the `VMHOST-USERDATA-END` line).
/// The console turns `\n` into `\r\n`; lines without the guest's prefix (kernel messages) are
/// not part of a block.
fn printed_blocks(serial: &str) -> Vec<(String, String)> {
    let serial = serial.replace("\r\n", "\n");
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in serial.lines() {
        if line.starts_with("VMHOST-USERDATA-BEGIN ") {
            current = Some(Vec::new());
        } else if let Some(text) = line.strip_prefix("VMHOST-USERDATA| ") {
            if let Some(lines) = current.as_mut() {
                lines.push(text);
            }
        } else if line.starts_with("VMHOST-USERDATA-END ") {
            if let Some(lines) = current.take() {
                let mut text = lines.join("\n");
                if line.ends_with(" newline=yes") {
                    text.push('\n');
                }
                blocks.push((text, line.to_string()));
            }
        }
    }
    blocks
}

/// Waits for the `n`th user-data block on `name`'s console.
fn wait_block(host: &TestHost, name: &str, n: usize) -> (String, String) {
    vmhost_tests::wait::until(&format!("user-data block {n} on the console of {name}"), BOOT, || {
        let log = host.serial(name);
        printed_blocks(&log).get(n - 1).cloned().ok_or_else(|| format!("serial:\n{log}"))
    })
}

#[test]
fn a_kernel_vm_named_with_an_underscore_reads_its_user_data_from_the_seed() {
    let host = TestHost::start(HostOptions::default());
    let name = "sensor1_sensor";
    let mut spec = host.kernel_spec(name);
    spec["user_data"] = json!(USER_DATA);
    // A data disk too: it must stay the guest's first disk (vda), the seed coming after it.
    spec["disks"] = json!([{"name": "nsm", "size_gib": 1}]);
    let created = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(created["vm"]["status"], "running", "{created}");
    assert_eq!(created["vm"]["spec"]["user_data"], USER_DATA);
    assert!(host.wait_serial(name, GUEST_READY, BOOT), "guest never reached userspace:\n{}", host.serial(name));

    let (text, end) = wait_block(&host, name, 1);
    assert_eq!(text, USER_DATA, "the guest read another user-data ({end})");
    assert!(end.starts_with("VMHOST-USERDATA-END vdb "), "the seed is the disk after the data disk: {end}");
    assert!(end.contains(&format!(" bytes={} ", USER_DATA.len())), "{end}");
    assert!(host.state().join("seeds/sensor1_sensor.img").exists());
    // QEMU got the seed as a read-only fd set, never its path.
    let pid = created["vm"]["pid"].as_i64().unwrap();
    let argv = argv_of(pid);
    assert!(argv.iter().any(|a| a.contains("id=seed,format=raw,readonly=on")), "{argv:?}");
    assert!(argv.iter().filter(|a| a.contains("seeds/")).all(|a| a.contains("opaque=")), "{argv:?}");

    // A new user_data alone: recorded, no restart (cloud-init reads it at a first boot).
    let second = "#cloud-config\nruncmd: [\"true\"]\n";
    spec["user_data"] = json!(second);
    let applied = host.call("vm.apply", json!({ "spec": spec }));
    assert_eq!(applied["changed"], true, "{applied}");
    assert_eq!(applied["vm"]["pid"].as_i64(), Some(pid), "no restart for a user_data change: {applied}");
    assert_eq!(applied["vm"]["pending_restart"], false, "{applied}");
    assert_eq!(host.call("vm.get", json!({ "name": name }))["spec"]["user_data"], second);
    // The next start writes the seed from the recorded spec.
    host.call("vm.stop", json!({ "name": name, "timeout_s": 30 }));
    let started = host.call("vm.start", json!({ "name": name }));
    assert_eq!(started["vm"]["status"], "running", "{started}");
    let (text, _) = wait_block(&host, name, 2);
    assert_eq!(text, second);

    // Without user_data a kernel VM has no seed at its next start, as before (dropping it needs
    // no restart either, even when one is allowed).
    spec.as_object_mut().unwrap().remove("user_data");
    let applied = host.call("vm.apply", json!({ "spec": spec, "restart": true, "timeout_s": 30 }));
    assert_eq!(applied["vm"]["pid"], started["vm"]["pid"], "{applied}");
    assert!(applied["vm"]["spec"].get("user_data").is_none(), "{applied}");
    host.call("vm.stop", json!({ "name": name, "timeout_s": 30 }));
    let started = host.call("vm.start", json!({ "name": name }));
    let argv = argv_of(started["vm"]["pid"].as_i64().unwrap());
    assert!(!argv.iter().any(|a| a.contains("seed")), "{argv:?}");
    assert!(!host.state().join("seeds/sensor1_sensor.img").exists(), "the old seed is gone");

    host.call("vm.destroy", json!({ "name": name }));
}

#[test]
fn a_user_data_over_64_kib_is_refused_and_nothing_is_made() {
    let host = TestHost::start(HostOptions::default());
    let name = "sensor2_sensor";
    let mut spec = host.kernel_spec(name);
    spec["user_data"] = json!("x".repeat(65537));
    for method in ["vm.create", "vm.apply"] {
        let (code, e) = host.call_err(method, json!({ "spec": spec }));
        assert_eq!((code, e.field.as_deref()), (2001, Some("spec.user_data")), "{method}: {e:?}");
        let (code, _) = host.call_err("vm.get", json!({ "name": name }));
        assert_eq!(code, 4040, "{method}");
    }
    assert!(host.qemu_pids().is_empty());
    assert!(!host.state().join("vms/sensor2_sensor.json").exists());
    assert!(!host.state().join("seeds/sensor2_sensor.img").exists());
    // 65536 bytes is the limit itself: accepted (stopped, nothing boots).
    spec["user_data"] = json!("x".repeat(65536));
    spec["state"] = json!("stopped");
    let created: Value = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(created["vm"]["status"], "stopped", "{created}");
    host.call("vm.destroy", json!({ "name": name }));
}
