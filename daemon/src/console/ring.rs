//! The replay buffer of one console and what a client that fell behind is told: pure, so the
//! offsets are unit-tested.
//!
//! Every byte the console hub reads from QEMU has an offset (bytes read before it, counting the
//! seed). [`Ring`] keeps the newest [`REPLAY_BYTES`] of them for clients that attach later, and
//! each chunk handed to clients carries its start offset, so a client that missed chunks knows
//! exactly how many bytes it lost ([`dropped`]) and says so with [`dropped_marker`].
//!
//! Order of use: [`Ring::seed`] once with the tail of the serial log when the hub connects, then
//! [`Ring::push`] for every read; [`Ring::snapshot`] when a client attaches.

use std::collections::VecDeque;

/// How much earlier output a client gets when it attaches.
pub const REPLAY_BYTES: usize = 16 * 1024;

/// The newest bytes of a console, at most a fixed number, with the offset of their end.
#[derive(Debug, Clone)]
pub struct Ring {
    buf: VecDeque<u8>,
    cap: usize,
    /// Offset just past the newest byte.
    end: u64,
}

impl Ring {
    /// An empty ring keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Ring {
        Ring { buf: VecDeque::with_capacity(cap), cap, end: 0 }
    }

    /// Appends `bytes` (the oldest fall out past the cap); returns the offset of their first byte.
    pub fn push(&mut self, bytes: &[u8]) -> u64 {
        let start = self.end;
        self.end += bytes.len() as u64;
        let keep = &bytes[bytes.len().saturating_sub(self.cap)..];
        let overflow = (self.buf.len() + keep.len()).saturating_sub(self.cap);
        self.buf.drain(..overflow);
        self.buf.extend(keep);
        start
    }

    /// [`Ring::push`] for the bytes that were there before the hub connected (the log's tail).
    pub fn seed(&mut self, bytes: &[u8]) {
        self.push(bytes);
    }

    /// The bytes held, oldest first, and the offset just past them: a client that replays them
    /// expects its next chunk to start there.
    pub fn snapshot(&self) -> (Vec<u8>, u64) {
        (self.buf.iter().copied().collect(), self.end)
    }
}

/// Bytes lost between what a client expected next and the start of the chunk it got.
pub fn dropped(expected: u64, chunk_start: u64) -> u64 {
    chunk_start.saturating_sub(expected)
}

/// What a client that fell behind is sent in place of the bytes it lost. In-band, on a line of
/// its own, so a human sees it; a guest could print the same text (docs/console.md).
pub fn dropped_marker(bytes: u64) -> String {
    format!("\r\n[vmhost: {bytes} bytes of console output dropped: this client fell behind]\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_bytes_and_counts_every_one() {
        let mut r = Ring::new(8);
        r.seed(b"0123456789");
        assert_eq!(r.snapshot(), (b"23456789".to_vec(), 10));
        assert_eq!(r.push(b"ab"), 10);
        assert_eq!(r.snapshot(), (b"456789ab".to_vec(), 12));
        assert_eq!(r.push(b"cdefghijklmnop"), 12, "a chunk over the cap keeps its own tail");
        assert_eq!(r.snapshot(), (b"ijklmnop".to_vec(), 26));
        assert_eq!(r.push(b""), 26);
        let empty = Ring::new(REPLAY_BYTES);
        assert_eq!(empty.snapshot(), (Vec::new(), 0));
    }

    #[test]
    fn a_client_knows_how_much_it_missed() {
        assert_eq!(dropped(10, 10), 0);
        assert_eq!(dropped(10, 4106), 4096);
        assert_eq!(dropped(10, 3), 0, "never negative");
        assert!(dropped_marker(4096).contains("4096 bytes"));
        assert!(dropped_marker(1).starts_with("\r\n[vmhost: "));
    }
}
