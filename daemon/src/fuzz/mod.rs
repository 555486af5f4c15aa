//! Entry points of the daemon's cargo fuzz targets (`daemon/fuzz/`, run by `tests/fuzz.sh`), one
//! module per target, each also replaying its committed corpus and past crashes as a unit test.
//!
//! Every harness feeds arbitrary bytes through the same functions production uses and panics
//! when a promise of that input path breaks; no production code calls them.

pub mod agent_frame;
pub mod config;
pub mod manifest;
pub mod migration_wire;
pub mod request;
pub mod spec;

/// Runs every file of `daemon/fuzz/corpus/TARGET/` and `daemon/fuzz/regressions/TARGET/` through
/// `harness`; returns how many there were.
#[cfg(test)]
pub(crate) fn replay(target: &str, harness: fn(&[u8])) -> usize {
    let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut seen = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else { continue };
        for entry in entries.flatten() {
            let data = std::fs::read(entry.path()).expect("read corpus file");
            harness(&data);
            seen += 1;
        }
    }
    seen
}
