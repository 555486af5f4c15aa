//! One exec port's session loop: frames in, requests run, notifications and the reply out.
//!
//! Order of use: [`ExecServer::new`] over an open [`Port`], then [`ExecServer::run`] until the
//! port fails (the caller finds and opens it again, as for the agent port). A session is `\n` +
//! `sync`, optionally `hello`, then exactly one request (`exec`, `file.push`, `file.pull`,
//! `time.set`, `guest.shutdown`, `ssh.authorize`); a request that did not follow a `sync` of
//! the current session is refused (-32600): a request left over from a host that gave up, or a
//! second one, never runs by accident. A host hang-up ends the session (and kills a running
//! command, see [`super::command`]).
//!
//! [`Conn`] holds the port and the input not yet handled: requests read their bulk bytes
//! ([`read_chunks`]) from it and send their notifications through it. Input that arrives
//! while a command runs is read (so the hang-up is seen) and dropped.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmhost_agent_protocol::exec::{
    ExecParams, FilePullParams, FilePushParams, OutputStream, ShutdownReply, SshAuthorizeParams, TimeSetParams,
    EXEC_CAPABILITIES, MAX_STDIN,
};
use vmhost_agent_protocol::{Hello, PROTOCOL_VERSION};

use super::chunks::{data_line, decode_chunk, output_line};
use super::clock::{time_set, Clock, SystemClock};
use super::command::{self, Link, RunError};
use super::files::{pull, PullError, Push};
use super::power::{self, How};
use super::ssh::{self, Accounts};
use crate::agent::{sync, to_value, NoParams};
use crate::log;
use crate::port::{Port, Readiness, HANGUP_RETRY, RECHECK, WRITE_TIMEOUT};
use crate::protocol::{
    handle_frame, parse_line, parse_params, reply, Frame, LineBuffer, Methods, Parsed, RpcError, INVALID_REQUEST,
    METHOD_NOT_FOUND,
};

/// How long one wait for input lasts before the loop looks again.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Longest error message sent, in bytes (the design's bound: a message names a guest path,
/// which can be 4 KiB, or a tool's output).
pub const MAX_MESSAGE: usize = 512;

/// `reply` with an error message cut to [`MAX_MESSAGE`] bytes (on a character boundary, `...`
/// marking the cut).
fn answer(id: &Value, method: &str, outcome: Result<Value, RpcError>) -> String {
    reply(
        id,
        method,
        outcome.map_err(|mut e| {
            if e.message.len() > MAX_MESSAGE {
                let mut end = MAX_MESSAGE - 3;
                while !e.message.is_char_boundary(end) {
                    end -= 1;
                }
                e.message.truncate(end);
                e.message.push_str("...");
            }
            e
        }),
    )
}

/// How long the host may pause between two chunks of a transfer.
pub const CHUNK_TIMEOUT: Duration = Duration::from_secs(30);

/// Why reading from the host stopped.
#[derive(Debug)]
pub enum Gone {
    /// The host hung up.
    HangUp,
    /// Nothing arrived in time.
    TimedOut,
    /// The port failed.
    Io(io::Error),
}

/// The port and the input read from it but not handled yet.
pub struct Conn {
    /// The port.
    port: Port,
    /// Input cut into frames.
    buffer: LineBuffer,
    /// Frames read, in order (at most one read's worth: filled only when empty).
    queue: VecDeque<Frame>,
    /// Read buffer.
    scratch: Vec<u8>,
}

impl Conn {
    /// A connection over `port`.
    pub fn new(port: Port) -> Conn {
        Conn { port, buffer: LineBuffer::new(), queue: VecDeque::new(), scratch: vec![0; 16 * 1024] }
    }

    /// Reads what the port has; frames are queued when `keep`, dropped otherwise. `Ok(false)`
    /// at end of file (the host is gone).
    fn pump(&mut self, keep: bool) -> io::Result<bool> {
        let n = self.port.read(&mut self.scratch)?;
        if n == 0 {
            return Ok(false);
        }
        let queue = &mut self.queue;
        self.buffer.push(&self.scratch[..n], |frame| {
            if keep {
                queue.push_back(frame);
            }
        });
        Ok(true)
    }

    /// The next frame, waiting up to `timeout` for it.
    ///
    /// # Errors
    /// [`Gone`]: a hang-up (which also drops frames read before it: they belong to the session
    /// that ended), nothing within `timeout`, or a port error.
    pub fn next_frame(&mut self, timeout: Duration) -> Result<Frame, Gone> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(frame) = self.queue.pop_front() {
                return Ok(frame);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.port.wait(left.min(POLL_INTERVAL)).map_err(Gone::Io)? {
                Readiness::Readable => {
                    if !self.pump(true).map_err(Gone::Io)? {
                        return Err(Gone::HangUp);
                    }
                }
                Readiness::HangUp => {
                    self.queue.clear();
                    return Err(Gone::HangUp);
                }
                Readiness::Idle if left.is_zero() => return Err(Gone::TimedOut),
                Readiness::Idle => {}
            }
        }
    }

    /// Sends one line (a newline is added).
    ///
    /// # Errors
    /// As [`Port::write_all`]: the host hung up or did not read for [`WRITE_TIMEOUT`].
    pub fn send(&mut self, line: &str) -> io::Result<()> {
        let mut text = String::with_capacity(line.len() + 1);
        text.push_str(line);
        text.push('\n');
        self.port.write_all(text.as_bytes(), WRITE_TIMEOUT)
    }
}

/// Reads the `total` bytes of [`vmhost_agent_protocol::exec::Chunk`] lines that follow a
/// request, passing each chunk's bytes to `sink`.
///
/// # Errors
/// `Err` when the host went away; `Ok(Err)` with the error to answer when a line is not a
/// valid chunk or none came for [`CHUNK_TIMEOUT`] (reading stops there).
pub fn read_chunks(conn: &mut Conn, total: u64, mut sink: impl FnMut(&[u8])) -> Result<Result<(), RpcError>, Gone> {
    let mut left = total;
    while left > 0 {
        let frame = match conn.next_frame(CHUNK_TIMEOUT) {
            Ok(frame) => frame,
            Err(Gone::TimedOut) => {
                return Ok(Err(RpcError::invalid_params(
                    "data",
                    format!("no chunk for {} s; {left} of {total} bytes missing", CHUNK_TIMEOUT.as_secs()),
                )))
            }
            Err(gone) => return Err(gone),
        };
        let line = match frame {
            Frame::Oversize => return Ok(Err(RpcError::invalid_params("data", "a chunk line longer than 64 KiB"))),
            Frame::Line(line) => line,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match decode_chunk(&line, left) {
            Ok(bytes) => {
                left -= bytes.len() as u64;
                sink(&bytes);
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(()))
}

/// Output of a running command, sent on the port as `exec.output`.
struct PortLink<'a> {
    /// The connection.
    conn: &'a mut Conn,
    /// The request's id.
    id: u64,
}

impl Link for PortLink<'_> {
    fn watch_fd(&self) -> Option<i32> {
        Some(self.conn.port.as_raw_fd())
    }

    fn readable(&mut self) -> bool {
        // Nothing is expected from the host now: read (to see the hang-up) and drop.
        self.conn.pump(false).unwrap_or(false)
    }

    fn output(&mut self, stream: OutputStream, data: &[u8]) -> io::Result<()> {
        let line = output_line(self.id, stream, data).map_err(|e| io::Error::other(e.message))?;
        self.conn.send(&line)
    }
}

/// What the exec methods touch in the guest; tests replace the clock, the power-off and the
/// file locations.
pub struct System {
    /// Accounts (`ssh.authorize`, `file.push`'s owner: `accounts.etc`).
    pub accounts: Accounts,
    /// `/run/systemd/system`: systemd runs the guest when it exists.
    pub run_systemd: PathBuf,
    /// The real-time clock.
    pub clock: Box<dyn Clock + Send>,
    /// Powers the guest off (after the `guest.shutdown` reply is out).
    pub power_off: fn(How),
}

impl Default for System {
    fn default() -> System {
        System {
            accounts: Accounts::default(),
            run_systemd: PathBuf::from("/run/systemd/system"),
            clock: Box::new(SystemClock),
            power_off: power::power_off,
        }
    }
}

/// Answers only `sync` and `hello`, for [`handle_frame`]'s oversize answer.
struct Nothing;

impl Methods for Nothing {
    fn call(&mut self, method: &str, _: Option<Value>) -> Result<Value, RpcError> {
        Err(RpcError::new(METHOD_NOT_FOUND, format!("unknown method {method:?}")))
    }
}

/// The request's id as the notifications carry it.
fn stream_id(id: &Value) -> Result<u64, RpcError> {
    id.as_u64().ok_or_else(|| RpcError::new(INVALID_REQUEST, "this method needs an unsigned integer id"))
}

/// Serves one exec port.
pub struct ExecServer {
    /// The port and pending input.
    conn: Conn,
    /// What the methods touch.
    system: System,
    /// The slot (for log lines).
    slot: usize,
    /// A `sync` of the current session was answered and no request ran since.
    synced: bool,
}

impl ExecServer {
    /// A server for slot `slot` on `port`.
    pub fn new(port: Port, system: System, slot: usize) -> ExecServer {
        ExecServer { conn: Conn::new(port), system, slot, synced: false }
    }

    /// Logs `message` with the slot.
    fn log(&self, message: &str) {
        log(&format!("exec.{}: {message}", self.slot));
    }

    /// Serves until the port fails; `still_there` as in [`crate::port::Server::run`].
    ///
    /// # Errors
    /// Only returns, with the error that ended serving; the caller reopens the port.
    pub fn run(&mut self, mut still_there: impl FnMut(&Port) -> bool) -> io::Error {
        let mut last_check = Instant::now();
        loop {
            match self.turn(POLL_INTERVAL) {
                // Unlike the agent port, connections are not logged: a host opens one per request.
                Ok(Readiness::HangUp) => {
                    if last_check.elapsed() >= RECHECK {
                        last_check = Instant::now();
                        if !still_there(&self.conn.port) {
                            return io::Error::new(io::ErrorKind::NotFound, "the port device went away");
                        }
                    }
                    std::thread::sleep(HANGUP_RETRY);
                }
                Ok(_) => {}
                Err(e) => return e,
            }
        }
    }

    /// Handles the next frame, waiting up to `timeout` for it.
    ///
    /// # Errors
    /// A port error.
    pub fn turn(&mut self, timeout: Duration) -> io::Result<Readiness> {
        let frame = match self.conn.next_frame(timeout) {
            Ok(frame) => frame,
            Err(Gone::TimedOut) => return Ok(Readiness::Idle),
            Err(Gone::HangUp) => {
                self.synced = false;
                return Ok(Readiness::HangUp);
            }
            Err(Gone::Io(e)) => return Err(e),
        };
        let answer = match &frame {
            Frame::Oversize => handle_frame(&frame, &mut Nothing),
            Frame::Line(line) => match parse_line(line) {
                Parsed::Nothing => None,
                Parsed::Answer(text) => Some(text),
                Parsed::Request { id, method, params } => match self.request(&id, &method, params) {
                    Ok(text) => text,
                    Err(Gone::HangUp) => {
                        self.synced = false;
                        return Ok(Readiness::HangUp);
                    }
                    Err(Gone::TimedOut) => None,
                    Err(Gone::Io(e)) => return Err(e),
                },
            },
        };
        if let Some(text) = answer {
            if let Err(e) = self.conn.send(&text) {
                self.log(&format!("reply dropped: {e}"));
                if e.kind() == io::ErrorKind::BrokenPipe {
                    self.synced = false;
                    return Ok(Readiness::HangUp);
                }
            }
        }
        Ok(Readiness::Readable)
    }

    /// Runs one request and returns its reply line (`None` when it was sent already:
    /// `guest.shutdown` sends its reply itself before it powers off).
    fn request(&mut self, id: &Value, method: &str, params: Option<Value>) -> Result<Option<String>, Gone> {
        match method {
            "sync" => {
                let outcome = sync(params);
                self.synced = outcome.is_ok();
                return Ok(Some(answer(id, method, outcome)));
            }
            "hello" => {
                let outcome = parse_params::<NoParams>(params).and_then(|_| {
                    to_value(&Hello {
                        agent_version: crate::info::AGENT_VERSION.to_string(),
                        protocol_version: PROTOCOL_VERSION,
                        capabilities: EXEC_CAPABILITIES.iter().map(|c| c.to_string()).collect(),
                    })
                });
                return Ok(Some(answer(id, method, outcome)));
            }
            _ => {}
        }
        if !EXEC_CAPABILITIES.contains(&method) {
            return Ok(Some(answer(
                id,
                method,
                Err(RpcError::new(METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
            )));
        }
        if !std::mem::take(&mut self.synced) {
            return Ok(Some(answer(
                id,
                method,
                Err(RpcError::new(INVALID_REQUEST, "one request per session, after sync: send sync first")),
            )));
        }
        let outcome = match method {
            "exec" => self.exec(id, params)?,
            "file.push" => self.push(params)?,
            "file.pull" => self.pull(id, params)?,
            "time.set" => parse_params::<TimeSetParams>(params).and_then(|p| {
                let r = time_set(&p, self.system.clock.as_ref());
                match &r {
                    Ok(r) => self.log(&format!(
                        "time.set: clock moved by {} ms",
                        (i128::from(r.after_ns) - i128::from(r.before_ns)) / 1_000_000
                    )),
                    Err(e) => self.log(&format!("time.set failed: {}", e.message)),
                }
                to_value(&r?)
            }),
            "guest.shutdown" => {
                let how = parse_params::<NoParams>(params).map(|_| power::plan(&self.system.run_systemd));
                if let Ok(how) = how {
                    self.log(&format!("guest.shutdown: powering off ({})", how.describe()));
                    let line = answer(id, method, to_value(&ShutdownReply { how: how.describe().to_string() }));
                    if let Err(e) = self.conn.send(&line) {
                        self.log(&format!("reply dropped: {e}"));
                    }
                    (self.system.power_off)(how);
                    return Ok(None);
                }
                how.map(|_| Value::Null)
            }
            "ssh.authorize" => parse_params::<SshAuthorizeParams>(params).and_then(|p| {
                let r = ssh::authorize(&p, &self.system.accounts);
                match &r {
                    Ok(r) => self.log(&format!(
                        "ssh.authorize: {} ({} keys, created {}, changed {})",
                        r.path,
                        p.keys.len(),
                        r.created,
                        r.changed
                    )),
                    Err(e) => self.log(&format!("ssh.authorize {} failed: {}", p.user, e.message)),
                }
                to_value(&r?)
            }),
            _ => Err(RpcError::new(METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
        };
        Ok(Some(answer(id, method, outcome)))
    }

    /// `exec`: stdin read, command run and supervised.
    fn exec(&mut self, id: &Value, params: Option<Value>) -> Result<Result<Value, RpcError>, Gone> {
        let p: ExecParams = match parse_params(params) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        let spec = command::validate(&p).and_then(|spec| stream_id(id).map(|id| (spec, id)));
        if p.stdin_bytes > MAX_STDIN {
            // More than any host may send: answered at once rather than waited for.
            return Ok(spec.map(|_| Value::Null));
        }
        let mut stdin = Vec::new();
        let keep = spec.is_ok();
        let read = read_chunks(&mut self.conn, p.stdin_bytes, |bytes| {
            if keep {
                stdin.extend_from_slice(bytes);
            }
        })?;
        let (spec, id) = match (spec, read) {
            (Ok(s), Ok(())) => s,
            (Err(e), _) | (_, Err(e)) => return Ok(Err(e)),
        };
        if !Path::new(&spec.cwd).is_dir() {
            return Ok(Err(RpcError::invalid("cwd", format!("{} is not a directory", spec.cwd))));
        }
        let names: Vec<&str> = spec.env.iter().map(|(k, _)| k.as_str()).collect();
        self.log(&format!(
            "exec: {:?} ({} args, env {names:?}, cwd {}, stdin {} bytes)",
            spec.argv[0],
            spec.argv.len(),
            spec.cwd,
            stdin.len()
        ));
        let mut link = PortLink { conn: &mut self.conn, id };
        match command::run(&spec, stdin, &mut link) {
            Ok(outcome) => {
                self.log(&format!(
                    "exec: {:?} ended: exit {:?} signal {:?} timed out {} after {} ms",
                    spec.argv[0],
                    outcome.exit_code,
                    outcome.signal,
                    outcome.timed_out,
                    outcome.duration.as_millis()
                ));
                Ok(to_value(&outcome.reply()))
            }
            Err(e @ RunError::Spawn { .. }) => Ok(Err(RpcError::invalid("argv", e.to_string()))),
            Err(RunError::HostGone) => {
                self.log(&format!("exec: {:?}: the host went away; the command was killed", spec.argv[0]));
                Err(Gone::HangUp)
            }
            Err(e @ RunError::Wait(_)) => Ok(Err(RpcError::internal(e.to_string()))),
        }
    }

    /// `file.push`: every announced byte read, the file written and put in place.
    fn push(&mut self, params: Option<Value>) -> Result<Result<Value, RpcError>, Gone> {
        let p: FilePushParams = match parse_params(params) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        let (size, path) = (p.size, p.path.clone());
        let mut push = Push::begin(p, &self.system.accounts.etc);
        let read = read_chunks(&mut self.conn, size, |bytes| {
            if let Ok(push) = push.as_mut() {
                push.write(bytes);
            }
        })?;
        let outcome = read.and(push).and_then(Push::finish);
        match &outcome {
            Ok(r) => self.log(&format!("file.push: {path:?} {} bytes sha256 {}", r.size, r.sha256)),
            Err(e) => self.log(&format!("file.push {path:?} refused: {}", e.message)),
        }
        Ok(outcome.and_then(|r| to_value(&r)))
    }

    /// `file.pull`: the file streamed as `file.data`.
    fn pull(&mut self, id: &Value, params: Option<Value>) -> Result<Result<Value, RpcError>, Gone> {
        let p: FilePullParams = match parse_params(params) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        let id = match stream_id(id) {
            Ok(id) => id,
            Err(e) => return Ok(Err(e)),
        };
        let conn = &mut self.conn;
        let outcome = pull(&p, |data| {
            let line = data_line(id, data).map_err(|e| io::Error::other(e.message))?;
            conn.send(&line)
        });
        match outcome {
            Ok(r) => {
                self.log(&format!("file.pull: {:?} {} bytes sha256 {}", p.path, r.size, r.sha256));
                Ok(to_value(&r))
            }
            Err(PullError::Rpc(e)) => {
                self.log(&format!("file.pull {:?} refused: {}", p.path, e.message));
                Ok(Err(e))
            }
            Err(PullError::Send(e)) => {
                self.log(&format!("file.pull {:?}: the host went away: {e}", p.path));
                Err(Gone::HangUp)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::files::sha256_hex;
    use serde_json::json;
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use vmhost_agent_protocol::base64::{decode, encode};

    /// A clock that is set, not the machine's.
    struct TestClock(AtomicU64);

    impl Clock for TestClock {
        fn now_ns(&self) -> io::Result<u64> {
            Ok(self.0.load(Ordering::SeqCst))
        }
        fn set_ns(&self, ns: u64) -> io::Result<()> {
            self.0.store(ns, Ordering::SeqCst);
            Ok(())
        }
    }

    static POWERED_OFF: AtomicBool = AtomicBool::new(false);

    fn fake_power_off(how: How) {
        assert_eq!(how, How::Kernel);
        POWERED_OFF.store(true, Ordering::SeqCst);
    }

    /// The host's end of a session with a server running in a thread.
    struct Host {
        writer: UnixStream,
        reader: BufReader<UnixStream>,
        server: Option<std::thread::JoinHandle<ExecServer>>,
    }

    impl Host {
        fn start(etc: &Path) -> Host {
            let (agent_end, host) = UnixStream::pair().expect("socketpair");
            let system = System {
                accounts: Accounts { etc: etc.to_path_buf(), home_root: etc.join("home"), tools: false },
                run_systemd: etc.join("no-systemd"),
                clock: Box::new(TestClock(AtomicU64::new(978_307_200_000_000_000))),
                power_off: fake_power_off,
            };
            let mut server = ExecServer::new(Port::from_fd(OwnedFd::from(agent_end)).expect("port"), system, 3);
            let handle = std::thread::spawn(move || {
                while let Ok(r) = server.turn(Duration::from_millis(100)) {
                    if r == Readiness::HangUp {
                        break;
                    }
                }
                server
            });
            host.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
            let reader = BufReader::new(host.try_clone().expect("clone"));
            Host { writer: host, reader, server: Some(handle) }
        }

        fn send(&mut self, line: &str) {
            self.writer.write_all(format!("{line}\n").as_bytes()).expect("write");
        }

        fn line(&mut self) -> Value {
            let mut line = String::new();
            loop {
                line.clear();
                let n = self.reader.read_line(&mut line).expect("read");
                assert!(n > 0, "end of file");
                if !line.trim().is_empty() {
                    return serde_json::from_str(line.trim()).expect("JSON");
                }
            }
        }

        /// The resync; returns the stale lines discarded before the answer.
        fn sync(&mut self, nonce: &str) -> usize {
            self.send("");
            self.send(
                &json!({"jsonrpc": "2.0", "id": format!("sync-{nonce}"), "method": "sync", "params": {"nonce": nonce}})
                    .to_string(),
            );
            let mut discarded = 0;
            while self.line()["result"]["nonce"] != nonce {
                discarded += 1;
            }
            discarded
        }

        fn request(&mut self, id: u64, method: &str, params: Value) {
            self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string());
        }

        fn chunks(&mut self, data: &[u8], size: usize) {
            for piece in data.chunks(size) {
                self.send(&json!({"data": encode(piece)}).to_string());
            }
        }

        /// Notifications (method, params) until the reply to `id`, and the reply.
        fn until_reply(&mut self, id: u64) -> (Vec<(String, Value)>, Value) {
            let mut notes = Vec::new();
            loop {
                let v = self.line();
                if v.get("id") == Some(&json!(id)) {
                    return (notes, v);
                }
                let method = v["method"].as_str().unwrap_or_else(|| panic!("unexpected line {v}")).to_string();
                assert_eq!(v["params"]["id"], id, "{v}");
                notes.push((method, v["params"].clone()));
            }
        }

        fn hang_up(mut self) -> ExecServer {
            let _ = self.writer.shutdown(std::net::Shutdown::Both);
            self.server.take().map(|h| h.join().unwrap_or_else(|_| panic!("server panicked"))).expect("server")
        }
    }

    fn bytes_of(notes: &[(String, Value)], method: &str, stream: Option<&str>) -> Vec<u8> {
        notes
            .iter()
            .filter(|(m, p)| m == method && stream.map_or(true, |s| p["stream"] == s))
            .flat_map(|(_, p)| decode(p["data"].as_str().unwrap_or("")).unwrap_or_default())
            .collect()
    }

    #[test]
    fn an_exec_session_streams_output_and_answers_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        // Stale input from an earlier host: ended by the resync newline, answered as garbage.
        host.send(r#"{"jsonrpc":"2.0","id":1,"meth"#);
        assert_eq!(host.sync("n1"), 1);
        host.request(2, "hello", json!({}));
        let hello = host.line();
        assert_eq!(hello["result"]["capabilities"], json!(EXEC_CAPABILITIES));
        let stdin: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let argv = ["/bin/sh", "-c", "cat; echo done >&2; exit 7"];
        host.request(
            3,
            "exec",
            json!({"argv": argv, "env": ["A=1"], "stdin_bytes": stdin.len(), "timeout_s": 30, "max_output": 60_000}),
        );
        host.chunks(&stdin, 30_000);
        let (notes, reply) = host.until_reply(3);
        assert_eq!(
            reply["result"],
            json!({"exit_code": 7, "signal": null, "timed_out": false, "duration_ms": reply["result"]["duration_ms"], "stdout_bytes": 100_000, "stderr_bytes": 5})
        );
        assert_eq!(bytes_of(&notes, "exec.output", Some("stdout")), &stdin[..60_000], "capped at max_output");
        assert_eq!(bytes_of(&notes, "exec.output", Some("stderr")), b"done\n");
        // One request per session: the next one needs a new sync.
        host.request(4, "time.set", json!({"unix_ns": 1_700_000_000_000_000_000u64}));
        assert_eq!(host.line()["error"]["code"], INVALID_REQUEST);
        host.sync("n2");
        host.request(5, "time.set", json!({"unix_ns": 1_700_000_000_000_000_000u64}));
        assert_eq!(
            host.line()["result"],
            json!({"before_ns": 978_307_200_000_000_000u64, "after_ns": 1_700_000_000_000_000_000u64})
        );
        host.sync("n3");
        host.request(6, "net.state", json!({}));
        assert_eq!(host.line()["error"]["code"], METHOD_NOT_FOUND);
        host.hang_up();
    }

    #[test]
    fn a_request_before_sync_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        host.request(1, "exec", json!({"argv": ["/bin/touch", dir.path().join("ran").display().to_string()], "timeout_s": 5, "max_output": 0}));
        let v = host.line();
        assert_eq!((v["id"].clone(), v["error"]["code"].clone()), (json!(1), json!(INVALID_REQUEST)));
        assert!(!dir.path().join("ran").exists());
        host.hang_up();
    }

    #[test]
    fn push_and_pull_round_trip_and_a_refused_push_still_reads_its_chunks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        let target = dir.path().join("sub/file.bin");
        let content: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
        let sha = sha256_hex(&content);
        // Refused (no parent, no mkdir): all chunks are read all the same, so the next sync is
        // answered right after the refusal, with nothing in between.
        host.sync("a");
        host.request(
            1,
            "file.push",
            json!({"path": target.display().to_string(), "mode": 0o640, "size": content.len(), "sha256": sha}),
        );
        host.chunks(&content, 32 * 1024);
        let v = host.line();
        assert_eq!((v["id"].clone(), v["error"]["data"]["field"].clone()), (json!(1), json!("path")));
        assert_eq!(host.sync("b"), 0, "every chunk was read as a chunk");
        host.request(2, "file.push", json!({"path": target.display().to_string(), "mode": 0o640, "size": content.len(), "sha256": sha, "mkdir": true}));
        host.chunks(&content, 32 * 1024);
        let v = host.line();
        assert_eq!(v["result"], json!({"size": 200_000, "sha256": sha}));
        assert_eq!(
            std::fs::read_dir(dir.path().join("sub")).map(|d| d.count()).ok(),
            Some(1),
            "no temporary file left"
        );
        assert_eq!(std::fs::read(&target).ok(), Some(content.clone()));
        host.sync("c");
        host.request(3, "file.pull", json!({"path": target.display().to_string(), "max_bytes": 200_000}));
        let (notes, reply) = host.until_reply(3);
        assert_eq!(reply["result"], json!({"size": 200_000, "sha256": sha, "mode": 0o640}));
        assert_eq!(bytes_of(&notes, "file.data", None), content);
        assert!(notes.iter().all(|(_, p)| p.get("stream").is_none()));
        host.sync("d");
        host.request(4, "file.pull", json!({"path": target.display().to_string(), "max_bytes": 1000}));
        let v = host.line();
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("200000 bytes")), "{v}");
        host.hang_up();
    }

    #[test]
    fn error_messages_are_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        host.sync("m");
        let path = format!("{}/{}/f", dir.path().display(), "é/".repeat(1300));
        host.request(1, "file.push", json!({"path": path, "mode": 0o644, "size": 1, "sha256": sha256_hex(b"x")}));
        host.chunks(b"x", 1);
        let v = host.line();
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.len() <= MAX_MESSAGE && message.ends_with("...") && message.contains("does not exist"), "{v}");
        host.hang_up();
    }

    #[test]
    fn shutdown_replies_first_then_powers_off() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        host.sync("s");
        host.request(1, "guest.shutdown", json!({}));
        let v = host.line();
        assert_eq!(v["result"], json!({"how": "reboot(2)"}));
        let start = Instant::now();
        while !POWERED_OFF.load(Ordering::SeqCst) {
            assert!(start.elapsed() < Duration::from_secs(10), "never powered off");
            std::thread::sleep(Duration::from_millis(5));
        }
        host.hang_up();
    }

    #[test]
    fn a_hang_up_mid_command_kills_it_and_ends_the_session() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = Host::start(dir.path());
        let pidfile = dir.path().join("pid");
        host.sync("h");
        let script = format!("echo $$ > {}; echo started; exec sleep 1000", pidfile.display());
        host.request(1, "exec", json!({"argv": ["/bin/sh", "-c", script], "timeout_s": 60, "max_output": 100}));
        let v = host.line();
        assert_eq!(v["method"], "exec.output", "{v}");
        let pid: i32 = std::fs::read_to_string(&pidfile).ok().and_then(|t| t.trim().parse().ok()).expect("pid");
        let _ = host.writer.shutdown(std::net::Shutdown::Both);
        // Killed on the hang-up, well before its 60 s timeout.
        let start = Instant::now();
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok() {
            assert!(start.elapsed() < Duration::from_secs(10), "the command survived the hang-up");
            std::thread::sleep(Duration::from_millis(10));
        }
        host.hang_up();
    }
}
