//! The pure half of an agent session: cutting the guest's byte stream into lines and deciding
//! what one line means for the request waiting on it.
//!
//! Kept apart from [`super::conn`] (which owns the socket, the deadlines and the ids) so that
//! everything a hostile guest's bytes reach without a socket can be fuzzed and unit-tested
//! directly: feed every chunk read to [`LineReader::push`], take lines with
//! [`LineReader::next_line`] until it returns `None`, and hand each line to [`match_reply`];
//! every line that is not the awaited reply goes through [`SkipBudget::skip`], which ends the wait
//! once a guest made the daemon read and parse [`MAX_SKIPPED_BYTES`] of unrelated lines.

use super::error::AgentError;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Longest line accepted from the guest, in bytes.
pub const MAX_FRAME: usize = 64 * 1024;

/// Longest error message kept from the guest, in characters.
pub const MAX_REMOTE_MESSAGE: usize = 512;

/// Most bytes of unrelated lines (stale replies, noise, garbage) read while waiting for one reply,
/// newlines included. Counted in bytes, not lines: a cap of lines let a flooding guest make the
/// daemon read and parse up to 1000 lines of [`MAX_FRAME`] bytes (64 MiB) per call. Four full
/// frames leave room for a resync's stale replies and a chatty agent's noise.
pub const MAX_SKIPPED_BYTES: usize = 4 * MAX_FRAME;

/// The bytes of lines skipped so far while waiting for one reply; one per wait.
#[derive(Debug, Default)]
pub struct SkipBudget {
    skipped: usize,
}

impl SkipBudget {
    /// A budget with nothing skipped yet.
    pub fn new() -> SkipBudget {
        SkipBudget::default()
    }

    /// Counts `line` (and its newline) as skipped.
    ///
    /// # Errors
    /// [`AgentError::Protocol`] ("more than 262144 bytes of unrelated lines") once more than
    /// [`MAX_SKIPPED_BYTES`] were skipped: the wait ends and the session must be dropped.
    pub fn skip(&mut self, line: &[u8]) -> Result<(), AgentError> {
        self.skipped = self.skipped.saturating_add(line.len().saturating_add(1));
        if self.skipped > MAX_SKIPPED_BYTES {
            return Err(AgentError::Protocol(format!("more than {MAX_SKIPPED_BYTES} bytes of unrelated lines")));
        }
        Ok(())
    }
}

/// Bytes read from the guest that do not yet form a complete line.
#[derive(Debug, Default)]
pub struct LineReader {
    buf: Vec<u8>,
    /// Bytes of `buf` already known to hold no newline. Scanning only what is new keeps a guest
    /// that trickles a long line one byte per read from costing quadratic time (the fuzzer found
    /// it: 64 KiB in single bytes took seconds).
    scanned: usize,
}

impl LineReader {
    /// An empty reader.
    pub fn new() -> LineReader {
        LineReader::default()
    }

    /// Adds bytes read from the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line without its newline, `None` when more bytes are needed.
    ///
    /// # Errors
    /// [`AgentError::Protocol`] when the pending line is longer than [`MAX_FRAME`] bytes; the
    /// session must then be dropped (the reader holds at most one chunk beyond the limit).
    pub fn next_line(&mut self) -> Result<Option<Vec<u8>>, AgentError> {
        let newline = self
            .buf
            .get(self.scanned..)
            .unwrap_or_default()
            .iter()
            .position(|b| *b == b'\n')
            .map(|at| self.scanned + at);
        self.scanned = newline.unwrap_or(self.buf.len());
        match newline {
            Some(pos) if pos <= MAX_FRAME => {
                let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
                line.pop();
                self.scanned = 0;
                Ok(Some(line))
            }
            Some(_) => Err(oversize()),
            None if self.buf.len() > MAX_FRAME => Err(oversize()),
            None => Ok(None),
        }
    }
}

fn oversize() -> AgentError {
    AgentError::Protocol(format!("a line longer than {MAX_FRAME} bytes"))
}

/// What one line means for the request with `id`: `None` when it is not its reply (stale, noise,
/// not JSON, an error line with id null) and is to be skipped; otherwise the outcome.
///
/// # Errors
/// Inside the `Some`: [`AgentError::Remote`] for a JSON-RPC error reply (message cut to
/// [`MAX_REMOTE_MESSAGE`] characters), [`AgentError::Protocol`] when the result does not fit the
/// closed type `T`.
pub fn match_reply<T: DeserializeOwned>(line: &[u8], id: &Value) -> Option<Result<T, AgentError>> {
    let msg = serde_json::from_slice::<Value>(line).ok()?;
    if msg.get("id") != Some(id) {
        return None;
    }
    if let Some(err) = msg.get("error") {
        return Some(Err(AgentError::Remote {
            code: err.get("code").and_then(Value::as_i64).unwrap_or(0),
            message: err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .chars()
                .take(MAX_REMOTE_MESSAGE)
                .collect(),
            data: err.get("data").cloned().unwrap_or(Value::Null),
        }));
    }
    let result = msg.get("result").cloned().unwrap_or(Value::Null);
    Some(serde_json::from_value(result).map_err(|e| AgentError::Protocol(e.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vmhost_agent_protocol::AgentInfo;

    fn lines(reader: &mut LineReader) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| reader.next_line().ok().flatten()).collect()
    }

    #[test]
    fn lines_are_cut_at_newlines_whatever_the_chunks() {
        let mut r = LineReader::new();
        r.push(b"ab");
        assert!(r.next_line().unwrap().is_none());
        r.push(b"c\n\nde\nf");
        assert_eq!(lines(&mut r), vec![b"abc".to_vec(), vec![], b"de".to_vec()]);
        r.push(b"\n");
        assert_eq!(lines(&mut r), vec![b"f".to_vec()]);
    }

    #[test]
    fn lines_trickled_one_byte_per_read_come_out_whole() {
        let text = b"first line\n\nthird, after an empty one\nunfinished";
        let mut r = LineReader::new();
        let mut got = Vec::new();
        for b in text {
            r.push(&[*b]);
            got.extend(lines(&mut r));
        }
        assert_eq!(got, vec![b"first line".to_vec(), vec![], b"third, after an empty one".to_vec()]);
        r.push(b" now\n");
        assert_eq!(lines(&mut r), vec![b"unfinished now".to_vec()]);
    }

    #[test]
    fn a_line_over_the_limit_is_an_error_with_or_without_its_newline() {
        let mut r = LineReader::new();
        r.push(&vec![b'x'; MAX_FRAME]);
        assert!(r.next_line().unwrap().is_none(), "exactly the limit is still a line in the making");
        r.push(b"\n");
        assert_eq!(r.next_line().unwrap().map(|l| l.len()), Some(MAX_FRAME));
        r.push(&vec![b'x'; MAX_FRAME + 1]);
        assert!(matches!(r.next_line(), Err(AgentError::Protocol(_))));
        let mut r = LineReader::new();
        r.push(&[vec![b'y'; MAX_FRAME + 1], b"\nok\n".to_vec()].concat());
        assert!(matches!(r.next_line(), Err(AgentError::Protocol(_))), "a complete but oversize line");
    }

    #[test]
    fn skipped_bytes_are_capped_whatever_the_line_count() {
        let mut b = SkipBudget::new();
        let line = vec![b'g'; MAX_FRAME - 1];
        for _ in 0..4 {
            assert!(b.skip(&line).is_ok(), "four full frames fit");
        }
        match b.skip(b"") {
            Err(AgentError::Protocol(m)) => assert_eq!(m, "more than 262144 bytes of unrelated lines"),
            other => panic!("{other:?}"),
        }
        // Many short lines count by their bytes (newlines included), not by their number.
        let mut b = SkipBudget::new();
        let n = (0..).take_while(|_| b.skip(b"x").is_ok()).count();
        assert_eq!(n, MAX_SKIPPED_BYTES / 2);
    }

    #[test]
    fn replies_are_matched_by_id_and_parsed_into_closed_types() {
        let id = json!(3);
        assert!(match_reply::<Value>(b"not json", &id).is_none());
        assert!(match_reply::<Value>(br#"{"jsonrpc":"2.0","id":2,"result":1}"#, &id).is_none(), "other id");
        assert!(match_reply::<Value>(br#"{"jsonrpc":"2.0","id":"3","result":1}"#, &id).is_none(), "string id");
        assert!(match_reply::<Value>(br#"{"jsonrpc":"2.0","id":null,"error":{"code":1}}"#, &id).is_none());
        let ok = match_reply::<u32>(br#"{"jsonrpc":"2.0","id":3,"result":7}"#, &id);
        assert_eq!(ok.map(|r| r.ok()), Some(Some(7)));
        let long = "m".repeat(2000);
        let line = json!({"jsonrpc": "2.0", "id": 3, "error": {"code": 5100, "message": long, "data": {"field": "x"}}});
        match match_reply::<Value>(line.to_string().as_bytes(), &id) {
            Some(Err(AgentError::Remote { code, message, data })) => {
                assert_eq!((code, message.len(), data), (5100, MAX_REMOTE_MESSAGE, json!({"field": "x"})));
            }
            other => panic!("{other:?}"),
        }
        let extra = br#"{"jsonrpc":"2.0","id":3,"result":{"version":"t","hostname":"g","kernel":"k","uptime_s":1,"boot_id":"b","rss_kib":1,"host_path":"/etc"}}"#;
        assert!(matches!(match_reply::<AgentInfo>(extra, &id), Some(Err(AgentError::Protocol(_)))));
    }
}
