//! The client's end of a console stream (`vmhostctl console`): the terminal in raw mode, the
//! guest's output written as it comes, keystrokes sent, `Ctrl-]` detaching (as in virsh).
//!
//! Blocking I/O with `poll`, like the rest of [`crate::client`]. Output is written as the guest
//! sent it, unescaped: a console is the guest driving the terminal, as with any serial console
//! (docs/console.md). Order of use: [`crate::client::Client::console`] switches the connection,
//! then [`run`] until [`Outcome`]; [`split_at_escape`] is its pure part.

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::termios::{self, SetArg, Termios};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;

/// `Ctrl-]`: detaches instead of reaching the guest.
pub const ESCAPE: u8 = 0x1d;

/// How a console session ended on the client's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The user typed `Ctrl-]` (or input ended).
    Detached,
    /// The daemon closed the stream (taken over, the VM stopped, the daemon stopping: its last
    /// line said which).
    Closed,
}

/// The part of `input` to send before any `Ctrl-]`, and whether one came (everything after it
/// is dropped: the user is leaving).
pub fn split_at_escape(input: &[u8]) -> (&[u8], bool) {
    match input.iter().position(|b| *b == ESCAPE) {
        Some(i) => (&input[..i], true),
        None => (input, false),
    }
}

/// The terminal's settings before raw mode, restored on drop.
struct RawMode<'a> {
    fd: BorrowedFd<'a>,
    saved: Termios,
}

impl<'a> RawMode<'a> {
    /// Puts the terminal `fd` into raw mode; `None` when it is not a terminal (a pipe: nothing
    /// to set).
    fn enter(fd: BorrowedFd<'a>) -> Option<RawMode<'a>> {
        let saved = termios::tcgetattr(fd).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(fd, SetArg::TCSANOW, &raw).ok()?;
        Some(RawMode { fd, saved })
    }
}

impl Drop for RawMode<'_> {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(self.fd, SetArg::TCSANOW, &self.saved);
    }
}

/// Runs the console on this process's terminal (stdin, stdout) until the user detaches or the
/// daemon closes the stream; `early_output` is what arrived with the answer of `vm.console`.
///
/// # Errors
/// The I/O error of the terminal or the socket.
pub fn run(mut stream: UnixStream, early_output: &[u8]) -> io::Result<Outcome> {
    let stdin = io::stdin();
    let _raw = RawMode::enter(stdin.as_fd());
    let mut stdout = io::stdout().lock();
    stdout.write_all(early_output)?;
    stdout.flush()?;
    let mut buf = vec![0u8; 4096];
    let mut input_open = true;
    loop {
        let (keys, socket) = {
            let mut fds = vec![PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
            if input_open {
                fds.push(PollFd::new(stdin.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
            (fds.get(1).is_some_and(ready), ready(&fds[0]))
        };
        if socket {
            let n = match stream.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => 0,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Ok(Outcome::Closed);
            }
            stdout.write_all(&buf[..n])?;
            stdout.flush()?;
        }
        if keys {
            // Unbuffered: std's stdin would hold keystrokes back in its buffer.
            let n = match nix::unistd::read(stdin.as_fd(), &mut buf) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => continue,
                Err(e) => return Err(e.into()),
            };
            if n == 0 {
                // Input ended (a pipe closed): keep watching until the daemon closes.
                input_open = false;
                continue;
            }
            let (send, detach) = split_at_escape(&buf[..n]);
            stream.write_all(send)?;
            if detach {
                return Ok(Outcome::Detached);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_bracket_detaches_and_nothing_after_it_is_sent() {
        assert_eq!(split_at_escape(b"ls\r"), (&b"ls\r"[..], false));
        assert_eq!(split_at_escape(b"ab\x1dcd"), (&b"ab"[..], true));
        assert_eq!(split_at_escape(b"\x1d"), (&b""[..], true));
        assert_eq!(split_at_escape(b""), (&b""[..], false));
    }
}
