//! Cold moves between two vmhostds (`vm.move`, issue 32, docs/moving.md "Cold moves"): two
//! daemons in their own network namespaces joined by a veth ([`vmhost_tests::migration_pair`]).
//! A stopped VM's data disk with a marker arrives on the destination and the VM starts there;
//! a running VM moved with `--stop` runs on the destination afterwards, with its MAC; a byte
//! changed on the wire (a relay in the test between the two ports) is refused with 2003 and
//! leaves nothing on the destination and the VM as it was on the source; so is a qcow2 disk
//! whose header names a host file as its backing file, and a disk larger than its spec allows
//! (refused from the announcement, before a byte is written). Snapshots move with the VM; a
//! VM whose revert is unfinished is refused. Internal snapshots (qcow2 disks) refuse a live move
//! and go with a cold one inside the disk files.

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;
use vmhost_tests::migration_pair::{data_disk, disk_mark, set_mark, tail, Pair, PairOptions, ADDRS, PORT};

/// Bound of a move of a 1 GiB sparse data disk (hashed on both sides) between TCG hosts.
const MOVE: Duration = Duration::from_secs(300);

fn ctl_ok(pair: &Pair, out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\nstdout: {}\nstderr: {}\n--- source log:\n{}\n--- destination log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        tail(&pair.hosts[0].daemon_log(), 60),
        tail(&pair.hosts[1].daemon_log(), 60)
    );
}

/// `vmhostctl move NAME --to-socket (host 1) [extra]` run against host 0.
fn move_ctl(pair: &Pair, name: &str, extra: &[&str]) -> std::process::Output {
    let to = pair.hosts[1].socket.display().to_string();
    let mut args = vec!["move", name, "--to-socket", to.as_str()];
    args.extend_from_slice(extra);
    pair.hosts[0].ctl(&args)
}

fn status(pair: &Pair, on: usize, name: &str) -> Option<Value> {
    pair.hosts[on].client().call::<Value>("vm.get", json!({ "name": name })).ok()
}

#[test]
fn a_stopped_vm_moves_with_its_data_disk_and_starts_on_the_destination() {
    let pair = Pair::start(PairOptions::default());
    let spec = pair.spec("coldvm", 256, "cold-mark", true);
    pair.create(0, &spec);
    let taps = pair.taps(0, "coldvm");
    let mac = status(&pair, 0, "coldvm").expect("vm")["nics"][0]["mac"].clone();
    pair.hosts[0].call("vm.stop", json!({ "name": "coldvm" }));
    assert_eq!(disk_mark(&data_disk(&pair.hosts[0], "coldvm")), "VMHOSTMARK:cold-mark");

    let out = move_ctl(&pair, "coldvm", &[]);
    ctl_ok(&pair, &out, "vmhostctl move");
    println!("vmhostctl said: {}", String::from_utf8_lossy(&out.stdout).trim());

    // The destination has it stopped, with the disk as it was; the source has nothing.
    let v = status(&pair, 1, "coldvm").expect("the destination has the VM");
    assert_eq!(v["status"], "stopped", "{v}");
    assert_eq!(v["nics"][0]["mac"], mac, "the NIC keeps its MAC");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "coldvm")), "VMHOSTMARK:cold-mark");
    pair.assert_clean(0, "coldvm", &taps);
    let kept = pair.hosts[0].state().join("kept-disks/coldvm/data.raw");
    assert_eq!(disk_mark(&kept), "VMHOSTMARK:cold-mark", "the source kept the disk as a destroy keeps it");

    // It starts there and its guest runs.
    pair.hosts[1].call("vm.start", json!({ "name": "coldvm" }));
    pair.hosts[1].wait_serial_count("coldvm", "VMHOST-COUNT ", 3, Duration::from_secs(120));
    assert_eq!(pair.settled("coldvm", Duration::from_secs(30)), 1);
}

#[test]
fn a_running_vm_moved_with_stop_runs_on_the_destination() {
    let pair = Pair::start(PairOptions::default());
    let spec = pair.spec("stopmove", 256, "stop-mark", false);
    pair.create(0, &spec);
    let taps = pair.taps(0, "stopmove");
    let mac = status(&pair, 0, "stopmove").expect("vm")["nics"][0]["mac"].clone();

    // Without stop a running VM is refused (before anything is reached) and stays as it is;
    // vmhostctl says so before it prepares the destination.
    let (code, e) = pair.hosts[0]
        .call_err("vm.move", json!({ "name": "stopmove", "destination": "127.0.0.1:9", "secret": "00".repeat(32) }));
    assert_eq!((code, e.details["reason"].clone()), (4097, json!("status")), "{e:?}");
    let out = move_ctl(&pair, "stopmove", &[]);
    assert!(!out.status.success(), "a running VM moved without --stop");
    assert!(status(&pair, 1, "stopmove").is_none(), "the destination was prepared for a refused move");
    assert_eq!(status(&pair, 0, "stopmove").expect("vm")["status"], "running");

    let out = move_ctl(&pair, "stopmove", &["--stop"]);
    ctl_ok(&pair, &out, "vmhostctl move --stop");
    assert_eq!(pair.settled("stopmove", MOVE), 1, "it runs on the destination");
    let v = status(&pair, 1, "stopmove").expect("vm");
    assert_eq!(v["nics"][0]["mac"], mac, "the NIC keeps its MAC");
    pair.hosts[1].wait_serial_count("stopmove", "VMHOST-COUNT ", 3, Duration::from_secs(120));
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], "stopmove")), "VMHOSTMARK:stop-mark");
    pair.assert_clean(0, "stopmove", &taps);
}

/// Relays connections from `listen` (in host 0's namespace) to host 1's migration port,
/// changing one byte of a `files` stream's file data on its way.
fn corrupting_relay(netns: &str, listen: &str) {
    let ns = std::fs::File::open(format!("/run/netns/{netns}")).expect("open netns");
    let listen = listen.to_string();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let l = TcpListener::bind(&listen).expect("bind the relay");
        ready_tx.send(()).expect("ready");
        for client in l.incoming().flatten() {
            // Threads started here are in this namespace too; the sockets are made already.
            let server = TcpStream::connect(format!("{}:{PORT}", ADDRS[1])).expect("connect to host 1");
            let (mut c_in, mut s_out) = (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
            let (mut s_in, mut c_out) = (server, client);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_in, &mut c_out);
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                // The opening line names the channel; a files stream's file data starts well
                // before 256 KiB after it (its nonce exchange and header frame are short).
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while c_in.read_exact(&mut byte).is_ok() {
                    line.push(byte[0]);
                    if byte[0] == b'\n' {
                        break;
                    }
                }
                let files = String::from_utf8_lossy(&line).contains("\"files\"");
                if s_out.write_all(&line).is_err() {
                    return;
                }
                let mut at = 0u64;
                let flip = 256 * 1024u64;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match c_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if files && at <= flip && flip < at + n as u64 {
                        buf[(flip - at) as usize] ^= 0xff;
                    }
                    at += n as u64;
                    if s_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).expect("the relay listens");
}

#[test]
fn a_file_changed_on_the_wire_is_refused_and_nothing_is_left_on_the_destination() {
    let pair = Pair::start(PairOptions::default());
    let spec = pair.spec("badwire", 256, "wire-mark", false);
    pair.create(0, &spec);
    pair.hosts[0].call("vm.stop", json!({ "name": "badwire" }));
    let before = status(&pair, 0, "badwire").expect("vm");

    let relay = format!("{}:{}", ADDRS[0], PORT + 99);
    corrupting_relay(pair.hosts[0].netns.as_deref().expect("netns"), &relay);
    let mut incoming = before["spec"].clone();
    incoming["nics"][0]["mac"] = before["nics"][0]["mac"].clone();
    let prepared = pair.hosts[1].call("vm.migrate_in", json!({ "spec": incoming, "mode": "cold" }));
    let mut c = pair.hosts[0].client();
    c.set_timeout(MOVE).expect("timeout");
    let e = match c
        .call::<Value>("vm.move", json!({ "name": "badwire", "destination": relay, "secret": prepared["secret"] }))
    {
        Ok(v) => panic!("a corrupted move succeeded: {v}"),
        Err(vmhost::client::ClientError::Api(e)) => e,
        Err(e) => panic!("vm.move: transport error {e}"),
    };
    assert_eq!(e.code.as_i32(), 2003, "{e:?}\n--- destination log:\n{}", tail(&pair.hosts[1].daemon_log(), 40));

    // The destination gives everything up; the source keeps the VM as it was.
    vmhost_tests::wait::until("the destination gave the move up", Duration::from_secs(60), || {
        match status(&pair, 1, "badwire") {
            None => Ok(()),
            Some(v) => Err(format!("still recorded: {v}")),
        }
    });
    let disks = pair.hosts[1].state().join("disks/badwire");
    assert!(!disks.exists(), "the destination kept {}", disks.display());
    assert!(!pair.hosts[1].state().join("kept-disks/badwire").exists());
    assert!(!pair.hosts[1].state().join("disks/badwire.qcow2").exists());
    let after = status(&pair, 0, "badwire").expect("the source keeps the VM");
    assert_eq!(after["status"], "stopped", "{after}");
    assert!(after.get("migration").is_none_or(Value::is_null), "{after}");
    assert_eq!(after["spec"], before["spec"]);
    assert_eq!(disk_mark(&data_disk(&pair.hosts[0], "badwire")), "VMHOSTMARK:wire-mark");
}

/// A received qcow2 disk is inspected before it is put in place: one whose header names a host
/// file as its backing file (the destination's QEMU would open it) is refused and nothing is
/// left on the destination; the source keeps the VM. (A file made on the source by hand here;
/// a source holding the secret could send any.)
#[test]
fn a_received_qcow2_naming_a_host_file_is_refused() {
    let pair = Pair::start(PairOptions::default());
    let mut spec = pair.spec("backed", 256, "backed-mark", false);
    spec["disks"][0]["format"] = json!("qcow2");
    pair.create(0, &spec);
    pair.hosts[0].call("vm.stop", json!({ "name": "backed" }));
    let disk = pair.hosts[0].state().join("disks/backed/data.qcow2");
    assert!(disk.exists(), "{}", disk.display());
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-b", "/etc/hostname", "-F", "raw"])
        .arg(&disk)
        .arg("1G")
        .status()
        .expect("qemu-img");
    assert!(made.success());

    let out = move_ctl(&pair, "backed", &[]);
    assert!(!out.status.success(), "a disk naming /etc/hostname was moved");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("names the backing file"), "{said}");
    vmhost_tests::wait::until("the destination gave the move up", Duration::from_secs(60), || {
        match status(&pair, 1, "backed") {
            None => Ok(()),
            Some(v) => Err(format!("still recorded: {v}")),
        }
    });
    assert!(!pair.hosts[1].state().join("disks/backed").exists(), "the destination kept the disk");
    let after = status(&pair, 0, "backed").expect("the source keeps the VM");
    assert_eq!(after["status"], "stopped", "{after}");
}

/// The source daemon killed at crash point `step` of a cold move of a stopped VM, then both
/// restarted: the VM is `stopped` on the source with its disk, and the destination holds
/// nothing of it.
fn source_crash_case(step: &str) {
    let mut pair = Pair::start(PairOptions::default());
    let name = "coldcrash";
    pair.create(0, &pair.spec(name, 256, "survives", false));
    pair.hosts[0].call("vm.stop", json!({ "name": name }));
    let before = status(&pair, 0, name).expect("vm");
    let mut incoming = before["spec"].clone();
    incoming["nics"][0]["mac"] = before["nics"][0]["mac"].clone();
    let prepared = pair.hosts[1].call("vm.migrate_in", json!({ "spec": incoming, "mode": "cold" }));
    pair.hosts[0].arm_crash(step);
    let socket = pair.hosts[0].socket.clone();
    let call = std::thread::spawn(move || {
        vmhost::client::Client::connect(&socket).map_err(|e| e.to_string()).and_then(|mut c| {
            c.call::<Value>(
                "vm.move",
                json!({ "name": name, "destination": prepared["address"], "secret": prepared["secret"] }),
            )
            .map_err(|e| e.to_string())
        })
    });
    pair.hosts[0].restart_after_crash(step);
    let answer = call.join().unwrap_or_else(|_| Err("the call's thread panicked".into()));
    assert!(answer.is_err(), "{step}: vm.move answered {answer:?} from a daemon that died");
    pair.hosts[1].kill_daemon();
    pair.hosts[1].spawn_daemon();
    vmhost_tests::wait::until(&format!("{step}: settled on both hosts"), Duration::from_secs(120), || {
        let here = status(&pair, 0, name);
        let there = status(&pair, 1, name);
        match (&here, &there) {
            (Some(v), None) if v["status"] == "stopped" && v.get("migration").is_none_or(Value::is_null) => Ok(()),
            _ => Err(format!("source {here:?}; destination {there:?}")),
        }
    });
    assert_eq!(disk_mark(&data_disk(&pair.hosts[0], name)), "VMHOSTMARK:survives", "{step}: the marker");
    assert!(!pair.hosts[1].state().join("disks").join(name).exists(), "{step}: the destination kept files");
    // It is an ordinary stopped VM again: it moves now.
    let out = move_ctl(&pair, name, &[]);
    ctl_ok(&pair, &out, "vmhostctl move after the crash");
    assert_eq!(disk_mark(&data_disk(&pair.hosts[1], name)), "VMHOSTMARK:survives");
}

#[test]
fn crash_at_move_recorded_leaves_the_vm_stopped_on_the_source() {
    source_crash_case("move:recorded");
}

#[test]
fn crash_at_move_sent_leaves_the_vm_stopped_on_the_source() {
    source_crash_case("move:sent");
}

/// The names `vm.snapshots` lists for `name` on host `on`, oldest first.
fn snapshot_names(pair: &Pair, on: usize, name: &str) -> Vec<String> {
    let list = pair.hosts[on].call("vm.snapshots", json!({ "name": name }));
    list.as_array().expect("a list").iter().map(|s| s["name"].as_str().expect("a name").to_string()).collect()
}

/// Snapshots go with a cold move (docs/snapshots.md "Moving a VM"). A live migration of a
/// running VM with a snapshot that cannot reach its destination changes nothing (it runs on,
/// its snapshot kept; tests/tests/migration.rs moves one live); stopped, an
/// unfinished revert (the daemon killed at `revert:recorded`) refuses the cold move (4090) and
/// nothing moves. Once the revert ran again, the VM with two snapshots moves: both are listed
/// on the destination, a revert to each there gives back its marker, and the source holds
/// nothing of them.
#[test]
fn snapshots_move_with_a_stopped_vm_and_an_unfinished_revert_refuses_the_move() {
    let mut pair = Pair::start(PairOptions::default());
    let name = "snapmove";
    pair.create(0, &pair.spec(name, 256, "first", false));
    pair.hosts[0].call("vm.snapshot", json!({ "name": name, "snapshot": "older" }));

    // Live to a destination that is not listening: nothing reached, nothing changed.
    let (code, e) = pair.hosts[0]
        .call_err("vm.migrate", json!({ "name": name, "destination": "127.0.0.1:9", "secret": "00".repeat(32) }));
    assert_eq!((code, e.details["step"].clone()), (4001, json!("connect")), "{e:?}");
    let v = status(&pair, 0, name).expect("vm");
    assert_eq!(v["status"], "running", "{v}");
    assert!(v.get("migration").is_none_or(Value::is_null), "{v}");
    assert_eq!(snapshot_names(&pair, 0, name), ["older"]);

    pair.hosts[0].call("vm.stop", json!({ "name": name }));
    let disk = data_disk(&pair.hosts[0], name);
    assert_eq!(disk_mark(&disk), "VMHOSTMARK:first");
    set_mark(&disk, "second");
    pair.hosts[0].call("vm.snapshot", json!({ "name": name, "snapshot": "newer" }));

    // A revert interrupted after its intent was recorded: the cold move is refused.
    pair.hosts[0].crash_during("revert:recorded", "vm.revert", json!({ "name": name, "snapshot": "older" }));
    let (code, e) =
        pair.hosts[0].call_err("vm.move", json!({ "name": name, "destination": ADDRS[1], "secret": "00".repeat(32) }));
    assert_eq!(code, 4090, "{e:?}");
    assert!(e.message.contains("revert"), "{e:?}");
    assert!(status(&pair, 1, name).is_none(), "the destination got something of a refused move");
    let v = status(&pair, 0, name).expect("vm");
    assert_eq!(v["status"], "stopped", "{v}");
    assert!(v.get("migration").is_none_or(Value::is_null), "{v}");
    pair.hosts[0].call("vm.revert", json!({ "name": name, "snapshot": "older" }));
    assert_eq!(disk_mark(&disk), "VMHOSTMARK:first", "the revert ran again");
    set_mark(&disk, "third");

    let out = move_ctl(&pair, name, &[]);
    ctl_ok(&pair, &out, "vmhostctl move of a VM with snapshots");
    let v = status(&pair, 1, name).expect("the destination has the VM");
    assert_eq!(v["status"], "stopped", "{v}");
    assert_eq!(snapshot_names(&pair, 1, name), ["older", "newer"]);
    let dest = data_disk(&pair.hosts[1], name);
    assert_eq!(disk_mark(&dest), "VMHOSTMARK:third", "the VM's own disk as it was");
    let snapshots = pair.hosts[1].state().join("snapshots");
    let left: Vec<_> = std::fs::read_dir(&snapshots)
        .expect("the destination's snapshots")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [name], "only the VM's snapshots, nothing staged: {left:?}");
    assert!(status(&pair, 0, name).is_none(), "the source still has the VM");
    let source = pair.hosts[0].state().join("snapshots").join(name);
    assert!(!source.exists(), "the source kept {}", source.display());

    // Each reverts there to what it held.
    pair.hosts[1].call("vm.revert", json!({ "name": name, "snapshot": "newer" }));
    assert_eq!(disk_mark(&dest), "VMHOSTMARK:second");
    pair.hosts[1].call("vm.revert", json!({ "name": name, "snapshot": "older" }));
    assert_eq!(disk_mark(&dest), "VMHOSTMARK:first");
    pair.hosts[1].call("vm.start", json!({ "name": name }));
    pair.hosts[1].wait_serial_count(name, "VMHOST-COUNT ", 3, Duration::from_secs(120));
}

/// The destination checks every announced file against the spec it admitted before it writes
/// a byte: a raw data disk twice the size its spec gives (grown by hand on the source) is
/// refused (2001 on `files`), nothing is received or left there, and the source keeps the VM.
#[test]
fn a_file_larger_than_its_spec_allows_is_refused_before_anything_is_written() {
    let pair = Pair::start(PairOptions::default());
    let name = "toobig";
    pair.create(0, &pair.spec(name, 256, "big-mark", false));
    pair.hosts[0].call("vm.stop", json!({ "name": name }));
    let disk = data_disk(&pair.hosts[0], name);
    std::fs::OpenOptions::new().write(true).open(&disk).and_then(|f| f.set_len(2 << 30)).expect("grow the disk");

    let incoming = pair.incoming_spec(0, name);
    let prepared = pair.hosts[1].call("vm.migrate_in", json!({ "spec": incoming, "mode": "cold" }));
    let mut c = pair.hosts[0].client();
    c.set_timeout(MOVE).expect("timeout");
    let e = match c.call::<Value>(
        "vm.move",
        json!({ "name": name, "destination": prepared["address"], "secret": prepared["secret"] }),
    ) {
        Ok(v) => panic!("a disk larger than its spec moved: {v}"),
        Err(vmhost::client::ClientError::Api(e)) => e,
        Err(e) => panic!("vm.move: transport error {e}"),
    };
    assert_eq!(e.code.as_i32(), 2001, "{e:?}");
    assert!(e.message.contains("data:data") && e.message.contains("2147483648"), "{e:?}");
    vmhost_tests::wait::until("the destination gave the move up", Duration::from_secs(60), || {
        match status(&pair, 1, name) {
            None => Ok(()),
            Some(v) => Err(format!("still recorded: {v}")),
        }
    });
    let log = pair.hosts[1].daemon_log();
    let received = |l: &&str| l.contains("cold::receive") && l.contains(" received ");
    assert!(!log.lines().any(|l| received(&l)), "a file was received:\n{log}");
    assert!(!pair.hosts[1].state().join("disks").join(name).exists(), "the destination kept its disk directory");
    let v = status(&pair, 0, name).expect("the source keeps the VM");
    assert_eq!(v["status"], "stopped", "{v}");
    assert!(v.get("migration").is_none_or(Value::is_null), "{v}");
    assert_eq!(disk_mark(&disk), "VMHOSTMARK:big-mark");
}

/// The first marker of the qcow2 disk `path` (converted to raw by `qemu-img`, sparse).
fn qcow2_mark(path: &std::path::Path) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let raw = dir.path().join("disk.raw");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(path)
        .arg(&raw)
        .status()
        .expect("run qemu-img");
    assert!(st.success(), "qemu-img convert {}", path.display());
    disk_mark(&raw)
}

/// A snapshot that keeps a qcow2 disk inside its file (an internal snapshot) refuses a live
/// move (4097, reason `internal_snapshots`, before the destination is asked) and goes with a cold move inside the
/// disk file: the destination's disk holds the tag and a revert there brings the marker back.
#[test]
fn internal_snapshots_refuse_a_live_move_and_go_with_a_cold_one_inside_the_disk() {
    let pair = Pair::start(PairOptions::default());
    let name = "inmove";
    let mut spec = pair.spec(name, 256, "first", false);
    spec["disks"].as_array_mut().expect("disks").push(json!({ "name": "logs", "size_gib": 1 }));
    let cmdline = format!("{} vmhost.writemark=logs:first", spec["boot"]["cmdline"].as_str().expect("cmdline"));
    spec["boot"]["cmdline"] = json!(cmdline);
    pair.create(0, &spec);
    let s = pair.hosts[0].call("vm.snapshot", json!({ "name": name, "snapshot": "older" }));
    assert_eq!(s["internal"][0]["name"], "logs", "{s}");
    let tag = s["internal"][0]["tag"].as_str().expect("tag").to_string();

    let (code, e) = pair.hosts[0]
        .call_err("vm.migrate", json!({ "name": name, "destination": ADDRS[1], "secret": "00".repeat(32) }));
    assert_eq!((code, e.details["reason"].as_str()), (4097, Some("internal_snapshots")), "{e:?}");
    assert!(e.message.contains("vm.move"), "{e:?}");
    assert_eq!(status(&pair, 0, name).expect("vm")["status"], "running");

    pair.hosts[0].call("vm.stop", json!({ "name": name }));
    let logs = pair.hosts[0].state().join("disks").join(name).join("logs.qcow2");
    assert_eq!(qcow2_mark(&logs), "VMHOSTMARK:first");
    let st = std::process::Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x41 0 512"])
        .arg(&logs)
        .status()
        .expect("qemu-io");
    assert!(st.success());
    assert_ne!(qcow2_mark(&logs), "VMHOSTMARK:first");

    let out = move_ctl(&pair, name, &[]);
    ctl_ok(&pair, &out, "vmhostctl move of a VM with internal snapshots");
    assert_eq!(snapshot_names(&pair, 1, name), ["older"]);
    let dest = pair.hosts[1].state().join("disks").join(name).join("logs.qcow2");
    let info = std::process::Command::new("qemu-img").args(["info", "-U"]).arg(&dest).output().expect("qemu-img");
    assert!(String::from_utf8_lossy(&info.stdout).contains(&tag), "{info:?}");
    pair.hosts[1].call("vm.revert", json!({ "name": name, "snapshot": "older" }));
    assert_eq!(qcow2_mark(&dest), "VMHOSTMARK:first", "the internal snapshot moved inside the disk");
}
