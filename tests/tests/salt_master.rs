//! The Salt master engine end to end: a real salt-master running `vmhost_engine`, two real
//! salt-minions named as Security Onion names hypervisors (`hv1_hypervisor`, `hv2_hypervisor`)
//! running `vmhost_events`, each pointed at its own real vmhostd (TCG QEMU, own network
//! namespace), and a third hypervisor whose key is accepted but whose minion is down, all on
//! loopback in temp dirs. The engine reads Security Onion `<hypervisor>VMs` files, finds each
//! file's minion by the glob `<hypervisor>_*` and converges both hosts in parallel (the down one
//! fails alone, later than the others finish); VMs are named as SO names them
//! (`sensor1_sensor`); SO's tracking, `.error` and `.status` files and `soc/dyanno/hypervisor/...`
//! events appear, a hardware refusal leaves an `.error` with code 3 until the entry is fixed;
//! each VM gets the bootstrap user-data and its guest prints it from the cloud-init seed.
//! Removing an entry destroys that VM on the right host only and never a VM the engine did not
//! create; daemon events and the engine's results reach the master's event bus under
//! `vmhost/<minion id>/<vm>/<status>`. An edited entry is reconfigured in place (same disk
//! inode, a new QEMU with the new memory); an entry whose VM has another image is reported
//! `reconcile_failed` with the daemon's 2002 and its VM left alone: the engine never replaces.
//! A boot source with `cloud_init: false` gets its bootstrap script through `vm.exec` instead of
//! a seed.
//!
//! Needs `tests/setup.sh` (target/salt-venv with salt 3007) and `cargo build --workspace --bins`.

use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmhost_tests::salt::{free_port, venv, Group, GRACE};
use vmhost_tests::{guest, run_ok, wait, workspace, HostOptions, TestHost, LAN_NETWORK};

/// The failure bound of every wait on salt (a master's start, an event, a VM the engine made).
const WAIT: Duration = Duration::from_secs(300);

const LISTENER: &str = r#"
import json, sys
import salt.config, salt.utils.event
opts = salt.config.master_config(sys.argv[1])
bus = salt.utils.event.get_master_event(opts, opts["sock_dir"], listen=True)
bus.connect_pub()
print("READY", flush=True)
with open(sys.argv[2], "a") as out:
    while True:
        ev = bus.get_event(full=True, wait=5)
        if ev:
            out.write(json.dumps({"tag": ev["tag"], "data": ev["data"]}, default=str) + "\n")
            out.flush()
"#;

struct Salt {
    dir: tempfile::TempDir,
    vms: PathBuf,
    events: PathBuf,
    // Ended by Salt's Drop.
    procs: Vec<Group>,
}

impl Salt {
    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A master and one running minion per `hosts` entry (`(minion id, its vmhostd)`); `down`
    /// names minions whose keys the master has accepted but that never run.
    fn start(hosts: &[(&str, &TestHost)], down: &[&str]) -> Salt {
        Salt::start_with(hosts, down, false, "")
    }

    /// As [`Salt::start`]; with `exec_bootstrap` the engine's one boot source is the agent guest
    /// with `cloud_init: false` and its bootstrap a script, run through `vm.exec`. `engine_extra`
    /// is appended to the engine's config (lines indented six spaces).
    fn start_with(hosts: &[(&str, &TestHost)], down: &[&str], exec_bootstrap: bool, engine_extra: &str) -> Salt {
        let dir = tempfile::Builder::new().prefix("slt").tempdir_in("/tmp").expect("tempdir");
        let d = dir.path().to_path_buf();
        let (publish, ret) = (free_port(), free_port());
        let ext = workspace().join("plugins/salt/src/saltext/vmhost");
        let g = guest();
        let vms = d.join("vms");
        fs::create_dir_all(&vms).expect("vms dir");
        fs::create_dir_all(d.join("master/conf")).expect("master dir");
        let agent = vmhost_tests::agent_guest();
        let exec_engine = format!(
            r#"      timeout: 300
      so_compat: true
      master: salt.so.test
      bootstrap_timeout: 60
      bootstrap: |
        #!/bin/sh
        echo "{{vm_name}} {{master}} {{hypervisor}}" > /root/bootstrapped
      boot:
        default:
          kernel: {kernel}
          initrd: {initrd}
          cmdline: "console=ttyS0 panic=-1 quiet"
          cloud_init: false
"#,
            kernel = agent.kernel.display(),
            initrd = agent.initrd.display(),
        );
        let default_engine = format!(
            r#"      timeout: 60
      so_compat: true
      master: salt.so.test
      bootstrap: |
        #cloud-config
        salt_minion:
          conf:
            id: {{vm_name}}
            master: {{master}}
            grains: {{{{hypervisor: {{hypervisor}}, role: {{role}}}}}}
      boot:
        default:
          kernel: {kernel}
          initrd: {initrd}
          cmdline: "console=ttyS0 panic=-1 quiet"
        roles:
          heavynode: {{image: base.qcow2, disk_gib: 1}}
"#,
            kernel = g.kernel.display(),
            initrd = g.initrd.display(),
        );
        let master = format!(
            r#"root_dir: {d}/master
pki_dir: {d}/master/pki
cachedir: {d}/master/cache
sock_dir: {d}/master/sock
pidfile: {d}/master/master.pid
log_file: {d}/master/master.log
log_level_logfile: info
interface: 127.0.0.1
publish_port: {publish}
ret_port: {ret}
auto_accept: True
user: root
worker_threads: 2
module_dirs: [{ext}]
engines:
  - vmhost_engine:
      vms_dir: {vms}
      network: lan
      poll: 1
      retry: 3
      interval: 600
{engine}{engine_extra}"#,
            d = d.display(),
            ext = ext.display(),
            vms = vms.display(),
            engine = if exec_bootstrap { exec_engine } else { default_engine },
        );
        fs::write(d.join("master/conf/master"), master).expect("master config");
        // Accepted keys of minions that never connect: a hypervisor that is down.
        fs::create_dir_all(d.join("master/pki/minions")).expect("pki dir");
        fs::create_dir_all(d.join("keys")).expect("keys dir");
        for id in down {
            run_ok(
                Command::new(venv("salt-key"))
                    .arg("-c")
                    .arg(d.join("master/conf"))
                    .arg(format!("--gen-keys={id}"))
                    .arg(format!("--gen-keys-dir={}", d.join("keys").display())),
            );
            fs::rename(d.join("keys").join(format!("{id}.pub")), d.join("master/pki/minions").join(id))
                .expect("accept key");
        }
        fs::write(d.join("listen.py"), LISTENER).expect("listener");
        let mut procs = Vec::new();
        let mlog = d.join("master.out");
        procs.push(Group::spawn(
            "salt-master",
            Command::new(venv("salt-master")).arg("-c").arg(d.join("master/conf")),
            &mlog,
        ));
        let events = d.join("events.jsonl");
        let mut salt = Salt { dir, vms, events, procs };

        // The listener subscribes once the master's publisher socket exists.
        let publisher = salt.path("master/sock/master_event_pub.ipc");
        wait::until("salt-master's publisher socket", WAIT, || {
            salt.procs[0].assert_running(&mlog);
            if publisher.exists() {
                Ok(())
            } else {
                Err(format!("no {}; master log:\n{}", publisher.display(), read(&mlog)))
            }
        });
        let llog = salt.path("listener.out");
        let listener = Group::spawn(
            "listener",
            Command::new(venv("python"))
                .arg(salt.path("listen.py"))
                .arg(salt.path("master/conf/master"))
                .arg(&salt.events),
            &llog,
        );
        salt.procs.push(listener);
        wait_for(|| read(&llog).contains("READY"), "the event listener to subscribe", &llog);

        for (id, host) in hosts {
            let md = d.join(id);
            fs::create_dir_all(md.join("conf")).expect("minion dir");
            let minion = format!(
                r#"id: {id}
master: 127.0.0.1
master_port: {ret}
publish_port: {publish}
root_dir: {md}
pki_dir: {md}/pki
cachedir: {md}/cache
sock_dir: {md}/sock
pidfile: {md}/minion.pid
log_file: {md}/minion.log
log_level_logfile: info
user: root
acceptance_wait_time: 1
random_reauth_delay: 0
enable_fqdns_grains: False
enable_gpu_grains: False
module_dirs: [{ext}]
vmhost.socket: {socket}
engines:
  - vmhost_events: {{}}
"#,
                md = md.display(),
                ext = ext.display(),
                socket = host.socket.display(),
            );
            fs::write(md.join("conf/minion"), minion).expect("minion config");
            let log = d.join(format!("{id}.out"));
            salt.procs.push(Group::spawn(
                "salt-minion",
                Command::new(venv("salt-minion")).arg("-c").arg(md.join("conf")),
                &log,
            ));
        }
        // Both minions authenticated (keys auto-accepted) and connected.
        for (id, _) in hosts {
            let tag = format!("salt/minion/{id}/start");
            salt.wait_event(&format!("{id} to start"), |e| e["tag"] == tag.as_str());
        }
        salt
    }

    fn events(&self) -> Vec<Value> {
        read(&self.events).lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    fn wait_event(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        wait::until(&format!("an event for {what}"), WAIT, || {
            self.events()
                .into_iter()
                .find(|e| pred(e))
                .ok_or_else(|| format!("events:\n{}\n{}", read(&self.events), self.logs()))
        })
    }

    /// Waits until `get` gives something other than null.
    fn wait_for_value(&self, what: &str, get: impl Fn() -> Value) -> Value {
        wait::until(what, WAIT, || {
            let v = get();
            if v.is_null() {
                Err(format!("nothing yet\n{}", self.logs()))
            } else {
                Ok(v)
            }
        })
    }

    fn tag_event(&self, tag: &str) -> Value {
        self.wait_event(tag, |e| e["tag"] == tag)
    }

    fn write_vms(&self, hypervisor: &str, entries: Value) {
        // Written aside and renamed: the engine never sees half a file.
        let tmp = self.dir.path().join(format!("{hypervisor}.tmp"));
        fs::write(&tmp, serde_json::to_vec_pretty(&entries).expect("json")).expect("write");
        fs::rename(&tmp, self.vms.join(format!("{hypervisor}VMs"))).expect("rename");
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for f in ["master/master.log", "hv1_hypervisor/minion.log", "hv2_hypervisor/minion.log"] {
            let text = read(&self.path(f));
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out += &format!("--- {f} (tail)\n{}\n", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
        out
    }
}

impl Drop for Salt {
    fn drop(&mut self) {
        // SIGTERM every group at once and give them 3 s together, then SIGKILL what is left;
        // reaping (Group's Drop) is then immediate.
        let groups: Vec<_> = self.procs.iter().map(|p| nix::unistd::Pid::from_raw(-(p.child.id() as i32))).collect();
        for g in &groups {
            let _ = nix::sys::signal::kill(*g, nix::sys::signal::Signal::SIGTERM);
        }
        // (A grace period, not a wait for a fact: SIGKILL follows either way.)
        let _ = wait::poll(GRACE, || {
            if self.procs.iter_mut().any(|p| matches!(p.child.try_wait(), Ok(None))) {
                Err(String::new())
            } else {
                Ok(())
            }
        });
        for g in &groups {
            let _ = nix::sys::signal::kill(*g, nix::sys::signal::Signal::SIGKILL);
        }
        while let Some(p) = self.procs.pop() {
            drop(p);
        }
    }
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_default()
}

fn wait_for(cond: impl Fn() -> bool, what: &str, log: &Path) {
    wait::until_true(what, WAIT, cond, || read(log));
}

/// `{name: (status, pid)}` of a host's VMs.
fn vms(host: &TestHost) -> Vec<(String, String, Option<u64>)> {
    let list = host.call("vm.list", json!({}));
    list.as_array()
        .expect("vm.list array")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap_or_default().to_string(),
                v["status"].as_str().unwrap_or_default().to_string(),
                v["pid"].as_u64(),
            )
        })
        .collect()
}

/// Waits, on the host's events, until it has exactly the VMs `want` (sorted), all running.
fn wait_vms(host: &TestHost, want: &[&str], salt: &Salt) {
    let exactly = |list: &Value| {
        let Some(list) = list.as_array() else { return false };
        list.iter().all(|v| v["status"] == "running")
            && list.iter().map(|v| v["name"].as_str()).eq(want.iter().map(|w| Some(*w)))
    };
    if let Err(e) = host.wait_list(&format!("exactly {want:?} running"), WAIT, exactly) {
        panic!("{e}\n{}", salt.logs());
    }
}

/// An empty qcow2 base image in a host's images dir.
fn base_image(host: &TestHost, name: &str) {
    run_ok(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(host.images().join(name)).arg("64M"));
}

fn so_entry(hostname: &str, role: &str, net: Value) -> Value {
    let mut e =
        json!({ "hostname": hostname, "role": role, "cpu": 1, "memory": 1, "disk": [], "copper": [], "sfp": [] });
    for (k, v) in net.as_object().expect("object") {
        e[k] = v.clone();
    }
    e
}

#[test]
fn master_engine_converges_two_hypervisors_prunes_only_its_vms_and_events_reach_the_master() {
    let opts = || HostOptions { netns: true, extra: LAN_NETWORK.into(), ..HostOptions::default() };
    let hv1 = TestHost::start(opts());
    let hv2 = TestHost::start(opts());
    base_image(&hv1, "base.qcow2");
    base_image(&hv2, "base.qcow2");
    base_image(&hv2, "other.qcow2");
    // A VM on hv2 that the engine did not create: it must survive every prune.
    hv2.call("vm.create", json!({ "spec": hv2.kernel_spec("manual") }));

    let t0 = Instant::now();
    let salt = Salt::start(&[("hv1_hypervisor", &hv1), ("hv2_hypervisor", &hv2)], &["hv0_hypervisor"]);
    eprintln!("salt up after {:?}", t0.elapsed());

    let sensor1 = so_entry(
        "sensor1",
        "sensor",
        json!({"network_mode": "static4", "ip4": "10.0.0.11/24", "gw4": "10.0.0.1",
               "dns4": "10.0.0.1, 10.0.0.2", "search4": "so.test"}),
    );
    let search1 = so_entry(
        "search1",
        "searchnode",
        json!({"network_mode": "dhcp4", "ip4": "", "gw4": "", "dns4": "", "search4": "", "cpu": "1", "memory": "1",
               "nsm_size": 1}),
    );
    let sensor2 =
        so_entry("sensor2", "sensor", json!({"network_mode": "static4", "ip4": "10.0.0.21/24", "gw4": "10.0.0.1"}));
    let broken = so_entry("broken", "sensor", json!({"network_mode": "dhcp4", "cpu": "lots"}));
    // More CPUs than the host has: refused for hardware (SO's code 3) until fixed.
    let big1 = so_entry("big1", "idh", json!({"network_mode": "dhcp4", "cpu": 64}));
    // hv0's minion is down (key accepted, never answers): it sorts first, so a serial engine
    // would make every other hypervisor wait for its timeout.
    salt.write_vms("hv0", json!([so_entry("down1", "idh", json!({"network_mode": "dhcp4"}))]));
    salt.write_vms("hv1", json!([sensor1, search1, big1]));
    salt.write_vms("hv2", json!([sensor2, broken]));
    // A file whose hypervisor has no accepted minion key fails alone.
    salt.write_vms("hv9", json!([so_entry("x", "idh", json!({"network_mode": "dhcp4"}))]));

    wait_vms(&hv1, &["search1_searchnode", "sensor1_sensor"], &salt);
    wait_vms(&hv2, &["manual", "sensor2_sensor"], &salt);
    eprintln!("both hosts converged after {:?}", t0.elapsed());

    // The SO entry became the spec the mapping promises.
    let s1 = hv1.call("vm.get", json!({"name": "sensor1_sensor"}));
    assert_eq!(s1["spec"]["role"], "sensor");
    assert_eq!(s1["spec"]["cpu"], 1);
    assert_eq!(s1["spec"]["memory_mib"], 1024);
    assert_eq!(
        s1["spec"]["nics"],
        json!([{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.11/24", "gateway": "10.0.0.1",
                "dns": ["10.0.0.1", "10.0.0.2"], "search": ["so.test"]}}])
    );
    assert_eq!(s1["spec"]["boot"]["kernel"], json!(guest().kernel));
    let q1 = hv1.call("vm.get", json!({"name": "search1_searchnode"}));
    assert_eq!(q1["spec"]["nics"], json!([{"network": "lan", "ipv4": {"mode": "dhcp"}}]));
    // nsm_size is SO's NSM volume: a raw, preallocated data disk of its own.
    assert_eq!(
        q1["spec"]["disks"],
        json!([{"name": "nsm", "size_gib": 1, "format": "raw", "preallocate": true, "aio": "native"}]),
        "(defaults such as cache none are left out of the echo)"
    );
    let nsm = hv1.state().join("disks").join("search1_searchnode").join("nsm.raw");
    assert!(std::fs::metadata(&nsm).is_ok_and(|m| m.len() == 1 << 30), "{}", nsm.display());

    // Events on the master bus: the daemon's, forwarded by each minion's vmhost_events (the
    // master stamps the authenticated minion id), and the engine's per-VM results.
    for (hyp, vm) in [
        ("hv1_hypervisor", "sensor1_sensor"),
        ("hv1_hypervisor", "search1_searchnode"),
        ("hv2_hypervisor", "sensor2_sensor"),
    ] {
        let e = salt.tag_event(&format!("vmhost/{hyp}/{vm}/running"));
        assert_eq!(e["data"]["id"], hyp, "{e}");
        assert_eq!(e["data"]["data"]["source"], "vmhostd", "{e}");
        assert_eq!(e["data"]["data"]["from"], "creating", "{e}");
        let e = salt.tag_event(&format!("vmhost/{hyp}/{vm}/reconciled"));
        assert_eq!(e["data"]["action"], "create", "{e}");
        assert_eq!(e["data"]["source"], "vmhost_engine", "{e}");
    }
    let bad = salt.tag_event("vmhost/hv2_hypervisor/broken_sensor/invalid");
    assert_eq!(bad["data"]["field"], "cpu", "{bad}");
    assert!(bad["data"]["error"].as_str().unwrap_or_default().contains("hv2VMs"), "{bad}");
    let hv9 = salt.tag_event("vmhost/hv9/_hypervisor/reconcile_failed");
    assert!(hv9["data"]["error"].as_str().unwrap_or_default().contains("no accepted minion key matches"), "{hv9}");

    // Security Onion's files under vms/<hypervisor>/ and its status events.
    let so = |hyp: &str, file: &str| -> Value {
        serde_json::from_str(&read(&salt.vms.join(hyp).join(file))).unwrap_or(Value::Null)
    };
    assert_eq!(so("hv1", "sensor1_sensor"), json!({ "config": sensor1 }), "tracking file");
    // SO writes JSON with an indent of 2.
    assert!(read(&salt.vms.join("hv1/sensor1_sensor")).starts_with("{\n  \"config\": {\n    \""), "indent 2");
    assert_eq!(so("hv2", "sensor2_sensor"), json!({ "config": sensor2 }), "tracking file");
    let status = so("hv1", "sensor1_sensor.status");
    assert_eq!(status["status"], "Created Instance", "{status}");
    let keys: Vec<&String> = status.as_object().expect("status object").keys().collect();
    assert_eq!(keys, ["status", "timestamp"], "{status}");
    for (step, tag) in [("Processing", "processing"), ("Created Instance", "created instance")] {
        let tag = format!("soc/dyanno/hypervisor/{tag}");
        let e = salt.wait_event(&tag, |e| e["tag"] == tag.as_str() && e["data"]["vm_name"] == "sensor1_sensor");
        let mut data = e["data"].clone();
        data.as_object_mut().expect("object").remove("_stamp");
        assert_eq!(data, json!({"vm_name": "sensor1_sensor", "hypervisor": "hv1", "status": step}), "{e}");
    }
    // A hardware refusal leaves SO's .error file with code 3.
    let err = salt.wait_for_value("big1's .error file", || so("hv1", "big1_idh.error"));
    assert_eq!(err["status"], "error", "{err}");
    assert_eq!(err["error_details"]["code"], 3, "{err}");
    let message = err["error_details"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("Hardware validation failure: "), "{err}");
    assert_eq!(err["config"]["hostname"], "big1", "{err}");
    assert!(err["timestamp"].is_string(), "{err}");
    salt.wait_event("big1's SO status", |e| {
        e["tag"] == "soc/dyanno/hypervisor/hardware configuration failed" && e["data"]["vm_name"] == "big1_idh"
    });

    // The bootstrap: each VM's user_data makes its salt-minion join as the VM's name, and the
    // guest finds it in its cloud-init seed.
    let s1 = hv1.call("vm.get", json!({"name": "sensor1_sensor"}));
    let user_data = s1["spec"]["user_data"].as_str().expect("user_data").to_string();
    assert!(user_data.contains("id: sensor1_sensor\n") && user_data.contains("master: salt.so.test\n"), "{user_data}");
    assert!(user_data.contains("{hypervisor: hv1, role: sensor}"), "{user_data}");
    assert!(hv1.wait_serial("sensor1_sensor", "VMHOST-USERDATA-END", WAIT), "{}", hv1.serial("sensor1_sensor"));
    assert!(hv1.serial("sensor1_sensor").contains("    id: sensor1_sensor"), "{}", hv1.serial("sensor1_sensor"));

    // The down hypervisor failed alone, and later: hv1's VMs were reconciled before it timed out.
    let hv0 = salt.tag_event("vmhost/hv0_hypervisor/_hypervisor/reconcile_failed");
    assert!(hv0["data"]["error"].as_str().unwrap_or_default().contains("did not answer"), "{hv0}");
    let events = salt.events();
    let at = |tag: &str| events.iter().position(|e| e["tag"] == tag).unwrap_or(usize::MAX);
    assert!(
        at("vmhost/hv1_hypervisor/sensor1_sensor/reconciled")
            < at("vmhost/hv0_hypervisor/_hypervisor/reconcile_failed"),
        "hv1 waited for the down hv0"
    );

    // Fixed: the VM is made and its .error file is gone.
    let big1_fixed = so_entry("big1", "idh", json!({"network_mode": "dhcp4"}));
    salt.write_vms("hv1", json!([sensor1, search1, big1_fixed]));
    wait_vms(&hv1, &["big1_idh", "search1_searchnode", "sensor1_sensor"], &salt);
    salt.tag_event("vmhost/hv1_hypervisor/_hypervisor/reconciled");
    assert!(!salt.vms.join("hv1/big1_idh.error").exists(), "the .error file is removed once the VM succeeded");
    assert_eq!(so("hv1", "big1_idh"), json!({ "config": big1_fixed }));
    assert_eq!(so("hv1", "big1_idh.status")["status"], "Created Instance");
    // The engine's only write: its cache dir.
    let state: Value =
        serde_json::from_str(&read(&salt.path("master/cache/vmhost_engine/state.json"))).expect("engine state");
    assert_eq!(state["hv1"]["managed"], json!(["big1_idh", "search1_searchnode", "sensor1_sensor"]));
    assert_eq!(state["hv2"]["managed"], json!(["sensor2_sensor"]));

    // Removing an entry from hv1's file destroys that VM on hv1 only.
    let before1 = vms(&hv1);
    let before2 = vms(&hv2);
    salt.write_vms("hv1", json!([sensor1]));
    wait_vms(&hv1, &["sensor1_sensor"], &salt);
    let e = salt.tag_event("vmhost/hv1_hypervisor/search1_searchnode/destroyed");
    assert_eq!(e["data"]["id"], "hv1_hypervisor", "{e}");
    salt.wait_event("the engine's destroy result", |e| {
        e["tag"] == "vmhost/hv1_hypervisor/search1_searchnode/reconciled" && e["data"]["action"] == "destroy"
    });
    salt.wait_event("SO's destroyed status", |e| {
        e["tag"] == "soc/dyanno/hypervisor/destroyed instance" && e["data"]["vm_name"] == "search1_searchnode"
    });
    assert!(!salt.vms.join("hv1/search1_searchnode").exists(), "tracking file removed with the VM");
    assert_eq!(so("hv1", "search1_searchnode.status")["status"], "Destroyed Instance");
    let s1_before = before1.iter().find(|v| v.0 == "sensor1_sensor").cloned();
    assert_eq!(vms(&hv1).first().cloned(), s1_before, "sensor1 untouched");
    assert_eq!(vms(&hv2), before2, "hv2 untouched");

    // Removing hv2's last good entry destroys sensor2 but never the VM made by hand.
    salt.write_vms("hv2", json!([broken]));
    wait_vms(&hv2, &["manual"], &salt);
    salt.tag_event("vmhost/hv2_hypervisor/sensor2_sensor/destroyed");
    assert_eq!(vms(&hv2)[0], before2.iter().find(|v| v.0 == "manual").cloned().expect("manual"));
    assert_eq!(vms(&hv1).first().cloned(), s1_before, "hv1 untouched");
    assert!(!salt
        .events()
        .iter()
        .any(|e| e["tag"].as_str().unwrap_or_default().starts_with("vmhost/hv2_hypervisor/manual/")));
    eprintln!("prunes done after {:?}", t0.elapsed());

    // An edited entry is changed in place and keeps its disk. img1 is a heavynode, which the
    // engine config boots from an image (empty: QEMU runs, the guest has no OS and ignores
    // ACPI, so its restart waits for the 30 s power-off timeout host.reconcile uses).
    let img1 = so_entry("img1", "heavynode", json!({"network_mode": "dhcp4"}));
    salt.write_vms("hv1", json!([sensor1, img1]));
    wait_vms(&hv1, &["img1_heavynode", "sensor1_sensor"], &salt);
    salt.wait_event("img1's create", |e| {
        e["tag"] == "vmhost/hv1_hypervisor/img1_heavynode/reconciled" && e["data"]["action"] == "create"
    });
    let ino = vmhost_tests::overlay_ino(&hv1, "img1_heavynode");
    let before = hv1.call("vm.get", json!({"name": "img1_heavynode"}));
    let img1_pid = before["pid"].as_i64().expect("pid");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(img1_pid), "-m"), "1024");
    let s1_pid = hv1.call("vm.get", json!({"name": "sensor1_sensor"}))["pid"].clone();

    // The engine never replaces: a VM whose image differs from what its entry maps to gets the
    // daemon's 2002 and is left alone. A VM made by hand on hv2 with another image, then claimed
    // by an entry, meets the same plan entry as a change of the engine's boot image would.
    let img2_spec = json!({"name": "img2_heavynode", "role": "heavynode", "cpu": 1, "memory_mib": 1024,
        "boot": {"image": "other.qcow2", "disk_gib": 1}, "nics": [{"network": "lan", "ipv4": {"mode": "dhcp"}}]});
    hv2.call("vm.create", json!({ "spec": img2_spec }));
    let img2_before = hv2.call("vm.get", json!({"name": "img2_heavynode"}));
    let manual_before = vms(&hv2).into_iter().find(|v| v.0 == "manual");

    let mut img1_more = img1.clone();
    img1_more["memory"] = json!(2);
    let t1 = Instant::now();
    salt.write_vms("hv1", json!([sensor1, img1_more]));
    salt.write_vms("hv2", json!([broken, so_entry("img2", "heavynode", json!({"network_mode": "dhcp4"}))]));
    let e = salt.wait_event("img1's reconfigure", |e| {
        e["tag"] == "vmhost/hv1_hypervisor/img1_heavynode/reconciled" && e["data"]["action"] == "reconfigure"
    });
    eprintln!("img1 reconfigured after {:?}", t1.elapsed());
    assert_eq!((&e["data"]["ok"], &e["data"]["changed"]), (&json!(true), &json!(true)), "{e}");
    assert_eq!((&e["data"]["fields"], &e["data"]["restart"]), (&json!(["memory_mib"]), &json!(true)), "{e}");
    let after = hv1.call("vm.get", json!({"name": "img1_heavynode"}));
    assert_eq!((&after["status"], &after["spec"]["memory_mib"]), (&json!("running"), &json!(2048)), "{after}");
    let new_pid = after["pid"].as_i64().expect("pid");
    assert_ne!(new_pid, img1_pid, "restarted for the change");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(new_pid), "-m"), "2048");
    assert_eq!(vmhost_tests::overlay_ino(&hv1, "img1_heavynode"), ino, "the disk is kept");
    assert_eq!(after["created_at"], before["created_at"], "not recreated");
    assert_eq!(hv1.call("vm.get", json!({"name": "sensor1_sensor"}))["pid"], s1_pid, "sensor1 untouched");

    let f = salt.tag_event("vmhost/hv2_hypervisor/img2_heavynode/reconcile_failed");
    assert_eq!((&f["data"]["action"], &f["data"]["ok"]), (&json!("replace"), &json!(false)), "{f}");
    assert_eq!(
        (&f["data"]["error"]["code"], &f["data"]["error"]["field"]),
        (&json!(2002), &json!("spec.boot.image")),
        "{f}"
    );
    // The hand-made VM has no user_data; the engine gives every VM its bootstrap.
    assert_eq!(f["data"]["fields"], json!(["boot.image", "user_data"]), "{f}");
    assert!(f["data"]["hint"].as_str().unwrap_or_default().contains("never replaces"), "{f}");
    let img2_after = hv2.call("vm.get", json!({"name": "img2_heavynode"}));
    assert_eq!(
        (&img2_after["pid"], &img2_after["spec"], &img2_after["created_at"]),
        (&img2_before["pid"], &img2_before["spec"], &img2_before["created_at"]),
        "img2 left alone"
    );
    assert_eq!(vms(&hv2).into_iter().find(|v| v.0 == "manual"), manual_before, "manual untouched");
    assert!(
        !salt.events().iter().any(|e| e["data"]["action"] == "replace" && e["data"]["ok"] == true),
        "nothing was replaced"
    );
    eprintln!("edits done after {:?}", t0.elapsed());
    drop(salt);
    eprintln!("salt stopped after {:?}", t0.elapsed());
}

/// A boot source with `cloud_init: false`: the VM gets no user_data, and the engine runs the
/// bootstrap script through the hypervisor minion's `vmhost.guest_file_push` and
/// `vmhost.guest_exec` once the guest's exec server answers (`bootstrap_waiting` until then).
#[test]
fn a_vm_without_cloud_init_gets_its_bootstrap_through_exec() {
    let extra = format!("{LAN_NETWORK}\n[agent]\nallow_exec = true\n");
    let hv1 = TestHost::start(HostOptions { netns: true, extra, ..HostOptions::default() });
    let salt = Salt::start_with(&[("hv1_hypervisor", &hv1)], &[], true, "");
    salt.write_vms("hv1", json!([so_entry("idh1", "idh", json!({"network_mode": "dhcp4"}))]));
    let done = salt.tag_event("vmhost/hv1_hypervisor/idh1_idh/bootstrapped");
    assert_eq!(done["data"]["exit_code"], 0, "{done}");
    let vm = hv1.call("vm.get", json!({"name": "idh1_idh"}));
    assert!(vm["spec"]["user_data"].is_null(), "no seed for a guest without cloud-init: {vm}");
    let out = hv1.ctl(&["exec", "idh1_idh", "--", "cat", "/root/bootstrapped"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "idh1_idh salt.so.test hv1\n", "{out:?}\n{}", salt.logs());
    let runs = salt.events().iter().filter(|e| e["tag"] == "vmhost/hv1_hypervisor/idh1_idh/bootstrapped").count();
    assert_eq!(runs, 1, "once per VM");
}

/// The engine's `capture_interface` (issue 31): with `capture_interface: span0` (a veth in the
/// hypervisor's netns, listed in its vmhostd's `[capture] interfaces`), the sensor's VM gets a
/// second NIC `{mode: monitor, source: span0}` after its addressed one and runs with it
/// attached, and the search node's VM (not a sniffing role) gets none.
#[test]
fn the_engine_gives_sensors_a_monitor_nic_of_the_capture_interface() {
    let extra = format!("{LAN_NETWORK}\n[capture]\ninterfaces = [\"span0\"]\n");
    let hv1 = TestHost::start(HostOptions { netns: true, extra, ..HostOptions::default() });
    hv1.ip(&["link", "add", "span0", "type", "veth", "peer", "name", "span0p"]);
    for link in ["span0", "span0p"] {
        hv1.ip(&["link", "set", link, "up"]);
    }
    let salt = Salt::start_with(&[("hv1_hypervisor", &hv1)], &[], false, "      capture_interface: span0\n");
    let dhcp = || json!({"network_mode": "dhcp4"});
    salt.write_vms("hv1", json!([so_entry("sensor1", "sensor", dhcp()), so_entry("search1", "searchnode", dhcp())]));
    wait_vms(&hv1, &["search1_searchnode", "sensor1_sensor"], &salt);
    let sensor = hv1.call("vm.get", json!({"name": "sensor1_sensor"}));
    let nics = &sensor["spec"]["nics"];
    assert_eq!(nics[0]["network"], "lan", "{sensor}");
    assert_eq!(nics[1], json!({"mode": "monitor", "source": "span0"}), "{sensor}");
    assert_eq!(sensor["nics"][1]["capture"], "attached", "{sensor}");
    let search = hv1.call("vm.get", json!({"name": "search1_searchnode"}));
    assert_eq!(search["spec"]["nics"].as_array().map(Vec::len), Some(1), "{search}");
}
