//! The agent's request parser under arbitrary host bytes: see `vmhost_agent::fuzz`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost_agent::fuzz::requests(data));
