//! The image store (docs/images.md): `image.import` from a file in the import directory, from
//! an http URL served on loopback (curl run by the spawner as QEMU's user, the only program
//! Landlock lets connect, to the configured port), and of a file put in the images directory
//! by hand; a wrong sha256 leaves nothing; `image.list` shows each image with its users;
//! `image.delete` is refused while a VM boots from it; `host.check` notices a recorded image
//! that changed.

use serde_json::{json, Value};
use vmhost_tests::{boot_sector, serve_http, sha256_hex, HostOptions, TestHost};

const BOOT: std::time::Duration = std::time::Duration::from_secs(60);

/// A raw image whose boot sector prints `marker` on the serial console.
fn image_bytes(host: &TestHost, marker: &str) -> Vec<u8> {
    let path = host.dir.path().join(format!("{marker}.fixture"));
    boot_sector::write_image(&path, &boot_sector::serial_print(marker));
    std::fs::read(&path).unwrap()
}

fn images_item(host: &TestHost) -> Value {
    let check = host.call("host.check", json!({}));
    check["items"].as_array().unwrap().iter().find(|i| i["name"] == "images").cloned().unwrap()
}

/// A host whose downloads may connect to the port `files` are served on, and that port.
fn host_serving(files: Vec<(String, std::path::PathBuf)>) -> (TestHost, u16) {
    let port = serve_http(files);
    let host = TestHost::start(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}]\n"),
        ..HostOptions::default()
    });
    (host, port)
}

#[test]
fn a_local_file_is_imported_verified_listed_and_deleted_only_when_unused() {
    let host = TestHost::start(HostOptions::default());
    let data = image_bytes(&host, "VMHOST-IMPORTED-IMAGE");
    let sha = sha256_hex(&data);
    let import = host.state().join("import");
    std::fs::write(import.join("upload.raw"), &data).unwrap();
    let before = host.image_dir_entries();

    // A wrong sha256: 2003 with what was found, and nothing left behind.
    let wrong = "0".repeat(64);
    let (code, e) = host.call_err("image.import", json!({"name": "base.raw", "sha256": wrong, "source": "upload.raw"}));
    assert_eq!((code, e.field.as_deref()), (2003, Some("sha256")), "{e:?}");
    assert_eq!(e.details["found"], sha.as_str());
    assert_eq!(e.details["bytes"], data.len());
    assert_eq!(host.image_dir_entries(), before, "no image and no temp file left");
    assert!(host.listed_image("base.raw").is_none());

    // The right one: copied (the source stays), recorded, listed.
    let v = host.call("image.import", json!({"name": "base.raw", "sha256": sha, "source": "upload.raw"}));
    assert_eq!(v["changed"], true, "{v}");
    assert_eq!((&v["image"]["format"], &v["image"]["sha256"]), (&json!("raw"), &json!(sha)), "{v}");
    assert_eq!(std::fs::read(host.images().join("base.raw")).unwrap(), data);
    assert!(import.join("upload.raw").is_file(), "a copy: the source stays");
    let again = host.call("image.import", json!({"name": "base.raw", "sha256": sha, "source": "upload.raw"}));
    assert_eq!(again["changed"], false, "the same image again changes nothing");
    let (code, e) =
        host.call_err("image.import", json!({"name": "base.raw", "sha256": "1".repeat(64), "source": "upload.raw"}));
    assert_eq!((code, e.details["sha256"].as_str()), (4093, Some(sha.as_str())), "never replaced: {e:?}");
    assert_eq!(images_item(&host)["status"], "ok");

    // A VM boots from it: delete refused, naming the VM.
    let spec = json!({"name": "user", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("user", "VMHOST-IMPORTED-IMAGE", BOOT), "{}", host.serial("user"));
    assert_eq!(host.listed_image("base.raw").unwrap()["used_by"], json!(["user"]));
    let (code, e) = host.call_err("image.delete", json!({"name": "base.raw"}));
    assert_eq!((code, &e.details["vms"]), (4092, &json!(["user"])), "{e:?}");
    assert!(host.images().join("base.raw").is_file());

    // A recorded image that changes under the store: host.check says so.
    let mut changed = data.clone();
    changed[600] ^= 1;
    std::fs::write(host.images().join("base.raw"), &changed).unwrap();
    let item = images_item(&host);
    assert_eq!(item["status"], "error", "{item}");
    assert!(item["detail"].as_str().unwrap().contains(&sha256_hex(&changed)), "{item}");
    std::fs::write(host.images().join("base.raw"), &data).unwrap();
    assert_eq!(images_item(&host)["status"], "ok");

    host.call("vm.destroy", json!({"name": "user"}));
    let v = host.call("image.delete", json!({"name": "base.raw"}));
    assert_eq!(v["changed"], true);
    assert!(!host.images().join("base.raw").exists());
    assert!(host.listed_image("base.raw").is_none());
    assert_eq!(host.call("image.delete", json!({"name": "base.raw"}))["changed"], false);
    let spec = json!({"name": "late", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    assert_eq!(host.call_err("vm.create", json!({ "spec": spec })).0, 2001, "the image is gone");
}

#[test]
fn an_image_put_there_by_hand_is_listed_then_recorded_where_it_is() {
    let host = TestHost::start(HostOptions::default());
    let data = image_bytes(&host, "VMHOST-HAND-PLACED");
    std::fs::write(host.images().join("hand.raw"), &data).unwrap();
    let v = host.listed_image("hand.raw").unwrap();
    assert_eq!((&v["sha256"], &v["format"], &v["bytes"]), (&Value::Null, &json!("raw"), &json!(data.len())), "{v}");

    let (code, _) = host.call_err("image.import", json!({"name": "hand.raw", "sha256": "a".repeat(64)}));
    assert_eq!(code, 2003, "checked where it is");
    assert!(host.images().join("hand.raw").is_file(), "a refused check removes nothing");
    let sha = sha256_hex(&data);
    let v = host.call("image.import", json!({"name": "hand.raw", "sha256": sha}));
    assert_eq!(
        (&v["changed"], &v["image"]["sha256"], &v["image"]["source"]),
        (&json!(true), &json!(sha), &Value::Null)
    );
    assert_eq!(host.listed_image("hand.raw").unwrap()["sha256"], sha.as_str());
    let (code, e) = host.call_err("image.import", json!({"name": "none.raw", "sha256": sha}));
    assert_eq!((code, e.field.as_deref()), (4040, Some("source")));

    // vmhostctl: the same calls.
    let out = host.ctl(&["image", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.lines().any(|l| l.starts_with("hand.raw") && l.contains(&sha)), "{text}");
    let out = host.ctl(&["image", "import", "hand.raw", &sha]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("hand.raw: unchanged"), "{out:?}");
    let out = host.ctl(&["image", "delete", "hand.raw"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("hand.raw: deleted"), "{out:?}");
    assert!(!host.images().join("hand.raw").exists());
}

#[test]
fn a_url_is_fetched_by_curl_and_checked_and_a_failed_fetch_leaves_nothing() {
    let served = tempfile::tempdir().unwrap();
    let file = served.path().join("web.raw");
    boot_sector::write_image(&file, &boot_sector::serial_print("VMHOST-DOWNLOADED"));
    let data = std::fs::read(&file).unwrap();
    let sha = sha256_hex(&data);
    let (host, port) = host_serving(vec![("/images/web.raw".into(), file.clone())]);
    let url = format!("http://127.0.0.1:{port}/images/web.raw");
    let before = host.image_dir_entries();

    let (code, e) = host.call_err("image.import", json!({"name": "web.raw", "sha256": "f".repeat(64), "source": url}));
    assert_eq!((code, e.details["found"].as_str()), (2003, Some(sha.as_str())), "{e:?}");
    let missing = format!("http://127.0.0.1:{port}/images/missing.raw");
    let (code, e) = host.call_err("image.import", json!({"name": "web.raw", "sha256": sha, "source": missing}));
    assert_eq!((code, e.details["step"].as_str()), (4001, Some("download")), "{e:?}");
    assert!(e.message.contains("404"), "curl's message: {e:?}");
    // The same server on a port the config does not list: Landlock lets curl connect to
    // `download_ports` only.
    let other = serve_http(vec![("/images/web.raw".into(), file.clone())]);
    let elsewhere = format!("http://127.0.0.1:{other}/images/web.raw");
    let (code, e) = host.call_err("image.import", json!({"name": "web.raw", "sha256": sha, "source": elsewhere}));
    assert_eq!((code, e.details["step"].as_str()), (4001, Some("download")), "{e:?}");
    assert!(e.message.contains("connect"), "{e:?}");
    assert_eq!(host.image_dir_entries(), before, "nothing left");

    let v = host.call("image.import", json!({"name": "web.raw", "sha256": sha, "source": url}));
    assert_eq!((&v["changed"], &v["image"]["source"]), (&json!(true), &json!(url)), "{v}");
    assert_eq!(std::fs::read(host.images().join("web.raw")).unwrap(), data);
    let spec = json!({"name": "web", "cpu": 1, "memory_mib": 64, "boot": {"image": "web.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("web", "VMHOST-DOWNLOADED", BOOT), "{}", host.serial("web"));
}
