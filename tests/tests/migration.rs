//! Live migration between two vmhostds (issue 32, docs/moving.md): two daemons, each in its
//! own network namespace with its own state directory, joined by a veth
//! ([`vmhost_tests::migration_pair`]). The guest prints a counter with its boot id every
//! 100 ms; a migration must carry it on the destination's console without a restart, its data
//! disk's marker must be there, and the source must hold nothing afterwards (a kept data disk
//! aside, as a destroy keeps it). The refusals change nothing. A kill -9 of either daemon at
//! each crash point, then a restart, leaves the VM running on exactly one host with its marker
//! intact and the other host clean.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vmhost_tests::migration_pair::{
    continuity, data_disk, disk_mark, tail, with_mac, CounterWatch, Pair, PairOptions, ADDRS, PORT,
};

/// Bound of a whole migration of a 256 MiB TCG guest (a failure bound, not a speed).
const MIGRATION: Duration = Duration::from_secs(180);

/// Bound of settling after a crash: the source asks an unknown outcome every 5 s for 60 s.
const SETTLE: Duration = Duration::from_secs(180);

#[test]
fn a_running_guest_moves_with_its_counter_boot_id_and_disk_and_the_source_keeps_nothing() {
    let pair = Pair::start(PairOptions::default());
    let spec = pair.spec("mover", 256, "before-move", true);
    pair.create(0, &spec);
    let taps = pair.taps(0, "mover");
    let mac = pair.hosts[0].call("vm.get", json!({ "name": "mover" }))["nics"][0]["mac"].clone();
    assert_eq!(disk_mark(&data_disk(&pair.hosts[0], "mover")), "VMHOSTMARK:before-move");

    let watch = CounterWatch::start(&pair, "mover");
    // A few ticks on the source first, so the switch is between two ticks it saw.
    vmhost_tests::wait::until("counter ticks on the source", Duration::from_secs(30), || {
        if watch.ticks().len() >= 5 {
            Ok(())
        } else {
            Err(format!("{} ticks", watch.ticks().len()))
        }
    });
    let started = Instant::now();
    let out = pair.migrate_ctl(0, 1, "mover");
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "vmhostctl migrate --to-socket failed: {}\nstdout: {}\nstderr: {}\n--- source log:\n{}\n--- destination log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        tail(&pair.hosts[0].daemon_log(), 60),
        tail(&pair.hosts[1].daemon_log(), 60)
    );
    // Ticks on the destination after the switch.
    vmhost_tests::wait::until("counter ticks on the destination", Duration::from_secs(60), || {
        let n = watch.ticks().iter().filter(|t| t.host == 1).count();
        if n >= 10 {
            Ok(())
        } else {
            Err(format!("{n} ticks on the destination; serial:\n{}", pair.hosts[1].serial("mover")))
        }
    });
    let ticks = watch.finish();
    let c = continuity(&ticks, 0, 1);
    println!(
        "migration of a 256 MiB guest: vmhostctl took {took:?}; largest gap between two counter lines \
         {:?} (last on the source {:?}, first on the destination {:?}); vmhostctl said: {}",
        c.largest_gap,
        c.last_on_source,
        c.first_on_destination,
        String::from_utf8_lossy(&out.stdout).trim()
    );
    assert_eq!(c.boots.len(), 1, "the guest restarted: boot ids {:?}", c.boots);
    let (last, first) = (c.last_on_source.expect("ticks on the source"), c.first_on_destination.expect("ticks"));
    // A line cut by the switch is split over both logs: the next whole one may be one later.
    assert!(
        first > last && first <= last + 2,
        "the counter did not go on from where it was: last {last} on the source, first {first} on the destination"
    );
    assert!(c.largest_gap < Duration::from_secs(10), "the guest stood still {:?}", c.largest_gap);

    // The destination runs it, with the marker written before the move.
    let v = pair.hosts[1].call("vm.get", json!({ "name": "mover" }));
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["nics"][0]["mac"], mac, "the guest's NIC kept its MAC");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "mover")), "VMHOSTMARK:before-move");
    assert_eq!(pair.hosts[1].qemu_pids().len(), 1);

    // The source: nothing but the kept data disk, as a destroy leaves it.
    pair.assert_clean(0, "mover", &taps);
    let kept = pair.hosts[0].state().join("kept-disks/mover/data.raw");
    assert_eq!(disk_mark(&kept), "VMHOSTMARK:before-move", "the source's kept data disk");
}

#[test]
fn two_api_calls_move_a_guest_and_answer_what_it_took() {
    let pair = Pair::start(PairOptions::default());
    // A MAC in the spec: the same spec on both sides (the allocated-MAC case is the first test's).
    pair.create(0, &with_mac(pair.spec("calls", 256, "m", false)));
    let prepared = pair.migrate_in(0, 1, "calls");
    assert_eq!(prepared["address"], format!("{}:{PORT}", ADDRS[1]), "{prepared}");
    assert_eq!(prepared["secret"].as_str().map(str::len), Some(64), "{prepared}");
    // The destination shows it incoming until the source sends.
    assert_eq!(pair.hosts[1].call("vm.get", json!({ "name": "calls" }))["status"], "incoming");
    let done = pair.migrate(0, "calls", &prepared).unwrap_or_else(|e| {
        panic!(
            "vm.migrate: {e}\n--- source:\n{}\n--- destination:\n{}",
            tail(&pair.hosts[0].daemon_log(), 60),
            tail(&pair.hosts[1].daemon_log(), 60)
        )
    });
    println!("vm.migrate answered {done}");
    assert_eq!(
        (done["mode"].clone(), done["destination"].clone()),
        (json!("live"), prepared["address"].clone()),
        "{done}"
    );
    assert!(done["ram_bytes"].as_u64().unwrap_or(0) > 0, "{done}");
    assert_eq!(pair.settled("calls", MIGRATION), 1);
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "calls")), "VMHOSTMARK:m");
}

/// The error code of `method` on host `on`.
fn code(pair: &Pair, on: usize, method: &str, params: Value) -> (i32, Value) {
    let (code, e) = pair.hosts[on].call_err(method, params);
    let view = json!({ "message": e.message, "data": { "field": e.field, "details": e.details } });
    (code, view)
}

#[test]
fn a_destination_without_the_network_and_a_stopped_vm_are_refused() {
    let pair = Pair::start(PairOptions { second_without_lan: true, ..PairOptions::default() });
    let spec = pair.spec("stay", 256, "m", false);
    pair.create(0, &spec);
    let incoming = pair.incoming_spec(0, "stay");

    // The destination lacks the VM's network: refused there, before anything is made.
    let (c, e) = code(&pair, 1, "vm.migrate_in", json!({ "spec": incoming }));
    assert_eq!(c, 3001, "a destination without the network `lan`: {e}");
    assert!(pair.hosts[1].client().call::<Value>("vm.get", json!({"name": "stay"})).is_err());
    assert!(!pair.hosts[1].state().join("disks/stay").exists());

    // A stopped VM does not migrate live (vm.move is for it).
    let mut idle = json!({ "name": "idle", "cpu": 1, "memory_mib": 128, "boot": spec["boot"], "state": "stopped" });
    idle["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet");
    pair.hosts[0].call("vm.create", json!({ "spec": idle }));
    let (c, e) = code(
        &pair,
        0,
        "vm.migrate",
        json!({ "name": "idle", "destination": format!("{}:{PORT}", ADDRS[1]), "secret": "00".repeat(32) }),
    );
    assert_eq!((c, e["data"]["details"]["reason"].clone()), (4097, json!("status")), "{e}");
    assert_eq!(pair.hosts[0].call("vm.get", json!({ "name": "idle" }))["status"], "stopped");
    assert_eq!(pair.hosts[0].call("vm.get", json!({ "name": "stay" }))["status"], "running");
}

#[test]
fn a_missing_mac_and_a_wrong_secret_are_refused_and_nothing_changes() {
    let pair = Pair::start(PairOptions::default());
    pair.create(0, &pair.spec("sec", 256, "m", false));
    let incoming = pair.incoming_spec(0, "sec");

    // A bridge NIC without its MAC: the guest would lose its interface.
    let mut no_mac = incoming.clone();
    no_mac["nics"][0].as_object_mut().map(|n| n.remove("mac"));
    let (c, e) = code(&pair, 1, "vm.migrate_in", json!({ "spec": no_mac }));
    assert_eq!((c, e["data"]["field"].clone()), (2001, json!("spec.nics[0].mac")), "{e}");
    assert!(pair.hosts[1].client().call::<Value>("vm.get", json!({"name": "sec"})).is_err());

    // A wrong secret: the destination refuses the streams; the guest keeps running here.
    let prepared = pair.migrate_in(0, 1, "sec");
    let wrong = json!({ "address": prepared["address"], "secret": "ab".repeat(32) });
    let answer = pair.migrate(0, "sec", &wrong);
    assert!(answer.is_err(), "a wrong secret was accepted: {answer:?}");
    let v = pair.hosts[0].call("vm.get", json!({ "name": "sec" }));
    assert_eq!(v["status"], "running", "{v}");
    assert!(v.get("migration").is_none_or(Value::is_null), "{v}");
    assert!(
        pair.hosts[1].daemon_log().contains("refused"),
        "the destination did not log the refused stream:\n{}",
        tail(&pair.hosts[1].daemon_log(), 30)
    );
    // The right secret still works afterwards: the attempt spent nothing.
    pair.migrate(0, "sec", &prepared).unwrap_or_else(|e| panic!("vm.migrate with the right secret: {e}"));
    assert_eq!(pair.settled("sec", MIGRATION), 1);
}

#[test]
fn a_destination_without_a_migration_port_refuses_to_prepare() {
    let pair = Pair::start(PairOptions { second_without_port: true, ..PairOptions::default() });
    let spec = pair.spec("noport", 256, "m", false);
    let (c, e) = code(&pair, 1, "vm.migrate_in", json!({ "spec": spec }));
    assert_eq!(c, 3001, "{e}");
    assert_eq!(e["data"]["field"], "migration.listen", "{e}");
}

#[test]
fn a_spec_with_passed_through_devices_is_not_movable_live() {
    let pair = Pair::start(PairOptions::default());
    let mut spec = pair.spec("pci", 256, "m", false);
    spec["pci"] = json!(["0000:00:1f.0"]);
    let (c, e) = code(&pair, 1, "vm.migrate_in", json!({ "spec": spec }));
    assert_eq!((c, e["data"]["details"]["reason"].clone()), (4097, json!("passthrough")), "{e}");
}

/// Which daemon dies at a crash point.
#[derive(Debug, Clone, Copy)]
enum Side {
    Source,
    Destination,
}

/// Where the VM must end after a kill at that point (and a restart): on the source
/// (nothing committed) or on the destination (committed).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ends {
    Source,
    Destination,
}

/// Migrates a fresh counter guest from host 0 to host 1 with `step` armed on `side`; the
/// daemon dies there and is restarted, then the other one is restarted too (kill -9); the VM
/// must run on exactly one host (`ends`), with its marker, the other host clean.
fn crash_case(side: Side, step: &str, ends: Ends) {
    let mut pair = Pair::start(PairOptions::default());
    let name = "crashy";
    pair.create(0, &with_mac(pair.spec(name, 256, "survives", false)));
    let taps = pair.taps(0, name);
    let dying = match side {
        Side::Source => 0,
        Side::Destination => 1,
    };
    pair.hosts[dying].arm_crash(step);
    let spec = pair.incoming_spec(0, name);
    let prepared = pair.hosts[1].client().call::<Value>("vm.migrate_in", json!({ "spec": spec }));
    let answer = match prepared {
        Ok(prepared) => {
            // The source's call runs while the dying daemon dies and comes back: in a thread.
            let socket = pair.hosts[0].socket.clone();
            let call = std::thread::spawn(move || {
                vmhost::client::Client::connect(&socket).map_err(|e| e.to_string()).and_then(|mut c| {
                    c.call::<Value>(
                        "vm.migrate",
                        json!({ "name": name, "destination": prepared["address"], "secret": prepared["secret"] }),
                    )
                    .map_err(|e| e.to_string())
                })
            });
            // The daemon dies at the point, or the call ends without it getting there: then
            // say what the call answered and what both daemons logged.
            let pid = pair.hosts[dying].daemon_pid().expect("daemon") as i32;
            vmhost_tests::wait::until_true(
                &format!("vmhostd to die at {step} or vm.migrate to end"),
                Duration::from_secs(180),
                || !vmhost_tests::alive(pid) || call.is_finished(),
                || "neither yet".into(),
            );
            // A call cut by the death may end a moment before the process is seen gone.
            let died = vmhost_tests::wait::poll(Duration::from_secs(5), || {
                if vmhost_tests::alive(pid) {
                    Err(String::new())
                } else {
                    Ok(())
                }
            });
            if died.is_err() {
                let answer = call.join().unwrap_or_else(|_| Err("the call's thread panicked".into()));
                panic!(
                    "{step} was never reached; vm.migrate answered {answer:?}\n--- source log:\n{}\n--- destination log:\n{}",
                    tail(&pair.hosts[0].daemon_log(), 40),
                    tail(&pair.hosts[1].daemon_log(), 40)
                );
            }
            pair.hosts[dying].restart_after_crash(step);
            call.join().unwrap_or_else(|_| Err("the call's thread panicked".into()))
        }
        Err(e) => {
            // migrate_in:recorded kills the destination under vm.migrate_in itself.
            pair.hosts[dying].restart_after_crash(step);
            Err(e.to_string())
        }
    };
    // And the other daemon, killed too and restarted: both recover from their records.
    let other = 1 - dying;
    pair.hosts[other].kill_daemon();
    pair.hosts[other].spawn_daemon();
    let on = pair.settled(name, SETTLE);
    println!("{step}: vm.migrate answered {answer:?}; the VM runs on host {on}");
    let want = match ends {
        Ends::Source => 0,
        Ends::Destination => 1,
    };
    assert_eq!(on, want, "{step}: the VM ended on host {on}; vm.migrate answered {answer:?}");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[on], name)), "VMHOSTMARK:survives", "{step}: the marker");
    let other_taps = if on == 0 { Vec::new() } else { taps };
    pair.assert_clean(1 - on, name, &other_taps);
    // The guest runs: its counter goes on with the same boot id.
    let before = pair.hosts[on].serial(name).matches("VMHOST-COUNT ").count();
    pair.hosts[on].wait_serial_count(name, "VMHOST-COUNT ", before + 5, Duration::from_secs(60));
    let log = pair.hosts[0].serial(name) + &pair.hosts[1].serial(name);
    let boots: std::collections::BTreeSet<&str> =
        log.lines().filter_map(|l| l.split("VMHOST-BOOT-ID ").nth(1)).map(str::trim).collect();
    assert!(boots.len() <= 1, "{step}: the guest rebooted: {boots:?}");
}

#[test]
fn crash_at_migrate_in_recorded_leaves_the_vm_on_the_source() {
    crash_case(Side::Destination, "migrate_in:recorded", Ends::Source);
}

#[test]
fn crash_at_migrate_in_launched_leaves_the_vm_on_the_source() {
    crash_case(Side::Destination, "migrate_in:launched", Ends::Source);
}

#[test]
fn crash_at_migrate_in_commit_leaves_the_vm_on_the_source() {
    crash_case(Side::Destination, "migrate_in:commit", Ends::Source);
}

#[test]
fn crash_at_migrate_in_committed_leaves_the_vm_on_the_destination() {
    crash_case(Side::Destination, "migrate_in:committed", Ends::Destination);
}

#[test]
fn crash_at_migrate_recorded_leaves_the_vm_on_the_source() {
    crash_case(Side::Source, "migrate:recorded", Ends::Source);
}

#[test]
fn crash_at_migrate_mirroring_leaves_the_vm_on_the_source() {
    crash_case(Side::Source, "migrate:mirroring", Ends::Source);
}

#[test]
fn crash_at_migrate_memory_leaves_the_vm_on_the_source() {
    crash_case(Side::Source, "migrate:memory", Ends::Source);
}

#[test]
fn crash_at_migrate_commit_leaves_the_vm_on_the_source() {
    crash_case(Side::Source, "migrate:commit", Ends::Source);
}

#[test]
fn crash_at_migrate_confirmed_leaves_the_vm_on_the_destination() {
    crash_case(Side::Source, "migrate:confirmed", Ends::Destination);
}
