//! `Capture::sync` against the real kernel, each test in its own network namespace: a veth
//! pair is the source (frames are sent into its peer, or out of the source itself) and vmhost
//! taps read through their descriptors are the monitors.

use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use super::super::link::Netlink;
use super::super::tap::create_tap;
use super::super::testing::{self, in_netns};
use super::*;

const SRC: &str = "src0";
const PEER: &str = "peer0";
const TAP_A: &str = "vmh0000000an0";
const TAP_B: &str = "vmh0000000bn0";

/// Runs `CMD ARGS` as a fixture (links and filters the code under test must not make).
fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().expect("run fixture command");
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Output of `tc ARGS`.
fn tc_out(args: &[&str]) -> String {
    let out = Command::new("tc").args(args).output().expect("run tc");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The veth pair `src0`/`peer0`, both up.
fn make_source() {
    run("ip", &["link", "add", SRC, "type", "veth", "peer", "name", PEER]);
    run("ip", &["link", "set", SRC, "up"]);
    run("ip", &["link", "set", PEER, "up"]);
}

/// A vmhost-named tap, up, with its descriptor made non-blocking for [`wait_frame`].
async fn make_tap(nl: &Netlink, name: &str) -> OwnedFd {
    let fd = create_tap(name).unwrap();
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        assert!(libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) == 0);
    }
    let link = nl.link_by_name(name).await.unwrap().unwrap();
    nl.set_up(link.index).await.unwrap();
    fd
}

/// Sends one test frame out of `ifname`, carrying `marker`.
fn send_frame(ifname: &str, marker: &[u8]) {
    let frame =
        testing::test_frame([0x02, 0x11, 0x22, 0x33, 0x44, 0x55], [0x02, 0x66, 0x77, 0x88, 0x99, 0xaa], None, marker);
    testing::send_frame(ifname, &frame);
}

/// Reads the tap until a frame carrying `marker` arrives (true) or 5 s pass (false). The tap's
/// own stack may send other frames (IPv6 router solicitations); they are skipped.
fn wait_frame(tap: &OwnedFd, marker: &[u8]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        let mut pfd = libc::pollfd { fd: tap.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll and read on a descriptor we own, into a buffer of the given size.
        let n = unsafe {
            libc::poll(&mut pfd, 1, 100);
            libc::read(tap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
        };
        if n > 0 && buf[..n as usize].windows(marker.len()).any(|w| w == marker) {
            return true;
        }
    }
    false
}

/// Reads whatever the tap has queued, so a later [`wait_frame`] sees only new frames.
fn drain(tap: &OwnedFd) {
    let mut buf = [0u8; 2048];
    // SAFETY: a non-blocking read on a descriptor we own.
    while unsafe { libc::read(tap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
}

fn monitor(vm: &str, tap: &str, direction: CaptureDirection) -> Monitor {
    Monitor { vm: vm.into(), nic: 0, source: SRC.into(), tap: tap.into(), direction }
}

fn capture(dir: &std::path::Path) -> Capture {
    Capture::new(dir, dir)
}

async fn source(nl: &Netlink) -> LinkInfo {
    nl.link_by_name(SRC).await.unwrap().unwrap()
}

use super::super::link::LinkInfo;

/// Every filter on both hooks of `ifindex`.
async fn all_filters(nl: &Netlink, ifindex: u32) -> Vec<FilterInfo> {
    let mut f = nl.filters(ifindex, Hook::Ingress).await.unwrap();
    f.extend(nl.filters(ifindex, Hook::Egress).await.unwrap());
    f
}

#[test]
fn frames_reach_the_taps_a_second_sync_changes_nothing_and_removal_gives_back() {
    in_netns(|| async {
        let d = tempfile::tempdir().unwrap();
        let cap = capture(d.path());
        make_source();
        let nl = Netlink::connect().unwrap();
        let a = make_tap(&nl, TAP_A).await;
        let b = make_tap(&nl, TAP_B).await;
        let src = source(&nl).await;
        assert!(!src.promisc);
        assert!(!nl.has_clsact(src.index).await.unwrap());

        let want = [monitor("a", TAP_A, CaptureDirection::Both), monitor("b", TAP_B, CaptureDirection::Ingress)];
        let report = cap.sync(&nl, &want).await;
        assert_eq!(report.monitors.iter().map(|(_, s)| s.name()).collect::<Vec<_>>(), ["attached", "attached"]);
        assert!(source(&nl).await.promisc);
        let filters = all_filters(&nl, src.index).await;
        assert_eq!(filters.len(), 3, "{filters:?}");
        assert!(filters.iter().all(|f| f.cookie.as_deref().and_then(parse_cookie).is_some()));

        // What the source receives reaches both; what it sends only the `both` monitor.
        drain(&a);
        drain(&b);
        send_frame(PEER, b"capture-rx-1");
        assert!(wait_frame(&a, b"capture-rx-1"), "tap a got no copy of a received frame");
        assert!(wait_frame(&b, b"capture-rx-1"), "tap b got no copy of a received frame");
        send_frame(SRC, b"capture-tx-1");
        assert!(wait_frame(&a, b"capture-tx-1"), "tap a (both) got no copy of a sent frame");

        // A second sync adds nothing and removes nothing.
        let again = cap.sync(&nl, &want).await;
        assert_eq!(again, report);
        assert_eq!(
            all_filters(&nl, src.index).await.iter().map(|f| f.id.clone()).collect::<Vec<_>>(),
            filters.iter().map(|f| f.id.clone()).collect::<Vec<_>>()
        );

        // b leaves: its filter goes, a's stay.
        cap.sync(&nl, &want[..1]).await;
        let left = all_filters(&nl, src.index).await;
        assert_eq!(left.len(), 2);
        assert!(left.iter().all(|f| f.cookie.as_deref() == Some(&cookie(TAP_A)[..])));

        // The last leaves: filters, qdisc, flag and ledger all given back.
        let report = cap.sync(&nl, &[]).await;
        assert_eq!(
            report.sources,
            [SourceReport { source: SRC.into(), present: true, promisc: false, vmhost_filters: 0 }]
        );
        assert!(!source(&nl).await.promisc);
        assert!(!nl.has_clsact(src.index).await.unwrap());
        assert!(ledger::read_all(&d.path().join(ledger::DIR)).ok.is_empty());
        drain(&a);
        send_frame(PEER, b"capture-rx-2");
        assert!(!wait_frame(&a, b"capture-rx-2"), "a frame reached the tap after removal");
    });
}

#[test]
fn an_operators_promisc_qdisc_and_u32_filter_survive() {
    in_netns(|| async {
        let d = tempfile::tempdir().unwrap();
        let cap = capture(d.path());
        make_source();
        run("ip", &["link", "set", SRC, "promisc", "on"]);
        run("tc", &["qdisc", "add", "dev", SRC, "clsact"]);
        run(
            "tc",
            &["filter", "add", "dev", SRC, "ingress", "pref", "7", "protocol", "all", "u32", "match", "u32", "0", "0"],
        );
        let nl = Netlink::connect().unwrap();
        let a = make_tap(&nl, TAP_A).await;
        let src = source(&nl).await;
        let theirs = all_filters(&nl, src.index).await;
        assert!(!theirs.is_empty());

        let report = cap.sync(&nl, &[monitor("a", TAP_A, CaptureDirection::Both)]).await;
        assert_eq!(report.monitors[0].1, MonitorState::Attached);
        drain(&a);
        send_frame(PEER, b"capture-next-to-u32");
        assert!(wait_frame(&a, b"capture-next-to-u32"));

        cap.sync(&nl, &[]).await;
        let left = all_filters(&nl, src.index).await;
        assert_eq!(left.iter().map(|f| &f.id).collect::<Vec<_>>(), theirs.iter().map(|f| &f.id).collect::<Vec<_>>());
        assert!(nl.has_clsact(src.index).await.unwrap(), "the operator's qdisc stays");
        assert!(source(&nl).await.promisc, "the operator's promiscuous flag stays");
        assert!(tc_out(&["filter", "show", "dev", SRC, "ingress"]).contains("u32"));
    });
}

#[test]
fn a_foreign_filter_added_while_monitored_keeps_the_qdisc() {
    in_netns(|| async {
        let d = tempfile::tempdir().unwrap();
        let cap = capture(d.path());
        make_source();
        let nl = Netlink::connect().unwrap();
        let _a = make_tap(&nl, TAP_A).await;
        let src = source(&nl).await;
        cap.sync(&nl, &[monitor("a", TAP_A, CaptureDirection::Ingress)]).await;
        run(
            "tc",
            &["filter", "add", "dev", SRC, "egress", "pref", "9", "protocol", "all", "u32", "match", "u32", "0", "0"],
        );
        let theirs = nl.filters(src.index, Hook::Egress).await.unwrap();
        cap.sync(&nl, &[]).await;
        assert!(nl.has_clsact(src.index).await.unwrap(), "a qdisc with someone's filter on it stays");
        assert_eq!(all_filters(&nl, src.index).await, theirs);
        assert!(!source(&nl).await.promisc, "the flag was ours: given back");
    });
}

#[test]
fn a_source_deleted_and_recreated_is_attached_again() {
    in_netns(|| async {
        let d = tempfile::tempdir().unwrap();
        let cap = capture(d.path());
        make_source();
        let nl = Netlink::connect().unwrap();
        let a = make_tap(&nl, TAP_A).await;
        let want = [monitor("a", TAP_A, CaptureDirection::Both)];
        assert_eq!(cap.sync(&nl, &want).await.monitors[0].1, MonitorState::Attached);

        run("ip", &["link", "del", SRC]);
        let report = cap.sync(&nl, &want).await;
        assert_eq!(report.monitors[0].1, MonitorState::SourceMissing);
        assert!(ledger::read_all(&d.path().join(ledger::DIR)).ok.is_empty(), "the ledger of a gone link is dropped");

        make_source();
        let report = cap.sync(&nl, &want).await;
        assert_eq!(report.monitors[0].1, MonitorState::Attached);
        let src = source(&nl).await;
        assert!(src.promisc);
        drain(&a);
        send_frame(PEER, b"capture-after-recreate");
        assert!(wait_frame(&a, b"capture-after-recreate"));

        // The tap goes (its QEMU died): the filters pointing at it are ours and stale.
        drop(a);
        crate::net::testing::wait_link_gone(&nl, TAP_A).await;
        let report = cap.sync(&nl, &want).await;
        assert_eq!(report.monitors[0].1, MonitorState::TapMissing);
        assert!(all_filters(&nl, src.index).await.is_empty());
        cap.sync(&nl, &[]).await;
        assert!(!source(&nl).await.promisc);
        assert!(!nl.has_clsact(src.index).await.unwrap());
    });
}

#[test]
fn our_filters_without_a_ledger_are_removed_from_any_link() {
    in_netns(|| async {
        let d = tempfile::tempdir().unwrap();
        let cap = capture(d.path());
        make_source();
        let nl = Netlink::connect().unwrap();
        let _a = make_tap(&nl, TAP_A).await;
        let src = source(&nl).await;
        cap.sync(&nl, &[monitor("a", TAP_A, CaptureDirection::Both)]).await;
        std::fs::remove_dir_all(d.path().join(ledger::DIR)).unwrap();
        let report = cap.sync(&nl, &[]).await;
        assert_eq!(report.sources.len(), 1);
        assert!(all_filters(&nl, src.index).await.is_empty(), "the cookie alone identifies ours");
        // Nothing says the flag and qdisc were ours: left.
        assert!(source(&nl).await.promisc);
        assert!(nl.has_clsact(src.index).await.unwrap());
    });
}
