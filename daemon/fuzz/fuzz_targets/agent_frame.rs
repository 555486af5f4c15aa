//! The daemon's agent-frame parser under arbitrary guest bytes: see `vmhost::fuzz::agent_frame`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::agent_frame::replies(data));
