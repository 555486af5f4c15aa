//! Multiqueue NICs end to end: a real vmhostd in its own network namespace, a real multiqueue
//! tap, a real TCG guest whose virtio-net has two queue pairs (seen through `vm.exec`).
//!
//! This machine has no `/dev/vhost-net`: the VM runs virtio-net in QEMU's userspace, and
//! `vm.get` and `host.check` say so. vhost-net itself is proven in the lab (tests/tests/lab.rs).

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{agent_guest, argv_of, wait, HostOptions, TestHost, GUEST_READY, LAN_NETWORK};

#[test]
fn a_nic_with_two_queues_gives_the_guest_two_queue_pairs_without_vhost_net_here() {
    assert!(!std::path::Path::new("/dev/vhost-net").exists(), "this test expects a host without vhost-net");
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: format!("{LAN_NETWORK}\n[agent]\nallow_exec = true\n"),
        ..HostOptions::default()
    });
    let g = agent_guest();
    // Two vCPUs: Linux's virtio-net uses min(queue pairs, online CPUs) by default.
    let spec = json!({"name": "mq", "cpu": 2, "memory_mib": 256,
        "nics": [{"network": "lan", "queues": 2}, {"network": "lan"}],
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    let created = host.call("vm.create", json!({ "spec": spec }));
    let vm = &created["vm"];
    assert_eq!(vm["spec"]["nics"][0]["queues"], 2);
    assert!(vm["spec"]["nics"][1].get("queues").is_none(), "1 is left out: {}", vm["spec"]);
    let nics = host.call("vm.get", json!({"name": "mq"}))["nics"].clone();
    assert_eq!((nics[0]["queues"].clone(), nics[0]["vhost"].clone()), (json!(2), json!(false)), "{nics}");
    assert_eq!((nics[1]["queues"].clone(), nics[1]["vhost"].clone()), (json!(1), json!(false)), "{nics}");

    // host.check: ok overall as far as vhost goes, the item says why not.
    let check = host.call("host.check", json!({}));
    let item = check["items"].as_array().unwrap().iter().find(|i| i["name"] == "vhost_net").cloned();
    let item = item.expect("a vhost_net item");
    assert_eq!(item["status"], "ok");
    let detail = item["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("not usable, VMs run virtio-net in QEMU's userspace")
            && detail.contains("accel is tcg")
            && detail.contains("/dev/vhost-net does not exist"),
        "{detail}"
    );

    // Host side: one multiqueue tap with two queues, the other as before.
    // QEMU detaches the queues the guest's driver has not enabled yet (`numdisabled`).
    let tap = nics[0]["tap"].as_str().unwrap();
    let tun_queues = || -> (u32, u32) {
        let details = host.ip(&["-d", "link", "show", "dev", tap]);
        assert!(details.contains("multi_queue"), "{details}");
        let after = |word: &str| -> u32 {
            let mut it = details.split_whitespace().skip_while(|w| *w != word);
            it.nth(1).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{word}: {details}"))
        };
        (after("numqueues"), after("numdisabled"))
    };
    let (attached, disabled) = tun_queues();
    assert_eq!(attached + disabled, 2, "one tap descriptor per queue");
    let single = host.ip(&["-d", "link", "show", "dev", nics[1]["tap"].as_str().unwrap()]);
    assert!(!single.contains("multi_queue"), "{single}");

    // QEMU's side: two tap descriptors, no vhost, mq with 2*2+2 vectors.
    let pid = vm["pid"].as_i64().expect("running");
    let argv = argv_of(pid);
    let netdevs: Vec<&String> = argv.windows(2).filter(|w| w[0] == "-netdev").map(|w| &w[1]).collect();
    assert_eq!(netdevs.len(), 2, "{argv:?}");
    assert!(netdevs[0].starts_with("tap,id=net0,fds=") && netdevs[0].split(':').count() == 2, "{netdevs:?}");
    assert!(netdevs[1].starts_with("tap,id=net1,fd="), "{netdevs:?}");
    assert!(!argv.iter().any(|a| a.contains("vhost")), "{argv:?}");
    assert!(argv.iter().any(|a| a.starts_with("virtio-net-pci,netdev=net0,") && a.ends_with(",mq=on,vectors=6")));

    // Guest side: eth0 has two queue pairs, eth1 one.
    assert!(host.wait_serial("mq", GUEST_READY, Duration::from_secs(300)), "{}", host.serial("mq"));
    let ls = |dev: &str| -> Value {
        host.client()
            .call::<Value>("vm.exec", json!({"name": "mq", "argv": ["ls", format!("/sys/class/net/{dev}/queues")]}))
            .unwrap_or(Value::Null)
    };
    wait::until("the exec server to answer", Duration::from_secs(120), || match ls("eth0") {
        v if v["exit_code"] == 0 => Ok(()),
        other => Err(format!("{other}")),
    });
    let queues = |dev: &str| -> Vec<String> {
        let v = ls(dev);
        let mut q: Vec<String> =
            v["stdout"].as_str().unwrap_or_default().split_whitespace().map(String::from).collect();
        q.sort();
        q
    };
    assert_eq!(queues("eth0"), ["rx-0", "rx-1", "tx-0", "tx-1"]);
    assert_eq!(queues("eth1"), ["rx-0", "tx-0"]);
    // The guest's driver enabled both queue pairs: QEMU uses both of the tap's queues now.
    wait::until("both tap queues in use", Duration::from_secs(60), || match tun_queues() {
        (2, 0) => Ok(()),
        other => Err(format!("{other:?}")),
    });
}
