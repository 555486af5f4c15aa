//! The interactive serial console (`vm.console`, `vmhostctl console`, docs/console.md) against a
//! real vmhostd and a real TCG guest running a shell on ttyS0 (`vmhost.shell`, tests/guest).
//!
//! `vmhostctl console` runs on a pseudo-terminal, as an operator's would: raw mode, keystrokes,
//! `Ctrl-]`. The read-only peer is a real credential: a copy of vmhostctl run as uid 65534 in
//! `nogroup`, the host's read-only group here.

use serde_json::json;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmhost_tests::{bin, HostOptions, TestHost, GUEST_READY};

/// Debian's `nogroup`: the read-only group of these hosts.
const NOGROUP: u32 = 65534;

/// How long a guest command may take to show its output under TCG.
const ANSWER: Duration = Duration::from_secs(60);

/// A host whose read-only group is `nogroup`, running `name` with a shell on its console.
fn shell_vm(name: &str) -> TestHost {
    let host = TestHost::start(HostOptions { readonly_group: "nogroup".into(), ..HostOptions::default() });
    let mut spec = host.kernel_spec(name);
    spec["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet vmhost.shell");
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial(name, GUEST_READY, Duration::from_secs(120)), "{name} never came up");
    // init.sh starts the shell on ttyS0 after it prints GUEST_READY: wait until a shell answers,
    // so what a test types reaches a shell rather than a terminal nobody reads yet. Typed again
    // every few seconds (a line typed before the shell started may be lost with its tty);
    // `shell-9` appears only when a shell ran the line, the terminal's echo shows `$((3*3))`.
    let (mut probe, _, _) = host.client().console(name, false, false).expect("attach to probe the shell");
    let answered = (0..24).any(|_| {
        probe.write_all(b"echo shell-$((3*3))\r").expect("type the probe");
        host.wait_serial(name, "shell-9", Duration::from_secs(5))
    });
    assert!(answered, "{name}'s shell never answered; serial log:\n{}", host.serial(name));
    drop(probe);
    host
}

/// A running `vmhostctl console` and everything it printed so far.
struct Console {
    child: Child,
    /// Where keystrokes go: the pty's master, or the child's stdin pipe.
    keys: Option<File>,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Console {
    /// `vmhostctl console ARGS` on a new pseudo-terminal (stdin, stdout and stderr).
    fn on_pty(host: &TestHost, args: &[&str]) -> Console {
        let pty = nix::pty::openpty(None, None).expect("openpty");
        let slave: OwnedFd = pty.slave;
        let mut cmd = Command::new(bin("vmhostctl"));
        cmd.arg("--socket").arg(&host.socket).arg("console").args(args);
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        let child = cmd.spawn().expect("spawn vmhostctl console");
        // Our copies of the slave are gone: the master reads EIO once the child exits.
        let master = File::from(pty.master);
        Console::collect(child, master.try_clone().unwrap(), Some(master))
    }

    /// `vmhostctl console ARGS` run by `program` as the read-only peer, on pipes.
    fn read_only_peer(host: &TestHost, program: &PathBuf, args: &[&str]) -> Console {
        let mut cmd = Command::new(program);
        cmd.arg("--socket").arg(&host.socket).arg("console").args(args);
        // As root, std also clears the supplementary groups.
        cmd.uid(NOGROUP).gid(NOGROUP);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn vmhostctl as the read-only peer");
        let keys = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
        let out = File::from(OwnedFd::from(child.stdout.take().unwrap()));
        let err = File::from(OwnedFd::from(child.stderr.take().unwrap()));
        let c = Console::collect(child, out, keys);
        c.also_collect(err);
        c
    }

    fn collect(child: Child, from: File, keys: Option<File>) -> Console {
        let c = Console { child, keys, out: Arc::new(Mutex::new(Vec::new())) };
        c.also_collect(from);
        c
    }

    /// Appends what `from` yields to the output, in a thread, until EOF or EIO.
    fn also_collect(&self, mut from: File) {
        let out = Arc::clone(&self.out);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                out.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    fn len(&self) -> usize {
        self.out.lock().unwrap().len()
    }

    /// Waits until the output after byte `from` holds `needle`.
    fn wait_for(&self, from: usize, needle: &str) {
        vmhost_tests::wait::until_true(
            &format!("{needle:?} after byte {from}"),
            ANSWER,
            || String::from_utf8_lossy(&self.out.lock().unwrap()[from..]).contains(needle),
            || format!("output:\n{}", self.text()),
        );
    }

    fn send(&mut self, bytes: &[u8]) {
        let keys = self.keys.as_mut().expect("an input");
        keys.write_all(bytes).expect("type");
        keys.flush().unwrap();
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let out = self.out.clone();
        let status = vmhost_tests::wait::poll(ANSWER, || match self.child.try_wait() {
            Ok(Some(st)) => Ok(st),
            _ => Err(String::new()),
        });
        status.unwrap_or_else(|_| {
            panic!("vmhostctl console did not exit; output:\n{}", String::from_utf8_lossy(&out.lock().unwrap()))
        })
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn an_operator_types_into_the_guest_shell_one_writer_at_a_time() {
    let host = shell_vm("con1");
    // The read-only peer's copy of vmhostctl, where uid 65534 may run it.
    let ro_ctl = host.dir.path().join("vmhostctl");
    std::fs::copy(bin("vmhostctl"), &ro_ctl).unwrap();
    std::fs::set_permissions(&ro_ctl, std::fs::Permissions::from_mode(0o755)).unwrap();

    // The writer attaches on a terminal: the replay holds what the guest printed at boot.
    let mut a = Console::on_pty(&host, &["con1"]);
    a.wait_for(0, "escape character is ^]");
    a.wait_for(0, GUEST_READY);
    let mark = a.len();
    a.send(b"echo $((6*7))\r");
    a.wait_for(mark, "\n42\r\n");

    // One writer at a time: a second one is refused with 4090.
    let second = host.ctl(&["console", "con1"]);
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("error 4090 (busy)"), "{err}");

    // A read-only peer may not write, but may watch; its keystrokes never reach the guest.
    let mut refused = Console::read_only_peer(&host, &ro_ctl, &["con1"]);
    assert_eq!(refused.wait_exit().code(), Some(1));
    // Its exit may come before the collecting thread read its last output.
    refused.wait_for(0, "error 1002 (read_only)");
    let mut watcher = Console::read_only_peer(&host, &ro_ctl, &["--read-only", "con1"]);
    watcher.wait_for(0, "read-only");
    watcher.wait_for(0, "\n42\r\n");
    watcher.send(b"echo vmhost-ro-keys\r");
    let (mark, watched) = (a.len(), watcher.len());
    a.send(b"echo after-$((2+3))\r");
    a.wait_for(mark, "\nafter-5\r\n");
    watcher.wait_for(watched, "\nafter-5\r\n");

    // --force takes over: the first writer is told and detached; the new one types.
    let mut b = Console::on_pty(&host, &["--force", "con1"]);
    b.wait_for(0, "escape character is ^]");
    a.wait_for(mark, "console taken over by uid 0");
    assert_eq!(a.wait_exit().code(), Some(4), "{}", a.text());
    let mark = b.len();
    b.send(b"echo forced-$((3*3))\r");
    b.wait_for(mark, "\nforced-9\r\n");

    // Ctrl-] detaches (exit 0); the console is free for the next writer at once.
    b.send(&[0x1d]);
    assert!(b.wait_exit().success(), "{}", b.text());
    b.wait_for(mark, "Detached from the console of con1");
    let mut c = Console::on_pty(&host, &["con1"]);
    c.wait_for(0, "forced-9");
    let mark = c.len();
    c.send(b"echo last-$((4+4))\r");
    c.wait_for(mark, "\nlast-8\r\n");
    watcher.wait_for(0, "\nlast-8\r\n");

    // The console log holds the whole session, and nothing the read-only peer typed: the
    // guest's terminal would have echoed it.
    let log = host.serial("con1");
    for typed in ["echo $((6*7))", "\n42\r\n", "echo after-$((2+3))", "after-5", "forced-9", "last-8"] {
        assert!(log.contains(typed), "the log lacks {typed:?}:\n{log}");
    }
    assert!(!log.contains("vmhost-ro-keys"), "a read-only peer's keystrokes reached the guest:\n{log}");
    assert!(!watcher.text().contains("vmhost-ro-keys"), "{}", watcher.text());

    // vm.console is checked like any request, and switches only a request of its own line.
    let (code, e) = host.call_err("vm.console", json!({ "name": "con1", "froce": true }));
    assert_eq!((code, e.field.as_deref()), (-32602, Some("froce")));
    let (code, _) = host.call_err("vm.console", json!({ "name": "nosuch" }));
    assert_eq!(code, 4040);
    let batch = host
        .client()
        .call_raw(r#"[{"jsonrpc":"2.0","id":1,"method":"vm.console","params":{"name":"con1"}}]"#)
        .expect("batch answer");
    assert_eq!(batch[0]["error"]["code"], -32600, "{batch:?}");

    // Stopping the VM closes every console (exit 4, told why).
    host.call("vm.stop", json!({ "name": "con1", "force": true }));
    assert_eq!(c.wait_exit().code(), Some(4));
    c.wait_for(0, "console closed");
    assert_eq!(watcher.wait_exit().code(), Some(4));
    let (code, e) = host.call_err("vm.console", json!({ "name": "con1" }));
    assert_eq!((code, e.field.as_deref()), (4091, Some("name")), "{e:?}");
}

#[test]
fn a_client_that_never_reads_stops_neither_the_guest_nor_the_log_and_the_log_outlives_the_daemon() {
    let mut host = shell_vm("con2");
    // This client types a command printing far more than every buffer holds, then never reads.
    let (mut stuck, _, attached) = host.client().console("con2", false, false).expect("attach");
    assert!(!attached.read_only);
    stuck
        .write_all(b"i=0; while [ $i -lt 12000 ]; do echo flood-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done; echo flood-done-$((6*7))\r")
        .unwrap();
    // The guest's output reaches the log all the same, and the daemon answers meanwhile.
    if !host.wait_serial("con2", "flood-done-42", Duration::from_secs(600)) {
        let log = host.serial("con2");
        let tail = |s: &str, n: usize| s.chars().skip(s.chars().count().saturating_sub(n)).collect::<String>();
        panic!(
            "the guest's output stalled; serial log ({} bytes) ends:\n{}\nvmhostd's log ends:\n{}",
            log.len(),
            tail(&log, 2000),
            tail(&host.daemon_log(), 4000)
        );
    }
    // Every line, in order. A character may appear more than once: when the console socket is
    // full (vmhostd's reads lag on a loaded machine), QEMU's 16550 retries the byte, and QEMU's
    // chardev logs a byte it could not send as if it never would be retried (chardev/char.c
    // `qemu_chr_write_buffer`), so the retried byte is logged again (docs/console.md).
    let log = host.serial("con2");
    let flood: Vec<String> =
        (0..12000).map(|i| format!("flood-{i}-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n")).collect();
    let from = log.find("\nflood-0-").map_or(0, |at| at + 1);
    if let Err(at) = in_order_allowing_repeats(&log[from..], &flood) {
        panic!("line {at} of the flood is not in the log in order; the log there:\n{:?}", {
            let near = log.find(&format!("flood-{}-", at.saturating_sub(1))).unwrap_or(from);
            log[near..].chars().take(300).collect::<String>()
        });
    }
    assert_eq!(host.call("vm.get", json!({ "name": "con2" }))["status"], "running");
    // ... while that client is still attached (it still holds the writer's place): the guest's
    // output did not wait for it to be dropped.
    match host.client().console("con2", false, false) {
        Err(vmhost::client::ClientError::Api(e)) => assert_eq!(e.code.as_i32(), 4090, "{e:?}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("the client that never reads was dropped before the guest's output got through"),
    }
    // A watcher attached now gets the replay (the newest 16 KiB) at once.
    let (mut watcher, early, attached) = host.client().console("con2", true, false).expect("watch");
    assert!(attached.read_only && attached.replay_bytes > 0 && attached.replay_bytes <= 16 * 1024, "{attached:?}");
    let replay = read_replay(&mut watcher, early, attached.replay_bytes);
    assert!(String::from_utf8_lossy(&replay).contains("flood-done-42"));
    drop((stuck, watcher));

    // VMs outlive the daemon, and so does their console log: a command typed before the daemon
    // is killed prints while it is down, and the log has it; after its restart the console
    // attaches again and replays it. The command prints numbered lines, one a second, so
    // "printed while down" is a fact (a line numbered above any the log had when the daemon
    // was gone), not a bet that a `sleep` outlasts the kill.
    let (mut typer, _, _) = host.client().console("con2", false, false).expect("attach again");
    typer.write_all(b"i=0; while [ $i -lt 900 ]; do echo while-down-$((7*6))-$i; i=$((i+1)); sleep 1; done\r").unwrap();
    let mut echoed = Vec::new();
    let mut buf = [0u8; 4096];
    typer.set_read_timeout(Some(ANSWER)).unwrap();
    while !String::from_utf8_lossy(&echoed).contains("while-down-$((7*6))-$i") {
        let n = typer.read(&mut buf).expect("echo of the command");
        assert!(n > 0);
        echoed.extend_from_slice(&buf[..n]);
    }
    let last_line =
        |log: &str| log.lines().filter_map(|l| l.trim_end().strip_prefix("while-down-42-")?.parse::<u32>().ok()).max();
    let seen = |host: &TestHost, at_kill: Option<u32>| {
        let log = host.serial("con2");
        let tail: String = log.chars().rev().take(600).collect::<Vec<_>>().into_iter().rev().collect();
        format!(
            "last numbered line {:?} ({at_kill:?} when the daemon was killed); the log's end:\n{tail:?}",
            last_line(&log)
        )
    };
    // The echo shows the command typed, not run: the guest reads its input at the UART's pace,
    // so the final Enter may still be on its way when the echo of the text is back. Its first
    // line is the fact that it runs (a kill before it would lose the Enter with the daemon).
    vmhost_tests::wait::until("the typed command's first line", ANSWER, || {
        last_line(&host.serial("con2")).map(|_| ()).ok_or_else(|| seen(&host, None))
    });
    host.kill_daemon();
    let at_kill = last_line(&host.serial("con2"));
    vmhost_tests::wait::until("a console line printed while vmhostd was down", ANSWER, || {
        if last_line(&host.serial("con2")) > at_kill {
            Ok(())
        } else {
            Err(seen(&host, at_kill))
        }
    });
    host.spawn_daemon();
    host.wait_status("con2", "running", Duration::from_secs(60));
    let (mut again, early, attached) = host.client().console("con2", true, false).expect("attach after a restart");
    let replay = read_replay(&mut again, early, attached.replay_bytes);
    assert!(String::from_utf8_lossy(&replay).contains("\nwhile-down-42"), "{}", String::from_utf8_lossy(&replay));
}

/// The whole replay of a console stream: `early` (what came with the answer) and the rest.
fn read_replay(stream: &mut std::os::unix::net::UnixStream, early: Vec<u8>, len: u64) -> Vec<u8> {
    let mut replay = early;
    stream.set_read_timeout(Some(ANSWER)).unwrap();
    while replay.len() < len as usize {
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf).expect("replay");
        assert!(n > 0, "the replay ended early");
        replay.extend_from_slice(&buf[..n]);
    }
    replay
}

/// Whether `lines` follow one another at the start of `text`, each character of them standing
/// there once or repeated a few times (QEMU's retried serial bytes, logged again); `Err` with
/// the index of the first line that does not.
fn in_order_allowing_repeats(text: &str, lines: &[String]) -> Result<(), usize> {
    /// How often one byte can be logged: the first try and QEMU's MAX_XMIT_RETRY (4) retries.
    const MOST: usize = 5;
    let text = text.as_bytes();
    let mut at = 0;
    for (i, line) in lines.iter().enumerate() {
        let want = line.as_bytes();
        let mut k = 0;
        while k < want.len() {
            // A run of the same character in the line must be a run of it in the text, as long
            // or up to MOST times longer.
            let c = want[k];
            let run = want[k..].iter().take_while(|&&b| b == c).count();
            let got = text[at.min(text.len())..].iter().take_while(|&&b| b == c).count();
            if got < run || got > run * MOST {
                return Err(i);
            }
            at += got;
            k += run;
        }
    }
    Ok(())
}

#[test]
fn the_flood_matcher_allows_repeated_characters_only() {
    let lines: Vec<String> = (9..12).map(|i| format!("flood-{i}-xx\r\n")).collect();
    assert_eq!(in_order_allowing_repeats("flood-9-xx\r\nflood-10-xx\r\nflood-11-xx\r\n", &lines), Ok(()));
    assert_eq!(in_order_allowing_repeats("flood-9-xxx\r\nflooood-10-xx\r\r\nflood-111-xx\r\n", &lines), Ok(()));
    assert_eq!(in_order_allowing_repeats("flood-9-xx\r\nflood-11-xx\r\n", &lines), Err(1), "a line lost");
    assert_eq!(in_order_allowing_repeats("flood-9-x\r\nflood-10-xx\r\nflood-11-xx\r\n", &lines), Err(0), "a byte lost");
    assert_eq!(in_order_allowing_repeats("flood-9-xx\r\nflood-10-xx\r\n", &lines), Err(2), "the end lost");
}
