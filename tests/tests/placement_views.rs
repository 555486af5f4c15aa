//! Placement as a real vmhostd reports and plans it, without starting a VM: `host.info`'s `numa`
//! and `cpus` from the host's sysfs and `[hardware] vm_cpus`, and `host.reconcile`'s dry run,
//! which places the VMs it would start (docs/api.md, "CPU and NUMA placement").

use serde_json::{json, Value};
use vmhost_tests::{HostOptions, TestHost};

/// Every CPU in a cpulist string.
fn cpus(list: &str) -> Vec<u32> {
    if list.is_empty() {
        return Vec::new();
    }
    list.split(',')
        .flat_map(|item| match item.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().unwrap()..=b.parse().unwrap()).collect::<Vec<_>>(),
            None => vec![item.parse().unwrap()],
        })
        .collect()
}

fn host() -> TestHost {
    TestHost::start(HostOptions { extra: "vm_cpus = \"1\"\n".into(), ..HostOptions::default() })
}

fn dry_run(host: &TestHost, vms: Vec<Value>) -> Vec<Value> {
    let r = host.call("host.reconcile", json!({ "vms": vms, "dry_run": true }));
    r["plan"].as_array().unwrap().clone()
}

fn spec(host: &TestHost, name: &str, extra: Value) -> Value {
    let mut s = host.kernel_spec(name);
    for (k, v) in extra.as_object().unwrap() {
        s[k] = v.clone();
    }
    s
}

#[test]
fn host_info_shows_the_nodes_and_the_cpus_by_use() {
    let host = host();
    let info = host.call("host.info", json!({}));
    let online = cpus(std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap().trim());
    assert_eq!(info["cpus"]["vm_cpus"], "1", "{info}");
    assert_eq!(info["cpus"]["shared_pool"], "1", "{info}");
    assert_eq!(info["cpus"]["dedicated"], json!([]), "{info}");
    let housekeeping = cpus(info["cpus"]["housekeeping"].as_str().unwrap());
    assert_eq!(housekeeping, online.iter().copied().filter(|&c| c != 1).collect::<Vec<_>>(), "{info}");
    let nodes = info["numa"].as_array().unwrap();
    assert!(!nodes.is_empty(), "{info}");
    let mut all: Vec<u32> = nodes.iter().flat_map(|n| cpus(n["cpus"].as_str().unwrap())).collect();
    all.sort_unstable();
    assert_eq!(all, online, "every online CPU is on a node: {info}");
    let with_1: Vec<&Value> = nodes.iter().filter(|n| cpus(n["cpus"].as_str().unwrap()).contains(&1)).collect();
    assert_eq!(with_1.len(), 1, "{info}");
    assert_eq!(with_1[0]["vm_cpus"], "1", "{info}");
    assert!(with_1[0]["memory_mib"].as_u64().unwrap() > 0, "{info}");
    assert!(with_1[0]["hugepages"].is_object() && with_1[0]["holders"] == json!([]), "{info}");
}

#[test]
fn a_dry_run_places_the_vms_it_would_start() {
    let host = host();
    let node_of_1 = host.call("host.info", json!({}))["numa"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| cpus(n["cpus"].as_str().unwrap()).contains(&1))
        .map(|n| n["node"].clone())
        .unwrap();
    // One dedicated VM takes the one vm_cpu; a second finds none left.
    let plan = dry_run(
        &host,
        vec![
            spec(&host, "a", json!({"cpu_policy": "dedicated"})),
            spec(&host, "b", json!({"cpu_policy": "dedicated"})),
        ],
    );
    let a = &plan[0]["placement"];
    assert_eq!((&a["policy"], &a["cpus"], &a["vcpus"]), (&json!("dedicated"), &json!("1"), &json!([1])), "{plan:?}");
    assert_eq!(a["nodes"], json!([node_of_1]), "{plan:?}");
    assert_eq!(plan[0]["error"], Value::Null, "{plan:?}");
    let e = &plan[1]["error"];
    assert_eq!((&e["code"], &e["data"]["field"]), (&json!(3002), &json!("spec.cpu")), "{plan:?}");
    assert_eq!(e["data"]["details"]["resource"], "cpu", "{plan:?}");
    assert_eq!(plan[1].get("placement"), None, "{plan:?}");
    // A shared VM floats over the shared pool; the reconcile changed nothing.
    let plan = dry_run(&host, vec![spec(&host, "s", json!({}))]);
    assert_eq!((&plan[0]["placement"]["policy"], &plan[0]["placement"]["cpus"]), (&json!("shared"), &json!("1")));
    assert_eq!(host.call("vm.list", json!({})), json!([]));
    // No such node; hugepages the pools do not have (none reserved here, or the size not
    // offered).
    let plan = dry_run(
        &host,
        vec![
            spec(&host, "n", json!({"cpu_policy": "dedicated", "numa": 7})),
            spec(&host, "h", json!({"hugepages": "1G", "memory_mib": 1024, "numa": "auto"})),
        ],
    );
    let e = &plan[0]["error"];
    assert_eq!((&e["code"], &e["data"]["field"]), (&json!(3001), &json!("spec.numa")), "{plan:?}");
    let e = &plan[1]["error"];
    assert_eq!(e["data"]["field"], "spec.hugepages", "{plan:?}");
    assert!(e["code"] == 3001 || e["data"]["details"]["available"] == 0, "{plan:?}");
    // A closed member: anything else is the params' error.
    let (code, _) = host.call_err("host.reconcile", json!({"vms": [spec(&host, "x", json!({"numa": "local"}))]}));
    assert_eq!(code, -32602);
}
