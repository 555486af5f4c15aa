use super::*;
use crate::api::{ApiError, Code};
use crate::validate::tests::config;

/// The request check as a client sees it: through the boundary's mapping, so these tests hold
/// the codes and fields of the API.
fn check_import(
    config: &Config,
    name: &str,
    sha256: &str,
    source: Option<&str>,
    timeout_s: Option<u64>,
) -> Result<ImportRequest, ApiError> {
    super::check_import(config, name, sha256, source, timeout_s).map_err(ApiError::from)
}

fn sha(data: &[u8]) -> String {
    crate::qemu::integrity::sha256_of(&mut &data[..]).unwrap()
}

fn store_in(d: &Path) -> (Config, Store) {
    let mut c = config();
    c.paths.state = d.join("state");
    c.paths.images = d.join("images");
    std::fs::create_dir_all(&c.paths.state).unwrap();
    std::fs::create_dir_all(&c.paths.images).unwrap();
    let s = Store::open(&c).unwrap();
    (c, s)
}

#[test]
fn an_import_request_is_checked_before_anything_is_touched() {
    let c = config();
    let good = "ab".repeat(32);
    let field = |name: &str, sha: &str, source: Option<&str>, t: Option<u64>| {
        check_import(&c, name, sha, source, t).err().and_then(|e| e.field)
    };
    for bad in ["", ".hidden", "a/b", "../x", "sp ace"] {
        assert_eq!(field(bad, &good, None, None).as_deref(), Some("name"), "{bad:?}");
    }
    for bad in ["", "ab", &"g".repeat(64), &"a".repeat(65)] {
        assert_eq!(field("i.qcow2", bad, None, None).as_deref(), Some("sha256"), "{bad:?}");
    }
    let long = format!("https://example.org/{}", "a".repeat(MAX_URL));
    let outside = "/etc/shadow";
    for bad in ["ftp://example.org/i", "file:///etc/passwd", "https://a b/", &long, outside, "../i", "sub/i"] {
        assert_eq!(field("i.qcow2", &good, Some(bad), None).as_deref(), Some("source"), "{bad:?}");
    }
    assert_eq!(field("i.qcow2", &good, None, Some(0)).as_deref(), Some("timeout_s"));

    let upper = "AB".repeat(32);
    let r = check_import(&c, "i.qcow2", &upper, Some("https://example.org/i.qcow2"), None).unwrap();
    assert_eq!(r.sha256, good, "hex is kept in lower case");
    assert_eq!(r.source, Source::Url(url::parse("https://example.org/i.qcow2").unwrap()));
    let e = check_import(&c, "i.qcow2", &good, Some("https://user:pw@example.org/i"), None).unwrap_err();
    assert_eq!((e.code, e.field.as_deref()), (Code::InvalidSpec, Some("source")), "user info is refused");
    assert!(!e.message.contains("pw@"), "{}", e.message);
    assert_eq!(r.timeout, std::time::Duration::from_secs(DEFAULT_DOWNLOAD_TIMEOUT_S));
    let dir = c.paths.import_dir();
    let by_name = check_import(&c, "i.qcow2", &good, Some("up.qcow2"), Some(5)).unwrap();
    assert_eq!(by_name.source, Source::File(dir.join("up.qcow2")));
    let by_path = dir.join("up.qcow2");
    let r = check_import(&c, "i.qcow2", &good, Some(by_path.to_str().unwrap()), None).unwrap();
    assert_eq!(r.source, Source::File(by_path));
    assert_eq!(check_import(&c, "i.qcow2", &good, None, None).unwrap().source, Source::InPlace);
}

#[test]
fn a_temp_file_is_placed_whole_never_over_a_file_and_removed_when_dropped() {
    let d = tempfile::tempdir().unwrap();
    let (_c, store) = store_in(d.path());
    let held = store.begin("a.raw").unwrap();
    assert_eq!(ApiError::from(store.begin("a.raw").unwrap_err()).code, Code::Busy, "one operation per name");

    let mut data = vec![7u8; 3000];
    data.extend(vec![0u8; 2 * temp::BLOCK]);
    data.push(1);
    let mut t = store.temp(&held, "a.raw").unwrap();
    for chunk in data.chunks(temp::BLOCK) {
        t.write(chunk).unwrap();
    }
    assert_eq!(t.finish().unwrap(), sha(&data));
    assert!(store.files().unwrap().is_empty(), "a temp file is not an image");
    let meta = t.place(&store.path("a.raw")).unwrap();
    assert_eq!(std::fs::read(store.path("a.raw")).unwrap(), data);
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 < data.len() as u64, "zero blocks are holes");

    let mut again = store.temp(&held, "a.raw").unwrap();
    again.write(b"other").unwrap();
    again.finish().unwrap();
    let e = again.place(&store.path("a.raw")).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read(store.path("a.raw")).unwrap(), data, "never replaced");

    let dropped = store.temp(&held, "b.raw").unwrap();
    drop(dropped);
    let names: Vec<_> = std::fs::read_dir(store.path("")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("a.raw")], "no temp file left");
    drop(held);
    assert!(store.begin("a.raw").is_ok(), "the name is free again");
}

#[test]
fn leftover_temp_files_are_removed_at_open() {
    let d = tempfile::tempdir().unwrap();
    let (c, store) = store_in(d.path());
    let held = store.begin("x").unwrap();
    let t = store.temp(&held, "x").unwrap();
    std::mem::forget(t);
    std::fs::write(store.path(".keep-me"), b"").unwrap();
    std::fs::write(store.path("x.qcow2"), b"").unwrap();
    Store::open(&c).unwrap();
    let mut names: Vec<_> = std::fs::read_dir(store.path("")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, vec![std::ffi::OsString::from(".keep-me"), "x.qcow2".into()]);
}

#[test]
fn records_persist_and_a_changed_image_is_hashed_again() {
    let d = tempfile::tempdir().unwrap();
    let (c, store) = store_in(d.path());
    let path = store.path("i.raw");
    std::fs::write(&path, b"content").unwrap();
    let record = |sha256: String| ImageRecord {
        sha256,
        bytes: 7,
        format: "raw".into(),
        virtual_size: 7,
        source: None,
        imported_at: "2026-12-04T00:00:00Z".into(),
        version: Version::of(&std::fs::metadata(&path).unwrap()),
    };
    let held = store.begin("i.raw").unwrap();
    store.put(&held, "i.raw", record(sha(b"content"))).unwrap();
    assert_eq!(store.verify("i.raw"), Some(Verdict::Match));
    assert_eq!(store.verify("other"), None, "no record, nothing to check");

    let reopened = Store::open(&c).unwrap();
    assert_eq!(reopened.record("i.raw").unwrap().sha256, sha(b"content"), "kept in STATE/images.json");
    assert!(c.paths.state.join("images.json").is_file());

    // A record whose version is the file's is trusted without reading: prove it by a record
    // with a wrong sha256 but the file's version.
    store.put(&held, "i.raw", record("00".repeat(32))).unwrap();
    assert_eq!(store.verify("i.raw"), Some(Verdict::Match), "unchanged files are not read again");
    std::fs::write(&path, b"changed").unwrap();
    assert_eq!(store.verify("i.raw"), Some(Verdict::Mismatch { found: sha(b"changed") }));
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(store.verify("i.raw"), Some(Verdict::Unreadable(_))));

    assert!(store.remove(&held, "i.raw").unwrap(), "the record was there");
    assert!(store.record("i.raw").is_none());
    assert!(!store.remove(&held, "i.raw").unwrap());
    assert!(Store::open(&c).unwrap().records().is_empty());
}

#[test]
fn a_broken_records_file_stops_the_open() {
    let d = tempfile::tempdir().unwrap();
    let (c, _) = store_in(d.path());
    std::fs::write(c.paths.state.join("images.json"), b"{not json").unwrap();
    assert!(Store::open(&c).unwrap_err().contains("images.json"));
}

#[test]
fn the_leftovers_of_one_file_are_its_own_temp_files_only() {
    let d = tempfile::tempdir().unwrap();
    for f in [
        ".web.qcow2.import-1-0",
        ".web.qcow2.import-2-5",
        ".webx.qcow2.import-1-0",
        ".db.qcow2.import-1-1",
        "web.qcow2",
    ] {
        std::fs::write(d.path().join(f), b"").unwrap();
    }
    remove_leftovers_of(&d.path().join("web.qcow2"));
    let mut left: Vec<String> =
        std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, [".db.qcow2.import-1-1", ".webx.qcow2.import-1-0", "web.qcow2"]);
}

#[test]
fn a_copy_with_a_passed_deadline_is_given_up_and_one_without_runs_whole() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.raw");
    std::fs::write(&src, vec![7u8; 3 << 20]).unwrap();
    let mut temp = Temp::create(d.path(), "out.raw").unwrap();
    let e = copy_until(&src, &mut temp, Some(std::time::Instant::now())).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    let mut temp = Temp::create(d.path(), "out.raw").unwrap();
    let later = std::time::Instant::now().checked_add(std::time::Duration::from_secs(3600));
    copy_until(&src, &mut temp, later).unwrap();
    assert_eq!(temp.bytes(), 3 << 20);
}
