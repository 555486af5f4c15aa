//! The image store (docs/images.md): `image.import` from a file in the import directory, from
//! an http URL served on loopback (curl run by the spawner as QEMU's user, the only program
//! Landlock lets connect, to the configured port), and of a file put in the images directory
//! by hand; a wrong sha256 leaves nothing; `image.list` shows each image with its users;
//! `image.delete` is refused while a VM boots from it (as its base image, or its kernel);
//! `host.check` notices a recorded image that changed. A URL import reaches no address the
//! host alone can reach unless `[images] allow_private` says so, also through a name or a
//! redirect, and a URL's query string and user information stay out of argv, records and logs.

use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vmhost_tests::{boot_sector, serve_http, serve_routes, sha256_hex, HostOptions, Reply, TestHost};

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

/// A host whose downloads may connect to the port `files` are served on (on loopback: with
/// `allow_private`), and that port.
fn host_serving(files: Vec<(String, std::path::PathBuf)>) -> (TestHost, u16) {
    let port = serve_http(files);
    let host = TestHost::start(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}]\nallow_private = true\n"),
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

/// The raw test image served by these tests, and its sha256.
fn served_image(dir: &std::path::Path, marker: &str) -> (std::path::PathBuf, Vec<u8>, String) {
    let file = dir.join(format!("{marker}.raw"));
    boot_sector::write_image(&file, &boot_sector::serial_print(marker));
    let data = std::fs::read(&file).unwrap();
    let sha = sha256_hex(&data);
    (file, data, sha)
}

/// The daemon's /etc/hosts in these tests: public-looking names for loopback addresses.
const HOSTS: &str = "127.0.0.1 localhost\n127.0.0.1 images.example.test\n127.0.0.2 internal.example.test\n";

#[test]
fn a_url_import_reaches_no_private_address_by_default_not_even_through_a_name() {
    let served = tempfile::tempdir().unwrap();
    let (file, _, sha) = served_image(served.path(), "VMHOST-PRIVATE");
    let server = serve_routes("127.0.0.1", vec![("/web.raw".into(), Reply::File(file))]);
    let port = server.port;
    let host = TestHost::start(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}]\n"),
        hosts: Some(HOSTS.into()),
        ..HostOptions::default()
    });
    let before = host.image_dir_entries();
    for (url, addr) in [
        (format!("http://127.0.0.1:{port}/web.raw"), "127.0.0.1"),
        // A public-looking name the daemon's resolver maps to loopback (its /etc/hosts).
        (format!("http://images.example.test:{port}/web.raw"), "127.0.0.1"),
        (format!("http://[::1]:{port}/web.raw"), "::1"),
        (format!("http://[::ffff:127.0.0.1]:{port}/web.raw"), "127.0.0.1"),
        (format!("http://169.254.169.254:{port}/latest/meta-data"), "169.254.169.254"),
    ] {
        let (code, e) = host.call_err("image.import", json!({"name": "web.raw", "sha256": sha, "source": url}));
        assert_eq!((code, e.field.as_deref()), (2001, Some("source")), "{url}: {e:?}");
        assert!(e.message.contains(addr), "{url}: names the address: {e:?}");
        assert!(e.message.contains("allow_private"), "{url}: {e:?}");
    }
    assert_eq!(server.requests(), Vec::<String>::new(), "nothing was fetched");
    assert_eq!(host.image_dir_entries(), before, "no image and no temp file");
}

#[test]
fn allowed_networks_are_reached_redirects_are_checked_and_url_secrets_stay_secret() {
    let served = tempfile::tempdir().unwrap();
    let (file, data, sha) = served_image(served.path(), "VMHOST-SECRET-URL");
    let release = Arc::new(AtomicBool::new(false));
    let inside = serve_routes("127.0.0.2", vec![("/web.raw".into(), Reply::File(file.clone()))]);
    let server = serve_routes(
        "127.0.0.1",
        vec![
            ("/web.raw".into(), Reply::File(file.clone())),
            ("/slow.raw".into(), Reply::Held(file.clone(), Arc::clone(&release))),
            ("/hop".into(), Reply::Redirect("/web.raw?token=secret123".into())),
            (
                "/inside".into(),
                Reply::Redirect(format!("http://internal.example.test:{}/web.raw?token=secret123", inside.port)),
            ),
            ("/ftp".into(), Reply::Redirect("ftp://images.example.test/web.raw".into())),
        ],
    );
    let port = server.port;
    // 127.0.0.1 only: 127.0.0.2, loopback too, stays refused.
    let host = TestHost::start(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}, {}]\nallow_private = [\"127.0.0.1/32\"]\n", inside.port),
        hosts: Some(HOSTS.into()),
        ..HostOptions::default()
    });
    let base = format!("http://images.example.test:{port}");
    let before = host.image_dir_entries();

    // User information is refused before anything happens.
    let with_user = format!("http://user:pw@images.example.test:{port}/web.raw");
    let (code, e) = host.call_err("image.import", json!({"name": "a.raw", "sha256": sha, "source": with_user}));
    assert_eq!((code, e.field.as_deref()), (2001, Some("source")), "{e:?}");
    // A redirect to a name of 127.0.0.2 is checked as the first URL was: refused, not fetched.
    let (code, e) = host.call_err(
        "image.import",
        json!({"name": "a.raw", "sha256": sha, "source": format!("{base}/inside?token=secret123")}),
    );
    assert_eq!((code, e.field.as_deref()), (2001, Some("source")), "{e:?}");
    assert!(e.message.contains("internal.example.test") && e.message.contains("127.0.0.2"), "{e:?}");
    assert_eq!(inside.requests(), Vec::<String>::new(), "the refused redirect was not followed");
    let (code, e) =
        host.call_err("image.import", json!({"name": "a.raw", "sha256": sha, "source": format!("{base}/ftp")}));
    assert_eq!((code, e.field.as_deref()), (2001, Some("source")), "only http(s) after a redirect: {e:?}");
    // A failed download says so without the token.
    let (code, e) = host.call_err(
        "image.import",
        json!({"name": "a.raw", "sha256": sha, "source": format!("{base}/missing.raw?token=secret123")}),
    );
    assert_eq!((code, e.details["step"].as_str()), (4001, Some("download")), "{e:?}");
    assert!(e.message.contains("404") && e.message.contains("?REDACTED"), "{e:?}");
    assert!(!format!("{e:?}").contains("secret123"), "{e:?}");
    let (code, e) = host.call_err(
        "image.import",
        json!({"name": "a.raw", "sha256": "0".repeat(64), "source": format!("{base}/web.raw?token=secret123")}),
    );
    assert_eq!(code, 2003, "{e:?}");
    assert!(!format!("{e:?}").contains("secret123"), "{e:?}");
    assert_eq!(host.image_dir_entries(), before, "nothing left by the refusals and failures");

    // An allowed redirect (on the allowed address) is followed: the image arrives whole.
    let v = host.call("image.import", json!({"name": "hop.raw", "sha256": sha, "source": format!("{base}/hop")}));
    assert_eq!(v["changed"], true, "{v}");
    assert_eq!(std::fs::read(host.images().join("hop.raw")).unwrap(), data);
    assert!(server.requests().contains(&"/web.raw?token=secret123".to_string()), "{:?}", server.requests());

    // vmhostctl takes the URL on stdin (`--source -`), so its own argv holds no token either.
    let mut ctl = std::process::Command::new(vmhost_tests::bin("vmhostctl"))
        .arg("--socket")
        .arg(&host.socket)
        .args(["image", "import", "cli.raw", &sha, "--source", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = ctl.stdin.take().unwrap();
        writeln!(stdin, "{base}/web.raw?token=secret123").unwrap();
    }
    let out = ctl.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(host.images().join("cli.raw")).unwrap(), data);

    // While curl runs, no process shows the URL's token (or the URL) in its command line.
    let url = format!("{base}/slow.raw?token=secret123");
    let socket = host.socket.clone();
    let call = std::thread::spawn(move || {
        let mut c = vmhost::client::Client::connect(&socket).unwrap();
        c.call::<Value>("image.import", json!({"name": "slow.raw", "sha256": sha, "source": url}))
    });
    vmhost_tests::wait::until_true(
        "curl to ask for /slow.raw",
        std::time::Duration::from_secs(120),
        || server.requests().iter().any(|r| r.starts_with("/slow.raw")),
        || format!("requests: {:?}", server.requests()),
    );
    let mut curls = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let text = String::from_utf8_lossy(&raw).replace('\0', " ");
        assert!(!text.contains("secret123") && !text.contains("images.example.test"), "{text}");
        if text.contains("curl") && text.contains(" -K - ") {
            curls += 1;
        }
    }
    assert!(curls >= 1, "a curl with its config on stdin was running while we looked");
    release.store(true, Ordering::SeqCst);
    let v = call.join().unwrap().expect("the held download completes");
    assert_eq!(v["image"]["source"], format!("{base}/slow.raw?REDACTED"), "{v}");

    // Recorded, listed and logged without the token.
    for name in ["hop.raw", "cli.raw", "slow.raw"] {
        let listed = host.listed_image(name).unwrap();
        assert!(!listed.to_string().contains("secret123"), "{listed}");
    }
    assert_eq!(host.listed_image("slow.raw").unwrap()["source"], format!("{base}/slow.raw?REDACTED"));
    let records = std::fs::read_to_string(host.state().join("images.json")).unwrap();
    assert!(!records.contains("secret123"), "{records}");
    let log = host.daemon_log();
    assert!(log.contains("image imported"), "the log is the daemon's");
    assert!(!log.contains("secret123"), "the daemon log holds the token");
}

#[test]
fn an_image_that_is_a_vms_kernel_is_in_use() {
    let host = TestHost::start(HostOptions::default());
    let guest = vmhost_tests::guest();
    std::fs::copy(&guest.kernel, host.images().join("vmlinuz")).unwrap();
    let mut spec = host.kernel_spec("direct");
    spec["boot"]["kernel"] = json!(host.images().join("vmlinuz"));
    spec["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(host.listed_image("vmlinuz").unwrap()["used_by"], json!(["direct"]));
    let (code, e) = host.call_err("image.delete", json!({"name": "vmlinuz"}));
    assert_eq!((code, &e.details["vms"]), (4092, &json!(["direct"])), "{e:?}");
    assert!(host.images().join("vmlinuz").is_file());
    host.call("vm.destroy", json!({"name": "direct"}));
    assert_eq!(host.call("image.delete", json!({"name": "vmlinuz"}))["changed"], true);
}
