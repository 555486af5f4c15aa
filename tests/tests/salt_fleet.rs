//! The Salt runner moving real VMs between real vmhostds (issue 32 item 5, docs/salt.md
//! "Runner"): three vmhostds (`h1`, `h2`, `h3`; 4, 6 and 8 GiB) in three network namespaces on
//! one migration bridge ([`vmhost_tests::migration_pair::Fleet`]), a real salt-master and three
//! real salt-minions (Salt 3007 from target/salt-venv, on loopback in a temp dir), each
//! minion's `vmhost` execution module pointed at its host's vmhostd socket, the runner loaded
//! from the checkout (`runner_dirs`).
//!
//! On `h1` two running counter guests with the role `sensor` (each prints its boot id and a
//! counter; each wrote a marker on its data disk) and one VM created stopped. `salt-run
//! vmhost.evacuate host=h1 dry_run=True` answers a plan and moves nothing; `salt-run
//! vmhost.evacuate host=h1` then runs it: every VM is where the plan said (each vmhostd's
//! `vm.get`), the sensors apart (anti-affinity), the running ones still running with the same
//! boot id and a counter that went on (live, no restart), their markers on the destinations'
//! disks, the stopped one stopped; `h1` holds no VM, no QEMU, no record, no disk, no tap.
//! `salt-run vmhost.migrate vm=s2 to=h3` moves a sensor again, live; `salt-run vmhost.place`
//! answers the host with room and no sensor for a sensor spec (not the one with the most free
//! memory, which holds both sensors), and that one for a spec without a role.
//!
//! Needs `tests/setup.sh` (target/salt-venv with salt 3007) and `cargo build --workspace --bins`.

use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmhost_tests::migration_pair::{
    assert_clean_of, counter_spec, create_counter, data_disk, disk_mark, parse_tick, taps_of, Fleet,
};
use vmhost_tests::salt::{free_port, venv, Group};
use vmhost_tests::{wait, workspace, TestHost};

/// The failure bound of waits on Salt (the minions' start) and of each `salt-run`.
const WAIT: Duration = Duration::from_secs(300);

/// Minion ids, in the fleet's host order.
const IDS: [&str; 3] = ["h1", "h2", "h3"];

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_default()
}

/// A salt-master whose runner is the checkout's and one minion per host.
struct Salt {
    dir: tempfile::TempDir,
    // Ended by Drop, minions first.
    procs: Vec<Group>,
}

impl Salt {
    fn start(hosts: &[TestHost]) -> Salt {
        let dir = tempfile::Builder::new().prefix("slf").tempdir_in("/tmp").expect("tempdir");
        let d = dir.path().to_path_buf();
        let (publish, ret) = (free_port(), free_port());
        let ext = workspace().join("plugins/salt/src/saltext/vmhost");
        fs::create_dir_all(d.join("master")).expect("master dir");
        // JSON is YAML: the configs are written with serde_json, no quoting by hand.
        let master = json!({
            "root_dir": d.join("master-root"),
            "interface": "127.0.0.1",
            "publish_port": publish,
            "ret_port": ret,
            "auto_accept": true,
            "user": "root",
            "worker_threads": 2,
            "runner_dirs": [ext.join("runners")],
            "vmhost_runner": {"hosts": "h*", "timeout": 60},
            "log_file": d.join("master.log"),
            "log_level_logfile": "info",
        });
        fs::write(d.join("master/master"), master.to_string()).expect("master config");
        let mut procs = vec![Group::spawn(
            "salt-master",
            Command::new(venv("salt-master")).arg("-c").arg(d.join("master")),
            &d.join("master.out"),
        )];
        for (id, host) in IDS.iter().zip(hosts) {
            let conf = d.join(id);
            fs::create_dir_all(&conf).expect("minion dir");
            let minion = json!({
                "id": id,
                "master": "127.0.0.1",
                "master_port": ret,
                "publish_port": publish,
                "root_dir": d.join(format!("{id}-root")),
                "user": "root",
                "acceptance_wait_time": 1,
                "random_reauth_delay": 0,
                "enable_fqdns_grains": false,
                "enable_gpu_grains": false,
                "module_dirs": [ext.join("modules")],
                "vmhost": {"socket": host.socket, "timeout": 60},
                "log_file": d.join(format!("{id}.log")),
                "log_level_logfile": "info",
            });
            fs::write(conf.join("minion"), minion.to_string()).expect("minion config");
            procs.push(Group::spawn(
                id,
                Command::new(venv("salt-minion")).arg("-c").arg(&conf),
                &d.join(format!("{id}.out")),
            ));
        }
        let salt = Salt { dir, procs };
        // Keys are auto-accepted; a minion counts once it answers.
        wait::until("the three minions to answer test.ping", WAIT, || {
            let out = salt.salt(&["h*", "test.ping"]);
            let up: Vec<&str> = IDS.iter().copied().filter(|id| out[*id] == true).collect();
            if up.len() == IDS.len() {
                Ok(())
            } else {
                Err(format!("answered: {out}\n{}", salt.logs()))
            }
        });
        salt
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("master")
    }

    /// `salt --out=json --static -t 10 ARGS`: its JSON, null when it printed none.
    fn salt(&self, args: &[&str]) -> Value {
        let out = Command::new(venv("salt"))
            .arg("-c")
            .arg(self.conf())
            .args(["--out=json", "--static", "-t", "10"])
            .args(args)
            .output()
            .expect("run salt");
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// `salt-run --out=json ARGS`: its exit code and JSON answer.
    ///
    /// # Panics
    /// When it prints no JSON.
    fn run(&self, args: &[&str]) -> (i32, Value) {
        let started = Instant::now();
        let out = Command::new(venv("salt-run"))
            .arg("-c")
            .arg(self.conf())
            .arg("--out=json")
            .args(args)
            .output()
            .expect("run salt-run");
        eprintln!("salt-run {} took {:?}", args.join(" "), started.elapsed());
        let answer = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "salt-run {args:?} printed no JSON ({e}), rc {:?}\nstdout: {}\nstderr: {}\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.logs()
            )
        });
        (out.status.code().unwrap_or(-1), answer)
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for f in ["master.log", "h1.log", "h2.log", "h3.log"] {
            let text = read(&self.dir.path().join(f));
            let lines: Vec<&str> = text.lines().collect();
            out += &format!("--- {f} (tail)\n{}\n", lines[lines.len().saturating_sub(30)..].join("\n"));
        }
        out
    }
}

impl Drop for Salt {
    fn drop(&mut self) {
        while let Some(p) = self.procs.pop() {
            drop(p);
        }
    }
}

/// The counter lines (`(boot id, count)`) of `name`'s console on `h`.
fn ticks(h: &TestHost, name: &str) -> Vec<(String, u64)> {
    h.serial(name).lines().filter_map(parse_tick).collect()
}

/// What a running VM showed on its source before a move: boot id and last count.
fn last_tick(h: &TestHost, name: &str) -> (String, u64) {
    ticks(h, name).pop().unwrap_or_else(|| panic!("no counter line of {name}: {}", h.serial(name)))
}

/// Asserts `name` runs on `h` as the same boot that printed `before` on its source: ticks
/// with that boot id only, going on past the count seen there. Waits for 5 ticks.
fn assert_continues(h: &TestHost, name: &str, before: &(String, u64)) {
    let seen = wait::until(&format!("{name}'s counter on its destination"), Duration::from_secs(120), || {
        let t = ticks(h, name);
        if t.len() >= 5 {
            Ok(t)
        } else {
            Err(format!("{} ticks; serial:\n{}", t.len(), h.serial(name)))
        }
    });
    assert!(seen.iter().all(|(boot, _)| *boot == before.0), "{name} restarted: boot ids {seen:?}, before {before:?}");
    assert!(seen[0].1 > before.1, "{name}'s counter did not go on: {} on the source, then {seen:?}", before.1);
}

/// `(name, status)` of every VM `h` has, sorted.
fn vms(h: &TestHost) -> Vec<(String, String)> {
    let list = h.call("vm.list", json!({}));
    let mut v: Vec<(String, String)> = list
        .as_array()
        .expect("vm.list array")
        .iter()
        .map(|v| (v["name"].as_str().unwrap_or_default().into(), v["status"].as_str().unwrap_or_default().into()))
        .collect();
    v.sort();
    v
}

fn list(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items.iter().map(|(n, s)| (n.to_string(), s.to_string())).collect()
}

/// The runner's list of moves (`plan.moves`, `done`) as (vm, to, mode).
fn moves_of(list: &Value) -> Vec<(String, String, String)> {
    let text = |m: &Value, key: &str| m[key].as_str().unwrap_or_default().to_string();
    let moves = list.as_array().unwrap_or_else(|| panic!("not a list of moves: {list}"));
    moves.iter().map(|m| (text(m, "vm"), text(m, "to"), text(m, "mode"))).collect()
}

fn host_index(id: &str) -> usize {
    IDS.iter().position(|i| *i == id).unwrap_or_else(|| panic!("{id} is not a fleet minion"))
}

fn sensor(name: &str, mark: &str) -> Value {
    let mut spec = counter_spec(name, 256, mark, false);
    spec["role"] = json!("sensor");
    spec
}

#[test]
fn evacuate_through_a_real_salt_master_moves_real_vms_as_the_plan_said() {
    let t0 = Instant::now();
    let fleet = Fleet::start(&[4, 6, 8]);
    let h = &fleet.hosts;
    create_counter(&h[0], &sensor("s1", "s1-mark"));
    create_counter(&h[0], &sensor("s2", "s2-mark"));
    let mut db = counter_spec("db", 128, "db-mark", false);
    db["role"] = json!("db");
    db["state"] = json!("stopped");
    db.as_object_mut().expect("spec").remove("disks");
    h[0].call("vm.create", json!({ "spec": db }));
    let taps: Vec<(String, Vec<String>)> =
        ["s1", "s2", "db"].iter().map(|n| (n.to_string(), taps_of(&h[0], n))).collect();
    let macs: Vec<Value> = ["s1", "s2", "db"]
        .iter()
        .map(|n| h[0].call("vm.get", json!({ "name": n }))["nics"][0]["mac"].clone())
        .collect();
    for n in ["s1", "s2"] {
        assert_eq!(disk_mark(&data_disk(&h[0], n)), format!("VMHOSTMARK:{n}-mark"));
    }
    eprintln!("three hosts and three VMs after {:?}", t0.elapsed());
    let salt = Salt::start(h);
    eprintln!("salt up after {:?}", t0.elapsed());

    // The plan: the largest first (s1, s2: 256 MiB, by name), each to the host with the most
    // free memory that holds no VM of its role; h1 is being emptied.
    let (rc, dry) = salt.run(&["vmhost.evacuate", "host=h1", "dry_run=True"]);
    assert_eq!(rc, 0, "{dry}");
    let plan = &dry["plan"];
    let moves = moves_of(&plan["moves"]);
    let want = |v: &str, to: &str, mode: &str| (v.to_string(), to.to_string(), mode.to_string());
    assert_eq!(moves, [want("s1", "h3", "live"), want("s2", "h2", "live"), want("db", "h3", "cold")], "{dry}");
    assert_eq!((&plan["unmovable"], &plan["unplaced"], &dry["skipped"]), (&json!([]), &json!([]), &json!({})), "{dry}");
    assert_eq!(vms(&h[0]), list(&[("db", "stopped"), ("s1", "running"), ("s2", "running")]), "a dry run moves nothing");
    assert!(vms(&h[1]).is_empty() && vms(&h[2]).is_empty(), "a dry run prepares nothing");

    let before: Vec<(String, u64)> = ["s1", "s2"].iter().map(|n| last_tick(&h[0], n)).collect();
    let (rc, done) = salt.run(&["vmhost.evacuate", "host=h1"]);
    assert_eq!(rc, 0, "{done}\n{}", salt.logs());
    assert_eq!(done["result"], true, "{done}");
    assert_eq!(done["failed"], json!([]), "{done}");
    assert_eq!(&done["plan"], plan, "the plan run is the plan shown");
    let reported = moves_of(&done["done"]);
    assert_eq!(reported, moves, "{done}");
    for m in done["done"].as_array().expect("done") {
        eprintln!("{} -> {} ({}): {}", m["vm"], m["to"], m["mode"], m["outcome"]);
    }

    // Every VM is where the plan said, as its vmhostd says.
    for (i, (vm, to, _)) in moves.iter().enumerate() {
        let dest = &h[host_index(to)];
        let v = dest.call("vm.get", json!({ "name": vm }));
        let status = if vm == "db" { "stopped" } else { "running" };
        assert_eq!(v["status"], status, "{vm} on {to}: {v}");
        assert_eq!(v["nics"][0]["mac"], macs[i], "{vm} kept its MAC");
        for (j, id) in IDS.iter().enumerate() {
            if *id != to.as_str() {
                assert!(h[j].client().call::<Value>("vm.get", json!({ "name": vm })).is_err(), "{vm} is also on {id}");
            }
        }
    }
    assert_eq!(vms(&h[1]), list(&[("s2", "running")]));
    assert_eq!(vms(&h[2]), list(&[("db", "stopped"), ("s1", "running")]));
    assert_eq!(h[2].qemu_pids().len(), 1, "h3 runs s1 only (db is stopped)");
    assert_eq!(h[1].qemu_pids().len(), 1, "h2 runs s2");
    // Live: the same boot, the counter going on; the marker written before the move.
    assert_continues(&h[2], "s1", &before[0]);
    assert_continues(&h[1], "s2", &before[1]);
    assert_eq!(disk_mark(&data_disk(&h[2], "s1")), "VMHOSTMARK:s1-mark");
    assert_eq!(disk_mark(&data_disk(&h[1], "s2")), "VMHOSTMARK:s2-mark");

    // h1 holds nothing: no VM, no QEMU, no record, no disk, no tap, no kept disk.
    assert!(vms(&h[0]).is_empty(), "{:?}", vms(&h[0]));
    for (vm, vm_taps) in &taps {
        assert_clean_of(&h[0], vm, vm_taps);
    }
    for dir in ["vms", "disks", "kept-disks"] {
        let left: Vec<String> = fs::read_dir(h[0].state().join(dir))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "h1's state dir {dir}/ kept {left:?}");
    }
    eprintln!("evacuated after {:?}", t0.elapsed());

    // One more move through the runner: s2 from h2 to h3, found by asking the minions.
    let before = last_tick(&h[1], "s2");
    let s2_taps = taps_of(&h[1], "s2");
    let (rc, moved) = salt.run(&["vmhost.migrate", "vm=s2", "to=h3"]);
    assert_eq!(rc, 0, "{moved}\n{}", salt.logs());
    assert_eq!((&moved["from"], &moved["to"], &moved["mode"]), (&json!("h2"), &json!("h3"), &json!("live")), "{moved}");
    assert_eq!(h[2].call("vm.get", json!({ "name": "s2" }))["status"], "running");
    assert_continues(&h[2], "s2", &before);
    assert_eq!(disk_mark(&data_disk(&h[2], "s2")), "VMHOSTMARK:s2-mark");
    assert_clean_of(&h[1], "s2", &s2_taps);
    assert!(vms(&h[1]).is_empty(), "{:?}", vms(&h[1]));

    // place: h3 has the most free memory but both sensors; a sensor goes to the host with
    // the most free memory among those without one (h2), a VM without a role to h3.
    let mut s3 = sensor("s3", "s3-mark");
    let (rc, placed) = salt.run(&["vmhost.place", &format!("spec={s3}")]);
    assert_eq!(rc, 0, "{placed}");
    assert_eq!(
        (&placed["host"], &placed["key"], &placed["sharing"]),
        (&json!("h2"), &json!("sensor"), &json!([])),
        "{placed}"
    );
    let ranking: Vec<&str> =
        placed["ranking"].as_array().expect("ranking").iter().filter_map(|r| r["host"].as_str()).collect();
    assert_eq!(ranking, ["h2", "h1", "h3"], "{placed}");
    s3.as_object_mut().expect("spec").remove("role");
    let (rc, placed) = salt.run(&["vmhost.place", &format!("spec={s3}")]);
    assert_eq!(rc, 0, "{placed}");
    assert_eq!(placed["host"], "h3", "{placed}");
    eprintln!("done after {:?}", t0.elapsed());
}
