//! The agent-frame parser as the cargo fuzz target `agent_frame` drives it (`daemon/fuzz/`), and
//! the replay of its corpus and past crashes as unit tests.
//!
//! [`replies`] treats arbitrary bytes as what a hostile guest writes on its port and runs them
//! through exactly what a session does with them ([`LineReader`] then [`match_reply`] into every
//! closed reply type the daemon asks for). It panics when a promise breaks: no line longer than
//! [`MAX_FRAME`] is ever handed on, framing fails only as a protocol error, and an error message kept from the guest is cut to
//! [`MAX_REMOTE_MESSAGE`] characters. No production code calls it.

use crate::agent::error::AgentError;
use crate::agent::frame::{match_reply, LineReader, MAX_FRAME, MAX_REMOTE_MESSAGE};
use serde::de::DeserializeOwned;
use serde_json::Value;
use vmhost_agent_protocol::{AgentInfo, ApplyReport, CheckReport, Hello, NetState, SyncReply};

/// Runs `data` through the session's framing and reply matching as the guest's bytes.
///
/// The first byte chooses how the rest is cut into reads (1 to 256 bytes each), so the same input
/// also exercises lines split across reads; the second chooses the id waited for (0 to 3).
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn replies(data: &[u8]) {
    let [step, id, rest @ ..] = data else { return };
    let id = Value::from(id % 4);
    let mut reader = LineReader::new();
    for chunk in rest.chunks(usize::from(*step) + 1) {
        reader.push(chunk);
        loop {
            match reader.next_line() {
                Ok(Some(line)) => {
                    assert!(line.len() <= MAX_FRAME, "a line of {} bytes", line.len());
                    assert!(!line.contains(&b'\n'), "a line holding a newline");
                    each_reply_type(&line, &id);
                }
                Ok(None) => break,
                // The session is dropped: nothing more is read.
                Err(AgentError::Protocol(_)) => return,
                Err(e) => panic!("framing fails only as a protocol error, got {e:?}"),
            }
        }
    }
}

fn each_reply_type(line: &[u8], id: &Value) {
    check::<SyncReply>(line, id);
    check::<Hello>(line, id);
    check::<AgentInfo>(line, id);
    check::<NetState>(line, id);
    check::<CheckReport>(line, id);
    check::<ApplyReport>(line, id);
    check::<Value>(line, id);
}

fn check<T: DeserializeOwned>(line: &[u8], id: &Value) {
    match match_reply::<T>(line, id) {
        None | Some(Ok(_)) | Some(Err(AgentError::Protocol(_))) => {}
        Some(Err(AgentError::Remote { message, .. })) => {
            assert!(message.chars().count() <= MAX_REMOTE_MESSAGE, "a guest message of {} chars", message.len());
        }
        Some(Err(e)) => panic!("matching a reply fails only as protocol or remote errors, got {e:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("agent_frame", replies) >= 5, "the seed corpus is committed");
    }
}
