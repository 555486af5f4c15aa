//! `vmhostctl exec NAME [options] -- CMD ARG...`: a command in the guest (`vm.exec`), with its
//! output as it comes and its exit status as vmhostctl's, like `incus exec`.
//!
//! Why a module of its own: it is the one command whose exit code is not vmhostctl's but the
//! guest command's (128 + signal, 124 at its timeout, 255 when vmhostd refuses or fails), and
//! whose output is the guest's bytes.
//!
//! Order of use: [`run`] builds the request ([`params`]), calls `vm.exec {stream: true}` and
//! writes each `vm.exec.output` notification through an [`Output`] as it arrives, then maps
//! the answer to the exit code with [`exit_status`]. With `--json` the call is not streamed and
//! the answer is printed (output as text) before the same exit code.
//!
//! Guest bytes on a terminal are escaped ([`Output`]: every control, C1 and reordering
//! character except newline and tab is shown as a visible escape, invalid UTF-8 as `\xNN`), so
//! a guest cannot drive the terminal; to a pipe or file they are written as they came, so
//! `vmhostctl exec vm -- cat /etc/shadow > copy` keeps the file's bytes.

use super::{json_line, Failure};
use serde_json::{json, Value};
use std::io::{self, IsTerminal, Read, Write};
use std::time::Duration;
use vmhost::client::{Client, ClientError};
use vmhost_agent_protocol::base64;

/// Longest stdin sent (`vm.exec`'s `stdin` limit, decoded).
pub const MAX_STDIN: usize = 1024 * 1024;

/// Seconds past the command's timeout that vmhostd may take to answer (its own bound is
/// `timeout_s` + 10 s before 5002), plus a margin for a slow host.
const ANSWER_MARGIN_S: u64 = 40;

/// The exit code for an error of vmhostd (or of reaching it): a command's own codes are 0-255,
/// and 255 is what `ssh` uses for the same case.
pub const DAEMON_FAILURE: u8 = 255;

/// Arguments of `vmhostctl exec`.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// The VM.
    pub name: String,
    /// An environment variable for the command, `NAME=value` (repeatable).
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Working directory in the guest (absolute); `/` when not given.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Seconds the command may run; then its process group is killed and vmhostctl exits 124.
    #[arg(long, default_value_t = 60)]
    pub timeout: u32,
    /// Send vmhostctl's standard input (at most 1 MiB) to the command; without it the command
    /// reads /dev/null.
    #[arg(long)]
    pub stdin: bool,
    /// Bytes kept per output stream (daemon default 1 MiB, at most 4 MiB); the rest is counted
    /// and dropped.
    #[arg(long)]
    pub max_output: Option<u64>,
    /// The command and its arguments (no shell: name one, e.g. `-- sh -c '...'`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub argv: Vec<String>,
}

/// The `vm.exec` params for `args`, with `stdin` as read; `stream` asks for notifications.
pub fn params(args: &ExecArgs, stdin: Option<&[u8]>, stream: bool) -> Value {
    let mut p = json!({
        "name": args.name,
        "argv": args.argv,
        "env": args.env,
        "timeout_s": args.timeout,
        "stream": stream,
        // Streamed output comes as notifications; the answer's (when a daemon sends it anyway)
        // is decoded exactly. --json shows text, which is what a reader of JSON wants.
        "encoding": if stream { "base64" } else { "text" },
    });
    if let Some(cwd) = &args.cwd {
        p["cwd"] = json!(cwd);
    }
    if let Some(bytes) = stdin {
        p["stdin"] = json!(base64::encode(bytes));
    }
    if let Some(n) = args.max_output {
        p["max_output"] = json!(n);
    }
    p
}

/// vmhostctl's exit code for a `vm.exec` answer: the command's exit code, 124 when it was
/// killed at its timeout, 128 + the signal that ended it, 255 for an answer with none of them.
pub fn exit_status(answer: &Value) -> u8 {
    if answer["timed_out"] == true {
        return 124;
    }
    if let Some(signal) = answer["signal"].as_i64() {
        return u8::try_from(128 + signal.clamp(0, 127)).unwrap_or(DAEMON_FAILURE);
    }
    match answer["exit_code"].as_i64() {
        Some(code) => u8::try_from(code).unwrap_or(DAEMON_FAILURE),
        None => DAEMON_FAILURE,
    }
}

/// Runs `vmhostctl exec`; the exit code on success (the command's, mapped by [`exit_status`]).
///
/// # Errors
///
/// [`Failure`] when stdin cannot be read or is too long, vmhostd cannot be reached, refuses the
/// call (4095 exec off, 4096 slots busy, 5001 no exec server, ...) or sends what is not a
/// `vm.exec` answer.
pub fn run(mut client: Client, args: &ExecArgs, json_out: bool) -> Result<u8, Failure> {
    let stdin = if args.stdin { Some(read_stdin()?) } else { None };
    let wait = u64::from(args.timeout).saturating_add(ANSWER_MARGIN_S);
    client.set_timeout(Duration::from_secs(wait))?;
    if json_out {
        let answer: Value = client.call("vm.exec", params(args, stdin.as_deref(), false))?;
        println!("{}", json_line(&serde_json::to_string_pretty(&answer).unwrap_or_default()));
        return Ok(exit_status(&answer));
    }
    let mut stdout: Output<Box<dyn Write>> = Output::new(Box::new(io::stdout()), io::stdout().is_terminal());
    let mut stderr: Output<Box<dyn Write>> = Output::new(Box::new(io::stderr()), io::stderr().is_terminal());
    let answer: Value =
        client.call_streaming("vm.exec", params(args, stdin.as_deref(), true), "vm.exec.output", |note| {
            let bytes = note["data"]
                .as_str()
                .and_then(|text| base64::decode(text).ok())
                .ok_or_else(|| ClientError::Protocol("vm.exec.output without base64 data".into()))?;
            match note["stream"].as_str() {
                Some("stdout") => stdout.write(&bytes)?,
                Some("stderr") => stderr.write(&bytes)?,
                _ => return Err(ClientError::Protocol("vm.exec.output of an unknown stream".into())),
            }
            Ok(())
        })?;
    // A daemon that did not stream puts the output in its answer.
    for (key, out) in [("stdout", &mut stdout), ("stderr", &mut stderr)] {
        if let Some(bytes) = answer[key].as_str().filter(|s| !s.is_empty()).and_then(|text| base64::decode(text).ok()) {
            out.write(&bytes).map_err(output_failed)?;
        }
    }
    stdout.finish().map_err(output_failed)?;
    stderr.finish().map_err(output_failed)?;
    for stream in ["stdout", "stderr"] {
        if answer[format!("{stream}_truncated")] == true {
            let total = &answer[format!("{stream}_bytes")];
            tell!("vmhostctl: the command's {stream} was cut: it wrote {total} bytes (--max-output)");
        }
    }
    if answer["timed_out"] == true {
        tell!("vmhostctl: killed at its timeout of {} s", args.timeout);
    }
    Ok(exit_status(&answer))
}

fn output_failed(e: io::Error) -> Failure {
    Failure::Usage(format!("cannot write the command's output: {e}"))
}

/// vmhostctl's standard input, refused beyond [`MAX_STDIN`].
fn read_stdin() -> Result<Vec<u8>, Failure> {
    let mut bytes = Vec::new();
    io::stdin()
        .take(MAX_STDIN as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Failure::Usage(format!("stdin: {e}")))?;
    if bytes.len() > MAX_STDIN {
        return Err(Failure::Usage(format!("--stdin: more than {MAX_STDIN} bytes (vm.exec's limit)")));
    }
    Ok(bytes)
}

/// Where a stream of guest bytes goes: as they are, or escaped for a terminal. A UTF-8
/// character split between two chunks is held back until its end arrives.
pub struct Output<W: Write> {
    /// The writer (stdout or stderr).
    out: W,
    /// Escape for a terminal.
    escape: bool,
    /// The start of a character whose end has not arrived (at most 3 bytes).
    carry: Vec<u8>,
}

impl<W: Write> Output<W> {
    /// Output to `out`, escaped when `escape`.
    pub fn new(out: W, escape: bool) -> Output<W> {
        Output { out, escape, carry: Vec::new() }
    }

    /// Writes one chunk and flushes, so output shows as the command makes it.
    ///
    /// # Errors
    ///
    /// The writer's error.
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        if !self.escape {
            self.out.write_all(bytes)?;
            return self.out.flush();
        }
        let mut pending = std::mem::take(&mut self.carry);
        pending.extend_from_slice(bytes);
        let mut text = String::with_capacity(pending.len());
        let mut rest: &[u8] = &pending;
        while !rest.is_empty() {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    push_escaped(&mut text, valid);
                    rest = &[];
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    push_escaped(&mut text, std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            for b in &after[..n] {
                                text.push_str(&format!("\\x{b:02x}"));
                            }
                            rest = &after[n..];
                        }
                        None => {
                            self.carry = after.to_vec();
                            rest = &[];
                        }
                    }
                }
            }
        }
        self.out.write_all(text.as_bytes())?;
        self.out.flush()
    }

    /// Writes what is held back (the start of a character that never ended) as `\xNN`.
    ///
    /// # Errors
    ///
    /// The writer's error.
    pub fn finish(&mut self) -> io::Result<()> {
        let held = std::mem::take(&mut self.carry);
        let text: String = held.iter().map(|b| format!("\\x{b:02x}")).collect();
        self.out.write_all(text.as_bytes())?;
        self.out.flush()
    }
}

/// `text` with every unsafe character ([`vmhost::guest_text::is_unsafe`]) escaped except the
/// newline and the tab, which a command's output is made of.
fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        if c != '\n' && c != '\t' && vmhost::guest_text::is_unsafe(c) {
            let mut buf = [0u8; 4];
            out.push_str(&vmhost::guest_text::escape(c.encode_utf8(&mut buf)));
        } else {
            out.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ExecArgs,
    }

    fn parse(argv: &[&str]) -> Result<ExecArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("exec").chain(argv.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn arguments_become_the_request() {
        let args = parse(&[
            "vm1",
            "--env",
            "A=1",
            "--env",
            "B=two words",
            "--cwd",
            "/tmp",
            "--timeout",
            "5",
            "--",
            "ls",
            "-l",
            "--all",
        ])
        .unwrap();
        assert_eq!(
            params(&args, Some(b"hi"), true),
            json!({"name": "vm1", "argv": ["ls", "-l", "--all"], "env": ["A=1", "B=two words"], "cwd": "/tmp",
                   "timeout_s": 5, "stream": true, "encoding": "base64", "stdin": "aGk="})
        );
        let args = parse(&["vm1", "--max-output", "10", "--", "true"]).unwrap();
        assert_eq!(
            params(&args, None, false),
            json!({"name": "vm1", "argv": ["true"], "env": [], "timeout_s": 60, "stream": false,
                   "encoding": "text", "max_output": 10})
        );
        assert!(parse(&["vm1"]).is_err(), "a command is required");
        assert!(parse(&["vm1", "ls"]).is_err(), "the command comes after --");
    }

    #[test]
    fn the_exit_status_is_the_commands() {
        let answer = |e: Value, s: Value, t: bool| json!({"exit_code": e, "signal": s, "timed_out": t});
        assert_eq!(exit_status(&answer(json!(0), Value::Null, false)), 0);
        assert_eq!(exit_status(&answer(json!(3), Value::Null, false)), 3);
        assert_eq!(exit_status(&answer(json!(255), Value::Null, false)), 255);
        assert_eq!(exit_status(&answer(Value::Null, json!(15), false)), 143);
        assert_eq!(exit_status(&answer(Value::Null, json!(9), true)), 124);
        assert_eq!(exit_status(&answer(json!(-1), Value::Null, false)), DAEMON_FAILURE);
        assert_eq!(exit_status(&answer(json!(300), Value::Null, false)), DAEMON_FAILURE);
        assert_eq!(exit_status(&answer(Value::Null, json!(1000), false)), 255);
        assert_eq!(exit_status(&json!({})), DAEMON_FAILURE);
    }

    #[test]
    fn guest_bytes_are_escaped_on_a_terminal_and_kept_elsewhere() {
        let hostile = "ok\t\u{e9}\n\u{1b}]0;owned\u{7}\r\u{9b}2J\u{202e}".as_bytes();
        let mut raw = Output::new(Vec::new(), false);
        raw.write(hostile).unwrap();
        raw.finish().unwrap();
        assert_eq!(raw.out, hostile);

        let mut shown = Output::new(Vec::new(), true);
        // Split inside the two-byte é and the C1 character: each comes out whole.
        for piece in [&hostile[..4], &hostile[4..14], &hostile[14..17], &hostile[17..]] {
            shown.write(piece).unwrap();
        }
        shown.write(b"\xff\xc3").unwrap();
        shown.finish().unwrap();
        let text = String::from_utf8(shown.out).unwrap();
        assert_eq!(text, "ok\t\u{e9}\n\\x1b]0;owned\\x07\\r\\u{9b}2J\\u{202e}\\xff\\xc3");
    }
}
