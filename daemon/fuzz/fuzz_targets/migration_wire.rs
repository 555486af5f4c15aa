//! What a peer sends on the migration port under arbitrary bytes: see `vmhost::fuzz::migration_wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::migration_wire::wire_bytes(data));
