//! The Salt extension end to end: real `salt-call --local` (Salt 3007 from `target/salt-venv`,
//! made by `tests/setup.sh`) runs the `vmhost` states and execution module against a real vmhostd
//! and real QEMU (TCG). Both ways of loading the modules are used: synced from `salt://_modules`
//! and `salt://_states`, and the `saltext.vmhost` distribution installed with pip (its
//! `salt.loader` entry points), which must be the only thing that makes the module available.

use serde_json::{json, Map, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use vmhost_tests::{alive, run_ok, workspace, HostOptions, TestHost};

/// How the minion finds the vmhost modules.
enum Loading {
    /// Copies in `file_roots` (`_modules/vmhost.py`, `_states/vmhost.py`), then `saltutil.sync_all`.
    Sync,
    /// `pip install --target` of plugins/salt; the dir is put on PYTHONPATH.
    Extension,
}

/// A masterless minion configuration in a temp dir, pointed at one test host.
struct Minion {
    dir: tempfile::TempDir,
    pythonpath: Option<PathBuf>,
}

fn venv_bin(name: &str) -> PathBuf {
    let p = workspace().join("target/salt-venv/bin").join(name);
    assert!(p.exists(), "{} not found: run tests/setup.sh first", p.display());
    p
}

fn plugin_src() -> PathBuf {
    workspace().join("plugins/salt/src/saltext/vmhost")
}

impl Minion {
    fn new(host: &TestHost, loading: Loading) -> Minion {
        let dir = tempfile::Builder::new().prefix("vmhsalt").tempdir().expect("tempdir");
        let d = dir.path();
        let srv = d.join("srv");
        fs::create_dir_all(&srv).expect("mkdir srv");
        let socket = host.socket.display().to_string();
        let mut conf = format!(
            "root_dir: {root}\nfile_client: local\nfile_roots:\n  base:\n    - {srv}\n",
            root = d.join("root").display(),
            srv = srv.display()
        );
        let mut pythonpath = None;
        match loading {
            Loading::Sync => {
                // The socket from the minion config (nested form).
                conf.push_str(&format!("vmhost:\n  socket: {socket}\n"));
                for kind in ["modules", "states"] {
                    fs::create_dir_all(srv.join(format!("_{kind}"))).expect("mkdir");
                    fs::copy(plugin_src().join(kind).join("vmhost.py"), srv.join(format!("_{kind}/vmhost.py")))
                        .expect("copy module");
                }
            }
            Loading::Extension => {
                // The socket from pillar.
                let pillar = d.join("pillar");
                fs::create_dir_all(&pillar).expect("mkdir pillar");
                fs::write(pillar.join("top.sls"), "base:\n  '*':\n    - vmhost\n").expect("pillar top");
                fs::write(pillar.join("vmhost.sls"), format!("vmhost:\n  socket: {socket}\n")).expect("pillar");
                conf.push_str(&format!("pillar_roots:\n  base:\n    - {}\n", pillar.display()));
                pythonpath = Some(install_extension(d));
            }
        }
        fs::write(d.join("minion"), conf).expect("write minion config");
        Minion { dir, pythonpath }
    }

    /// Runs `salt-call --local -c DIR --out=json ARGS`.
    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(venv_bin("salt-call"));
        cmd.args(["--local", "--out=json", "-c"]).arg(self.dir.path()).args(args);
        if let Some(p) = &self.pythonpath {
            cmd.env("PYTHONPATH", p);
        }
        cmd.output().expect("run salt-call")
    }

    /// Runs `salt-call` and returns the `local` member of its JSON output.
    fn call(&self, args: &[&str]) -> Value {
        let out = self.run(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!("salt-call {args:?}: {e}\nstdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr))
        });
        v["local"].clone()
    }

    /// Writes `srv/NAME.sls` (JSON renderer) with one state `ID: {FUN: [args...]}`.
    fn sls(&self, name: &str, id: &str, fun: &str, args: &Map<String, Value>) {
        let list: Vec<Value> = args.iter().map(|(k, v)| json!({ k.as_str(): v })).collect();
        let text = format!("#!json\n{}\n", json!({ id: { fun: list } }));
        fs::write(self.dir.path().join("srv").join(format!("{name}.sls")), text).expect("write sls");
    }

    /// Applies an sls and returns the result of its single state.
    fn apply(&self, sls: &str, test: bool) -> Value {
        let local = self.call(&["state.apply", sls, if test { "test=True" } else { "test=False" }]);
        let states = local.as_object().unwrap_or_else(|| panic!("state.apply {sls} did not run: {local}"));
        assert_eq!(states.len(), 1, "{local}");
        states.values().next().cloned().unwrap_or_default()
    }
}

/// `pip install --no-deps --target` of a copy of plugins/salt (the build writes into its source
/// tree). pip fetches the build backend (setuptools) from the package index, as on any machine.
fn install_extension(dir: &Path) -> PathBuf {
    let copy = dir.join("plugin-src");
    let st = Command::new("cp").arg("-r").arg(workspace().join("plugins/salt")).arg(&copy).status().expect("cp");
    assert!(st.success());
    let _ = fs::remove_dir_all(copy.join("tests"));
    let target = dir.join("site");
    let out = Command::new(venv_bin("pip"))
        .args(["install", "-q", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&target)
        .arg(&copy)
        .output()
        .expect("run pip");
    assert!(out.status.success(), "pip install failed: {}", String::from_utf8_lossy(&out.stderr));
    target
}

/// The spec's members but `name`, as state arguments.
fn args_of(spec: &Value) -> Map<String, Value> {
    let mut m = spec.as_object().cloned().unwrap_or_default();
    m.remove("name");
    m
}

fn get_err(host: &TestHost, name: &str) -> i32 {
    host.call_err("vm.get", json!({ "name": name })).0
}

#[test]
fn synced_states_create_converge_predict_and_destroy() {
    let host = TestHost::start(HostOptions::default());
    let minion = Minion::new(&host, Loading::Sync);
    let synced = minion.call(&["saltutil.sync_all"]);
    assert_eq!(synced["modules"], json!(["modules.vmhost"]), "{synced}");
    assert_eq!(synced["states"], json!(["states.vmhost"]), "{synced}");

    let spec = host.kernel_spec("web");
    minion.sls("web", "web", "vmhost.running", &args_of(&spec));

    // test=True: the daemon's dry run predicts a create, and nothing is created.
    let r = minion.apply("web", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert_eq!(r["changes"]["action"], "create", "{r}");
    assert!(r["comment"].as_str().unwrap_or("").contains("would be created"), "{r}");
    assert_eq!(get_err(&host, "web"), 4040, "test=True must not create");

    let r = minion.apply("web", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(r["changes"]["old"], Value::Null, "{r}");
    assert_eq!(r["changes"]["new"]["status"], "running", "{r}");
    let vm = host.call("vm.get", json!({ "name": "web" }));
    assert_eq!(vm["status"], "running");
    let pid = vm["pid"].as_i64().expect("pid") as i32;
    assert!(alive(pid));
    assert_eq!(r["changes"]["new"]["pid"], pid);

    // Second run: nothing to do.
    let r = minion.apply("web", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");
    assert_eq!(host.call("vm.get", json!({ "name": "web" }))["pid"], pid);

    // The execution module sees the same VM.
    let listed = minion.call(&["vmhost.list"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["name"], "web");

    // stopped under test=True: a stop is predicted, the VM keeps running.
    minion.sls("webstop", "web", "vmhost.stopped", &args_of(&spec));
    let r = minion.apply("webstop", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert_eq!(r["changes"]["action"], "stop", "{r}");
    let vm = host.call("vm.get", json!({ "name": "web" }));
    assert_eq!((&vm["status"], &vm["pid"]), (&json!("running"), &json!(pid)), "test=True must not stop");

    // absent under test=True predicts, then destroys for real, then has nothing to do.
    minion.sls("gone", "web", "vmhost.absent", &Map::new());
    let r = minion.apply("gone", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert_eq!(host.call("vm.get", json!({ "name": "web" }))["pid"], pid, "test=True must not destroy");
    let r = minion.apply("gone", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(r["changes"]["new"], Value::Null, "{r}");
    assert_eq!(r["changes"]["old"]["status"], "running", "{r}");
    assert_eq!(get_err(&host, "web"), 4040);
    assert!(!alive(pid), "destroy kills QEMU");
    let r = minion.apply("gone", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");
}

#[test]
fn stopped_creates_without_qemu_and_present_keeps_the_recorded_run_state() {
    let host = TestHost::start(HostOptions::default());
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let spec = host.kernel_spec("idle");
    minion.sls("idle", "idle", "vmhost.stopped", &args_of(&spec));
    let r = minion.apply("idle", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(r["changes"]["new"]["status"], "stopped", "{r}");
    let vm = host.call("vm.get", json!({ "name": "idle" }));
    assert_eq!((&vm["status"], &vm["pid"]), (&json!("stopped"), &Value::Null));
    assert!(host.qemu_pids().is_empty(), "created stopped: no QEMU");
    assert_eq!(minion.apply("idle", false)["changes"], json!({}), "second run");

    // present keeps the recorded desired state (stopped): nothing to do, under test=True too.
    minion.sls("idlepresent", "idle", "vmhost.present", &args_of(&spec));
    for test in [true, false] {
        let r = minion.apply("idlepresent", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "test={test}: {r}");
    }
    assert_eq!(host.call("vm.get", json!({ "name": "idle" }))["status"], "stopped");

    // running starts it, reporting the run state that changed.
    minion.sls("idlerun", "idle", "vmhost.running", &args_of(&spec));
    let r = minion.apply("idlerun", true);
    assert_eq!((&r["result"], &r["changes"]["action"]), (&Value::Null, &json!("start")), "{r}");
    let r = minion.apply("idlerun", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(r["changes"]["old"]["status"], "stopped", "{r}");
    assert_eq!(r["changes"]["new"]["status"], "running", "{r}");
    assert_eq!(r["changes"]["new"]["spec"], json!({ "state": "running" }), "{r}");
    assert_eq!(host.call("vm.get", json!({ "name": "idle" }))["status"], "running");
}

#[test]
fn invalid_spec_fails_with_the_daemons_code_and_field() {
    let host = TestHost::start(HostOptions::default());
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let mut spec = host.kernel_spec("bad");
    spec["memory_mib"] = json!(16);
    minion.sls("bad", "bad", "vmhost.running", &args_of(&spec));
    for test in [true, false] {
        let r = minion.apply("bad", test);
        assert_eq!(r["result"], false, "test={test}: {r}");
        assert_eq!(r["changes"], json!({}), "{r}");
        let comment = r["comment"].as_str().unwrap_or("");
        assert!(comment.contains("vmhostd error 2001 (spec.memory_mib)"), "test={test}: {comment}");
    }
    assert_eq!(get_err(&host, "bad"), 4040);

    // A NIC on a network the host does not define: 3001 on the NIC's field.
    let mut spec = host.kernel_spec("badnet");
    spec["nics"] = json!([{ "network": "nosuch" }]);
    minion.sls("badnet", "badnet", "vmhost.running", &args_of(&spec));
    let r = minion.apply("badnet", false);
    assert_eq!(r["result"], false, "{r}");
    assert!(r["comment"].as_str().unwrap_or("").contains("vmhostd error 3001 (spec.nics[0].network)"), "{r}");
}

#[test]
fn the_execution_module_reports_stats_of_every_vm_or_one() {
    let host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": host.kernel_spec("counted") }));
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let all = minion.call(&["vmhost.stats"]);
    let vm = &all["vms"][0];
    assert_eq!((vm["name"].clone(), vm["status"].clone()), (json!("counted"), json!("running")), "{all}");
    assert!(vm["cpu_seconds"].as_f64().is_some() && all["timestamp_ms"].as_u64().unwrap_or(0) > 0, "{all}");
    let one = minion.call(&["vmhost.stats", "counted"]);
    assert_eq!(one["vms"].as_array().map(Vec::len), Some(1), "{one}");
    // An unknown VM is the daemon's 4040, as for every other function.
    let out = minion.run(&["vmhost.stats", "nosuch"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("4040"), "{text}");
}

fn comment(r: &Value) -> &str {
    r["comment"].as_str().unwrap_or_default()
}

/// An image-booted VM (an empty base image: QEMU runs, the guest has no OS and ignores ACPI, so
/// every restart ends with a kill after the state's `timeout_s: 1`). A changed `memory_mib` is
/// made in place: same overlay inode, a new QEMU with the new `-m`. Only a new `boot.image`
/// needs `replace: True`.
#[test]
fn a_memory_change_reconfigures_in_place_and_keeps_the_disk() {
    let host = TestHost::start(HostOptions::default());
    for image in ["base.qcow2", "other.qcow2"] {
        run_ok(
            Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(host.images().join(image)).arg("64M"),
        );
    }
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let spec = json!({"name": "disk", "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}});
    let sls = |name: &str, spec: &Value, extra: Value| {
        let mut args = args_of(spec);
        args.insert("timeout_s".into(), json!(1));
        args.extend(extra.as_object().cloned().unwrap_or_default());
        minion.sls(name, "disk", "vmhost.running", &args);
    };
    sls("disk", &spec, json!({}));
    let r = minion.apply("disk", false);
    assert_eq!((&r["result"], comment(&r)), (&json!(true), "VM disk created (running)"), "{r}");
    let ino = vmhost_tests::overlay_ino(&host, "disk");
    let pid = host.call("vm.get", json!({ "name": "disk" }))["pid"].as_i64().expect("pid");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(pid), "-m"), "128");

    // test=True: the daemon's dry run predicts a reconfigure with a restart; nothing happens.
    let mut more = spec.clone();
    more["memory_mib"] = json!(256);
    sls("more", &more, json!({}));
    let r = minion.apply("more", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert_eq!(r["changes"]["action"], "reconfigure", "{r}");
    assert_eq!((&r["changes"]["fields"], &r["changes"]["restart"]), (&json!(["memory_mib"]), &json!(true)), "{r}");
    assert_eq!(comment(&r), "VM disk would be reconfigured in place (disk kept): memory_mib; it is restarted");
    assert_eq!(host.call("vm.get", json!({ "name": "disk" }))["pid"], pid, "test=True must not restart");

    // The real run: changed in place, without replace. Same disk, a new QEMU with -m 256.
    let r = minion.apply("more", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(comment(&r), "VM disk reconfigured in place (disk kept): memory_mib (running)", "{r}");
    assert_eq!(
        (&r["changes"]["old"]["spec"], &r["changes"]["new"]["spec"]),
        (&json!({"memory_mib": 128}), &json!({"memory_mib": 256})),
        "{r}"
    );
    let vm = host.call("vm.get", json!({ "name": "disk" }));
    assert_eq!((&vm["status"], &vm["pending_restart"]), (&json!("running"), &json!(false)), "{vm}");
    let new_pid = vm["pid"].as_i64().expect("pid");
    assert_ne!(new_pid, pid, "restarted");
    assert!(!alive(pid as i32));
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(new_pid), "-m"), "256");
    assert_eq!(vmhost_tests::overlay_ino(&host, "disk"), ino, "the disk is kept");
    assert_eq!(host.qemu_pids().len(), 1, "one QEMU");
    let r = minion.apply("more", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "second run: {r}");

    // restart: False records the change; the VM runs on as it was until it restarts.
    let mut later = spec.clone();
    later["memory_mib"] = json!(384);
    sls("later", &later, json!({"restart": false}));
    let r = minion.apply("later", false);
    assert_eq!(r["result"], true, "{r}");
    assert!(comment(&r).contains("memory_mib; restart pending (restart is False)"), "{r}");
    assert_eq!(r["changes"]["new"]["pending_restart"], true, "{r}");
    let vm = host.call("vm.get", json!({ "name": "disk" }));
    assert_eq!((vm["pid"].as_i64(), &vm["pending_restart"]), (Some(new_pid), &json!(true)), "{vm}");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(new_pid), "-m"), "256");
    // The same state with restart (the default) applies it now.
    sls("now", &later, json!({}));
    let r = minion.apply("now", true);
    assert_eq!((&r["result"], &r["changes"]["action"]), (&Value::Null, &json!("reconfigure")), "{r}");
    let r = minion.apply("now", false);
    assert_eq!(comment(&r), "VM disk restarted to apply its pending change (running)", "{r}");
    let vm = host.call("vm.get", json!({ "name": "disk" }));
    let pid384 = vm["pid"].as_i64().expect("pid");
    assert_eq!(
        (&vm["pending_restart"], vmhost_tests::value_after(&vmhost_tests::argv_of(pid384), "-m")),
        (&json!(false), "384".into())
    );
    assert_eq!(vmhost_tests::overlay_ino(&host, "disk"), ino, "the disk is kept");

    // A new boot.image needs a new disk: refused (2002) without replace, under test=True too,
    // and nothing changes.
    let mut other = later.clone();
    other["boot"]["image"] = json!("other.qcow2");
    sls("other", &other, json!({}));
    for test in [true, false] {
        let r = minion.apply("other", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "test={test}: {r}");
        assert!(comment(&r).contains("vmhostd error 2002 (spec.boot.image)"), "test={test}: {r}");
        assert!(comment(&r).contains("set replace: True to recreate the VM with a new disk"), "{r}");
    }
    let vm = host.call("vm.get", json!({ "name": "disk" }));
    assert_eq!((vm["pid"].as_i64(), &vm["spec"]["boot"]["image"]), (Some(pid384), &json!("base.qcow2")));
    assert_eq!(vmhost_tests::overlay_ino(&host, "disk"), ino);

    // With replace: True it is replaced: a new disk (a new VM record), a new QEMU.
    sls("replace", &other, json!({"replace": true}));
    let r = minion.apply("replace", true);
    assert_eq!((&r["result"], &r["changes"]["action"]), (&Value::Null, &json!("replace")), "{r}");
    let r = minion.apply("replace", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(
        comment(&r),
        "VM disk replaced (new disk; the old disk overlay was deleted): boot.image (running)",
        "{r}"
    );
    let after = host.call("vm.get", json!({ "name": "disk" }));
    assert_eq!(after["spec"]["boot"]["image"], "other.qcow2");
    assert_ne!(after["created_at"], vm["created_at"], "a replace makes a new VM");
    assert_ne!(after["pid"].as_i64(), Some(pid384));
}

/// `vmhost.image_present` imports a file of the daemon's import directory once (test=True
/// predicts it, a rerun is quiet), a wrong sha256 fails with the daemon's 2003 and leaves
/// nothing, another sha256 for an image that is there is refused (4093) naming both, a file put
/// there by hand is recorded where it is; `vmhost.image_absent` fails while a VM boots from the
/// image (4092, naming it) and then deletes it.
#[test]
fn images_are_imported_once_predicted_refused_and_deleted() {
    let host = TestHost::start(HostOptions::default());
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let fixture = host.dir.path().join("salt-image.fixture");
    vmhost_tests::boot_sector::write_image(&fixture, &vmhost_tests::boot_sector::serial_print("VMHOST-SALT-IMAGE"));
    let data = fs::read(&fixture).unwrap();
    let sha = vmhost_tests::sha256_hex(&data);
    fs::write(host.state().join("import").join("upload.raw"), &data).unwrap();
    let before = host.image_dir_entries();
    let args = |sha256: &str| {
        let mut m = Map::new();
        m.insert("sha256".into(), json!(sha256));
        m.insert("source".into(), json!("upload.raw"));
        m
    };
    minion.sls("img", "base.raw", "vmhost.image_present", &args(&sha));

    // test=True predicts the import and imports nothing.
    let r = minion.apply("img", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert_eq!(r["changes"]["new"], json!({"sha256": sha, "source": "upload.raw"}), "{r}");
    assert_eq!(comment(&r), format!("image base.raw would be imported from upload.raw (sha256 {sha})"));
    assert_eq!(host.image_dir_entries(), before, "test=True must not import");

    // The import: the file is in the images directory, image.list shows the sha256.
    let r = minion.apply("img", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!((&r["changes"]["old"], &r["changes"]["new"]["sha256"]), (&Value::Null, &json!(sha)), "{r}");
    assert_eq!((&r["changes"]["new"]["format"], &r["changes"]["new"]["bytes"]), (&json!("raw"), &json!(data.len())));
    assert_eq!(fs::read(host.images().join("base.raw")).unwrap(), data);
    assert_eq!(host.listed_image("base.raw").unwrap()["sha256"], sha.as_str());

    // A rerun, and a rerun under test=True: nothing to do.
    for test in [false, true] {
        let r = minion.apply("img", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "test={test}: {r}");
        assert_eq!(comment(&r), format!("image base.raw is present with sha256 {sha}"));
    }
    // The execution module lists it.
    let listed = minion.call(&["vmhost.image_list"]);
    let entry = listed.as_array().and_then(|a| a.iter().find(|i| i["name"] == "base.raw")).cloned();
    assert_eq!(entry.map(|e| e["sha256"].clone()), Some(json!(sha)), "{listed}");

    // A wrong sha256: the daemon's 2003 with what it found; nothing is kept.
    let wrong = "0".repeat(64);
    minion.sls("wrong", "other.raw", "vmhost.image_present", &args(&wrong));
    let r = minion.apply("wrong", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
    assert!(comment(&r).starts_with("vmhostd error 2003 (sha256): "), "{r}");
    assert!(comment(&r).contains(&format!("\"found\": \"{sha}\"")), "{r}");
    assert!(host.listed_image("other.raw").is_none());
    let mut expected = before.clone();
    expected.push("base.raw".into());
    assert_eq!(host.image_dir_entries(), expected, "no image and no temp file left");

    // Another sha256 for base.raw: never replaced, predicted under test=True, naming both.
    let other = "1".repeat(64);
    minion.sls("clash", "base.raw", "vmhost.image_present", &args(&other));
    let r = minion.apply("clash", true);
    assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
    assert!(comment(&r).starts_with(&format!("image base.raw is there with sha256 {sha}, not {other}: ")), "{r}");
    let r = minion.apply("clash", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
    assert!(comment(&r).starts_with("vmhostd error 4093 (name): "), "{r}");
    assert!(comment(&r).contains(&sha) && comment(&r).contains(&other), "{r}");
    assert_eq!(fs::read(host.images().join("base.raw")).unwrap(), data, "never replaced");

    // A file put there by hand: listed without a sha256, recorded where it is.
    fs::write(host.images().join("hand.raw"), &data).unwrap();
    let mut hand = Map::new();
    hand.insert("sha256".into(), json!(sha));
    minion.sls("hand", "hand.raw", "vmhost.image_present", &hand);
    let r = minion.apply("hand", true);
    assert_eq!((&r["result"], &r["changes"]["old"]), (&Value::Null, &json!({"sha256": null})), "{r}");
    assert_eq!(host.listed_image("hand.raw").unwrap()["sha256"], Value::Null, "test=True records nothing");
    let r = minion.apply("hand", false);
    assert_eq!((&r["result"], &r["changes"]["new"]["sha256"]), (&json!(true), &json!(sha)), "{r}");
    assert_eq!(host.listed_image("hand.raw").unwrap()["sha256"], sha.as_str());
    assert_eq!(minion.apply("hand", false)["changes"], json!({}), "second run");

    // A VM boots from base.raw (created stopped: no QEMU needed): absent fails naming it.
    let spec = json!({"name": "user", "cpu": 1, "memory_mib": 64, "state": "stopped",
                      "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    minion.sls("gone", "base.raw", "vmhost.image_absent", &Map::new());
    let r = minion.apply("gone", true);
    assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
    assert_eq!(comment(&r), "image base.raw is the base of VMs user: vmhostd would refuse to delete it (4092)");
    let r = minion.apply("gone", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
    assert!(comment(&r).starts_with("image base.raw is the base of VMs user, not deleted: vmhostd error 4092"), "{r}");
    assert!(host.images().join("base.raw").is_file());

    // Once the VM is gone: predicted, deleted, then nothing to do.
    host.call("vm.destroy", json!({"name": "user"}));
    let r = minion.apply("gone", true);
    assert_eq!((&r["result"], &r["changes"]["old"]["sha256"]), (&Value::Null, &json!(sha)), "{r}");
    assert!(host.images().join("base.raw").is_file(), "test=True must not delete");
    let r = minion.apply("gone", false);
    assert_eq!(
        (&r["result"], &r["changes"]["new"], &r["changes"]["old"]["sha256"]),
        (&json!(true), &Value::Null, &json!(sha))
    );
    assert_eq!(comment(&r), "image base.raw deleted");
    assert!(!host.images().join("base.raw").exists());
    assert!(host.listed_image("base.raw").is_none());
    let r = minion.apply("gone", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");
    assert_eq!(comment(&r), "image base.raw is already absent");
}

#[test]
fn installed_extension_provides_modules_states_and_engines_through_entry_points() {
    let host = TestHost::start(HostOptions::default());
    let minion = Minion::new(&host, Loading::Extension);
    let site = minion.pythonpath.clone().expect("installed");

    // The entry points name the four loader hooks, and each returns the package's dir.
    let probe = Command::new(venv_bin("python"))
        .env("PYTHONPATH", &site)
        .args([
            "-c",
            "import json, importlib.metadata as m\n\
             eps = [e for e in m.entry_points(group='salt.loader') if e.dist.name == 'saltext.vmhost']\n\
             print(json.dumps({e.name: e.load()() for e in eps}))",
        ])
        .output()
        .expect("run python");
    let hooks: Value = serde_json::from_slice(&probe.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&probe.stderr)));
    let pkg = site.join("saltext/vmhost");
    assert_eq!(
        hooks,
        json!({
            "module_dirs": [pkg.join("modules")],
            "states_dirs": [pkg.join("states")],
            "engines_dirs": [pkg.join("engines")],
            "runner_dirs": [pkg.join("runners")],
        })
    );

    // Without the installed distribution on the path the minion has no vmhost module at all, so
    // what follows is loaded through the entry points.
    let bare = Minion { dir: tempfile::tempdir().expect("tempdir"), pythonpath: None };
    fs::copy(minion.dir.path().join("minion"), bare.dir.path().join("minion")).expect("copy config");
    let missing = bare.run(&["vmhost.info"]);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && stderr.contains("'vmhost.info' is not available"), "{stderr}");

    let info = minion.call(&["vmhost.info"]);
    assert_eq!(info["api_version"], 1, "{info}");

    let spec = host.kernel_spec("ext");
    minion.sls("ext", "ext", "vmhost.running", &args_of(&spec));
    let r = minion.apply("ext", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(host.call("vm.get", json!({ "name": "ext" }))["status"], "running");
    let r = minion.apply("ext", false);
    assert_eq!(r["changes"], json!({}), "{r}");

    // The engine's contract: reconcile returns the daemon's report unchanged.
    let spec_json = spec.to_string();
    let report = minion.call(&["vmhost.reconcile", &format!("[{spec_json}]"), "dry_run=True"]);
    assert_eq!(report["dry_run"], true, "{report}");
    assert_eq!(report["plan"][0]["action"], "none", "{report}");
    assert_eq!(report["ok"], true, "{report}");

    minion.sls("extgone", "ext", "vmhost.absent", &Map::new());
    assert_eq!(minion.apply("extgone", false)["result"], true);
    assert_eq!(get_err(&host, "ext"), 4040);
}

/// Security Onion's `defaults.yaml` format (`hypervisor.model.<MODEL>.hardware`): two models, a
/// null class, string indices, indices running across classes.
const SO_DEFAULTS: &str = "\
hypervisor:
  model:
    SOSTEST:
      hardware:
        cpu: 16
        memory: 32
        disk:
          1: pci_0000_c7_00_0
        copper: null
        sfp:
          '6': pci_0000_41_00_1
          5: pci_0000_41_00_0
    SOSOTHER:
      hardware:
        cpu: 64
        memory: 128
        disk:
        copper:
          1: pci_0000_02_00_0
        sfp:
";

/// What `vmhost.hardware_from_so` writes for SOSTEST with `reserved_cpu: 2`, `reserved_memory_gib: 4`.
const SOSTEST_SECTION: &str = "\
[hardware]
# Written by Salt (vmhost.hardware_from_so) from Security Onion model SOSTEST; the
# [hardware] tables are replaced at its next run.
cpu = 16
memory_gib = 32
reserved_cpu = 2
reserved_memory_gib = 4

[hardware.disk]
1 = \"0000:c7:00.0\"

[hardware.sfp]
5 = \"0000:41:00.0\"
6 = \"0000:41:00.1\"
";

/// `vmhost.hardware_from_so` with real `salt-call`, a real `vmhostd --check-config` and a real
/// vmhostd: the `[hardware]` tables of the host's config become the model the minion's
/// `sosmodel` grain names in SO's `defaults.yaml`, every other byte of the file stays, vmhostd is
/// restarted once (by a `restart_cmd` that SIGTERMs the test's vmhostd; the harness, which owns
/// the process, starts it again) and then reports the model while a VM started before keeps its
/// QEMU. A second run changes nothing and restarts nothing; an unknown model fails and leaves the
/// file as it was.
#[test]
fn hardware_from_so_rewrites_only_the_hardware_tables_and_restarts_once() {
    let tail = "\n# after the hardware tables\n[logs]\nmax_bytes = 262144\n";
    let mut host = TestHost::start(HostOptions {
        extra: format!("[hardware.copper]\n1 = \"0000:c8:00.0\"\n{tail}"),
        ..HostOptions::default()
    });
    let before = fs::read_to_string(&host.config).expect("read config");
    let (head, _) = before.split_once("[hardware]\n").expect("the harness writes [hardware]");
    // From the blank line that ends the hardware tables to the end of the file (the harness
    // adds a newline after `extra`).
    let rest = &before[before.find(tail).expect("the tail")..];
    host.call("vm.create", json!({ "spec": host.kernel_spec("keep") }));
    let vm_pid = host.wait_status("keep", "running", std::time::Duration::from_secs(30))["pid"].clone();

    let minion = Minion::new(&host, Loading::Sync);
    let d = minion.dir.path();
    let conf = d.join("minion");
    let mut text = fs::read_to_string(&conf).expect("minion config");
    text.push_str("grains:\n  sosmodel: SOSTEST\n");
    fs::write(&conf, &text).expect("grains");
    minion.call(&["saltutil.sync_all"]);
    let defaults = d.join("defaults.yaml");
    fs::write(&defaults, SO_DEFAULTS).expect("defaults.yaml");
    // The restart command: counts its runs and SIGTERMs this host's vmhostd (the test then
    // waits for that daemon to exit, as `systemctl restart` would).
    let count = d.join("restarts");
    let script = d.join("restart-vmhostd");
    let pid = host.daemon_pid().expect("daemon pid");
    fs::write(&script, format!("#!/bin/sh\necho run >> {count}\nkill -TERM {pid}\n", count = count.display()))
        .expect("write script");
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let restarts = || fs::read_to_string(&count).map(|t| t.lines().count()).unwrap_or(0);
    let config = host.config.display().to_string();
    let mut args = Map::new();
    args.insert("defaults".into(), json!(defaults));
    args.insert("reserved_cpu".into(), json!(2));
    args.insert("reserved_memory_gib".into(), json!(4));
    args.insert("restart_cmd".into(), json!([script]));
    args.insert("vmhostd".into(), json!(vmhost_tests::bin("vmhostd")));
    minion.sls("hw", &config, "vmhost.hardware_from_so", &args);

    // test=True: the diff, nothing written, no restart.
    let r = minion.apply("hw", true);
    assert_eq!(r["result"], Value::Null, "{r}");
    assert!(r["changes"]["diff"].as_str().unwrap_or("").contains("\n+cpu = 16\n"), "{r}");
    assert_eq!(fs::read_to_string(&host.config).expect("config"), before, "test=True writes nothing");
    assert_eq!(restarts(), 0);

    // The real run: the hardware tables replaced, the rest byte for byte, one restart.
    let r = minion.apply("hw", false);
    assert_eq!(r["result"], true, "{r}");
    assert_eq!(r["changes"]["model"], "SOSTEST", "{r}");
    assert_eq!(
        comment(&r),
        format!("{config}: [hardware] set to Security Onion model SOSTEST; restarted with {}", script.display())
    );
    let after = fs::read_to_string(&host.config).expect("config");
    assert_eq!(after, format!("{head}{SOSTEST_SECTION}{rest}"));
    assert_eq!(restarts(), 1, "restarted once");
    let name = host.config.file_name().expect("name").to_string_lossy().into_owned();
    let marker = host.config.with_file_name(format!(".{name}.vmhost-restart-pending"));
    assert!(!marker.exists(), "the pending-restart marker is removed once the restart succeeded");
    let status = host.daemon_exited(std::time::Duration::from_secs(30));
    assert!(status.success(), "vmhostd exited cleanly on the restart command's SIGTERM: {status}");
    run_ok(Command::new(vmhost_tests::bin("vmhostd")).arg("--config").arg(&host.config).arg("--check-config"));
    host.spawn_daemon();
    let info = host.call("host.info", json!({}));
    assert_eq!((&info["cpu"]["total"], &info["cpu"]["reserved"]), (&json!(16), &json!(2)), "{info}");
    assert_eq!((&info["memory_mib"]["total"], &info["memory_mib"]["reserved"]), (&json!(32768), &json!(4096)));
    let model: Vec<(Value, Value, Value)> = info["hardware"]
        .as_array()
        .expect("hardware")
        .iter()
        .map(|h| (h["class"].clone(), h["index"].clone(), h["pci"].clone()))
        .collect();
    assert_eq!(
        model,
        vec![
            (json!("disk"), json!(1), json!("0000:c7:00.0")),
            (json!("sfp"), json!(5), json!("0000:41:00.0")),
            (json!("sfp"), json!(6), json!("0000:41:00.1")),
        ]
    );
    let vm = host.call("vm.get", json!({ "name": "keep" }));
    assert_eq!((&vm["status"], &vm["pid"]), (&json!("running"), &vm_pid), "the VM kept its QEMU: {vm}");
    assert!(alive(vm_pid.as_i64().expect("pid") as i32));

    // The same inputs again: no changes, no restart.
    let daemon = host.daemon_pid();
    let r = minion.apply("hw", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");
    assert_eq!(comment(&r), format!("{config}: [hardware] is already Security Onion model SOSTEST"));
    assert_eq!(fs::read_to_string(&host.config).expect("config"), after);
    assert_eq!((restarts(), host.daemon_pid()), (1, daemon));
    assert!(alive(daemon.expect("pid") as i32));

    // A model defaults.yaml does not have: fails naming it and the models there; file as it was.
    fs::write(&conf, text.replace("sosmodel: SOSTEST", "sosmodel: SOSNOPE")).expect("grains");
    for test in [true, false] {
        let r = minion.apply("hw", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "{r}");
        assert_eq!(
            comment(&r),
            format!("model 'SOSNOPE' is not in {} (models there: SOSOTHER, SOSTEST)", defaults.display())
        );
    }
    assert_eq!(fs::read_to_string(&host.config).expect("config"), after);
    assert_eq!(restarts(), 1);
}

/// The guest access functions with real `salt-call` against a real vmhostd (`[agent]
/// allow_exec = true`) and the agent guest's exec server: a command's output and status (the
/// job's retcode too), `test=True` running nothing, a file pushed and pulled back.
#[test]
fn guest_functions_run_commands_and_move_files_in_a_real_guest() {
    let host = TestHost::start(HostOptions { extra: "[agent]\nallow_exec = true\n".into(), ..HostOptions::default() });
    let mut spec = host.kernel_spec("gx");
    spec["boot"]["initrd"] = json!(vmhost_tests::agent_guest().initrd);
    host.call("vm.create", json!({ "spec": spec }));
    vmhost_tests::wait::until("the exec server of gx", std::time::Duration::from_secs(300), || {
        let out = host.ctl(&["exec", "gx", "--", "true"]);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    });
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);

    let argv = r#"["sh", "-c", "echo out; echo err >&2; exit 3"]"#;
    let r = minion.call(&["vmhost.guest_exec", "gx", argv]);
    assert_eq!(
        (r["exit_code"].clone(), r["stdout"].clone(), r["stderr"].clone()),
        (json!(3), json!("out\n"), json!("err\n")),
        "{r}"
    );
    let passthrough = minion.run(&["--retcode-passthrough", "vmhost.guest_exec", "gx", argv]);
    assert_eq!(passthrough.status.code(), Some(3), "the command's status is the job's retcode");

    let t = minion.call(&["vmhost.guest_exec", "gx", r#"["touch", "/tmp/ran"]"#, "test=True"]);
    assert_eq!(t["test"], true, "{t}");
    let probe = minion.call(&["vmhost.guest_exec", "gx", r#"["test", "-e", "/tmp/ran"]"#]);
    assert_eq!(probe["exit_code"], 1, "test=True ran nothing: {probe}");

    let pushed = minion.call(&["vmhost.guest_file_push", "gx", "/etc/motd", "content=hello from salt", "mode=640"]);
    assert_eq!(pushed["size"], 15, "{pushed}");
    let pulled = minion.call(&["vmhost.guest_file_pull", "gx", "/etc/motd"]);
    assert_eq!(
        (pulled["content"].clone(), pulled["mode"].clone()),
        (json!("aGVsbG8gZnJvbSBzYWx0"), json!(0o640)),
        "{pulled}"
    );
}

/// A network whose bridge does not exist: configured, so a stopped VM's NIC on it is admitted and
/// recorded (no tap is made until it starts).
const VOID_NETWORK: &str = "[networks.void]\nbridge = \"br-void-none\"\n";

/// The placement members pass through the states to vmhostd and back. The test config names no
/// `[hardware] vm_cpus`: a VM declared `cpu_policy: shared` with `numa: "none"` is created and
/// runs, its view shows them (`shared` left out as vmhostd's default), and a rerun changes
/// nothing; a NIC's `queues` round-trips on a stopped VM; `cpu_policy: dedicated` fails with the
/// daemon's 3001 on `spec.cpu_policy`, under `test=True` too, and nothing is created.
#[test]
fn placement_members_round_trip_and_dedicated_without_vm_cpus_is_the_daemons_3001() {
    let host = TestHost::start(HostOptions { extra: VOID_NETWORK.into(), ..HostOptions::default() });
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);

    let mut spec = host.kernel_spec("shared1");
    spec["cpu_policy"] = json!("shared");
    spec["numa"] = json!("none");
    spec["emulator_cpu"] = json!(false);
    minion.sls("shared1", "shared1", "vmhost.running", &args_of(&spec));
    let r = minion.apply("shared1", false);
    assert_eq!(r["result"], true, "{r}");
    let vm = host.call("vm.get", json!({ "name": "shared1" }));
    assert_eq!(vm["status"], "running", "{vm}");
    assert_eq!(vm["spec"]["numa"], "none", "{vm}");
    assert!(vm["spec"].get("cpu_policy").is_none_or(|p| p == "shared"), "{vm}");
    assert!(vm["spec"].get("emulator_cpu").is_none_or(|e| e == false), "{vm}");
    let pid = vm["pid"].clone();
    for test in [true, false] {
        let r = minion.apply("shared1", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "rerun, test={test}: {r}");
    }
    assert_eq!(host.call("vm.get", json!({ "name": "shared1" }))["pid"], pid, "the rerun restarted nothing");

    let mut spec = host.kernel_spec("mq1");
    spec["nics"] = json!([{ "network": "void", "queues": 4 }, { "network": "void", "queues": 1 }]);
    minion.sls("mq1", "mq1", "vmhost.stopped", &args_of(&spec));
    let r = minion.apply("mq1", false);
    assert_eq!(r["result"], true, "{r}");
    let nics = host.call("vm.get", json!({ "name": "mq1" }))["spec"]["nics"].clone();
    assert_eq!(nics[0]["queues"], 4, "{nics}");
    assert!(nics[1].get("queues").is_none_or(|q| q == 1), "{nics}");
    let r = minion.apply("mq1", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");

    let mut spec = host.kernel_spec("ded1");
    spec["cpu_policy"] = json!("dedicated");
    minion.sls("ded1", "ded1", "vmhost.running", &args_of(&spec));
    for test in [true, false] {
        let r = minion.apply("ded1", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "test={test}: {r}");
        assert!(comment(&r).contains("vmhostd error 3001 (spec.cpu_policy)"), "test={test}: {r}");
    }
    assert_eq!(get_err(&host, "ded1"), 4040, "a refused spec creates nothing");
}

/// The capture config of [`capture_host`]: `cap0` may be monitored, `cap1` (also on the host)
/// may not.
const CAPTURE_CONFIG: &str = "[capture]\ninterfaces = [\"cap0\"]\n";

/// A test host in a netns of its own whose `[capture] interfaces` lists `cap0`, a veth made in
/// that netns (peer `cap0p`), up; `cap1` exists too but is not listed.
fn capture_host() -> TestHost {
    let host = TestHost::start(HostOptions { netns: true, extra: CAPTURE_CONFIG.into(), ..HostOptions::default() });
    for (name, peer) in [("cap0", "cap0p"), ("cap1", "cap1p")] {
        host.ip(&["link", "add", name, "type", "veth", "peer", "name", peer]);
        for link in [name, peer] {
            host.ip(&["link", "set", link, "up"]);
        }
    }
    host
}

/// A monitor NIC (issue 31) passes through the state: a VM declared with `mode: monitor`,
/// `source: cap0` (listed in `[capture] interfaces`, a veth in the daemon's netns) and
/// `direction: ingress` runs, `vm.get` shows the three members as declared and the NIC
/// `attached`, and a rerun (also `test=True`) changes nothing; a monitor NIC of `cap1`, which
/// the host config does not list, fails with the daemon's 3001 on `spec.nics[0].source`,
/// under `test=True` too, and nothing is created.
#[test]
fn a_monitor_nic_round_trips_and_a_source_the_host_does_not_list_is_the_daemons_3001() {
    let host = capture_host();
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);

    let mut spec = host.kernel_spec("sniff1");
    spec["nics"] = json!([{ "mode": "monitor", "source": "cap0", "direction": "ingress" }]);
    minion.sls("sniff1", "sniff1", "vmhost.running", &args_of(&spec));
    let r = minion.apply("sniff1", false);
    assert_eq!(r["result"], true, "{r}");
    let vm = host.call("vm.get", json!({ "name": "sniff1" }));
    assert_eq!(vm["status"], "running", "{vm}");
    let nic = &vm["spec"]["nics"][0];
    assert_eq!(
        (&nic["mode"], &nic["source"], &nic["direction"]),
        (&json!("monitor"), &json!("cap0"), &json!("ingress"))
    );
    assert!(nic.get("network").is_none_or(|n| n == ""), "a monitor NIC has no network: {vm}");
    assert_eq!(vm["nics"][0]["capture"], "attached", "{vm}");
    for test in [true, false] {
        let r = minion.apply("sniff1", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "rerun, test={test}: {r}");
    }
    assert_eq!(host.call("vm.get", json!({ "name": "sniff1" }))["pid"], vm["pid"], "the rerun restarted nothing");

    let mut spec = host.kernel_spec("sniff2");
    spec["nics"] = json!([{ "mode": "monitor", "source": "cap1" }]);
    minion.sls("sniff2", "sniff2", "vmhost.running", &args_of(&spec));
    for test in [true, false] {
        let r = minion.apply("sniff2", test);
        assert_eq!((&r["result"], &r["changes"]), (&json!(false), &json!({})), "test={test}: {r}");
        assert!(comment(&r).contains("vmhostd error 3001 (spec.nics[0].source)"), "test={test}: {r}");
        assert!(comment(&r).contains("cap1"), "test={test}: {r}");
    }
    assert_eq!(get_err(&host, "sniff2"), 4040, "a refused spec creates nothing");
}

/// `qemu-io` on a stopped VM's qcow2 disk: `write -P PATTERN` or `read -P PATTERN` (a read
/// fails unless every byte there is PATTERN) of 64 KiB at 1 MiB. Returns whether it succeeded
/// (qemu-io exits 0 even when a pattern does not match, so its output says).
fn disk_pattern(disk: &Path, op: &str, pattern: u8) -> bool {
    let out = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", &format!("{op} -P {pattern:#04x} 1M 64k")])
        .arg(disk)
        .output()
        .expect("run qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out.status.success() && !text.contains("Pattern verification failed") && !text.contains("failed")
}

/// Every entry of `paths.backups`, sorted.
fn backups_of(host: &TestHost) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(host.state().join("backups"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// The execution module's snapshot and backup functions through a real `salt-call` against a
/// real vmhostd, on a stopped image VM whose disk the test writes with qemu-io: a snapshot
/// keeps the written pattern, a later write is undone by `vmhost.revert`, the snapshot is
/// listed and deleted (a second delete is `changed: false`); `vmhost.export` writes a backup
/// that `vmhost.import` makes a VM from under a new name and, after a destroy, under the old
/// one, each disk holding the pattern. A param the module does not know reaches the daemon,
/// whose refusal comes back as the module's error with code and field; `test=True` sends
/// nothing. The states `vmhost.snapshot_present` (predicted, taken once) and
/// `vmhost.snapshot_absent`.
#[test]
fn snapshots_revert_export_and_import_through_the_execution_module() {
    let host = TestHost::start(HostOptions::default());
    vmhost_tests::boot_sector::write_image(
        &host.images().join("base.raw"),
        &vmhost_tests::boot_sector::serial_print("VMHOST-SALT-SNAP"),
    );
    let spec = json!({"name": "web", "cpu": 1, "memory_mib": 64, "state": "stopped",
                      "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    let minion = Minion::new(&host, Loading::Sync);
    minion.call(&["saltutil.sync_all"]);
    let fails = |args: &[&str]| {
        let out = minion.run(args);
        assert!(!out.status.success(), "salt-call {args:?} should fail");
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let overlay = host.state().join("disks").join("web.qcow2");
    assert!(disk_pattern(&overlay, "write", 0x11));

    let s = minion.call(&["vmhost.snapshot", "web", "before"]);
    assert_eq!(
        (&s["name"], &s["live"], &s["consistency"]),
        (&json!("before"), &json!(false), &json!("stopped")),
        "{s}"
    );
    let listed = minion.call(&["vmhost.snapshots", "web"]);
    assert_eq!(
        listed.as_array().map(|a| a.iter().map(|s| s["name"].clone()).collect::<Vec<_>>()),
        Some(vec![json!("before")]),
        "{listed}"
    );
    // The daemon's rules are the daemon's: a second snapshot of that name is its 2001.
    let text = fails(&["vmhost.snapshot", "web", "before"]);
    assert!(text.contains("vmhostd error 2001 (snapshot)"), "{text}");

    // Overwritten, then reverted: the snapshot's pattern is back.
    assert!(disk_pattern(&overlay, "write", 0x22));
    assert!(!disk_pattern(&overlay, "read", 0x11));
    let r = minion.call(&["vmhost.revert", "web", "before"]);
    assert_eq!((&r["changed"], &r["vm"]["name"]), (&json!(true), &json!("web")), "{r}");
    assert!(disk_pattern(&overlay, "read", 0x11), "the revert put the snapshot's data back");
    let text = fails(&["vmhost.revert", "web", "nosuch"]);
    assert!(text.contains("vmhostd error 4040 (snapshot)"), "{text}");

    // test=True sends nothing; a param the module does not know reaches the daemon, which
    // refuses it (-32602) and nothing is written.
    let t = minion.call(&["vmhost.export", "web", "test=True"]);
    assert_eq!(
        (&t["test"], &t["method"], &t["params"]),
        (&json!(true), &json!("vm.export"), &json!({"name": "web"})),
        "{t}"
    );
    let text = fails(&["vmhost.export", "web", "no_such_param=1"]);
    assert!(text.contains("vmhostd error -32602") && text.contains("no_such_param"), "{text}");
    assert_eq!(backups_of(&host), Vec::<String>::new(), "nothing exported");

    let x = minion.call(&["vmhost.export", "web", "requires=frozen", "timeout_s=600"]);
    let backup = x["backup"].as_str().unwrap_or_else(|| panic!("no backup: {x}")).to_string();
    assert_eq!((&x["manifest"]["vm"], &x["manifest"]["consistency"]), (&json!("web"), &json!("stopped")), "{x}");
    assert_eq!(backups_of(&host), vec![backup.clone()]);

    // Imported under a new name, stopped: its own disk with the pattern.
    let v = minion.call(&["vmhost.import", &backup, "name=web2", "state=stopped"]);
    assert_eq!(
        (&v["changed"], &v["vm"]["name"], &v["vm"]["status"]),
        (&json!(true), &json!("web2"), &json!("stopped")),
        "{v}"
    );
    assert_eq!(v["vm"]["spec"]["boot"], json!({"disk": "web2-root.qcow2", "disk_gib": 1}), "{v}");
    let text = fails(&["vmhost.import", &backup, "name=web2"]);
    assert!(text.contains("vmhostd error 2001 (name)"), "{text}");

    // The snapshot deleted (a second delete changes nothing), the VM destroyed and imported
    // back under its own name.
    let d = minion.call(&["vmhost.snapshot_delete", "web", "before"]);
    assert_eq!(d["changed"], true, "{d}");
    let d = minion.call(&["vmhost.snapshot_delete", "web", "before"]);
    assert_eq!(d["changed"], false, "{d}");
    assert_eq!(minion.call(&["vmhost.snapshots", "web"]), json!([]));
    minion.call(&["vmhost.destroy", "web"]);
    assert_eq!(get_err(&host, "web"), 4040);
    let v = minion.call(&["vmhost.import", &backup, "state=stopped"]);
    assert_eq!((&v["vm"]["name"], &v["vm"]["spec"]["boot"]["disk"]), (&json!("web"), &json!("web-root.qcow2")), "{v}");
    for vm in ["web", "web2"] {
        let disk = host.state().join("disks").join(vm).join("root.qcow2");
        assert!(disk_pattern(&disk, "read", 0x11), "{vm}: {} holds the exported data", disk.display());
    }

    // The states: snapshot_present predicted under test=True, taken once, quiet on a rerun;
    // snapshot_absent deletes it.
    let mut args = Map::new();
    args.insert("vm".into(), json!("web2"));
    minion.sls("snap", "nightly", "vmhost.snapshot_present", &args);
    let r = minion.apply("snap", true);
    assert_eq!((&r["result"], comment(&r)), (&Value::Null, "snapshot nightly of VM web2 would be taken"), "{r}");
    assert!(host.call("vm.snapshots", json!({"name": "web2"})).as_array().is_some_and(Vec::is_empty));
    let r = minion.apply("snap", false);
    assert_eq!((&r["result"], comment(&r)), (&json!(true), "snapshot nightly of VM web2 taken (stopped)"), "{r}");
    assert_eq!(host.call("vm.snapshots", json!({"name": "web2"}))[0]["name"], "nightly");
    let r = minion.apply("snap", false);
    assert_eq!((&r["result"], &r["changes"]), (&json!(true), &json!({})), "{r}");
    minion.sls("nosnap", "nightly", "vmhost.snapshot_absent", &args);
    let r = minion.apply("nosnap", false);
    assert_eq!((&r["result"], comment(&r)), (&json!(true), "snapshot nightly of VM web2 deleted"), "{r}");
    assert!(host.call("vm.snapshots", json!({"name": "web2"})).as_array().is_some_and(Vec::is_empty));
}
