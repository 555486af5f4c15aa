//! The config parser under arbitrary text: see `vmhost::fuzz::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::config::config_text(data));
