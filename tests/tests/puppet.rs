//! The Puppet module (`plugins/puppet`) end to end: real `puppet apply` with the module on its
//! modulepath, against a real vmhostd running real (TCG) QEMUs. A changed `cpu` or `memory` is
//! applied in place (the VM restarts with the new spec) without `replace`; only a new boot
//! image needs `replace => true`.

use serde_json::{json, Value};
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use vmhost::client::Client;
use vmhost_tests::{guest, run_ok, workspace, HostOptions, TestHost};

/// A throwaway Puppet setup: a modulepath holding `vmhost -> plugins/puppet` and private
/// conf/var dirs, so runs never touch /etc/puppet or /var/cache/puppet.
struct Puppet {
    dir: tempfile::TempDir,
}

/// One `puppet apply`: its `--detailed-exitcodes` code and its output (stdout and stderr).
struct Run {
    code: i32,
    output: String,
}

impl Puppet {
    fn new() -> Puppet {
        let dir = tempfile::Builder::new().prefix("vmhpup").tempdir_in("/tmp").expect("tempdir");
        fs::create_dir_all(dir.path().join("modules")).expect("modules dir");
        std::os::unix::fs::symlink(workspace().join("plugins/puppet"), dir.path().join("modules/vmhost"))
            .expect("symlink the module");
        Puppet { dir }
    }

    /// `puppet apply --detailed-exitcodes -e MANIFEST` with `VMHOST_SOCKET=socket`.
    fn apply(&self, socket: &Path, manifest: &str, extra: &[&str]) -> Run {
        let d = self.dir.path();
        let mut cmd = Command::new("puppet");
        cmd.arg("apply").arg("--detailed-exitcodes").arg("--color=false").arg("--modulepath").arg(d.join("modules"));
        for (opt, sub) in [("--confdir", "etc"), ("--vardir", "var"), ("--codedir", "code"), ("--logdir", "log")] {
            cmd.arg(opt).arg(d.join(sub));
        }
        cmd.args(extra).arg("-e").arg(manifest).env("VMHOST_SOCKET", socket);
        let out = cmd.output().expect("run puppet apply (apt-get install puppet)");
        let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Run { code: out.status.code().unwrap_or(-1), output }
    }
}

/// A kernel-booted VM as a manifest: 1 CPU, 256 MiB, the test guest; `extra` adds attributes.
fn vm(name: &str, ensure: &str, extra: &str) -> String {
    let g = guest();
    format!(
        "vmhost_vm {{ '{name}':\n  ensure => {ensure},\n  cpu => 1,\n  memory => '256M',\n  \
         boot => {{ 'kernel' => '{}', 'initrd' => '{}', 'cmdline' => 'console=ttyS0 panic=-1 quiet' }},\n  {extra}\n}}\n",
        g.kernel.display(),
        g.initrd.display()
    )
}

fn get(host: &TestHost, name: &str) -> Value {
    host.call("vm.get", json!({ "name": name }))
}

/// Every event the subscription has received so far (waits briefly for stragglers).
fn drain(events: &mut Client) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(e) = events.next_event(Duration::from_millis(500)).expect("read events") {
        seen.push(format!("{} {}", e.vm, e.reason));
    }
    seen
}

#[test]
fn puppet_creates_converges_reports_noop_changes_once_and_destroys() {
    let host = TestHost::start(HostOptions::default());
    let puppet = Puppet::new();
    let sock = host.socket.clone();
    let mut events = host.client();
    events.subscribe_events().expect("subscribe");

    // ensure => running creates the VM; the fact and the function read host.info on the way.
    let info = host.call("host.info", json!({}));
    let manifest = format!(
        "notice(\"fact-version=${{facts['vmhost']['version']}} fact-api=${{facts['vmhost']['api_version']}}\")\n\
         notice(\"fn-accel=${{vmhost::host_info()['accel']}}\")\n{}",
        vm("web1", "running", "guest_interfaces => [],")
    );
    let run = puppet.apply(&sock, &manifest, &[]);
    assert_eq!(run.code, 2, "first run must change something:\n{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/ensure: created"), "{}", run.output);
    let version = info["version"].as_str().unwrap();
    assert!(run.output.contains(&format!("fact-version={version} fact-api=1")), "fact: {}", run.output);
    assert!(run.output.contains("fn-accel=tcg"), "function: {}", run.output);
    let v = get(&host, "web1");
    assert_eq!(v["status"], "running");
    assert_eq!(v["spec"]["cpu"], 1);
    assert_eq!(v["spec"]["memory_mib"], 256);
    assert_eq!(v["spec"]["boot"]["kernel"], json!(guest().kernel));
    let pid = v["pid"].clone();
    assert_eq!(drain(&mut events).iter().filter(|e| e.as_str() == "web1 vm.create").count(), 2, "creating, running");

    // A rerun changes nothing: exit code 0 and not one event.
    let run = puppet.apply(&sock, &manifest, &[]);
    assert_eq!(run.code, 0, "rerun must change nothing:\n{}", run.output);
    assert!(drain(&mut events).is_empty());
    assert_eq!(get(&host, "web1")["pid"], pid);

    // --noop reports the change and sends nothing.
    let changed = vm("web1", "running", "cpu => 2, restart_timeout => 5,").replace("cpu => 1,\n", "");
    let run = puppet.apply(&sock, &changed, &["--noop"]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/cpu: current_value 1, should be 2 (noop)"), "{}", run.output);
    let v = get(&host, "web1");
    assert_eq!(v["spec"]["cpu"], 1, "noop changed the VM");
    assert_eq!(v["pid"], pid);
    assert!(drain(&mut events).is_empty(), "noop reached the daemon");

    // A cpu change without replace: vmhostd changes the VM in place and restarts it (ACPI,
    // QEMU killed after restart_timeout if the guest does not power off by then).
    let run = puppet.apply(&sock, &changed, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/cpu: cpu changed 1 to 2"), "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]: reconfigured in place, disk kept (cpu)"), "{}", run.output);
    let v = get(&host, "web1");
    assert_eq!((&v["spec"]["cpu"], &v["status"], &v["pending_restart"]), (&json!(2), &json!("running"), &json!(false)));
    let cpu_pid = v["pid"].as_i64().expect("pid");
    assert_ne!(json!(cpu_pid), pid, "restarted for the change");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(cpu_pid), "-smp"), "2");
    let seen = drain(&mut events);
    assert!(!seen.iter().any(|e| e.contains("replace")), "no replace: {seen:?}");
    let run = puppet.apply(&sock, &changed, &[]);
    assert_eq!(run.code, 0, "rerun after the change:\n{}", run.output);
    assert!(drain(&mut events).is_empty());

    // A memory change, likewise: in place, without replace.
    let more = changed.replace("memory => '256M'", "memory => '384M'");
    let run = puppet.apply(&sock, &more, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/memory: memory changed 256 to 384"), "{}", run.output);
    assert!(run.output.contains("reconfigured in place, disk kept (memory_mib)"), "{}", run.output);
    let v = get(&host, "web1");
    assert_eq!((&v["spec"]["memory_mib"], &v["status"]), (&json!(384), &json!("running")));
    let mem_pid = v["pid"].as_i64().expect("pid");
    assert_ne!(mem_pid, cpu_pid, "restarted for the change");
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(mem_pid), "-m"), "384");
    assert!(!drain(&mut events).iter().any(|e| e.contains("replace")));
    let run = puppet.apply(&sock, &more, &[]);
    assert_eq!(run.code, 0, "rerun after the change:\n{}", run.output);

    // A data disk: added (a restart), then grown live (same QEMU), reruns change nothing.
    let with_disk =
        more.replace("\n}\n", "\n  disks => [{ 'name' => 'nsm', 'size_gib' => 1, 'format' => 'raw' }],\n}\n");
    assert_ne!(with_disk, more, "the manifest has a place for disks:\n{more}");
    let run = puppet.apply(&sock, &with_disk, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/disks: disks changed"), "{}", run.output);
    let disk_pid = get(&host, "web1")["pid"].clone();
    let nsm = host.state().join("disks").join("web1").join("nsm.raw");
    assert_eq!(std::fs::metadata(&nsm).map(|m| m.len()).ok(), Some(1 << 30));
    let run = puppet.apply(&sock, &with_disk, &[]);
    assert_eq!(run.code, 0, "rerun after adding a disk:\n{}", run.output);
    let grown = with_disk.replace("'size_gib' => 1", "'size_gib' => 2");
    let run = puppet.apply(&sock, &grown, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert_eq!(get(&host, "web1")["pid"], disk_pid, "grown live");
    assert_eq!(std::fs::metadata(&nsm).map(|m| m.len()).ok(), Some(2 << 30));
    let run = puppet.apply(&sock, &grown, &[]);
    assert_eq!(run.code, 0, "rerun after the grow:\n{}", run.output);
    drain(&mut events);
    // The QEMU the next steps must leave untouched.
    let mem_pid = disk_pid.as_i64().expect("pid");

    // Only a new boot image needs replace: without it the daemon refuses with 2002 on
    // spec.boot.image, the hint is shown, and the VM is untouched.
    run_ok(
        Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(host.images().join("base.qcow2")).arg("64M"),
    );
    let image = "vmhost_vm { 'web1': ensure => running, boot => { 'image' => 'base.qcow2', 'disk_gib' => 1 }, ";
    let refused = format!("{image}}}");
    let run = puppet.apply(&sock, &refused, &[]);
    assert_eq!(run.code & 4, 4, "a refused change is a failure:\n{}", run.output);
    assert!(run.output.contains("error 2002 (spec_drift) on field spec.boot.image"), "{}", run.output);
    assert!(
        run.output.contains("(attribute boot); a new boot image needs a new disk: set replace => true"),
        "{}",
        run.output
    );
    let v = get(&host, "web1");
    assert_eq!((v["pid"].as_i64(), &v["spec"]["boot"]["kernel"]), (Some(mem_pid), &json!(guest().kernel)));

    // With replace => true: one replace, a new disk.
    let replaced = format!("{image}replace => true }}");
    let run = puppet.apply(&sock, &replaced, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]: replaced with a new disk ("), "{}", run.output);
    let v = get(&host, "web1");
    assert_eq!((&v["spec"]["boot"], &v["status"]), (&json!({"image": "base.qcow2", "disk_gib": 1}), &json!("running")));
    assert!(host.state().join("disks/web1.qcow2").exists());
    let seen = drain(&mut events);
    assert_eq!(seen.iter().filter(|e| e.as_str() == "web1 vm.apply replace").count(), 1, "{seen:?}");
    let run = puppet.apply(&sock, &replaced, &[]);
    assert_eq!(run.code, 0, "rerun after the replace:\n{}", run.output);
    assert!(drain(&mut events).is_empty());

    // ensure => absent destroys; a rerun has nothing to do.
    let run = puppet.apply(&sock, "vmhost_vm { 'web1': ensure => absent }", &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[web1]/ensure: removed"), "{}", run.output);
    assert_eq!(host.call_err("vm.get", json!({ "name": "web1" })).0, 4040);
    assert!(host.qemu_pids().is_empty());
    let run = puppet.apply(&sock, "vmhost_vm { 'web1': ensure => absent }", &[]);
    assert_eq!(run.code, 0, "{}", run.output);
}

#[test]
fn puppet_run_state_structured_attributes_and_errors() {
    let host = TestHost::start(HostOptions::default());
    let puppet = Puppet::new();
    let sock = host.socket.clone();

    // Created stopped (no QEMU), with structured attributes written the loose way (strings
    // for numbers, empty lists and classes) that the daemon echoes normalised.
    let attrs = "role => 'db', hardware => { 'sfp' => [] }, pci => [], nics => [],\n  \
                 guest_interfaces => [{ 'name' => 'dummy0', 'address' => '10.9.0.1/24' }],";
    let stopped = vm("db1", "stopped", attrs).replace("cpu => 1,", "cpu => '1',");
    let run = puppet.apply(&sock, &stopped, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    let v = get(&host, "db1");
    assert_eq!(v["status"], "stopped");
    assert_eq!(v["spec"]["state"], "stopped");
    assert_eq!(v["spec"]["role"], "db");
    assert_eq!(v["spec"]["guest_interfaces"], json!([{ "name": "dummy0", "address": "10.9.0.1/24" }]));
    assert!(host.qemu_pids().is_empty());
    let run = puppet.apply(&sock, &stopped, &[]);
    assert_eq!(run.code, 0, "rerun of the loose form must change nothing:\n{}", run.output);

    // ensure => present leaves the run state alone; running starts it.
    let run = puppet.apply(&sock, "vmhost_vm { 'db1': ensure => present }", &[]);
    assert_eq!(run.code, 0, "{}", run.output);
    let run = puppet.apply(&sock, "vmhost_vm { 'db1': ensure => running }", &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("ensure changed 'stopped' to 'running'"), "{}", run.output);
    let v = get(&host, "db1");
    assert_eq!(v["status"], "running");
    assert_eq!(v["spec"]["role"], "db", "undeclared attributes are kept");
    let run = puppet.apply(&sock, "vmhost_vm { 'db1': ensure => running }", &[]);
    assert_eq!(run.code, 0, "{}", run.output);

    // A spec the daemon refuses fails the resource with its code, field and message; the
    // explicit socket parameter is used over $VMHOST_SOCKET.
    let bad = vm("bad1", "running", &format!("socket => '{}',", sock.display())).replace("'256M'", "16");
    let nowhere = puppet.dir.path().join("nosuch.sock");
    let run = puppet.apply(&nowhere, &bad, &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(
        run.output.contains(
            "vmhostd refused vm.apply: error 2001 (invalid_spec) on field spec.memory_mib: \
             memory_mib must be at least 32 (attribute memory)"
        ),
        "{}",
        run.output
    );
    assert_eq!(host.call_err("vm.get", json!({ "name": "bad1" })).0, 4040, "a refused spec creates nothing");
    let too_big = vm("bad2", "running", "").replace("cpu => 1,", "cpu => 64,");
    let run = puppet.apply(&sock, &too_big, &[]);
    assert!(run.output.contains("error 3001 (not_in_model) on field spec.cpu"), "{}", run.output);

    // No daemon: the fact is absent, and a resource fails with the reason.
    let run = puppet.apply(&nowhere, "notice(\"fact-is-undef=${facts['vmhost'] == undef}\")", &[]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("fact-is-undef=true"), "{}", run.output);
    let run = puppet.apply(&nowhere, "vmhost_vm { 'db1': ensure => running }", &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(run.output.contains(&format!("cannot connect to vmhostd at {}", nowhere.display())), "{}", run.output);
}

fn image(name: &str, ensure: &str, sha256: &str, extra: &str) -> String {
    format!("vmhost_image {{ '{name}':\n  ensure => {ensure},\n  sha256 => '{sha256}',\n  {extra}\n}}\n")
}

/// `vmhost_image`: `--noop` predicts, the first run imports a file of the daemon's import
/// directory (a `vmhost_vm` booting from it in the same manifest comes after it), a rerun has no
/// change event, a wrong sha256 fails with the daemon's 2003 and leaves nothing, another sha256
/// for an image that is there is refused (4093), a file put there by hand is recorded, and
/// `ensure => absent` is refused while a VM boots from the image (4092) and then deletes it.
#[test]
fn puppet_imports_an_image_once_refuses_a_wrong_sha256_and_deletes_it() {
    let host = TestHost::start(HostOptions::default());
    let puppet = Puppet::new();
    let sock = host.socket.clone();
    let fixture = host.dir.path().join("puppet-image.fixture");
    vmhost_tests::boot_sector::write_image(&fixture, &vmhost_tests::boot_sector::serial_print("VMHOST-PUPPET-IMAGE"));
    let data = fs::read(&fixture).unwrap();
    let sha = vmhost_tests::sha256_hex(&data);
    fs::write(host.state().join("import").join("upload.raw"), &data).unwrap();
    let before = host.image_dir_entries();

    // A VM declared before the image it boots from: autorequire imports the image first. The
    // sha256 is written in upper case (compared in lower case).
    let present = image("base.raw", "present", &sha.to_uppercase(), "source => 'upload.raw',");
    let manifest = format!(
        "vmhost_vm {{ 'user':\n  ensure => stopped,\n  cpu => 1,\n  memory => 64,\n  \
         boot => {{ 'image' => 'base.raw', 'disk_gib' => 1 }},\n}}\n{present}"
    );
    let run = puppet.apply(&sock, &manifest, &["--noop"]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(
        run.output.contains("Vmhost_image[base.raw]/ensure: current_value 'absent', should be 'present' (noop)"),
        "{}",
        run.output
    );
    assert_eq!(host.image_dir_entries(), before, "--noop must not import");

    let run = puppet.apply(&sock, &manifest, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_image[base.raw]/ensure: created"), "{}", run.output);
    assert!(run.output.contains("Vmhost_vm[user]/ensure: created"), "{}", run.output);
    assert!(
        run.output.find("Vmhost_image[base.raw]/ensure: created") < run.output.find("Vmhost_vm[user]/ensure: created"),
        "the image first:\n{}",
        run.output
    );
    assert_eq!(fs::read(host.images().join("base.raw")).unwrap(), data);
    let listed = host.listed_image("base.raw").unwrap();
    assert_eq!((&listed["sha256"], &listed["used_by"]), (&json!(sha), &json!(["user"])), "{listed}");

    // A rerun: exit code 0, no change event.
    let run = puppet.apply(&sock, &manifest, &[]);
    assert_eq!(run.code, 0, "rerun must change nothing:\n{}", run.output);
    assert!(!run.output.contains("Vmhost_image[base.raw]/"), "{}", run.output);

    // A wrong sha256: the daemon's 2003; no image and no temp file left.
    let wrong = "0".repeat(64);
    let run = puppet.apply(&sock, &image("other.raw", "present", &wrong, "source => 'upload.raw',"), &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(
        run.output.contains("vmhostd refused image.import: error 2003 (checksum_mismatch) on field sha256: "),
        "{}",
        run.output
    );
    assert!(run.output.contains(&format!("\"found\":\"{sha}\"")), "{}", run.output);
    let mut expected = before.clone();
    expected.push("base.raw".into());
    assert_eq!(host.image_dir_entries(), expected, "nothing left");
    assert!(host.listed_image("other.raw").is_none());

    // Another sha256 for base.raw: --noop shows the difference, a run fails with 4093.
    let other = "1".repeat(64);
    let clash = image("base.raw", "present", &other, "source => 'upload.raw',");
    let run = puppet.apply(&sock, &clash, &["--noop"]);
    assert!(run.output.contains(&format!("current_value '{sha}', should be '{other}' (noop)")), "{}", run.output);
    let run = puppet.apply(&sock, &clash, &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(run.output.contains("error 4093 (image_exists) on field name: "), "{}", run.output);
    assert!(run.output.contains("an image is never replaced (VMs hold overlays over it): delete it first"));
    assert_eq!(fs::read(host.images().join("base.raw")).unwrap(), data, "never replaced");

    // A file put there by hand is recorded where it is (no source), once.
    fs::write(host.images().join("hand.raw"), &data).unwrap();
    let hand = image("hand.raw", "present", &sha, "");
    let run = puppet.apply(&sock, &hand, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(
        run.output.contains(&format!("Vmhost_image[hand.raw]/sha256: recorded with sha256 {sha}")),
        "{}",
        run.output
    );
    assert_eq!(host.listed_image("hand.raw").unwrap()["sha256"], sha.as_str());
    assert_eq!(puppet.apply(&sock, &hand, &[]).code, 0);

    // ensure => absent: refused while the VM boots from it, naming the VM.
    let absent = "vmhost_image { 'base.raw': ensure => absent }";
    let run = puppet.apply(&sock, absent, &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(run.output.contains("error 4092 (image_in_use) on field name: "), "{}", run.output);
    assert!(run.output.contains("the image is the base of VMs user: destroy them"), "{}", run.output);
    assert!(host.images().join("base.raw").is_file());

    // Without the VM: --noop predicts, a run deletes, a rerun has nothing to do.
    host.call("vm.destroy", json!({"name": "user"}));
    let run = puppet.apply(&sock, absent, &["--noop"]);
    assert!(run.output.contains("current_value 'present', should be 'absent' (noop)"), "{}", run.output);
    assert!(host.images().join("base.raw").is_file(), "--noop must not delete");
    let run = puppet.apply(&sock, absent, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_image[base.raw]/ensure: removed"), "{}", run.output);
    assert!(!host.images().join("base.raw").exists());
    assert!(host.listed_image("base.raw").is_none());
    let run = puppet.apply(&sock, absent, &[]);
    assert_eq!(run.code, 0, "{}", run.output);
}

/// `vmhost::guest_exec` and `vmhost::guest_file_push` in a real `puppet apply` against a real
/// vmhostd (`[agent] allow_exec = true`) and the agent guest's exec server: the answer in the
/// manifest, a failing checked command failing the run, a file pushed that the guest then has;
/// then `vmhost_vm`'s `ssh` written live and `guest_exec => false` refusing vm.exec, both
/// without a restart.
#[test]
fn puppet_functions_run_commands_and_push_files_in_a_real_guest() {
    let host = TestHost::start(HostOptions { extra: "[agent]\nallow_exec = true\n".into(), ..HostOptions::default() });
    let mut spec = host.kernel_spec("px");
    spec["boot"]["initrd"] = json!(vmhost_tests::agent_guest().initrd);
    host.call("vm.create", json!({ "spec": spec }));
    vmhost_tests::wait::until("the exec server of px", Duration::from_secs(300), || {
        let out = host.ctl(&["exec", "px", "--", "true"]);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    });
    let puppet = Puppet::new();
    let run = puppet.apply(
        &host.socket,
        "$r = vmhost::guest_exec('px', ['sh', '-c', 'echo \"$A\"; exit 4'], { env => { 'A' => 'from-puppet' } })\n\
         notice(\"exit=${r['exit_code']} out=${r['stdout']}\")\n\
         $p = vmhost::guest_file_push('px', '/etc/pushed', \"by puppet\\n\", { mode => '0640' })\n\
         notice(\"pushed=${p['size']}\")\n",
        &[],
    );
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("exit=4 out=from-puppet"), "{}", run.output);
    assert!(run.output.contains("pushed=10"), "{}", run.output);
    let cat = host.ctl(&["exec", "px", "--", "cat", "/etc/pushed"]);
    assert_eq!(String::from_utf8_lossy(&cat.stdout), "by puppet\n", "{cat:?}");

    let run = puppet.apply(&host.socket, "vmhost::guest_exec('px', ['false'], { check => true })", &[]);
    assert_eq!(run.code, 1, "{}", run.output);
    assert!(run.output.contains("false exited with status 1"), "{}", run.output);

    // `ssh` declared on the running VM: written at once by its exec server, no restart, not
    // named as a reconfigure; the rerun is quiet (vmhostd records the default user, vmhost).
    let pid = get(&host, "px")["pid"].clone();
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@puppet";
    let ssh = format!("vmhost_vm {{ 'px': ssh => {{ 'keys' => ['{key}'] }} }}");
    let run = puppet.apply(&host.socket, &ssh, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(!run.output.contains("reconfigured in place"), "{}", run.output);
    let v = get(&host, "px");
    assert_eq!((&v["pid"], &v["spec"]["ssh"]), (&pid, &json!({ "user": "vmhost", "keys": [key] })));
    let cat = host.ctl(&["exec", "px", "--", "cat", "/home/vmhost/.ssh/authorized_keys"]);
    assert_eq!(String::from_utf8_lossy(&cat.stdout), format!("{key}\n"), "{cat:?}");
    let run = puppet.apply(&host.socket, &ssh, &[]);
    assert_eq!(run.code, 0, "{}", run.output);

    // `guest_exec => false`: changed in place without a restart, and vm.exec is refused at once.
    let off = "vmhost_vm { 'px': guest_exec => false }";
    let run = puppet.apply(&host.socket, off, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("reconfigured in place, disk kept (guest_exec)"), "{}", run.output);
    let v = get(&host, "px");
    assert_eq!((&v["pid"], &v["spec"]["guest_exec"]), (&pid, &json!(false)));
    let refused = host.call_err("vm.exec", json!({ "name": "px", "argv": ["true"] }));
    assert_eq!(refused.0, 4095, "{refused:?}");
    let run = puppet.apply(&host.socket, off, &[]);
    assert_eq!(run.code, 0, "{}", run.output);
    let run = puppet.apply(&host.socket, "vmhost_vm { 'px': guest_exec => true }", &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert_eq!(get(&host, "px")["spec"].get("guest_exec"), None, "left out of views while true");
}

/// `vmhost_vm`'s placement attributes against a real vmhostd whose config names no
/// `[hardware] vm_cpus`: `cpu_policy => 'shared'`, `numa => 'none'` and `emulator_cpu =>
/// false` are sent and recorded (vmhostd leaves shared and false out of its views), and a rerun
/// is quiet; NIC `queues` round-trip on a stopped VM (`1` in sync with vmhostd leaving it out);
/// `cpu_policy => 'dedicated'` fails the resource with the daemon's 3001 on
/// `spec.cpu_policy`, naming the attribute, and creates nothing.
#[test]
fn puppet_placement_attributes_round_trip_and_dedicated_without_vm_cpus_fails_with_3001() {
    let host = TestHost::start(HostOptions {
        extra: "[networks.void]\nbridge = \"br-void-none\"\n".into(),
        ..HostOptions::default()
    });
    let puppet = Puppet::new();
    let sock = host.socket.clone();

    let shared = vm("perf1", "running", "cpu_policy => 'shared', numa => 'none', emulator_cpu => false,");
    let run = puppet.apply(&sock, &shared, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    let v = get(&host, "perf1");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["spec"]["numa"], "none", "{v}");
    assert!(v["spec"].get("cpu_policy").is_none_or(|p| p == "shared"), "{v}");
    assert!(v["spec"].get("emulator_cpu").is_none_or(|e| e == false), "{v}");
    let run = puppet.apply(&sock, &shared, &[]);
    assert_eq!(run.code, 0, "the rerun must change nothing:\n{}", run.output);
    assert_eq!(get(&host, "perf1")["pid"], v["pid"]);

    let queues = vm(
        "perf2",
        "stopped",
        "nics => [{ 'network' => 'void', 'queues' => 4 }, { 'network' => 'void', 'queues' => '1' }],",
    );
    let run = puppet.apply(&sock, &queues, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    let nics = get(&host, "perf2")["spec"]["nics"].clone();
    assert_eq!(nics[0]["queues"], 4, "{nics}");
    assert!(nics[1].get("queues").is_none_or(|q| q == 1), "{nics}");
    let run = puppet.apply(&sock, &queues, &[]);
    assert_eq!(run.code, 0, "the rerun must change nothing:\n{}", run.output);

    let dedicated = vm("perf3", "running", "cpu_policy => 'dedicated',");
    let run = puppet.apply(&sock, &dedicated, &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(run.output.contains("error 3001 (not_in_model) on field spec.cpu_policy"), "{}", run.output);
    assert!(run.output.contains("(attribute cpu_policy)"), "{}", run.output);
    assert_eq!(host.call_err("vm.get", json!({ "name": "perf3" })).0, 4040, "a refused spec creates nothing");
}

/// `vmhost_vm`'s NIC hashes carry a monitor NIC (issue 31) to a real vmhostd in a netns of its
/// own whose `[capture] interfaces` lists `cap0`, a veth there: `'mode' => 'monitor'`, `'source'
/// => 'cap0'`, `'direction' => 'ingress'` and `'trunk' => false` are sent, the VM runs, `vm.get`
/// shows mode, source and direction as declared and the NIC `attached`, and a rerun is quiet
/// (`trunk` false in sync with vmhostd leaving it out); a monitor NIC of `cap1` (on the host,
/// not listed) fails the resource with the daemon's 3001 on `spec.nics[0].source`, naming the
/// attribute, and creates nothing.
#[test]
fn puppet_monitor_nic_round_trips_and_an_unlisted_source_fails_with_3001() {
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: "[capture]\ninterfaces = [\"cap0\"]\n".into(),
        ..HostOptions::default()
    });
    for (name, peer) in [("cap0", "cap0p"), ("cap1", "cap1p")] {
        host.ip(&["link", "add", name, "type", "veth", "peer", "name", peer]);
        for link in [name, peer] {
            host.ip(&["link", "set", link, "up"]);
        }
    }
    let puppet = Puppet::new();
    let sock = host.socket.clone();

    let sniff = vm(
        "sniff1",
        "running",
        "nics => [{ 'mode' => 'monitor', 'source' => 'cap0', 'direction' => 'ingress', 'trunk' => false }],",
    );
    let run = puppet.apply(&sock, &sniff, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    let v = get(&host, "sniff1");
    assert_eq!(v["status"], "running", "{v}");
    let nic = &v["spec"]["nics"][0];
    assert_eq!(
        (&nic["mode"], &nic["source"], &nic["direction"]),
        (&json!("monitor"), &json!("cap0"), &json!("ingress"))
    );
    assert_eq!(v["nics"][0]["capture"], "attached", "{v}");
    let run = puppet.apply(&sock, &sniff, &[]);
    assert_eq!(run.code, 0, "the rerun must change nothing:\n{}", run.output);
    assert_eq!(get(&host, "sniff1")["pid"], v["pid"]);

    let unlisted = vm("sniff2", "running", "nics => [{ 'mode' => 'monitor', 'source' => 'cap1' }],");
    let run = puppet.apply(&sock, &unlisted, &[]);
    assert_eq!(run.code & 4, 4, "{}", run.output);
    assert!(run.output.contains("error 3001 ("), "{}", run.output);
    assert!(run.output.contains("on field spec.nics[0].source"), "{}", run.output);
    assert!(run.output.contains("(attribute nics)"), "{}", run.output);
    assert_eq!(host.call_err("vm.get", json!({ "name": "sniff2" })).0, 4040, "a refused spec creates nothing");
}

/// `qemu-io` on a stopped VM's qcow2 disk: `write -P PATTERN` or `read -P PATTERN` (false
/// unless every byte there is PATTERN) of 64 KiB at 1 MiB.
fn disk_pattern(disk: &Path, op: &str, pattern: u8) -> bool {
    let out = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", &format!("{op} -P {pattern:#04x} 1M 64k")])
        .arg(disk)
        .output()
        .expect("run qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out.status.success() && !text.contains("failed")
}

/// The names of VM `vm`'s snapshots.
fn snapshot_names(host: &TestHost, vm: &str) -> Vec<String> {
    let list = host.call("vm.snapshots", json!({ "name": vm }));
    list.as_array().map(|a| a.iter().filter_map(|s| s["name"].as_str().map(String::from)).collect()).unwrap_or_default()
}

/// Snapshots and backups with real `puppet apply` against a real vmhostd: `vmhost_snapshot`
/// takes a snapshot after the VM it autorequires is made (once: a rerun changes nothing),
/// `vmhost::revert` puts a later write back (under --noop it sends nothing), `vmhost::export`
/// writes a backup `vmhost::import` makes a new VM from with the exported data, an option the
/// module does not know reaches vmhostd and its refusal fails the run, the Bolt task scripts
/// run as Bolt runs them (JSON on stdin, the module's files under `_installdir`), and
/// `ensure => absent` deletes the snapshot.
#[test]
fn puppet_snapshots_reverts_exports_and_imports() {
    let host = TestHost::start(HostOptions::default());
    let puppet = Puppet::new();
    let sock = host.socket.clone();
    vmhost_tests::boot_sector::write_image(
        &host.images().join("base.raw"),
        &vmhost_tests::boot_sector::serial_print("VMHOST-PUPPET-SNAP"),
    );
    // Declared snapshot first, VM second: autorequire orders them.
    let manifest = "vmhost_snapshot { 'web/before': ensure => present, requires => 'frozen', timeout_s => 600 }\n\
                    vmhost_vm { 'web':\n  ensure => stopped,\n  cpu => 1,\n  memory => 64,\n  \
                    boot => { 'image' => 'base.raw', 'disk_gib' => 1 },\n}\n";
    let run = puppet.apply(&sock, manifest, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    let (vm_at, snap_at) = (
        run.output.find("Vmhost_vm[web]/ensure: created"),
        run.output.find("Vmhost_snapshot[web/before]/ensure: created"),
    );
    assert!(vm_at.is_some() && snap_at.is_some() && vm_at < snap_at, "the VM first:\n{}", run.output);
    assert_eq!(snapshot_names(&host, "web"), ["before"]);
    let s = &host.call("vm.snapshots", json!({"name": "web"}))[0];
    assert_eq!(s["consistency"], "stopped", "{s}");
    let run = puppet.apply(&sock, manifest, &[]);
    assert_eq!(run.code, 0, "rerun must change nothing:\n{}", run.output);

    // A write after the snapshot; a --noop revert sends nothing, a revert puts it back.
    let overlay = host.state().join("disks").join("web.qcow2");
    assert!(disk_pattern(&overlay, "read", 0x00));
    assert!(disk_pattern(&overlay, "write", 0x22));
    let revert = "$r = vmhost::revert('web', 'before')\nnotice(\"reverted=${r}\")\n";
    let run = puppet.apply(&sock, revert, &["--noop"]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("reverted={noop => true, method => vm.revert"), "{}", run.output);
    assert!(disk_pattern(&overlay, "read", 0x22), "--noop reverted");
    let run = puppet.apply(&sock, revert, &[]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("reverted={changed => true"), "{}", run.output);
    assert!(disk_pattern(&overlay, "read", 0x00), "the revert put the snapshot's data back");

    // An option the module does not know goes to vmhostd, which refuses it: the run fails and
    // nothing is exported.
    let run = puppet.apply(&sock, "vmhost::export('web', { no_such_param => 1 })", &[]);
    assert_eq!(run.code, 1, "{}", run.output);
    assert!(run.output.contains("vmhost::export: vmhostd refused vm.export: error -32602"), "{}", run.output);
    assert!(run.output.contains("no_such_param"), "{}", run.output);
    assert!(fs::read_dir(host.state().join("backups")).map(|d| d.count() == 0).unwrap_or(true));

    // Exported with new data, imported as a new VM holding it.
    assert!(disk_pattern(&overlay, "write", 0x33));
    let run = puppet.apply(
        &sock,
        "$x = vmhost::export('web', { requires => 'frozen' })\nnotice(\"backup=${x['backup']}.\")",
        &[],
    );
    assert_eq!(run.code, 0, "{}", run.output);
    let backup = run.output.split("backup=").nth(1).and_then(|t| t.split('.').next()).unwrap_or_default().to_string();
    assert!(host.state().join("backups").join(&backup).join("manifest.json").is_file(), "{backup:?}: {}", run.output);
    let import = format!("$v = vmhost::import('{backup}', {{ name => 'web2', state => 'stopped' }})\nnotice(\"imported=${{v['vm']['name']}}\")");
    let run = puppet.apply(&sock, &import, &[]);
    assert_eq!(run.code, 0, "{}", run.output);
    assert!(run.output.contains("imported=web2"), "{}", run.output);
    assert!(disk_pattern(&host.state().join("disks/web2/root.qcow2"), "read", 0x33), "web2 holds the exported data");

    // The Bolt tasks as Bolt runs them: the input on stdin, the module's files under _installdir.
    let task = |name: &str, input: Value| -> (i32, Value) {
        use std::io::Write;
        let mut child = Command::new("ruby")
            .arg(puppet.dir.path().join("modules/vmhost/tasks").join(format!("{name}.rb")))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run ruby");
        let mut full = input;
        full["_installdir"] = json!(puppet.dir.path().join("modules"));
        full["socket"] = json!(sock);
        child.stdin.take().expect("stdin").write_all(full.to_string().as_bytes()).expect("write the input");
        let out = child.wait_with_output().expect("wait for ruby");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let v = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("task {name}: {e}: {text}{}", String::from_utf8_lossy(&out.stderr)));
        (out.status.code().unwrap_or(-1), v)
    };
    let (code, out) = task("snapshot", json!({"vm": "web2", "snapshot": "t1"}));
    assert_eq!((code, &out["result"]["name"]), (0, &json!("t1")), "{out}");
    let (code, out) = task("snapshots", json!({"vm": "web2"}));
    assert_eq!((code, &out["result"][0]["name"]), (0, &json!("t1")), "{out}");
    let (code, out) = task("import", json!({"backup": backup, "name": "web2"}));
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        (&out["_error"]["details"]["code"], &out["_error"]["details"]["field"]),
        (&json!(2001), &json!("name")),
        "{out}"
    );
    let (code, out) = task("snapshot_delete", json!({"vm": "web2", "snapshot": "t1"}));
    assert_eq!((code, &out["result"]["changed"]), (0, &json!(true)), "{out}");
    assert!(snapshot_names(&host, "web2").is_empty());

    // ensure => absent deletes it; a second run has nothing to do.
    let absent = "vmhost_snapshot { 'before': vm => 'web', ensure => absent }";
    let run = puppet.apply(&sock, absent, &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    assert!(run.output.contains("Vmhost_snapshot[before]/ensure: removed"), "{}", run.output);
    assert!(snapshot_names(&host, "web").is_empty());
    assert_eq!(puppet.apply(&sock, absent, &[]).code, 0);
}
