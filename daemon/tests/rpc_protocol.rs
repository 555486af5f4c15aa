//! The RPC socket protocol over a real Unix socket: framing, batches, concurrency, errors,
//! subscriptions, peer-credential roles and isolation between clients.
//!
//! The server under test is `vmhost::rpc::server::serve` with a small dispatcher built here
//! (not the daemon's real methods), so these tests pin the transport alone. Peers other than root
//! are real processes: the test binary re-executes itself as uid/gid 65534 (`run_as_nobody`),
//! and the dedicated test `child_client` then acts as the client.

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use vmhost::api::{self, Code, Event, VmStatus};
use vmhost::client::{Client, ClientError};
use vmhost::rpc::auth::AccessPolicy;
use vmhost::rpc::dispatch::{Access, Body, Dispatcher, Handler};
use vmhost::rpc::methods::parse_params;
use vmhost::rpc::server::{bind, serve, MAX_IN_FLIGHT, MAX_LINE};

/// Counters the test methods keep, to observe side effects and task ends.
#[derive(Default)]
struct Ctx {
    /// Calls of `vm.create`, notifications included.
    creates: AtomicUsize,
    /// Subscription tasks still running.
    live_subscriptions: AtomicUsize,
    /// Set when a flood subscription ended because its connection went away.
    flood_ended: AtomicBool,
}

/// Decrements `live_subscriptions` when a subscription task ends, however it ends.
struct Live(Arc<Ctx>);

impl Live {
    fn new(ctx: Arc<Ctx>) -> Live {
        ctx.live_subscriptions.fetch_add(1, Ordering::SeqCst);
        Live(ctx)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live_subscriptions.fetch_sub(1, Ordering::SeqCst);
    }
}

fn event(i: u32) -> Event {
    Event {
        vm: format!("vm{i}"),
        from: None,
        to: Some(VmStatus::Running),
        reason: "test".into(),
        time: api::now_rfc3339(),
        guest: None,
        capture: None,
        migration: None,
    }
}

/// The params as JSON (`null` when absent).
fn echo(raw: Option<&serde_json::value::RawValue>) -> Value {
    raw.and_then(|r| serde_json::from_str(r.get()).ok()).unwrap_or(Value::Null)
}

/// `vm.list` (read) echoes its params; `vm.get` (read) sleeps `ms` and says so; `vm.create`
/// (mutating) counts and echoes; `events.subscribe` sends two events then waits to be closed;
/// `test.flood` sends notifications as fast as it can.
fn module(ctx: Arc<Ctx>) -> Dispatcher {
    let mut d = Dispatcher::new();
    d.add(
        "vm.list",
        Access::Read,
        Handler::Call(Arc::new(|raw, _| {
            let params = echo(raw);
            Ok(Box::pin(async move { Body::json(&json!({"echo": params})) }))
        })),
    )
    .unwrap();
    d.add(
        "vm.get",
        Access::Read,
        Handler::Call(Arc::new(|raw, _| {
            #[derive(serde::Deserialize)]
            struct Sleep {
                ms: u64,
            }
            let sleep: Sleep = parse_params(raw)?;
            Ok(Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(sleep.ms)).await;
                Body::json(&json!({"slept": sleep.ms}))
            }))
        })),
    )
    .unwrap();
    let creates = Arc::clone(&ctx);
    d.add(
        "vm.create",
        Access::Write,
        Handler::Call(Arc::new(move |raw, _| {
            creates.creates.fetch_add(1, Ordering::SeqCst);
            let params = echo(raw);
            Ok(Box::pin(async move { Body::json(&params) }))
        })),
    )
    .unwrap();
    let events = Arc::clone(&ctx);
    d.add(
        "events.subscribe",
        Access::Read,
        Handler::Subscribe {
            notification: api::EVENT_NOTIFICATION,
            open: Arc::new(move |sink| {
                let live = Live::new(Arc::clone(&events));
                Box::pin(async move {
                    let _live = live;
                    for i in 0..2 {
                        if sink.send(&event(i)).await.is_err() {
                            return;
                        }
                    }
                    sink.closed().await;
                })
            }),
        },
    )
    .unwrap();
    d.add("events.unsubscribe", Access::Read, Handler::Unsubscribe).unwrap();
    let flood = Arc::clone(&ctx);
    d.add(
        "test.flood",
        Access::Read,
        Handler::Subscribe {
            notification: "test.flooded",
            open: Arc::new(move |sink| {
                let ctx = Arc::clone(&flood);
                let live = Live::new(Arc::clone(&ctx));
                Box::pin(async move {
                    let _live = live;
                    for i in 0..1_000_000u32 {
                        if sink.send(&i).await.is_err() {
                            ctx.flood_ended.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                })
            }),
        },
    )
    .unwrap();
    d
}

/// A server on a temp socket, run by its own runtime; stops when dropped.
struct Server {
    ctx: Arc<Ctx>,
    path: PathBuf,
    stop: watch::Sender<bool>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

fn start(policy: AccessPolicy) -> Server {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    // Traversable for the uid-65534 child peers.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("vmhost.sock");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = {
        let _guard = rt.enter();
        bind(&path, 0o666).unwrap()
    };
    let ctx = Arc::new(Ctx::default());
    let (stop, stopped) = watch::channel(false);
    let dispatcher = Arc::new(module(Arc::clone(&ctx)));
    let handle = rt.spawn(serve(listener, dispatcher, Arc::new(policy), stopped));
    Server { ctx, path, stop, handle: Some(handle), rt, _dir: dir }
}

impl Server {
    fn client(&self) -> Client {
        let mut client = Client::connect(&self.path).unwrap();
        client.set_timeout(Duration::from_secs(20)).unwrap();
        client
    }

    fn raw(&self) -> UnixStream {
        let stream = UnixStream::connect(&self.path).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn admin_policy() -> AccessPolicy {
    // Tests run as root, which is always admin; the gids are irrelevant for root.
    AccessPolicy { admin_gid: None, readonly_gid: None }
}

/// Waits until `check` holds, for at most `limit`.
fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

fn code(v: &Value) -> i64 {
    v["error"]["code"].as_i64().unwrap_or_else(|| panic!("not an error: {v}"))
}

#[test]
fn single_call_and_typed_client() {
    let server = start(admin_policy());
    let mut client = server.client();
    let got: Value = client.call("vm.list", json!({"a": 1})).unwrap();
    assert_eq!(got, json!({"echo": {"a": 1}}));
    let raw = client.call_raw(r#"{"jsonrpc":"2.0","id":"x-1","method":"vm.list"}"#).unwrap();
    assert_eq!(raw, vec![json!({"jsonrpc": "2.0", "id": "x-1", "result": {"echo": null}})]);
    // Ids are echoed verbatim, whatever number form they take.
    let raw = client.call_raw(r#"{"jsonrpc":"2.0","id":-2.5,"method":"vm.list"}"#).unwrap();
    assert_eq!(raw[0]["id"], json!(-2.5));
    let raw = client.call_raw("{\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"vm.list\"}\r\n").unwrap();
    assert_eq!(raw[0]["id"], Value::Null);
    assert_eq!(raw[0]["result"], json!({"echo": null}));
}

#[test]
fn batch_with_valid_invalid_and_notification_elements() {
    let server = start(admin_policy());
    let mut client = server.client();
    let answers = client
        .call_raw(
            r#"[{"jsonrpc":"2.0","id":1,"method":"vm.list","params":[7]},
                {"foo":"bar"},
                {"jsonrpc":"2.0","method":"vm.create","params":{"n":1}},
                1,
                {"jsonrpc":"2.0","id":"c","method":"vm.create","params":{"n":2}},
                {"jsonrpc":"2.0","id":3,"method":"no.such"}]"#
                .replace('\n', " ")
                .as_str(),
        )
        .unwrap();
    assert_eq!(answers.len(), 5, "{answers:?}");
    assert_eq!(answers[0], json!({"jsonrpc": "2.0", "id": 1, "result": {"echo": [7]}}));
    assert_eq!((code(&answers[1]), &answers[1]["id"]), (-32600, &Value::Null));
    assert_eq!((code(&answers[2]), &answers[2]["id"]), (-32600, &Value::Null));
    assert_eq!(answers[3], json!({"jsonrpc": "2.0", "id": "c", "result": {"n": 2}}));
    assert_eq!((code(&answers[4]), &answers[4]["id"]), (-32601, &json!(3)));
    // The notification ran, without an answer.
    assert_eq!(server.ctx.creates.load(Ordering::SeqCst), 2);

    // A batch of notifications only is answered with nothing at all: the next line the client
    // sees is the answer to its next call.
    let mut raw = server.raw();
    raw.write_all(
        b"[{\"jsonrpc\":\"2.0\",\"method\":\"vm.list\"},{\"jsonrpc\":\"2.0\",\"method\":\"vm.create\"}]\n\
          {\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"vm.list\"}\n",
    )
    .unwrap();
    let mut lines = std::io::BufReader::new(raw.try_clone().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut lines, &mut line).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&line).unwrap()["id"], 9);
    assert!(eventually(Duration::from_secs(5), || server.ctx.creates.load(Ordering::SeqCst) == 3));

    // An empty batch is one -32600 object, not an array.
    raw.write_all(b"[]\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut lines, &mut line).unwrap();
    let answer: Value = serde_json::from_str(&line).unwrap();
    assert_eq!((code(&answer), &answer["id"]), (-32600, &Value::Null));
}

#[test]
fn requests_in_flight_are_answered_as_they_complete() {
    let server = start(admin_policy());
    let mut client = server.client();
    client
        .send_raw(
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"vm.get\",\"params\":{\"ms\":700}}\n\
              {\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"vm.get\",\"params\":{\"ms\":0}}\n",
        )
        .unwrap();
    let first: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
    let second: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
    assert_eq!((first["id"].clone(), second["id"].clone()), (json!(2), json!(1)));
    assert_eq!(second["result"], json!({"slept": 700}));
}

#[test]
fn requests_beyond_the_in_flight_limit_wait() {
    let server = start(admin_policy());
    let mut client = server.client();
    let count = MAX_IN_FLIGHT + 1;
    let mut burst = String::new();
    for id in 0..count {
        burst.push_str(&format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"vm.get\",\"params\":{{\"ms\":400}}}}\n"
        ));
    }
    let start = Instant::now();
    client.send_raw(burst.as_bytes()).unwrap();
    let mut seen = Vec::new();
    for _ in 0..count {
        let answer: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
        assert_eq!(answer["result"], json!({"slept": 400}), "{answer}");
        seen.push(answer["id"].as_u64().unwrap());
    }
    // The last request could only start once one of the first MAX_IN_FLIGHT had finished.
    assert!(start.elapsed() >= Duration::from_millis(800), "{:?}", start.elapsed());
    seen.sort_unstable();
    assert_eq!(seen, (0..count as u64).collect::<Vec<_>>());
}

#[test]
fn bad_input_gets_errors_and_the_connection_stays_usable() {
    let server = start(admin_policy());
    let mut client = server.client();
    let cases: [(&[u8], i64, Value); 7] = [
        (b"{\"jsonrpc\":\"2.0\",\"method\"\n", -32700, Value::Null),
        (b"\xff\xfe{}\n", -32700, Value::Null),
        (b"[1,\n", -32700, Value::Null),
        (b"\"just a string\"\n", -32600, Value::Null),
        (b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"vm.list\",\"extra\":1}\n", -32600, json!(4)),
        (b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"no.such.method\"}\n", -32601, json!(5)),
        (b"{\"jsonrpc\":\"2.0\",\"id\":6,\"method\":\"vm.get\",\"params\":{\"ms\":\"x\"}}\n", -32602, json!(6)),
    ];
    for (bytes, expected, id) in cases {
        client.send_raw(bytes).unwrap();
        let answer: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
        let shown = String::from_utf8_lossy(bytes);
        assert_eq!(code(&answer), expected, "{shown} -> {answer}");
        assert_eq!(answer["id"], id, "{shown} -> {answer}");
        // Still usable after each one.
        let got: Value = client.call("vm.list", Value::Null).unwrap();
        assert_eq!(got, json!({"echo": null}));
    }
    // Blank lines are ignored, not answered.
    client.send_raw(b"\n  \r\n").unwrap();
    let got: Value = client.call("vm.list", json!([1])).unwrap();
    assert_eq!(got, json!({"echo": [1]}));
    // The typed client maps errors to ApiError.
    match client.call::<Value>("no.such", Value::Null) {
        Err(ClientError::Api(e)) => assert_eq!(e.code, Code::MethodNotFound),
        other => panic!("{other:?}"),
    }
}

/// A valid vm.list request padded with spaces to exactly `len` bytes.
fn padded_request(len: usize) -> Vec<u8> {
    let mut line = br#"{"jsonrpc":"2.0","id":1,"method":"vm.list"}"#.to_vec();
    line.resize(len, b' ');
    line
}

#[test]
fn a_line_of_exactly_the_limit_is_served() {
    let server = start(admin_policy());
    let mut client = server.client();
    let mut line = padded_request(MAX_LINE);
    line.push(b'\n');
    client.send_raw(&line).unwrap();
    let answer: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
    assert_eq!(answer["result"], json!({"echo": null}));
}

#[test]
fn an_overlong_line_gets_one_error_then_eof() {
    let server = start(admin_policy());
    let mut client = server.client();
    let mut line = padded_request(MAX_LINE + 1);
    line.push(b'\n');
    client.send_raw(&line).unwrap();
    let answer: Value = serde_json::from_str(&client.read_raw_line().unwrap().unwrap()).unwrap();
    assert_eq!((code(&answer), &answer["id"]), (-32600, &Value::Null));
    assert_eq!(client.read_raw_line().unwrap(), None);
}

#[test]
fn an_endless_line_does_not_disturb_other_clients() {
    let server = start(admin_policy());
    let mut hog = server.raw();
    let writer = {
        let mut hog = hog.try_clone().unwrap();
        std::thread::spawn(move || {
            // Slowly, so the hog is connected and mid-line while the other client works.
            let chunk = vec![b'x'; 32 * 1024];
            let mut sent = 0usize;
            while hog.write_all(&chunk).is_ok() {
                sent += chunk.len();
                std::thread::sleep(Duration::from_millis(20));
            }
            sent
        })
    };
    let mut other = server.client();
    for i in 0..30 {
        let got: Value = other.call("vm.list", json!([i])).unwrap();
        assert_eq!(got, json!({"echo": [i]}));
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = writer.join().unwrap();
    assert!(sent > MAX_LINE, "the hog was cut off early: {sent} bytes");
    // The hog got its -32600 before being disconnected.
    let mut reply = String::new();
    let _ = hog.read_to_string(&mut reply);
    let first: Value = serde_json::from_str(reply.lines().next().unwrap_or("null")).unwrap();
    assert_eq!(code(&first), -32600);
    let got: Value = other.call("vm.list", Value::Null).unwrap();
    assert_eq!(got, json!({"echo": null}));
}

#[test]
fn subscriptions_deliver_events_and_end_with_the_connection() {
    let server = start(admin_policy());
    let mut client = server.client();
    let id = client.subscribe_events().unwrap();
    assert!(id.is_number() || id.is_string(), "{id}");
    let first = client.next_event(Duration::from_secs(10)).unwrap().unwrap();
    let second = client.next_event(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!((first.vm.as_str(), second.vm.as_str()), ("vm0", "vm1"));
    assert_eq!(first.to, Some(VmStatus::Running));
    // Calls keep working on a subscribed connection.
    let got: Value = client.call("vm.list", Value::Null).unwrap();
    assert_eq!(got, json!({"echo": null}));
    assert!(client.next_event(Duration::from_millis(200)).unwrap().is_none());
    assert!(client.unsubscribe_events().unwrap());
    assert!(eventually(Duration::from_secs(5), || server.ctx.live_subscriptions.load(Ordering::SeqCst) == 0));

    // A subscription opened in a batch: the batch answer names it, its events follow.
    let answers = client
        .call_raw(
            r#"[{"jsonrpc":"2.0","id":1,"method":"events.subscribe"},{"jsonrpc":"2.0","id":2,"method":"vm.list"}]"#,
        )
        .unwrap();
    assert!(answers[0]["result"].is_number(), "{answers:?}");
    assert_eq!(answers[1]["result"], json!({"echo": null}));
    let event = client.next_event(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(event.vm, "vm0");
    assert_eq!(server.ctx.live_subscriptions.load(Ordering::SeqCst), 1);
    // Closing the connection ends the subscription task.
    drop(client);
    assert!(eventually(Duration::from_secs(5), || server.ctx.live_subscriptions.load(Ordering::SeqCst) == 0));
}

#[test]
fn a_peer_that_does_not_read_is_dropped_alone() {
    let server = start(admin_policy());
    let mut sluggard = server.raw();
    sluggard.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"test.flood\"}\n").unwrap();
    // It never reads: the flood waits on its full write queue (bounded in bytes), and the server
    // drops it once a write has waited WRITE_TIMEOUT (30 s), which ends the flood.
    assert!(eventually(Duration::from_secs(60), || server.ctx.flood_ended.load(Ordering::SeqCst)));
    let mut other = server.client();
    let got: Value = other.call("vm.list", Value::Null).unwrap();
    assert_eq!(got, json!({"echo": null}));
    // What the sluggard can still read is a prefix of the flood, then the end.
    let mut all = Vec::new();
    let _ = sluggard.read_to_end(&mut all);
    let lines = all.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count();
    assert!(lines < 1_000_000, "{lines}");
    assert!(eventually(Duration::from_secs(5), || server.ctx.live_subscriptions.load(Ordering::SeqCst) == 0));
}

#[test]
fn shutdown_stops_accepting_and_answers_requests_in_flight() {
    let mut server = start(admin_policy());
    let mut busy = server.client();
    busy.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"vm.get\",\"params\":{\"ms\":500}}\n").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    server.stop.send(true).unwrap();
    let answer: Value = serde_json::from_str(&busy.read_raw_line().unwrap().unwrap()).unwrap();
    assert_eq!(answer["result"], json!({"slept": 500}));
    assert_eq!(busy.read_raw_line().unwrap(), None);
    let handle = server.handle.take().unwrap();
    let result = server.rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), handle).await });
    assert!(matches!(result, Ok(Ok(Ok(())))), "{result:?}");
    assert!(UnixStream::connect(&server.path).is_err());
}

// ---- peers that are not root -------------------------------------------------------------

const CHILD_SCENARIO: &str = "VMHOST_RPC_TEST_SCENARIO";
const CHILD_SOCKET: &str = "VMHOST_RPC_TEST_SOCKET";
const NOBODY: u32 = 65534;

/// Runs `child_client` in a copy of this test binary as uid/gid 65534, with `scenario`.
/// Returns false (after saying so) when not root, since only root can change uid.
fn run_as_nobody(scenario: &str, socket: &Path) -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("not root: skipping the {scenario} peer test");
        return false;
    }
    // A copy of this binary in a directory of the host's temp dir: the checkout may be in a
    // 0700 directory (a home, mktemp -d) that uid 65534 cannot enter to execute it.
    let copy_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(copy_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = copy_dir.path().join("rpc_protocol");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new(&exe)
        .args(["--exact", "child_client", "--nocapture", "--test-threads=1"])
        .env(CHILD_SCENARIO, scenario)
        .env(CHILD_SOCKET, socket)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{scenario} peer failed:\n{stdout}\n{stderr}");
    // Make sure the child really ran the scenario (and not zero tests).
    assert!(stdout.contains("1 passed"), "{scenario} peer ran nothing:\n{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("scenario {scenario} done")), "{stdout}");
    true
}

/// The client side of the non-root scenarios; does nothing unless started by `run_as_nobody`.
#[test]
fn child_client() {
    let Ok(scenario) = std::env::var(CHILD_SCENARIO) else {
        return;
    };
    let socket = std::env::var(CHILD_SOCKET).unwrap();
    assert_eq!(nix::unistd::geteuid().as_raw(), NOBODY);
    match scenario.as_str() {
        "readonly" => readonly_peer(&socket),
        "unauthorized" => unauthorized_peer(&socket),
        other => panic!("unknown scenario {other}"),
    }
    println!("scenario {scenario} done");
}

fn readonly_peer(socket: &str) {
    let mut client = Client::connect(socket).unwrap();
    client.set_timeout(Duration::from_secs(20)).unwrap();
    let got: Value = client.call("vm.list", json!([1])).unwrap();
    assert_eq!(got, json!({"echo": [1]}));
    match client.call::<Value>("vm.create", json!({"spec": {}})) {
        Err(ClientError::Api(e)) => {
            assert_eq!(e.code, Code::ReadOnly);
            assert!(e.message.contains("vm.create"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // Per element in a batch; unknown methods stay -32601.
    let answers = client
        .call_raw(
            r#"[{"jsonrpc":"2.0","id":1,"method":"vm.list"},{"jsonrpc":"2.0","id":2,"method":"vm.create"},{"jsonrpc":"2.0","id":3,"method":"no.such"}]"#,
        )
        .unwrap();
    assert_eq!(answers[0]["result"], json!({"echo": null}));
    assert_eq!((code(&answers[1]), &answers[1]["id"]), (1002, &json!(2)));
    assert_eq!(answers[1]["error"]["data"]["kind"], "read_only");
    assert_eq!((code(&answers[2]), &answers[2]["id"]), (-32601, &json!(3)));
    // A mutating notification is dropped silently.
    client.send_raw(b"{\"jsonrpc\":\"2.0\",\"method\":\"vm.create\"}\n").unwrap();
    // Subscribing is a read.
    client.subscribe_events().unwrap();
    let event = client.next_event(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(event.vm, "vm0");
}

fn unauthorized_peer(socket: &str) {
    // Without sending anything: one error line, then EOF.
    let mut raw = Client::connect(socket).unwrap();
    raw.set_timeout(Duration::from_secs(20)).unwrap();
    let line = raw.read_raw_line().unwrap().unwrap();
    let answer: Value = serde_json::from_str(&line).unwrap();
    assert_eq!((code(&answer), &answer["id"]), (1001, &Value::Null), "{answer}");
    assert_eq!(answer["error"]["data"]["kind"], "unauthorized");
    assert_eq!(raw.read_raw_line().unwrap(), None);
    // A typed call reports the refusal as an API error.
    let mut client = Client::connect(socket).unwrap();
    client.set_timeout(Duration::from_secs(20)).unwrap();
    match client.call::<Value>("vm.list", Value::Null) {
        Err(ClientError::Api(e)) => assert_eq!(e.code, Code::Unauthorized),
        other => panic!("{other:?}"),
    }
}

#[test]
fn readonly_peer_may_only_read() {
    // Unrelated admin gid; the read-only group is nobody's primary group.
    let server = start(AccessPolicy { admin_gid: Some(4_242_424), readonly_gid: Some(NOBODY) });
    if run_as_nobody("readonly", &server.path) {
        // The refused vm.create and the dropped notification never ran.
        assert_eq!(server.ctx.creates.load(Ordering::SeqCst), 0);
    }
}

#[test]
fn unauthorized_peer_is_refused() {
    let server = start(AccessPolicy { admin_gid: Some(4_242_424), readonly_gid: Some(4_242_425) });
    run_as_nobody("unauthorized", &server.path);
    // Root is still served by the same server.
    let got: Value = server.client().call("vm.list", Value::Null).unwrap();
    assert_eq!(got, json!({"echo": null}));
}
