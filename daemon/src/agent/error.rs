//! Why an agent session failed: one error type for both halves of a session.
//!
//! Its own module because [`super::frame`] (the pure framing that fails on oversize lines and
//! turns replies into outcomes) and [`super::conn`] (the socket, deadlines and ids, which use the
//! framing) both produce it; with the type in either one, each would import the other.

use crate::guest_text::GuestText;
use serde_json::Value;
use std::time::Duration;

/// Why a session failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The chardev socket cannot be reached (VM not running).
    #[error("cannot connect to the agent socket: {0}")]
    Connect(std::io::Error),
    /// The guest did not answer in time.
    #[error("the guest agent did not answer within {0:?}")]
    Timeout(Duration),
    /// The session broke (EOF, I/O error).
    #[error("agent session closed: {0}")]
    Closed(String),
    /// The guest sent something that is not a valid reply (oversize, not UTF-8, not JSON, wrong
    /// shape); the session is dropped. The text may quote the guest (serde names what it found):
    /// it displays escaped and capped.
    #[error("invalid reply from the guest agent: {}", GuestText(.0))]
    Protocol(String),
    /// The agent answered with a JSON-RPC error; its message is the guest's and displays escaped
    /// and capped.
    #[error("the guest agent refused: {} (code {code})", GuestText(.message))]
    Remote {
        /// The agent's code.
        code: i64,
        /// Its message.
        message: String,
        /// Its data.
        data: Value,
    },
}
