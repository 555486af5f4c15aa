//! TODO (placeholder until the process module lands)

use serde::{Deserialize, Serialize};

/// A process as recorded: pid plus start time, so a reused pid is not mistaken for ours.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// Process id.
    pub pid: i32,
    /// Field 22 of /proc/PID/stat.
    pub start_ticks: u64,
}
