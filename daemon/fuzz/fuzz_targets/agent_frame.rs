//! The daemon's agent-frame parser under arbitrary guest bytes: see `vmhost::agent::fuzz`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::agent::fuzz::replies(data));
