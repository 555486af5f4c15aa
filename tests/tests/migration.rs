//! Live migration between two vmhostds (issue 32, docs/moving.md): two daemons, each in its
//! own network namespace with its own state directory, joined by a veth
//! ([`vmhost_tests::migration_pair`]). The guest prints a counter with its boot id every
//! 100 ms; a migration must carry it on the destination's console without a restart, its data
//! disk's marker must be there, and the source must hold nothing afterwards (a kept data disk
//! aside, as a destroy keeps it). The refusals change nothing. A kill -9 of either daemon at
//! each crash point, then a restart, leaves the VM running on exactly one host with its marker
//! intact and the other host clean. A VM booted from its own root disk (`boot.disk`) moves
//! with what its guest wrote there, a UEFI guest with its variables store, and a VM with
//! snapshots with every one of them (reverted to on the destination).

use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use vmhost_tests::migration_pair::{
    continuity, data_disk, disk_mark, parse_tick, set_mark, tail, taps_of, with_mac, Continuity, CounterWatch, Pair,
    PairOptions, ADDRS, PORT,
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
    let out = pair.migrate_ctl_ok(0, 1, "mover");
    let took = started.elapsed();
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
    c.assert_went_on();

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
fn a_destination_whose_qemu_would_change_the_guests_machine_refuses_before_it_moves() {
    // `q35` resolves to pc-q35-7.2 on the source; the destination runs the older layout.
    let pair = Pair::start(PairOptions { second_machine: Some("pc-q35-7.1".into()), ..PairOptions::default() });
    pair.create(0, &pair.spec("mach", 256, "m", false));
    let before = pair.hosts[0].call("vm.get", json!({ "name": "mach" }));
    let prepared = pair.migrate_in(0, 1, "mach");
    let dest_taps = taps_of(&pair.hosts[1], "mach");
    let e = pair.migrate(0, "mach", &prepared).expect_err("a change of machine type was accepted");
    assert!(e.contains("4097") && e.contains("pc-q35-7.2") && e.contains("pc-q35-7.1"), "{e}");
    // The guest never left: the same QEMU runs here, nothing of the move is recorded.
    let v = pair.hosts[0].call("vm.get", json!({ "name": "mach" }));
    assert_eq!((v["status"].clone(), v["pid"].clone()), (json!("running"), before["pid"].clone()), "{v}");
    assert!(v.get("migration").is_none_or(Value::is_null), "{v}");
    // The destination gave up what it made for the guest.
    vmhost_tests::wait::until("the destination gives the VM up", Duration::from_secs(60), || {
        match pair.hosts[1].client().call::<Value>("vm.get", json!({ "name": "mach" })) {
            Err(_) => Ok(()),
            Ok(v) => Err(format!("still there: {v}")),
        }
    });
    pair.assert_clean(1, "mach", &dest_taps);
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

/// Moves `name` from host 0 to host 1 with `vmhostctl migrate --to-socket` while following its
/// counter on both consoles; checks that the counter went on from where it was with the same
/// boot id and that the guest never stood still for long. Returns what the counter did.
fn move_counting(pair: &Pair, name: &str) -> Continuity {
    let watch = CounterWatch::start(pair, name);
    vmhost_tests::wait::until("counter ticks on the source", Duration::from_secs(30), || {
        if watch.ticks().len() >= 5 {
            Ok(())
        } else {
            Err(format!("{} ticks", watch.ticks().len()))
        }
    });
    pair.migrate_ctl_ok(0, 1, name);
    vmhost_tests::wait::until("counter ticks on the destination", Duration::from_secs(60), || {
        let n = watch.ticks().iter().filter(|t| t.host == 1).count();
        if n >= 10 {
            Ok(())
        } else {
            Err(format!("{n} ticks on the destination; serial:\n{}", pair.hosts[1].serial(name)))
        }
    });
    let c = continuity(&watch.finish(), 0, 1);
    println!("{name}: largest gap between two counter lines {:?}", c.largest_gap);
    c.assert_went_on();
    let v = pair.hosts[1].call("vm.get", json!({ "name": name }));
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(pair.hosts[1].qemu_pids().len(), 1);
    c
}

/// A boot sector that counts, without any OS: it prints `VMHOST-COUNT <boot id> <n>` on COM1
/// about every 110 ms (two timer ticks of halt) and writes the same line, zero-padded, to the
/// disk's third sector (offset 1024) each time, through the BIOS (`int 13h`). The boot id is
/// four hex digits of the TSC at boot. Assembled with GNU as (`.code16`, `-Ttext=0x7c00`):
///
/// ```text
///   xor ax,ax / mov ds,ax / mov es,ax / mov ss,ax / mov sp,0x7c00 / sti / cld
///   mov di,0x8000 / mov cx,256 / rep stosw          ; line buffer zeroed
///   rdtsc / xor ax,dx / mov [0x7e00],ax             ; boot id
///   mov word [0x7e02],0                             ; count
/// again:
///   mov di,0x8000 / mov si,prefix / copy "VMHOST-COUNT " up to its NUL
///   4 hex digits of [0x7e00], ' ', decimal of [0x7e02] (div by 10, digits pushed), "\r\n"
///   zero the buffer up to 0x8040
///   out each byte up to the NUL to port 0x3f8
///   mov ax,0x0301 / mov cx,3 / mov dx,0x80 / mov bx,0x8000 / int 0x13   ; write sector 3
///   hlt / hlt / inc word [0x7e02] / jmp again
/// prefix: "VMHOST-COUNT ",0
/// ```
const COUNTING_BOOT_SECTOR: &[u8] = &[
    0x31, 0xc0, 0x8e, 0xd8, 0x8e, 0xc0, 0x8e, 0xd0, 0xbc, 0x00, 0x7c, 0xfb, 0xfc, 0xbf, 0x00, 0x80, 0xb9, 0x00, 0x01,
    0xf3, 0xab, 0x0f, 0x31, 0x31, 0xd0, 0xa3, 0x00, 0x7e, 0xc7, 0x06, 0x02, 0x7e, 0x00, 0x00, 0xbf, 0x00, 0x80, 0xbe,
    0x97, 0x7c, 0xac, 0x84, 0xc0, 0x74, 0x03, 0xaa, 0xeb, 0xf8, 0x8b, 0x1e, 0x00, 0x7e, 0xb9, 0x04, 0x00, 0xc1, 0xc3,
    0x04, 0x88, 0xd8, 0x24, 0x0f, 0x04, 0x30, 0x3c, 0x39, 0x76, 0x02, 0x04, 0x27, 0xaa, 0xe2, 0xee, 0xb0, 0x20, 0xaa,
    0xa1, 0x02, 0x7e, 0x31, 0xc9, 0xbb, 0x0a, 0x00, 0x31, 0xd2, 0xf7, 0xf3, 0x52, 0x41, 0x85, 0xc0, 0x75, 0xf6, 0x58,
    0x04, 0x30, 0xaa, 0xe2, 0xfa, 0xb0, 0x0d, 0xaa, 0xb0, 0x0a, 0xaa, 0xb9, 0x40, 0x80, 0x29, 0xf9, 0x30, 0xc0, 0xf3,
    0xaa, 0xbe, 0x00, 0x80, 0xba, 0xf8, 0x03, 0xac, 0x84, 0xc0, 0x74, 0x03, 0xee, 0xeb, 0xf8, 0xb8, 0x01, 0x03, 0xb9,
    0x03, 0x00, 0xba, 0x80, 0x00, 0xbb, 0x00, 0x80, 0xcd, 0x13, 0xf4, 0xf4, 0xff, 0x06, 0x02, 0x7e, 0xeb, 0x8b, 0x56,
    0x4d, 0x48, 0x4f, 0x53, 0x54, 0x2d, 0x43, 0x4f, 0x55, 0x4e, 0x54, 0x20, 0x00,
];

/// Where the test writes a marker of its own into the root disk before the import (sector 5):
/// data the guest never touches must arrive too.
const ROOT_MARK_AT: usize = 4096;

/// Runs `cmd`, panicking with its stderr on failure; its stdout.
fn run_ok(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// The guest-visible bytes of the qcow2 disk `disk` (read while its QEMU may hold it: `-U`).
fn qcow2_contents(disk: &Path, scratch: &Path) -> Vec<u8> {
    run_ok(Command::new("qemu-img").args(["convert", "-U", "-q", "-f", "qcow2", "-O", "raw"]).arg(disk).arg(scratch));
    std::fs::read(scratch).unwrap()
}

/// The virtual size of disk image `disk`.
fn virtual_size(disk: &Path) -> u64 {
    let info: Value =
        serde_json::from_slice(&run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(disk)))
            .unwrap();
    info["virtual-size"].as_u64().expect("virtual-size")
}

#[test]
fn a_vm_booted_from_its_own_root_disk_moves_live_with_what_its_guest_wrote_there() {
    let pair = Pair::start(PairOptions::default());
    let name = "rooted";
    // The root disk as an operator imports it: a qcow2 of 1 MiB (no GiB multiple: the disk made
    // on the destination must be exactly the source's size) whose boot sector counts.
    let mut image = vec![0u8; 1 << 20];
    image[..COUNTING_BOOT_SECTOR.len()].copy_from_slice(COUNTING_BOOT_SECTOR);
    image[510] = 0x55;
    image[511] = 0xAA;
    let mark = b"VMHOSTMARK:root-before";
    image[ROOT_MARK_AT..ROOT_MARK_AT + mark.len()].copy_from_slice(mark);
    let raw = pair.hosts[0].dir.path().join("rooted.raw");
    std::fs::write(&raw, &image).unwrap();
    let import = pair.hosts[0].state().join("import").join("rooted.qcow2");
    run_ok(Command::new("qemu-img").args(["convert", "-q", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(&import));
    let spec = json!({ "name": name, "cpu": 1, "memory_mib": 128, "boot": { "disk": "rooted.qcow2" } });
    pair.hosts[0].call("vm.create", json!({ "spec": spec }));
    pair.hosts[0].wait_serial_count(name, "VMHOST-COUNT ", 3, Duration::from_secs(60));
    let source_root = pair.hosts[0].state().join("disks").join(name).join("root.qcow2");
    assert_eq!(virtual_size(&source_root), 1 << 20);

    let c = move_counting(&pair, name);

    // The destination's root disk: where a create's import puts it, the source's format and
    // size, with the line the guest wrote last before the switch (or a later one) and the
    // marker it never touched.
    let root = pair.hosts[1].state().join("disks").join(name).join("root.qcow2");
    assert_eq!(virtual_size(&root), 1 << 20, "{}", root.display());
    let bytes = qcow2_contents(&root, &pair.hosts[1].dir.path().join("root-now.raw"));
    let line = String::from_utf8_lossy(&bytes[1024..1088]).trim_end_matches('\0').to_string();
    let (boot, n) = parse_tick(&line).unwrap_or_else(|| panic!("no counter line in the root disk: {line:?}"));
    assert_eq!(boot, c.boots[0], "the root disk's line is another boot's: {line:?}");
    let last = c.last_on_source.expect("ticks on the source");
    assert!(n >= last, "the root disk holds count {n}, older than the source's last {last}: a stale copy");
    assert_eq!(&bytes[ROOT_MARK_AT..ROOT_MARK_AT + mark.len()], mark, "the marker written before the import");
    assert!(!pair.hosts[1].state().join("import").join("rooted.qcow2").exists(), "nothing in the import directory");
    // The source keeps nothing: its root disk went with its destroy.
    pair.assert_clean(0, name, &[]);

    // The received disk is the VM's own: it boots from it again, and goes with its destroy.
    let boots_before = pair.hosts[1].serial(name);
    pair.hosts[1].call("vm.restart", json!({ "name": name, "timeout_s": 1, "force": true }));
    vmhost_tests::wait::until("a new boot from the received root disk", Duration::from_secs(60), || {
        let log = pair.hosts[1].serial(name);
        let new = log[boots_before.len().min(log.len())..].lines().filter_map(parse_tick).any(|(b, _)| b != c.boots[0]);
        if new {
            Ok(())
        } else {
            Err("no counter line of a new boot yet".into())
        }
    });
    pair.hosts[1].call("vm.destroy", json!({ "name": name }));
    assert!(!root.exists(), "the destroy deletes the received root disk");
}

/// The test guest with tests/guest/migration-efivar.sh as its program and the `efivarfs`
/// module (built once per process into `target/guest/initramfs-efivar.cpio.gz`).
fn efivar_guest() -> vmhost_tests::Guest {
    static GUEST: std::sync::OnceLock<vmhost_tests::Guest> = std::sync::OnceLock::new();
    GUEST
        .get_or_init(|| {
            let base = vmhost_tests::guest();
            let root = vmhost_tests::workspace();
            let out = root.join("target/guest");
            // build.sh's default list and efivarfs.
            let modules = "virtio_pci virtio_console virtio_net virtio_blk 8021q bridge tun dummy vfio_pci \
                           vfio_iommu_type1 button evdev vfat nls_cp437 nls_ascii nls_iso8859-1 nls_utf8 efivarfs";
            let st = Command::new(root.join("tests/guest/build.sh"))
                .env(
                    "EXTRA_FILES",
                    format!("{}:/bin/vmhost-agent", root.join("tests/guest/migration-efivar.sh").display()),
                )
                .env("INITRAMFS_NAME", "initramfs-efivar.cpio.gz")
                .env("MODULES", modules)
                .arg(&out)
                .status()
                .expect("run tests/guest/build.sh");
            assert!(st.success(), "tests/guest/build.sh (efivar guest): {st}");
            vmhost_tests::Guest { kernel: base.kernel, initrd: out.join("initramfs-efivar.cpio.gz") }
        })
        .clone()
}

#[test]
fn a_uefi_guest_moves_live_with_its_variables_store_as_it_last_wrote_it() {
    let pair = Pair::start(PairOptions::default());
    let name = "efi";
    let g = efivar_guest();
    let spec = json!({
        "name": name, "cpu": 1, "memory_mib": 256,
        "boot": { "kernel": g.kernel, "initrd": g.initrd, "firmware": "uefi",
                  "cmdline": "console=ttyS0 panic=-1 quiet vmhost.skipip" },
    });
    pair.hosts[0].call("vm.create", json!({ "spec": spec }));
    // OVMF adds about ten seconds to a TCG boot.
    pair.hosts[0].wait_serial_count(name, "VMHOST-EFIVAR-WROTE ", 1, Duration::from_secs(180));
    pair.hosts[0].wait_serial_count(name, "VMHOST-COUNT ", 3, Duration::from_secs(60));
    let log = pair.hosts[0].serial(name);
    assert!(log.contains("VMHOST-EFIVAR-SEEN none"), "a fresh store has no VmhostMark:\n{log}");
    let wrote = log
        .lines()
        .find_map(|l| l.split("VMHOST-EFIVAR-WROTE ").nth(1))
        .map(|b| b.trim().to_string())
        .expect("the guest wrote its variable");
    // OVMF wrote the variable into the flash device, which is the source's store file.
    let source_vars = pair.hosts[0].state().join("disks").join(name).join("uefi-vars.fd");
    let before = std::fs::read(&source_vars).unwrap();
    assert!(before.windows(wrote.len()).any(|w| w == wrote.as_bytes()), "the store lacks the guest's variable");

    let c = move_counting(&pair, name);
    assert_eq!(c.boots[0], wrote, "the counting boot is the one that wrote the variable");

    // The destination's store began as a copy of the template and was mirrored over: it is
    // the source's, byte for byte (the guest wrote no variable since).
    let vars = pair.hosts[1].state().join("disks").join(name).join("uefi-vars.fd");
    let after = std::fs::read(&vars).unwrap_or_else(|e| panic!("{}: {e}", vars.display()));
    assert!(after == before, "the destination's variables store differs from the source's");
    pair.assert_clean(0, name, &[]);

    // A later restart on the destination: the firmware reads the store from the file, and the
    // guest finds the variable its boot on the source wrote.
    pair.hosts[1].call("vm.restart", json!({ "name": name, "timeout_s": 1, "force": true }));
    let seen = format!("VMHOST-EFIVAR-SEEN {wrote}");
    assert!(
        pair.hosts[1].wait_serial(name, &seen, Duration::from_secs(180)),
        "after a restart on the destination the guest did not find its variable:\n{}",
        pair.hosts[1].serial(name)
    );
}

#[test]
fn a_running_vm_moves_live_with_its_snapshots_and_reverts_to_the_older_one_on_the_destination() {
    let pair = Pair::start(PairOptions::default());
    let spec = pair.spec("snapper", 256, "first", false);
    pair.create(0, &spec);
    let taps = pair.taps(0, "snapper");
    let disk = data_disk(&pair.hosts[0], "snapper");
    assert_eq!(disk_mark(&disk), "VMHOSTMARK:first");
    let s1 = pair.hosts[0].call("vm.snapshot", json!({ "name": "snapper", "snapshot": "s1" }));
    assert_eq!(s1["live"], true, "{s1}");
    // The host stands in for a guest rewriting its marker (this one writes it only at boot);
    // QEMU reads the file through the page cache, so the next copy sees it.
    set_mark(&disk, "second");
    let s2 = pair.hosts[0].call("vm.snapshot", json!({ "name": "snapper", "snapshot": "s2" }));
    assert_eq!(s2["live"], true, "{s2}");
    let source_snapshots = pair.hosts[0].state().join("snapshots/snapper");
    assert_eq!(disk_mark(&source_snapshots.join("s1/data.raw")), "VMHOSTMARK:first");
    assert_eq!(disk_mark(&source_snapshots.join("s2/data.raw")), "VMHOSTMARK:second");

    // Live, with the same boot id and the counter going on (move_counting checks both).
    move_counting(&pair, "snapper");
    let listed = pair.hosts[1].call("vm.snapshots", json!({ "name": "snapper" }));
    let names: Vec<&str> = listed.as_array().expect("a list").iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["s1", "s2"], "{listed}");
    let dest_snapshots = pair.hosts[1].state().join("snapshots/snapper");
    assert_eq!(disk_mark(&dest_snapshots.join("s2/data.raw")), "VMHOSTMARK:second");
    assert!(!pair.hosts[1].state().join("snapshots/.incoming-snapper").exists(), "the staging directory stays");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "snapper")), "VMHOSTMARK:second");

    // The source holds nothing: no record, QEMU, disks, tap, nor snapshot.
    pair.assert_clean(0, "snapper", &taps);
    assert!(!source_snapshots.exists(), "the source kept the snapshots");

    // The older snapshot's disks come back on the destination.
    pair.hosts[1].call("vm.stop", json!({ "name": "snapper", "force": true }));
    let v = pair.hosts[1].call("vm.revert", json!({ "name": "snapper", "snapshot": "s1" }));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "snapper")), "VMHOSTMARK:first");
}
