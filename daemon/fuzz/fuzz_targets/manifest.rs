//! A backup's `manifest.json` under arbitrary bytes: see `vmhost::fuzz::manifest`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::manifest::manifest_bytes(data));
