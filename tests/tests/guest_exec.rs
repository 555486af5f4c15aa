//! Commands and files in a guest end to end (`vm.exec`, `vm.file_push`, `vm.file_pull`): real
//! vmhostd, real TCG guests running the real static `vmhost-agent --exec` on the exec ports.
//!
//! The opt-in, access and no-exec-server tests need no exec server; the others need the test
//! guest's init to start `/bin/vmhost-agent --exec` (tests/guest/init.sh).

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vmhost::agent::exec::base64;
use vmhost_tests::{agent_guest, guest, wait, HostOptions, TestHost, GUEST_READY};

const NOGROUP: u32 = 65534;

/// A directory for `[agent] files_dir`, made before the daemon starts (its Landlock rules are
/// made from paths that exist then).
fn files_dir() -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("vmhost-files-{}-{:?}", std::process::id(), std::thread::current().id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A host that allows exec, with `files` as its files_dir.
fn exec_host(files: &Path) -> TestHost {
    TestHost::start(HostOptions {
        readonly_group: "nogroup".into(),
        extra: format!("[agent]\nallow_exec = true\nfiles_dir = {:?}\nmax_file_mib = 4\n", files.display().to_string()),
        ..HostOptions::default()
    })
}

fn spec(name: &str, g: &vmhost_tests::Guest) -> Value {
    json!({"name": name, "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}})
}

/// A stopped VM whose kernel is never booted.
fn record(host: &TestHost, name: &str, extra: Value) {
    let kernel = host.images().join("vmlinuz");
    std::fs::write(&kernel, b"not a kernel").unwrap();
    let mut spec = json!({"name": name, "cpu": 1, "memory_mib": 64, "state": "stopped",
        "boot": {"kernel": kernel, "cmdline": "console=ttyS0"}});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    host.call("vm.create", json!({ "spec": spec }));
}

/// Connects to `socket` as `uid` with primary group `gid` and no supplementary groups.
fn connect_as(socket: &Path, uid: u32, gid: u32) -> std::io::Result<UnixStream> {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        // SAFETY: raw system calls on plain integers; they change only this thread's
        // credentials, and the thread ends here.
        let dropped = unsafe {
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0
                && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
                && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
        };
        assert!(dropped, "cannot drop to {uid}:{gid}: {}", std::io::Error::last_os_error());
        UnixStream::connect(&socket)
    })
    .join()
    .expect("connecting thread")
}

fn exec(host: &TestHost, name: &str, argv: &[&str], extra: Value) -> Value {
    let mut params = json!({"name": name, "argv": argv});
    if let (Some(p), Some(e)) = (params.as_object_mut(), extra.as_object()) {
        p.extend(e.clone());
    }
    host.call("vm.exec", params)
}

/// Boots `name` from the agent guest and waits until its exec server answers.
fn boot_with_exec(host: &TestHost, name: &str) {
    host.call("vm.create", json!({ "spec": spec(name, &agent_guest()) }));
    assert!(host.wait_serial(name, GUEST_READY, Duration::from_secs(300)), "{}", host.serial(name));
    wait::until("the exec server to answer", Duration::from_secs(120), || {
        match host.client().call::<Value>("vm.exec", json!({"name": name, "argv": ["true"]})) {
            Ok(v) if v["exit_code"] == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
}

#[test]
fn exec_is_refused_unless_the_host_and_the_spec_allow_it_and_only_admins_may_ask() {
    // Off by default: 4095 with reason host, before the VM's state matters.
    let off = TestHost::start(HostOptions::default());
    record(&off, "a", json!({}));
    let (code, e) = off.call_err("vm.exec", json!({"name": "a", "argv": ["true"]}));
    assert_eq!((code, e.field.as_deref(), &e.details["reason"]), (4095, Some("name"), &json!("host")), "{e:?}");
    let (code, _) = off.call_err("vm.file_pull", json!({"name": "a", "path": "/etc/hostname"}));
    assert_eq!(code, 4095);
    let (code, _) = off.call_err("vm.exec", json!({"name": "nosuch", "argv": ["true"]}));
    assert_eq!(code, 4040);
    drop(off);

    let files = files_dir();
    let host = exec_host(&files);
    record(&host, "noexec", json!({"guest_exec": false}));
    record(&host, "stopped", json!({}));
    let (code, e) = host.call_err("vm.exec", json!({"name": "noexec", "argv": ["true"]}));
    assert_eq!((code, &e.details["reason"]), (4095, &json!("spec")), "{e:?}");
    let (code, e) = host.call_err("vm.exec", json!({"name": "stopped", "argv": ["true"]}));
    assert_eq!((code, e.field.as_deref()), (5001, Some("name")), "{e:?}");
    // Params are checked first, naming the field.
    let (code, e) = host.call_err("vm.exec", json!({"name": "stopped", "argv": []}));
    assert_eq!((code, e.field.as_deref()), (-32602, Some("argv")));
    let (code, e) = host.call_err("vm.file_push", json!({"name": "stopped", "path": "/x", "source": "../etc/passwd"}));
    assert_eq!((code, e.field.as_deref()), (5001, Some("name")), "the VM is checked before the source: {e:?}");
    // A read-only peer: 1002 for all three.
    let s = connect_as(&host.socket, 60020, NOGROUP).expect("connect as a read-only peer");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    for (i, (method, params)) in [
        ("vm.exec", json!({"name": "stopped", "argv": ["true"]})),
        ("vm.file_push", json!({"name": "stopped", "path": "/x", "content": ""})),
        ("vm.file_pull", json!({"name": "stopped", "path": "/x"})),
    ]
    .into_iter()
    .enumerate()
    {
        writeln!(w, "{}", json!({"jsonrpc": "2.0", "id": i, "method": method, "params": params})).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["error"]["code"], 1002, "{method}: {v}");
    }
    let _ = std::fs::remove_dir_all(files);
}

#[test]
fn a_guest_without_an_exec_server_is_5001_in_bounded_time() {
    let files = files_dir();
    let host = exec_host(&files);
    // The plain test guest runs no agent at all; its QEMU still has the eight exec ports.
    host.call("vm.create", json!({ "spec": spec("plain", &guest()) }));
    assert!(host.wait_serial("plain", GUEST_READY, Duration::from_secs(300)), "{}", host.serial("plain"));
    for slot in 0..8 {
        assert!(host.run().join("plain").join(format!("exec{slot}")).exists(), "exec port socket {slot}");
    }
    let started = Instant::now();
    let (code, e) = host.call_err("vm.exec", json!({"name": "plain", "argv": ["true"]}));
    assert_eq!((code, e.field.as_deref()), (5001, Some("name")), "{e:?}");
    assert!(e.message.contains("no exec server"), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    // The slot was given back: eight more calls each get a slot (and the same answer), none 4096.
    for _ in 0..9 {
        assert_eq!(host.call_err("vm.file_pull", json!({"name": "plain", "path": "/x"})).0, 5001);
    }
    assert_eq!(host.call("vm.get", json!({"name": "plain"}))["status"], "running");
    // A VM whose QEMU an older vmhostd started has no exec port sockets: told to restart.
    for slot in 0..8 {
        std::fs::remove_file(host.run().join("plain").join(format!("exec{slot}"))).unwrap();
    }
    let (code, e) = host.call_err("vm.exec", json!({"name": "plain", "argv": ["true"]}));
    assert_eq!(code, 5001);
    assert!(e.message.contains("restart the VM to get exec ports"), "{e:?}");
    let _ = std::fs::remove_dir_all(files);
}

#[test]
fn commands_exit_codes_signals_timeouts_and_slots() {
    let files = files_dir();
    let host = exec_host(&files);
    boot_with_exec(&host, "g");
    let v = exec(&host, "g", &["sh", "-c", "echo out; echo err >&2; exit 7"], json!({}));
    assert_eq!(
        (v["exit_code"].clone(), v["signal"].clone(), v["timed_out"].clone()),
        (json!(7), Value::Null, json!(false))
    );
    assert_eq!((v["stdout"].as_str(), v["stderr"].as_str()), (Some("out\n"), Some("err\n")), "{v}");
    let v = exec(&host, "g", &["sh", "-c", "kill -TERM $$"], json!({}));
    assert_eq!((v["exit_code"].clone(), v["signal"].clone()), (Value::Null, json!(15)), "{v}");
    let v = exec(&host, "g", &["cat"], json!({"stdin": base64::encode(b"piped\0bytes"), "encoding": "base64"}));
    assert_eq!(base64::decode(v["stdout"].as_str().unwrap()).unwrap(), b"piped\0bytes");
    let v = exec(&host, "g", &["sh", "-c", "head -c 5000 /dev/zero"], json!({"max_output": 100}));
    assert_eq!((v["stdout_bytes"].clone(), v["stdout_truncated"].clone()), (json!(5000), json!(true)), "{v}");
    assert_eq!(v["stdout"].as_str().map(str::len), Some(100));
    let v = exec(&host, "g", &["env"], json!({"env": ["VMHOST_T=1"], "cwd": "/tmp"}));
    assert!(v["stdout"].as_str().unwrap().contains("VMHOST_T=1"), "{v}");
    let (code, e) = host.call_err("vm.exec", json!({"name": "g", "argv": ["/no/such/program"]}));
    assert!(code == 4001 && e.details["agent_error"].is_object(), "{code} {e:?}");

    // A timeout kills the command: the answer comes after about timeout_s, not the command's 300 s.
    let started = Instant::now();
    let v = exec(&host, "g", &["sleep", "300"], json!({"timeout_s": 2}));
    assert_eq!((v["timed_out"].clone(), v["signal"].clone()), (json!(true), json!(9)), "{v}");
    assert!(started.elapsed() < Duration::from_secs(60));

    // Eight at once hold the eight slots; a ninth is 4096 meanwhile.
    let sleepers: Vec<_> = (0..8)
        .map(|_| {
            let client = host.client();
            std::thread::spawn(move || {
                let mut client = client;
                // The ninth caller's probes take a slot for a moment: a sleeper that meets
                // one asks again.
                wait::until("a slot for a sleeper", Duration::from_secs(60), || {
                    match client
                        .call::<Value>("vm.exec", json!({"name": "g", "argv": ["sleep", "30"], "timeout_s": 120}))
                    {
                        Err(vmhost::client::ClientError::Api(e)) if e.code.as_i32() == 4096 => Err(e.message),
                        other => Ok(other),
                    }
                })
            })
        })
        .collect();
    let busy = wait::until("a ninth call to find every slot busy", Duration::from_secs(60), || {
        match host.client().call::<Value>("vm.exec", json!({"name": "g", "argv": ["true"]})) {
            Err(vmhost::client::ClientError::Api(e)) if e.code.as_i32() == 4096 => Ok(e),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(busy.details["slots"], 8);
    let mut slots: Vec<u64> =
        sleepers.into_iter().map(|t| t.join().unwrap().expect("a sleeper")["slot"].as_u64().unwrap()).collect();
    slots.sort_unstable();
    assert_eq!(slots, (0..8).collect::<Vec<u64>>());
    assert_eq!(exec(&host, "g", &["true"], json!({}))["slot"], 0, "the slots are free again");
    let _ = std::fs::remove_dir_all(files);
}

#[test]
fn streamed_output_arrives_before_the_answer() {
    let files = files_dir();
    let host = exec_host(&files);
    boot_with_exec(&host, "s");
    // Every command is an event carrying the guest action, and an audit line.
    let events = UnixStream::connect(&host.socket).unwrap();
    events.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut events_r = BufReader::new(events.try_clone().unwrap());
    writeln!(&events, "{}", json!({"jsonrpc": "2.0", "id": 1, "method": "events.subscribe"})).unwrap();
    let mut line = String::new();
    events_r.read_line(&mut line).unwrap();
    let s = UnixStream::connect(&host.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let params = json!({"name": "s", "argv": ["sh", "-c", "echo one; sleep 2; echo two >&2"], "stream": true,
        "env": ["SECRET_NAME=hunter2"]});
    writeln!(w, "{}", json!({"jsonrpc": "2.0", "id": 9, "method": "vm.exec", "params": params})).unwrap();
    let mut notes = Vec::new();
    let answer = loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["id"] == 9 {
            break v;
        }
        assert_eq!(v["method"], "vm.exec.output", "{v}");
        notes.push(v["params"].clone());
    };
    let text: Vec<(String, Vec<u8>)> = notes
        .iter()
        .map(|n| (n["stream"].as_str().unwrap().to_string(), base64::decode(n["data"].as_str().unwrap()).unwrap()))
        .collect();
    assert_eq!(text, [("stdout".into(), b"one\n".to_vec()), ("stderr".into(), b"two\n".to_vec())], "{notes:?}");
    assert_eq!(notes[0]["name"], "s");
    let result = &answer["result"];
    assert_eq!((result["stdout"].as_str(), result["stdout_bytes"].as_u64()), (Some(""), Some(4)), "{answer}");
    let event = loop {
        let mut line = String::new();
        events_r.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["params"]["result"]["guest"].is_object() {
            break v["params"]["result"].clone();
        }
    };
    assert_eq!(
        (event["vm"].as_str(), event["from"].as_str(), event["to"].as_str()),
        (Some("s"), Some("running"), Some("running"))
    );
    let guest = &event["guest"];
    assert_eq!(
        (guest["action"].as_str(), guest["peer_uid"].as_u64(), guest["exit_code"].as_i64()),
        (Some("exec"), Some(0), Some(0)),
        "{event}"
    );
    assert_eq!(guest["argv"][0], "sh");
    let log = vmhost_tests::plain_log(&host.daemon_log());
    let audit: Vec<&str> = log.lines().filter(|l| l.contains("vmhost::audit") && l.contains("SECRET_NAME")).collect();
    assert!(!audit.is_empty(), "an audit line names the env entry");
    assert!(audit.iter().all(|l| !l.contains("hunter2")), "never an environment value: {audit:?}");
    let _ = std::fs::remove_dir_all(files);
}

#[test]
fn a_mebibyte_goes_in_and_out_with_equal_sha256_and_pushes_are_atomic() {
    let files = files_dir();
    let host = exec_host(&files);
    boot_with_exec(&host, "f");
    let blob: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(files.join("blob"), &blob).unwrap();
    let pushed = host.call(
        "vm.file_push",
        json!({"name": "f", "path": "/tmp/sub/blob", "source": "blob", "mkdir": true, "mode": 0o600}),
    );
    let pulled = host.call("vm.file_pull", json!({"name": "f", "path": "/tmp/sub/blob", "max_bytes": 2 << 20}));
    assert_eq!(pushed["sha256"], pulled["sha256"]);
    assert_eq!((pulled["size"].as_u64(), pulled["mode"].as_u64()), (Some(1 << 20), Some(0o600)));
    assert_eq!(base64::decode(pulled["content"].as_str().unwrap()).unwrap(), blob);
    // A sha256 that is not the content's: 2003 before anything is written.
    let (code, e) = host
        .call_err("vm.file_push", json!({"name": "f", "path": "/tmp/x", "content": "aGk=", "sha256": "0".repeat(64)}));
    assert_eq!((code, e.field.as_deref()), (2003, Some("sha256")));
    // A source that leaves files_dir: refused, naming source.
    std::os::unix::fs::symlink("/etc/shadow", files.join("escape")).unwrap();
    for bad in ["escape", "../etc/passwd", "/etc/passwd"] {
        let (code, e) = host.call_err("vm.file_push", json!({"name": "f", "path": "/tmp/x", "source": bad}));
        assert_eq!((code, e.field.as_deref()), (-32602, Some("source")), "{bad}: {e:?}");
    }
    // Over max_bytes: the guest refuses.
    let (code, e) = host.call_err("vm.file_pull", json!({"name": "f", "path": "/tmp/sub/blob", "max_bytes": 1000}));
    assert!(code == 4001 && e.details["agent_error"].is_object(), "{code} {e:?}");

    // Atomic: a reader in the guest reads the file in a loop while pushes alternate two
    // contents; it never sees anything but one of them whole.
    let (a, b) = ("a".repeat(4000), "b".repeat(4000));
    host.call("vm.file_push", json!({"name": "f", "path": "/tmp/atomic", "content": base64::encode(a.as_bytes())}));
    let reader = {
        let mut client = host.client();
        let (a, b) = (a.clone(), b.clone());
        std::thread::spawn(move || {
            let script = r#"n=0; bad=0; while [ ! -e /tmp/stop ]; do x=$(cat /tmp/atomic); case "$x" in "$A"|"$B") ;; *) bad=$((bad+1));; esac; n=$((n+1)); done; echo "reads=$n bad=$bad""#;
            client.call::<Value>(
                "vm.exec",
                json!({"name": "f", "argv": ["sh", "-c", script], "env": [format!("A={a}"), format!("B={b}")], "timeout_s": 600}),
            )
        })
    };
    for i in 0..30 {
        let content = if i % 2 == 0 { &b } else { &a };
        host.call(
            "vm.file_push",
            json!({"name": "f", "path": "/tmp/atomic", "content": base64::encode(content.as_bytes())}),
        );
    }
    host.call("vm.file_push", json!({"name": "f", "path": "/tmp/stop", "content": ""}));
    let v = reader.join().unwrap().expect("the reader");
    let out = v["stdout"].as_str().unwrap_or_default().to_string();
    assert!(out.contains(" bad=0"), "{out}");
    assert!(!out.contains("reads=0 "), "{out}");
    let _ = std::fs::remove_dir_all(files);
}

/// A guest whose exec server is `tests/guest/hostile/SCRIPT` (written by the guest side).
fn hostile_exec_guest(script: &str, initramfs: &str) -> vmhost_tests::Guest {
    vmhost_tests::hostile_guest(script, initramfs)
}

#[test]
fn flooding_and_silent_exec_servers_cost_bounded_memory_and_time() {
    let files = files_dir();
    let host = exec_host(&files);
    let daemon = host.daemon_pid().unwrap();
    for (name, script, initramfs) in [
        ("flood", "flood-exec.sh", "initramfs-flood-exec.cpio.gz"),
        ("silent", "silent-exec.sh", "initramfs-silent-exec.cpio.gz"),
    ] {
        host.call("vm.create", json!({ "spec": spec(name, &hostile_exec_guest(script, initramfs)) }));
        assert!(host.wait_serial(name, GUEST_READY, Duration::from_secs(300)), "{}", host.serial(name));
    }
    for name in ["flood", "silent"] {
        let started = Instant::now();
        let (code, e) = host.call_err("vm.exec", json!({"name": name, "argv": ["true"], "timeout_s": 1}));
        // A flood ends the session (5001: more than asked for, or an oversize line), silence
        // ends at the bound (5002 after timeout_s + 10 s, or 5001 when even sync is unanswered).
        assert!(code == 5001 || code == 5002, "{name}: {code} {e:?}");
        assert!(started.elapsed() < Duration::from_secs(60), "{name}: {:?}", started.elapsed());
        assert!(host.call("vm.list", json!({})).is_array(), "the daemon answers meanwhile");
    }
    let rss_kib = vmhost_tests::rss_kib(daemon);
    assert!(rss_kib > 0 && rss_kib < 200 * 1024, "vmhostd RSS {rss_kib} KiB");
    let _ = std::fs::remove_dir_all(files);
}
