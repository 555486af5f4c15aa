//! Real distribution guests (docs/guests.md): Debian 12 (ifupdown + resolvconf, cloud-init
//! 22.4) and Debian 13 (netplan + systemd-networkd + systemd-resolved, cloud-init 25), built
//! offline from the distribution's packages by `tests/guest/build-real-guest.sh` with the
//! project's vmhost-agent package installed, booted by vmhostd under TCG.
//!
//! In each guest: the declared address, default route and DNS are applied by the guest's own
//! cloud-init and the host reaches the guest over SSH; `vm.check` is ok; `user_data` ran once,
//! also after a memory change (the instance id and the SSH host keys are unchanged) whose new
//! search domain the guest's cloud-init applies at that restart; the data
//! disk is there by its serial; a live snapshot is `frozen` and the revert boots without a
//! journal replay; `vm.stop` is a clean ACPI power-off; the agent comes back after a guest
//! reboot; the same image boots with UEFI. In Debian 12 the Salt engine's `bootstrap` user-data
//! starts the image's salt-minion, which joins the test's salt-master under the VM's name.
//!
//! The Debian 12 image also boots under Secure Boot with vmhost's default template (Microsoft's
//! keys) and a TPM: Debian's signed shim, GRUB and kernel, as the image's ESP holds them.
//!
//! Every seed form vmhost writes is also parsed and rendered by each guest's own cloud-init
//! (`tests/guest/check-seed.py` run in the image's tree), failing on any warning.

use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use vmhost_tests::{build_debs, plain_log, run_ok, wait, workspace, HostOptions, TestHost, LAN_NETWORK};

/// A boot of a real guest under TCG on a busy 2-core machine (35-50 s when alone).
const BOOT: Duration = Duration::from_secs(420);

/// The two guests: distribution code name and the address its VM gets.
const BOOKWORM: &str = "bookworm";
const TRIXIE: &str = "trixie";

/// The project's vmhost-agent package, built once per process.
fn agent_deb() -> PathBuf {
    static DEB: OnceLock<PathBuf> = OnceLock::new();
    DEB.get_or_init(|| {
        let debs = build_debs();
        PathBuf::from(debs.iter().find(|d| d.contains("vmhost-agent_")).expect("the agent package"))
    })
    .clone()
}

/// `target/real-guests`, where the images and their trees are built and cached.
fn out_dir() -> PathBuf {
    workspace().join("target/real-guests")
}

/// Builds (or finds cached) the image of `dist`; returns the qcow2's path.
fn real_image(dist: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|d| d == dist) {
        run_ok(
            Command::new(workspace().join("tests/guest/build-real-guest.sh"))
                .arg(dist)
                .arg(out_dir())
                .arg(agent_deb())
                .stderr(Stdio::inherit()),
        );
        built.push(dist.to_string());
    }
    out_dir().join(format!("{dist}.qcow2"))
}

/// The image's installed tree (what check-seed.py runs in).
fn tree(dist: &str) -> PathBuf {
    real_image(dist);
    out_dir().join(format!("{dist}-tree"))
}

/// A client that waits long enough for calls that stop a real guest.
fn call(host: &TestHost, method: &str, params: Value) -> Value {
    let mut c = host.client();
    c.set_timeout(Duration::from_secs(600)).expect("timeout");
    c.call::<Value>(method, params.clone()).unwrap_or_else(|e| panic!("{method} {params}: {e}"))
}

/// Waits until `vm.check` of `name` answers ok; returns the last answer.
fn wait_check_ok(host: &TestHost, name: &str, timeout: Duration) -> Value {
    // The agent's answer, not a daemon state: no event says "the guest's network is as declared".
    let ok = wait::poll(timeout, || match host.client().call::<Value>("vm.check", json!({ "name": name })) {
        Ok(v) if v["ok"] == true => Ok(v),
        Ok(v) => Err(v.to_string()),
        Err(e) => Err(e.to_string()),
    });
    ok.unwrap_or_else(|last| {
        panic!("vm.check of {name} never ok within {timeout:?}: {last}\nconsole:\n{}", tail(&host.serial(name), 6000))
    })
}

fn tail(text: &str, bytes: usize) -> &str {
    let mut start = text.len().saturating_sub(bytes);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// An SSH client in the host's network namespace, logging in as `tester` with the test's key.
struct Ssh {
    netns: String,
    key: PathBuf,
    address: String,
}

impl Ssh {
    fn command(&self, remote: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns, "ssh", "-i"])
            .arg(&self.key)
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=10",
                "-o",
                "LogLevel=ERROR",
            ])
            .arg(format!("tester@{}", self.address))
            .arg(remote)
            .stdin(Stdio::null());
        c
    }

    /// Runs `remote` in the guest; panics with its output when it fails.
    fn run(&self, remote: &str) -> String {
        run_ok(&mut self.command(remote))
    }

    /// Waits until an SSH login works (sshd up, the key installed by cloud-init).
    fn wait(&self, timeout: Duration) {
        wait::until(&format!("an SSH login to {}", self.address), timeout, || {
            let out = self.command("true").output().map_err(|e| format!("run ssh: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        });
    }

    /// Waits until cloud-init has finished this boot (its final stage runs `runcmd` after sshd
    /// is up) and checks that it did not end in an error.
    fn wait_cloud_init(&self) {
        let out = self.command("sudo cloud-init status --wait --long").output().expect("run ssh");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("status: done"), "cloud-init did not finish cleanly:\n{text}");
    }

    /// The guest's SSH host keys as the network sees them (sorted `type key` lines).
    fn host_keys(&self) -> Vec<String> {
        let out =
            run_ok(Command::new("ip").args(["netns", "exec", &self.netns, "ssh-keyscan", "-T", "10", &self.address]));
        let mut keys: Vec<String> = out
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once(' ').map(|(_, k)| k.to_string()))
            .collect();
        keys.sort();
        assert!(!keys.is_empty(), "ssh-keyscan found no host key");
        keys
    }
}

/// The guest's boot id, as its agent reports it.
fn boot_id(host: &TestHost, name: &str) -> String {
    host.call("vm.guest_info", json!({ "name": name }))["boot_id"].as_str().unwrap_or_default().to_string()
}

/// A salt-master of the test's own in the host's network namespace, listening on the bridge
/// address (10.0.0.1), accepting every key, run from tests/setup.sh's venv.
struct SaltMaster {
    dir: PathBuf,
    child: Child,
}

impl SaltMaster {
    fn start(netns: &str, dir: &Path) -> SaltMaster {
        let d = dir.join("salt");
        fs::create_dir_all(d.join("conf")).expect("salt dir");
        let conf = format!(
            "root_dir: {d}\npki_dir: {d}/pki\ncachedir: {d}/cache\nsock_dir: {d}/sock\npidfile: {d}/master.pid\n\
             log_file: {d}/master.log\ninterface: 10.0.0.1\nauto_accept: True\nuser: root\nworker_threads: 2\n",
            d = d.display()
        );
        fs::write(d.join("conf/master"), conf).expect("master config");
        let log = fs::File::create(d.join("master.out")).expect("master log");
        let child = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(workspace().join("target/salt-venv/bin/salt-master"))
            .arg("-c")
            .arg(d.join("conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .expect("start salt-master");
        SaltMaster { dir: d, child }
    }

    /// `salt-key -L` as JSON.
    fn keys(&self) -> Value {
        let out = Command::new(workspace().join("target/salt-venv/bin/salt-key"))
            .arg("-c")
            .arg(self.dir.join("conf"))
            .args(["-L", "--out", "json"])
            .output()
            .expect("salt-key");
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }
}

impl Drop for SaltMaster {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        // salt-master's workers are its children; end what is left of them.
        let _ = Command::new("pkill").arg("-f").arg(self.dir.join("conf").to_string_lossy().as_ref()).status();
    }
}

/// The Salt master engine's rendering of its `bootstrap` template (the engine's own `render`),
/// with the test's user and run-once marker appended to the same cloud-config.
fn engine_bootstrap(vm: &str, key: &str) -> String {
    let template = "#cloud-config\nsalt_minion:\n  conf:\n    id: {vm_name}\n    master: {master}\n    grains: {{hypervisor: {hypervisor}, role: {role}}}\n";
    let script = format!(
        "import sys; sys.path.insert(0, {src:?})\nfrom saltext.vmhost.engines import vmhost_engine as e\n\
         print(e.render(sys.argv[1], {{'vm_name': sys.argv[2], 'hypervisor': 'hv1', 'master': '10.0.0.1', 'hostname': 'sensor1', 'role': 'sensor'}}), end='')",
        src = workspace().join("plugins/salt/src").display().to_string()
    );
    let rendered = run_ok(
        Command::new(workspace().join("target/salt-venv/bin/python")).arg("-c").arg(script).arg(template).arg(vm),
    );
    format!("{rendered}{}", test_user_data(key).trim_start_matches("#cloud-config\n"))
}

/// The test's cloud-config: a sudo user with the test's SSH key, and a first-boot command that
/// counts its runs on the root disk.
fn test_user_data(key: &str) -> String {
    format!(
        "#cloud-config\nusers:\n  - name: tester\n    sudo: \"ALL=(ALL) NOPASSWD:ALL\"\n    shell: /bin/bash\n    \
         ssh_authorized_keys: [{key:?}]\nruncmd:\n  - [sh, -c, \"date +%s >> /var/lib/vmhost-test-runcmd\"]\n"
    )
}

/// Lines of the guest's kernel log since its boot that say ext4 found its journal needing a
/// replay (the root is mounted read-only first, so a replay announces itself with "recovery
/// required on readonly filesystem"). Not "orphan cleanup" and the "recovery complete" after
/// it: a live copy of a frozen file system still holds the files that were deleted while open,
/// which any mount after a live snapshot cleans up; freezing flushes the journal, not them.
fn journal_replays(ssh: &Ssh) -> Vec<String> {
    ssh.run("sudo dmesg")
        .lines()
        .filter(|l| {
            l.contains("EXT4-fs") && (l.contains("recovery required") || l.contains("will be enabled during recovery"))
        })
        .map(str::to_string)
        .collect()
}

/// A host in a network namespace with `lan`, the image of `dist` in its images directory, and
/// an SSH key pair: the host, how to reach the guest at `address`, and the public key.
fn host_with_image(dist: &str, address: &str) -> (TestHost, Ssh, String) {
    let image = real_image(dist);
    let host = TestHost::start(HostOptions { netns: true, extra: LAN_NETWORK.into(), ..HostOptions::default() });
    let netns = host.netns.clone().expect("netns");
    let placed = host.images().join(format!("{dist}.qcow2"));
    if fs::hard_link(&image, &placed).is_err() {
        fs::copy(&image, &placed).expect("copy the image");
    }
    let key = host.dir.path().join("id_ed25519");
    run_ok(Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", ""]).arg("-f").arg(&key));
    let public = fs::read_to_string(key.with_extension("pub")).expect("public key").trim().to_string();
    (host, Ssh { netns, key, address: address.into() }, public)
}

/// Everything the issue asks of one real guest. `address` is its static address on `lan`.
fn a_real_guest_lives_its_life(dist: &str, address: &str, salt: bool) {
    let (host, ssh, public) = host_with_image(dist, address);
    let (netns, key) = (ssh.netns.clone(), ssh.key.clone());

    let name = format!("{dist}1");
    let master = salt.then(|| SaltMaster::start(&netns, host.dir.path()));
    let user_data = if salt { engine_bootstrap(&name, &public) } else { test_user_data(&public) };
    let spec = json!({
        "name": name, "cpu": 2, "memory_mib": 1024,
        "boot": {"image": format!("{dist}.qcow2"), "disk_gib": 4},
        "disks": [{"name": "data", "size_gib": 1}],
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": format!("{address}/24"),
            "gateway": "10.0.0.1", "dns": ["10.0.0.1"], "search": ["vmhost.test"]}}],
        "user_data": user_data,
    });
    let started = Instant::now();
    call(&host, "vm.create", json!({ "spec": spec }));

    // 1. The network as declared, applied by the guest's own cloud-init; the agent agrees.
    let check = wait_check_ok(&host, &name, BOOT);
    eprintln!("{dist}: vm.check ok {:.0} s after vm.create: {check}", started.elapsed().as_secs_f64());
    ssh.wait(BOOT);
    ssh.wait_cloud_init();
    let route = ssh.run("ip -4 route show default");
    assert!(route.contains("via 10.0.0.1"), "{route}");
    let addr = ssh.run("ip -4 -o addr show");
    assert!(addr.contains(&format!("{address}/24")), "{addr}");
    // DNS as the resolver uses it: resolv.conf (resolvconf) or systemd-resolved's upstream list.
    let dns = ssh.run("if command -v resolvectl >/dev/null; then resolvectl status; else cat /etc/resolv.conf; fi");
    assert!(dns.contains("10.0.0.1") && dns.contains("vmhost.test"), "{dns}");
    // The data disk by its serial, the root grown to the VM's disk_gib.
    let by_id = ssh.run("ls /dev/disk/by-id/");
    assert!(by_id.contains("virtio-data"), "{by_id}");
    let root_kib: u64 = ssh.run("df -k --output=size / | tail -n 1").trim().parse().expect("root size");
    assert!(root_kib > 3 * 1024 * 1024, "growpart grew / to the 4 GiB disk: {root_kib} KiB");
    let runs = ssh.run("cat /var/lib/vmhost-test-runcmd");
    assert_eq!(runs.lines().count(), 1, "user_data's runcmd ran once: {runs}");
    let instance = ssh.run("cat /var/lib/cloud/data/instance-id");
    let keys = ssh.host_keys();

    // 2. Debian 12: the Security Onion bootstrap joins the grid.
    if let Some(master) = &master {
        // The master's key list is salt's, outside vmhostd: looked at again until it has the key.
        let joined = wait::poll(BOOT, || {
            let keys = master.keys();
            if keys["minions"].as_array().is_some_and(|m| m.iter().any(|k| k == name.as_str())) {
                Ok(())
            } else {
                Err(keys.to_string())
            }
        });
        if let Err(keys) = joined {
            panic!(
                "{name}'s key never reached the master within {BOOT:?}: {keys}\nminion: {}",
                ssh.command("sudo journalctl -u salt-minion --no-pager | tail -n 30")
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default()
            );
        }
        let conf = ssh.run("cat /etc/salt/minion");
        assert!(conf.contains("master: 10.0.0.1") && conf.contains(&format!("id: {name}")), "{conf}");
        assert_eq!(ssh.run("systemctl is-active salt-minion").trim(), "active");
    }

    // 3. A live snapshot with the file systems frozen by the packaged agent unit.
    let snap = call(&host, "vm.snapshot", json!({"name": name, "snapshot": "s1", "requires": "frozen"}));
    assert_eq!(snap["consistency"], "frozen", "{snap}");
    assert!(snap["frozen"].as_array().is_some_and(|f| f.iter().any(|m| m == "/")), "the root was frozen: {snap}");
    let journal = ssh.run("sudo journalctl -u vmhost-agent --no-pager -b");
    assert!(!journal.contains("cannot freeze"), "the agent froze everything: {journal}");

    // 4. A memory change and a new search domain restart the VM, and it is the same instance:
    //    no first boot again, but the network config is applied again (the seed's vendor-data).
    let mut changed = call(&host, "vm.get", json!({ "name": name }))["spec"].clone();
    changed["memory_mib"] = json!(1280);
    changed["nics"][0]["ipv4"]["search"] = json!(["changed.test"]);
    let before = boot_id(&host, &name);
    call(&host, "vm.apply", json!({"spec": changed, "restart": true, "timeout_s": 300}));
    wait_check_ok(&host, &name, BOOT);
    assert_ne!(boot_id(&host, &name), before, "the VM was restarted");
    ssh.wait(BOOT);
    ssh.wait_cloud_init();
    assert_eq!(ssh.run("cat /var/lib/cloud/data/instance-id"), instance, "the instance id is kept");
    let mem_kib: u64 = ssh.run("awk '/MemTotal/ {print $2}' /proc/meminfo").trim().parse().expect("MemTotal");
    assert!(mem_kib > 1100 * 1024, "the new memory size: {mem_kib} KiB");
    let runs = ssh.run("cat /var/lib/vmhost-test-runcmd");
    assert_eq!(runs.lines().count(), 1, "runcmd did not run again after the memory change: {runs}");
    assert_eq!(ssh.host_keys(), keys, "the SSH host keys were not regenerated");
    let dns = ssh.run("if command -v resolvectl >/dev/null; then resolvectl status; else cat /etc/resolv.conf; fi");
    assert!(dns.contains("changed.test") && !dns.contains("vmhost.test"), "the new search domain applied: {dns}");

    // 5. The agent survives a reboot of the guest by itself.
    let before = boot_id(&host, &name);
    let _ = ssh.command("sudo systemctl reboot").output();
    wait::until("the agent back after the guest's reboot, with a new boot id", BOOT, || {
        match host.client().call::<Value>("vm.guest_info", json!({ "name": name })) {
            Ok(info) if info["boot_id"].as_str().is_some_and(|b| !b.is_empty() && b != before) => Ok(()),
            Ok(info) => Err(format!("boot id {} (before the reboot: {before})", info["boot_id"])),
            Err(e) => Err(e.to_string()),
        }
    });
    wait_check_ok(&host, &name, BOOT);

    // 6. vm.stop is a clean ACPI power-off: the guest's systemd powers off, QEMU is not killed.
    ssh.wait(BOOT);
    ssh.wait_cloud_init();
    let stopped = call(&host, "vm.stop", json!({"name": name, "timeout_s": 300}));
    assert_eq!(stopped["vm"]["status"], "stopped", "{stopped}");
    let console = host.serial(&name);
    assert!(tail(&console, 20000).contains("reboot: Power down"), "no clean power-off:\n{}", tail(&console, 4000));
    // Neither this stop nor the memory change's restart had to kill QEMU.
    let log = host.daemon_log();
    assert!(!log.contains("killing QEMU"), "QEMU was killed:\n{log}");

    // 7. Revert to the frozen snapshot: it boots without replaying the journal, and it is still
    //    the same instance (the snapshot was taken after the first boot).
    call(&host, "vm.revert", json!({"name": name, "snapshot": "s1"}));
    call(&host, "vm.start", json!({ "name": name }));
    wait_check_ok(&host, &name, BOOT);
    ssh.wait(BOOT);
    ssh.wait_cloud_init();
    assert_eq!(journal_replays(&ssh), Vec::<String>::new(), "the reverted root replayed its journal");
    assert_eq!(ssh.run("cat /var/lib/cloud/data/instance-id"), instance);
    assert_eq!(ssh.run("cat /var/lib/vmhost-test-runcmd").lines().count(), 1);
    call(&host, "vm.stop", json!({"name": name, "timeout_s": 300}));

    // 8. The same image under UEFI (OVMF without Secure Boot): Debian's shim on the image's ESP
    //    starts its signed GRUB unverified, which boots it.
    let efi = format!("{dist}efi");
    let spec = json!({
        "name": efi, "cpu": 2, "memory_mib": 1024,
        "boot": {"image": format!("{dist}.qcow2"), "disk_gib": 4, "firmware": "uefi"},
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.99/24", "gateway": "10.0.0.1"}}],
        "user_data": test_user_data(&public),
    });
    call(&host, "vm.create", json!({ "spec": spec }));
    wait_check_ok(&host, &efi, BOOT);
    let efi_ssh = Ssh { netns: netns.clone(), key, address: "10.0.0.99".into() };
    efi_ssh.wait(BOOT);
    efi_ssh.wait_cloud_init();
    assert_eq!(efi_ssh.run("test -d /sys/firmware/efi && echo uefi").trim(), "uefi");
    call(&host, "vm.destroy", json!({ "name": efi }));
    call(&host, "vm.destroy", json!({ "name": name }));
    eprintln!("{dist}: whole life {:.0} s", started.elapsed().as_secs_f64());
}

#[test]
fn debian12_with_ifupdown_and_cloud_init_22_4() {
    a_real_guest_lives_its_life(BOOKWORM, "10.0.0.21", true);
}

#[test]
fn debian13_with_netplan_networkd_and_resolved() {
    a_real_guest_lives_its_life(TRIXIE, "10.0.0.22", false);
}

/// Secure Boot with OVMF and SMM under TCG: shim, GRUB and the kernel each verified before they
/// run. A failure bound, not a speed (docs/testing.md gives the measured times).
const SECURE_BOOT: Duration = Duration::from_secs(600);

/// `SecureBoot` in EFI's global-variable namespace: 4 bytes of attributes, then the value.
const SECURE_BOOT_VAR: &str = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c";

/// A distribution's own Secure Boot chain under vmhost's default secure pair (the secboot code
/// and the `OVMF_VARS_4M.ms.fd` template: Microsoft's keys), with a TPM: the image's ESP holds
/// Debian's Microsoft-signed shim as `\EFI\BOOT\BOOTX64.EFI` and its Debian-signed GRUB, which
/// starts Debian's signed kernel. Nothing here is signed by the test. `address` is the VM's on `lan`.
fn a_real_guest_boots_its_signed_chain_under_secure_boot_with_a_tpm(dist: &str, address: &str) {
    let (host, ssh, public) = host_with_image(dist, address);

    // The host's firmware is the default secure pair: no `[firmware]` table in the config.
    let item = host.call("host.check", json!({}))["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["name"] == "secure_boot_firmware").cloned())
        .expect("a secure_boot_firmware item");
    assert_eq!(item["status"], "ok", "{item}");
    assert!(item.to_string().contains("OVMF_VARS_4M.ms.fd"), "Microsoft's template: {item}");

    let name = &format!("{dist}sb");
    let spec = json!({
        "name": name, "cpu": 2, "memory_mib": 1024, "tpm": true,
        "boot": {"image": format!("{dist}.qcow2"), "disk_gib": 4, "firmware": "uefi", "secure_boot": true},
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": format!("{address}/24"), "gateway": "10.0.0.1"}}],
        "user_data": test_user_data(&public),
    });
    let started = Instant::now();
    call(&host, "vm.create", json!({ "spec": spec }));
    let check = wait_check_ok(&host, name, SECURE_BOOT);
    let booted = started.elapsed().as_secs_f64();
    eprintln!("{dist} under Secure Boot with a TPM: vm.check ok {booted:.0} s after vm.create: {check}");

    // The kernel's own word, on the serial console: it was started with Secure Boot on (the EFI
    // stub and the kernel read the firmware's variable), so shim and GRUB before it were verified.
    let console = plain_log(&host.serial(name)).replace('\r', "");
    assert!(console.contains("secureboot: Secure boot enabled"), "console:\n{}", tail(&console, 6000));

    ssh.wait(SECURE_BOOT);
    ssh.wait_cloud_init();
    // The firmware's variable, as the running guest reads it: enabled (last byte 1).
    let var = ssh.run(&format!("od -An -tu1 {SECURE_BOOT_VAR}"));
    assert_eq!(var.split_whitespace().last(), Some("1"), "SecureBoot variable: {var}");
    // Debian's kernel locks itself down when booted with Secure Boot (LOCK_DOWN_IN_EFI_SECURE_BOOT).
    let lockdown = ssh.run("cat /sys/kernel/security/lockdown");
    assert!(lockdown.contains("[integrity]"), "lockdown: {lockdown}");
    // The chain that ran is the distribution's: the ESP holds Debian's signed shim and GRUB,
    // byte for byte what their packages ship.
    let esp = ssh.run(
        "sudo mount -o ro /dev/vda1 /mnt && cmp /mnt/EFI/BOOT/BOOTX64.EFI /usr/lib/shim/shimx64.efi.signed && \
         cmp /mnt/EFI/BOOT/grubx64.efi /usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed && \
         echo debian-signed; sudo umount /mnt",
    );
    assert!(esp.contains("debian-signed"), "{esp}");

    // The TPM: a TPM 2.0 device, and the firmware measured the Secure Boot policy into PCR 7.
    let tpm = ssh.run("ls /dev/tpm0 /dev/tpmrm0 && cat /sys/class/tpm/tpm0/tpm_version_major");
    assert_eq!(tpm.lines().last().map(str::trim), Some("2"), "{tpm}");
    let pcr7 = ssh.run("cat /sys/class/tpm/tpm0/pcr-sha256/7").trim().to_string();
    assert!(pcr7.len() == 64 && pcr7.chars().any(|c| c != '0'), "PCR 7 holds a measurement: {pcr7}");

    call(&host, "vm.destroy", json!({ "name": name }));
    eprintln!("{dist} under Secure Boot with a TPM: whole test {:.0} s", started.elapsed().as_secs_f64());
}

#[test]
fn debian12_boots_its_signed_shim_grub_and_kernel_under_secure_boot_with_a_tpm() {
    a_real_guest_boots_its_signed_chain_under_secure_boot_with_a_tpm(BOOKWORM, "10.0.0.23");
}

#[test]
fn debian13_boots_its_signed_shim_grub_and_kernel_under_secure_boot_with_a_tpm() {
    a_real_guest_boots_its_signed_chain_under_secure_boot_with_a_tpm(TRIXIE, "10.0.0.24");
}

/// One seed to check: a spec's NICs (`ipv4` of each, JSON), its `user_data`, and what each
/// renderer's output must contain.
struct SeedCase {
    what: &'static str,
    ipv4: Vec<Value>,
    user_data: Option<String>,
    /// The spec's `ssh` (JSON), if any.
    ssh: Option<Value>,
    present: Vec<&'static str>,
}

/// A key for the seed cases' ssh accounts.
const SEED_KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA t@t";

fn seed_cases() -> Vec<SeedCase> {
    let static_full = json!({"mode": "static", "address": "10.0.0.5/24", "gateway": "10.0.0.1",
        "dns": ["10.0.0.53", "10.0.0.54"], "search": ["example.test", "corp.test"]});
    vec![
        SeedCase {
            what: "static with gateway, two DNS servers and two search domains, generated user-data",
            ipv4: vec![static_full.clone()],
            user_data: None,
            ssh: None,
            present: vec!["10.0.0.5/24", "10.0.0.1", "10.0.0.53", "10.0.0.54", "example.test", "corp.test", "eth0"],
        },
        SeedCase {
            what: "static without gateway, DNS or search, the test's user-data",
            ipv4: vec![json!({"mode": "static", "address": "192.168.7.9/16"})],
            user_data: Some(test_user_data(
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA t@t",
            )),
            ssh: None,
            present: vec!["192.168.7.9/16", "eth0"],
        },
        SeedCase {
            what: "DNS without search, search without DNS",
            ipv4: vec![
                json!({"mode": "static", "address": "10.1.0.5/24", "gateway": "10.1.0.1", "dns": ["10.1.0.53"]}),
                json!({"mode": "static", "address": "10.2.0.5/24", "search": ["only.test"]}),
            ],
            user_data: None,
            ssh: None,
            present: vec!["10.1.0.5/24", "10.1.0.1", "10.1.0.53", "10.2.0.5/24", "only.test", "eth0", "eth1"],
        },
        SeedCase {
            what: "search domains and no DNS server in the whole VM",
            ipv4: vec![
                json!({"mode": "static", "address": "10.3.0.5/24", "gateway": "10.3.0.1", "search": ["lost.test"]}),
            ],
            user_data: None,
            ssh: None,
            present: vec!["10.3.0.5/24", "10.3.0.1", "lost.test", "eth0"],
        },
        SeedCase {
            what: "DHCP",
            ipv4: vec![json!({"mode": "dhcp"})],
            user_data: None,
            ssh: None,
            present: vec!["eth0"],
        },
        SeedCase {
            what: "a NIC without an address",
            ipv4: vec![Value::Null],
            user_data: None,
            ssh: None,
            present: vec!["eth0"],
        },
        SeedCase {
            what: "four NICs: static with gateway, DHCP, none, static",
            ipv4: vec![
                static_full,
                json!({"mode": "dhcp"}),
                Value::Null,
                json!({"mode": "static", "address": "172.16.0.9/12"}),
            ],
            user_data: Some("#cloud-config\nruncmd:\n  - [sh, -c, 'echo \"{\\\"a\\\": 1}\" > /x']\n".into()),
            ssh: None,
            present: vec![
                "10.0.0.5/24",
                "10.0.0.1",
                "10.0.0.53",
                "example.test",
                "172.16.0.9/12",
                "eth0",
                "eth1",
                "eth2",
                "eth3",
            ],
        },
        SeedCase {
            // A monitor NIC ({"monitor": SOURCE} here) is listed up with no address.
            what: "an addressed NIC and a monitor NIC",
            ipv4: vec![json!({"mode": "static", "address": "10.4.0.5/24"}), json!({"monitor": "span0"})],
            user_data: None,
            ssh: None,
            present: vec!["10.4.0.5/24", "eth0", "eth1"],
        },
        SeedCase {
            what: "an ssh account, generated user-data",
            ipv4: vec![json!({"mode": "dhcp"})],
            user_data: None,
            ssh: Some(
                json!({"user": "ops", "keys": [SEED_KEY, "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg= a@b"]}),
            ),
            present: vec!["eth0"],
        },
        SeedCase {
            what: "an ssh account beside the test's user-data (vendor-data)",
            ipv4: vec![json!({"mode": "dhcp"})],
            user_data: Some("#cloud-config\nruncmd:\n  - [\"true\"]\n".into()),
            ssh: Some(json!({"keys": [SEED_KEY]})),
            present: vec!["eth0"],
        },
    ]
}

/// The seed of `case` as vmhostd writes it (`vmhost::seed::render`, the same function its
/// lifecycle calls), with the allocations a VM would get.
fn render_case(case: &SeedCase) -> vmhost::seed::SeedFiles {
    let nics: Vec<Value> = case
        .ipv4
        .iter()
        .map(|ip| match ip {
            Value::Null => json!({"network": "lan"}),
            _ if ip.get("monitor").is_some() => json!({"mode": "monitor", "source": ip["monitor"]}),
            _ => json!({"network": "lan", "ipv4": ip}),
        })
        .collect();
    let mut spec = json!({"name": "seed_check", "cpu": 1, "memory_mib": 512,
        "boot": {"image": "debian.qcow2", "disk_gib": 4}, "nics": nics});
    if let Some(text) = &case.user_data {
        spec["user_data"] = json!(text);
    }
    if let Some(ssh) = &case.ssh {
        spec["ssh"] = ssh.clone();
    }
    let spec: vmhost::api::VmSpec = serde_json::from_value(spec).expect("a spec");
    let allocs: Vec<vmhost::nic::NicAlloc> = (0..case.ipv4.len())
        .map(|i| vmhost::nic::NicAlloc {
            mac: format!("52:54:00:12:34:{i:02x}"),
            tap: format!("vmh0n{i}"),
            vhost: false,
        })
        .collect();
    vmhost::seed::render(&spec, &allocs, &vmhost::seed::new_instance_id("seed_check").expect("an instance id"))
}

#[test]
fn every_seed_vmhost_writes_is_read_by_each_guests_cloud_init() {
    for dist in [BOOKWORM, TRIXIE] {
        let tree = tree(dist);
        let scratch =
            tempfile::Builder::new().prefix("vmhost-seed-").tempdir_in(tree.join("tmp")).expect("scratch dir");
        fs::copy(workspace().join("tests/guest/check-seed.py"), scratch.path().join("check-seed.py")).expect("checker");
        let inside = Path::new("/tmp").join(scratch.path().file_name().expect("a name"));
        for (i, case) in seed_cases().iter().enumerate() {
            let files = render_case(case);
            let dir = scratch.path().join(format!("seed{i}"));
            fs::create_dir(&dir).expect("seed dir");
            for (name, text) in [
                ("meta-data", &files.meta_data),
                ("user-data", &files.user_data),
                ("vendor-data", &files.vendor_data),
                ("network-config", &files.network_config),
            ] {
                fs::write(dir.join(name), text).expect("seed file");
            }
            fs::write(dir.join("expect.json"), json!({ "present": case.present }).to_string()).expect("expect.json");
            let out = Command::new("chroot")
                .arg(&tree)
                .args(["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8", "python3"])
                .arg(inside.join("check-seed.py"))
                .arg(inside.join(format!("seed{i}")))
                .output()
                .expect("run check-seed.py");
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(
                out.status.success() && text.contains("seed ok"),
                "{dist}: {} is not read as written:\n{text}\nnetwork-config:\n{}",
                case.what,
                files.network_config
            );
            eprintln!("{dist}: {}: ok", case.what);
        }
    }
}
