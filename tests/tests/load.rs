//! Load: 64 concurrent clients making 1000 mixed calls each against a real vmhostd while another
//! client creates and destroys 4 real (TCG) VMs over and over. Every answer must be a success or
//! one of the refusals the call can legitimately get; the daemon's RSS before and after is printed
//! (not asserted: figures are for docs/performance.md, tests don't judge them).

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use vmhost::client::{Client, ClientError};
use vmhost_tests::{rss_kib, HostOptions, TestHost};

const CLIENTS: usize = 64;
const CALLS: usize = 1000;
const CHURNED: [&str; 4] = ["churn0", "churn1", "churn2", "churn3"];

/// Call `i` of a client: the method, its params, and the error codes it may legitimately get.
fn mixed_call(i: usize, steady: &Value) -> (&'static str, Value, &'static [i32]) {
    let churned = CHURNED[i % CHURNED.len()];
    match i % 8 {
        0 => ("vm.list", json!({}), &[]),
        1 => ("host.info", json!({}), &[]),
        2 => ("vm.get", json!({ "name": "steady" }), &[]),
        // A churned VM exists or not, depending on the moment.
        3 => ("vm.get", json!({ "name": churned }), &[4040]),
        // Mutations that must be refused without touching anything.
        4 => ("vm.destroy", json!({ "name": "never-created" }), &[4040]),
        5 => ("vm.create", json!({ "spec": {"name": "bad", "cpu": 0, "memory_mib": 256, "boot": {}} }), &[2001]),
        // A desired set, planned only.
        6 => ("host.reconcile", json!({ "vms": [steady], "dry_run": true }), &[]),
        // Applying the steady VM's own spec changes nothing; it may meet another client's apply.
        _ => ("vm.apply", json!({ "spec": steady }), &[4090]),
    }
}

#[test]
fn sixty_four_clients_and_vm_churn_get_only_expected_answers() {
    let host = TestHost::start(HostOptions::default());
    let steady = host.kernel_spec("steady");
    host.call("vm.create", json!({ "spec": steady }));
    let daemon = host.daemon_pid().expect("daemon pid");
    let rss_before = rss_kib(daemon);

    let done = Arc::new(AtomicBool::new(false));
    let churn = {
        let socket = host.socket.clone();
        let specs: Vec<Value> = CHURNED.iter().map(|n| host.kernel_spec(n)).collect();
        let done = done.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&socket).expect("connect churn client");
            let mut rounds = 0;
            while rounds == 0 || !done.load(Ordering::Relaxed) {
                for spec in &specs {
                    c.call::<Value>("vm.create", json!({ "spec": spec })).expect("churn create");
                }
                for spec in &specs {
                    c.call::<Value>("vm.destroy", json!({ "name": spec["name"] })).expect("churn destroy");
                }
                rounds += 1;
            }
            rounds
        })
    };

    let unexpected: Arc<Mutex<Vec<String>>> = Arc::default();
    let codes: Arc<Mutex<BTreeMap<i32, usize>>> = Arc::default();
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let socket = host.socket.clone();
            let steady = steady.clone();
            let (unexpected, codes) = (unexpected.clone(), codes.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket).expect("connect load client");
                for i in 0..CALLS {
                    let (method, params, allowed) = mixed_call(i + k, &steady);
                    match c.call::<Value>(method, params) {
                        Ok(_) => {}
                        Err(ClientError::Api(e)) if allowed.contains(&e.code.as_i32()) => {
                            *codes.lock().unwrap().entry(e.code.as_i32()).or_default() += 1;
                        }
                        Err(e) => unexpected.lock().unwrap().push(format!("client {k} call {i} {method}: {e}")),
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("load client panicked");
    }
    let elapsed = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let rounds = churn.join().expect("churn client panicked");
    let rss_after = rss_kib(daemon);

    let unexpected = unexpected.lock().unwrap();
    assert!(
        unexpected.is_empty(),
        "{} unexpected answers, first: {:?}",
        unexpected.len(),
        &unexpected[..5.min(unexpected.len())]
    );
    let codes = codes.lock().unwrap();
    assert!(codes.get(&2001).is_some_and(|n| *n > 0) && codes.get(&4040).is_some_and(|n| *n > 0), "{codes:?}");
    // Nothing leaked: the churned VMs are gone, the steady one still runs in its first QEMU.
    let list = host.call("vm.list", json!({}));
    let names: Vec<&str> = list.as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, vec!["steady"]);
    assert_eq!(host.qemu_pids().len(), 1, "only the steady VM's QEMU is left");
    eprintln!(
        "load: {CLIENTS} clients x {CALLS} calls in {:.1} s ({:.0} calls/s) with {rounds} create/destroy rounds of {} VMs; \
         refusals {codes:?}; vmhostd RSS {rss_before} KiB before, {rss_after} KiB after",
        elapsed.as_secs_f64(),
        (CLIENTS * CALLS) as f64 / elapsed.as_secs_f64(),
        CHURNED.len()
    );
}
