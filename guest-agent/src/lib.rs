//! vmhost guest agent: answers the host daemon's JSON-RPC requests on a virtio-serial port.
//!
//! The binary (`src/main.rs`) finds the port ([`port::find_port`]), opens it and runs a
//! [`port::Server`] with the [`agent::Agent`] methods; the server cuts the byte stream into frames
//! and hands each to [`protocol::handle_line`]. The methods read the network through
//! [`netlink`] and [`state`], check it ([`check`], with [`probe`] for the gateway) and change it
//! ([`apply`]). README.md documents the protocol and the reasoning behind it.
//!
//! The design is blocking and single-threaded on purpose: the agent answers one host, one request
//! at a time, and must fit a 2 MiB static binary and 4 MiB of RSS.
//!
//! The same binary with `--exec` is the exec ports' server ([`exec`]): a separate process, run
//! as root without the agent unit's sandbox, with one blocking thread per exec port (slot).

pub mod addr;
pub mod agent;
pub mod apply;
pub mod check;
pub mod exec;
pub mod freeze;
pub mod fuzz;
pub mod info;
pub mod netlink;
pub mod port;
pub mod probe;
pub mod protocol;
pub mod state;

/// Longest message [`log`] writes, in bytes: a line names guest paths and kernel messages, and
/// the journal should get a line, not a page.
pub const MAX_LOG_MESSAGE: usize = 1024;

/// Writes one line to stderr (the serial console in the test guest, the journal under systemd),
/// as [`one_line`] makes it. The line goes out in one `write`: the agent and its `--exec`
/// process share the console, and `eprintln!` writes the prefix, the message and the newline
/// apart, so two processes' lines interleaved mid-line there.
pub fn log(message: &str) {
    use std::io::Write;
    let line = format!("vmhost-agent: {}\n", one_line(message));
    // Nothing to do if stderr is gone: the agent's work does not depend on its log.
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// `message` as one bounded line: control characters escaped (a newline in a mount point cannot
/// start a line of its own), cut at [`MAX_LOG_MESSAGE`] bytes on a character boundary, the cut
/// marked by `...`.
pub fn one_line(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_LOG_MESSAGE));
    for c in message.chars() {
        let piece: String = if c.is_control() { c.escape_default().collect() } else { c.to_string() };
        if out.len() + piece.len() > MAX_LOG_MESSAGE - 3 {
            out.push_str("...");
            break;
        }
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod kernel_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_are_one_line_and_bounded() {
        assert_eq!(one_line("cannot freeze /a\nb: x\u{1b}[2J"), "cannot freeze /a\\nb: x\\u{1b}[2J");
        let long = "é".repeat(MAX_LOG_MESSAGE);
        let cut = one_line(&long);
        assert!(cut.len() <= MAX_LOG_MESSAGE && cut.ends_with("..."), "{}", cut.len());
        assert!(cut.starts_with("éé"));
        assert_eq!(one_line("fs.thaw: thawed [\"/\"]"), "fs.thaw: thawed [\"/\"]");
    }
}
