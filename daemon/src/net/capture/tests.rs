//! Unit tests of capture: the pure `plan` exhaustively, and `sync_with` against a fake kernel.
//! The real kernel is exercised by `netns_tests`.

use super::*;
use std::sync::Mutex;

const BOOT: &str = "boot-1";
const SRC: &str = "eth1";
const SRC_INDEX: u32 = 10;
const TAP_A: &str = "vmh0000000an0";
const TAP_B: &str = "vmh0000000bn0";
const A_INDEX: u32 = 20;
const B_INDEX: u32 = 21;

fn mon(vm: &str, tap: &str, direction: CaptureDirection) -> Monitor {
    Monitor { vm: vm.to_string(), nic: 0, source: SRC.to_string(), tap: tap.to_string(), direction }
}

fn both(vm: &str, tap: &str) -> Monitor {
    mon(vm, tap, CaptureDirection::Both)
}

/// A present source, not promiscuous, no clsact, both taps present.
fn seen() -> Observed {
    Observed {
        present: true,
        ifindex: SRC_INDEX,
        promisc: false,
        clsact: false,
        filters: Vec::new(),
        taps: [(TAP_A.to_string(), A_INDEX), (TAP_B.to_string(), B_INDEX), (SRC.to_string(), SRC_INDEX)]
            .into_iter()
            .collect(),
    }
}

fn id(hook: Hook, prio: u16) -> FilterId {
    FilterId { hook, prio, protocol: 3, handle: 1, kind: "bpf".to_string() }
}

/// The id the kernel gives a new bpf filter at `prio` among `filters`: the next free handle of
/// that priority (0: the kernel picks the priority, here one past the highest).
fn next_id(filters: &[FilterInfo], hook: Hook, prio: u16) -> FilterId {
    let prio = if prio == 0 { filters.iter().map(|f| f.id.prio).max().unwrap_or(0) + 1 } else { prio };
    let handle =
        filters.iter().filter(|f| f.id.hook == hook && f.id.prio == prio).map(|f| f.id.handle).max().unwrap_or(0) + 1;
    FilterId { handle, ..id(hook, prio) }
}

fn ours(hook: Hook, prio: u16, tap: &str, target: Option<u32>) -> FilterInfo {
    FilterInfo { id: id(hook, prio), cookie: Some(cookie(tap)), mirred_to: target, packets: 0 }
}

fn foreign(hook: Hook, prio: u16, cookie: Option<&[u8]>) -> FilterInfo {
    FilterInfo {
        id: FilterId { hook, prio, protocol: 3, handle: 0x800, kind: "u32".to_string() },
        cookie: cookie.map(<[u8]>::to_vec),
        mirred_to: Some(99),
        packets: 0,
    }
}

fn ledger(promisc_was: bool, clsact_made: bool) -> Ledger {
    Ledger { source: SRC.to_string(), ifindex: SRC_INDEX, boot_id: BOOT.to_string(), promisc_was, clsact_made }
}

fn run(desired: &[Monitor], seen: &Observed, ledger: Option<&Ledger>) -> Vec<Step> {
    let refs: Vec<&Monitor> = desired.iter().collect();
    plan(SRC, &refs, seen, ledger, BOOT)
}

/// What the kernel and the state dir look like after `steps`, as `sync` would leave them.
fn simulate(steps: &[Step], seen: &mut Observed, ledger: &mut Option<Ledger>) {
    for step in steps {
        match step {
            Step::WriteLedger(l) => *ledger = Some(l.clone()),
            Step::DropLedger => *ledger = None,
            Step::SetPromisc(on) => seen.promisc = *on,
            Step::AddClsact => seen.clsact = true,
            Step::DelClsact => {
                seen.clsact = false;
                seen.filters.clear();
            }
            Step::AddMirror { hook, prio, tap, target } => {
                assert!(seen.clsact, "a mirror before its qdisc: {steps:?}");
                let id = next_id(&seen.filters, *hook, *prio);
                seen.filters.push(FilterInfo { id, ..ours(*hook, 0, tap, Some(*target)) });
            }
            Step::DelFilter(id) => {
                let before = seen.filters.len();
                seen.filters.retain(|f| &f.id != id);
                assert_eq!(seen.filters.len() + 1, before, "deleted a filter that is not there: {id:?}");
            }
        }
    }
}

/// Plans, checks the order rules, applies, and checks a second plan has nothing to do.
fn converge(desired: &[Monitor], seen: &mut Observed, ledger: &mut Option<Ledger>) -> Vec<Step> {
    let steps = run(desired, seen, ledger.as_ref());
    check_order(&steps);
    simulate(&steps, seen, ledger);
    let again = run(desired, seen, ledger.as_ref());
    assert!(again.is_empty(), "not idempotent: after {steps:?} the plan is {again:?}");
    steps
}

/// The design's order: ledger written first, promisc, clsact, then filters; on removal filters,
/// clsact, promisc, and the ledger dropped last.
fn check_order(steps: &[Step]) {
    let rank = |s: &Step| match s {
        Step::WriteLedger(_) => 0,
        Step::SetPromisc(true) => 1,
        Step::AddClsact => 2,
        Step::DelFilter(_) | Step::AddMirror { .. } => 3,
        Step::DelClsact => 4,
        Step::SetPromisc(false) => 5,
        Step::DropLedger => 6,
    };
    let ranks: Vec<u8> = steps.iter().map(rank).collect();
    assert!(ranks.windows(2).all(|w| w[0] <= w[1]), "out of order: {steps:?}");
    let adds = steps.iter().any(|s| matches!(s, Step::AddMirror { .. } | Step::AddClsact | Step::SetPromisc(true)));
    if adds {
        assert!(
            matches!(steps.first(), Some(Step::WriteLedger(_)))
                || !steps.iter().any(|s| matches!(s, Step::WriteLedger(_)))
        );
    }
}

fn add(hook: Hook, tap: &str, target: u32) -> Step {
    add_at(hook, FIRST_PRIO, tap, target)
}

fn add_at(hook: Hook, prio: u16, tap: &str, target: u32) -> Step {
    Step::AddMirror { hook, prio, tap: tap.to_string(), target }
}

#[test]
fn cookies_round_trip_and_fit_the_kernel() {
    let tap = "vmh0123abcdn15";
    let c = cookie(tap);
    assert_eq!(c, b"vmhc0123abcdn15");
    assert!(c.len() <= 16);
    assert_eq!(parse_cookie(&c).as_deref(), Some(tap));
    assert_eq!(cookie(&"vmh".repeat(5)).len(), 16, "a 15-byte tap name makes a 16-byte cookie");
    for not_ours in [&b""[..], b"vmhc", b"vmh", b"VMHC1", b"xvmhc1", b"vmhc\xff\xfe", b"vmhc a", b"vmhc0123456789abc"] {
        assert_eq!(parse_cookie(not_ours), None, "{not_ours:?}");
    }
}

#[test]
fn monitor_state_names_and_serde() {
    for (state, name) in [
        (MonitorState::Attached, "attached"),
        (MonitorState::SourceMissing, "source_missing"),
        (MonitorState::TapMissing, "tap_missing"),
        (MonitorState::Failed("x".into()), "failed"),
    ] {
        assert_eq!(state.name(), name);
        let json = serde_json::to_value(&state).unwrap();
        let shown =
            json.as_str().map(str::to_string).or_else(|| json.as_object().map(|o| o.keys().next().unwrap().clone()));
        assert_eq!(shown.as_deref(), Some(name));
    }
}

#[test]
fn fresh_source_gets_ledger_promisc_clsact_then_mirrors_in_that_order() {
    let mut s = seen();
    let mut l = None;
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(
        steps,
        [
            Step::WriteLedger(ledger(false, true)),
            Step::SetPromisc(true),
            Step::AddClsact,
            add(Hook::Ingress, TAP_A, A_INDEX),
            add(Hook::Egress, TAP_A, A_INDEX),
        ]
    );
}

#[test]
fn a_source_already_promiscuous_with_a_qdisc_is_recorded_so_and_left_so() {
    let mut s = Observed { promisc: true, clsact: true, filters: vec![foreign(Hook::Ingress, 1, None)], ..seen() };
    let mut l = None;
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(
        steps,
        [
            Step::WriteLedger(ledger(true, false)),
            // The operator's filter holds priority 1: no room before it, the kernel picks.
            add_at(Hook::Ingress, 0, TAP_A, A_INDEX),
            add(Hook::Egress, TAP_A, A_INDEX)
        ]
    );
    let steps = converge(&[], &mut s, &mut l);
    assert_eq!(
        steps,
        [Step::DelFilter(id(Hook::Ingress, 2)), Step::DelFilter(id(Hook::Egress, FIRST_PRIO)), Step::DropLedger]
    );
    assert!(s.promisc && s.clsact, "promisc and the qdisc were there before: kept");
    assert_eq!(s.filters, [foreign(Hook::Ingress, 1, None)]);
}

#[test]
fn mirrors_go_before_every_other_filter_and_share_one_priority() {
    // An operator's filter that ends classification must not hide frames from a monitor: ours
    // go one priority before the lowest there, and later ones join ours (each continues).
    let operators = vec![foreign(Hook::Ingress, 7, None), foreign(Hook::Ingress, 9, None)];
    let mut s = Observed { clsact: true, filters: operators.clone(), ..seen() };
    let mut l = None;
    let steps = converge(&[mon("a", TAP_A, CaptureDirection::Ingress)], &mut s, &mut l);
    assert!(steps.contains(&add_at(Hook::Ingress, 6, TAP_A, A_INDEX)), "{steps:?}");
    let both_vms = [mon("a", TAP_A, CaptureDirection::Ingress), both("b", TAP_B)];
    let steps = converge(&both_vms, &mut s, &mut l);
    assert_eq!(steps, [add_at(Hook::Ingress, 6, TAP_B, B_INDEX), add(Hook::Egress, TAP_B, B_INDEX)]);
    let prios: Vec<(u16, u32)> =
        s.filters.iter().filter(|f| f.cookie.is_some()).map(|f| (f.id.prio, f.id.handle)).collect();
    assert_eq!(prios, [(6, 1), (6, 2), (FIRST_PRIO, 1)], "one priority for ours on a hook, a handle each");
    // A stale one of ours does not hold the priority for the new one.
    let prio = mirror_prio(&s, Hook::Ingress, &[id(Hook::Ingress, 6), FilterId { handle: 2, ..id(Hook::Ingress, 6) }]);
    assert_eq!(prio, 6, "one below the operator's 7 again");
    converge(&[], &mut s, &mut l);
    assert_eq!(s.filters, operators, "the operator's filters stay");
}

#[test]
fn ingress_only_mirrors_one_hook_and_a_change_of_direction_drops_the_egress_mirror() {
    let mut s = seen();
    let mut l = None;
    let steps = converge(&[mon("a", TAP_A, CaptureDirection::Ingress)], &mut s, &mut l);
    assert_eq!(
        steps.iter().filter(|s| matches!(s, Step::AddMirror { .. })).collect::<Vec<_>>(),
        [&add(Hook::Ingress, TAP_A, A_INDEX)]
    );
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(steps, [add(Hook::Egress, TAP_A, A_INDEX)]);
    let steps = converge(&[mon("a", TAP_A, CaptureDirection::Ingress)], &mut s, &mut l);
    assert_eq!(steps, [Step::DelFilter(id(Hook::Egress, FIRST_PRIO))]);
}

#[test]
fn a_second_vm_on_the_same_source_adds_only_its_mirrors() {
    let mut s = seen();
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    let steps = converge(&[both("a", TAP_A), mon("b", TAP_B, CaptureDirection::Ingress)], &mut s, &mut l);
    assert_eq!(steps, [add(Hook::Ingress, TAP_B, B_INDEX)]);
    assert_eq!(l, Some(ledger(false, true)), "the ledger is written once, by the first");
}

#[test]
fn one_of_two_leaving_removes_only_its_filters() {
    let mut s = seen();
    let mut l = None;
    converge(&[both("a", TAP_A), both("b", TAP_B)], &mut s, &mut l);
    let b_filters: Vec<FilterInfo> = s
        .filters
        .iter()
        .filter(|f| parse_cookie(f.cookie.as_deref().unwrap()).as_deref() == Some(TAP_B))
        .cloned()
        .collect();
    let steps = converge(&[both("b", TAP_B)], &mut s, &mut l);
    assert!(steps.iter().all(|s| matches!(s, Step::DelFilter(_))), "{steps:?}");
    assert_eq!(steps.len(), 2);
    assert_eq!(s.filters, b_filters);
    assert!(s.promisc && s.clsact && l.is_some());
}

#[test]
fn the_last_leaving_gives_everything_back_in_order() {
    let mut s = seen();
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    let steps = converge(&[], &mut s, &mut l);
    assert_eq!(
        steps,
        [
            Step::DelFilter(id(Hook::Ingress, FIRST_PRIO)),
            Step::DelFilter(id(Hook::Egress, FIRST_PRIO)),
            Step::DelClsact,
            Step::SetPromisc(false),
            Step::DropLedger,
        ]
    );
    assert_eq!(s, seen(), "the source is as it was");
    assert_eq!(l, None);
}

#[test]
fn giving_back_respects_each_ledger_fact() {
    // (promisc_was, clsact_made, foreign filter) -> DelClsact?, SetPromisc(false)?
    for promisc_was in [false, true] {
        for clsact_made in [false, true] {
            for with_foreign in [false, true] {
                let mut filters = vec![ours(Hook::Ingress, 1, TAP_A, Some(A_INDEX))];
                if with_foreign {
                    filters.push(foreign(Hook::Egress, 5, Some(b"someone")));
                }
                let s = Observed { promisc: true, clsact: true, filters, ..seen() };
                let steps = run(&[], &s, Some(&ledger(promisc_was, clsact_made)));
                check_order(&steps);
                let case =
                    format!("promisc_was {promisc_was} clsact_made {clsact_made} foreign {with_foreign}: {steps:?}");
                assert_eq!(steps.first(), Some(&Step::DelFilter(id(Hook::Ingress, 1))), "{case}");
                assert_eq!(steps.contains(&Step::DelClsact), clsact_made && !with_foreign, "{case}");
                assert_eq!(steps.contains(&Step::SetPromisc(false)), !promisc_was, "{case}");
                assert_eq!(steps.last(), Some(&Step::DropLedger), "{case}");
                assert!(!steps.contains(&Step::DelFilter(foreign(Hook::Egress, 5, None).id)), "{case}");
            }
        }
    }
}

#[test]
fn foreign_filters_are_never_touched() {
    let strangers = vec![
        foreign(Hook::Ingress, 1, None),
        foreign(Hook::Egress, 2, Some(b"vmh")),
        foreign(Hook::Ingress, 3, Some(b"tc-user")),
        foreign(Hook::Egress, 4, Some(b"")),
    ];
    let ids: Vec<FilterId> = strangers.iter().map(|f| f.id.clone()).collect();
    for desired in [vec![], vec![both("a", TAP_A)], vec![mon("b", TAP_B, CaptureDirection::Ingress)]] {
        for l in [None, Some(ledger(false, true)), Some(ledger(true, false))] {
            let s = Observed { clsact: true, promisc: true, filters: strangers.clone(), ..seen() };
            let steps = run(&desired, &s, l.as_ref());
            for step in &steps {
                if let Step::DelFilter(id) = step {
                    assert!(!ids.contains(id), "{step:?} in {steps:?}");
                }
                assert_ne!(step, &Step::DelClsact, "a qdisc with foreign filters stays: {steps:?}");
            }
        }
    }
}

#[test]
fn stale_filters_of_ours_are_removed_and_the_wanted_one_remade() {
    let s = Observed {
        clsact: true,
        promisc: true,
        filters: vec![
            ours(Hook::Ingress, 1, TAP_A, Some(0)),            // its tap is gone: target 0
            ours(Hook::Ingress, 2, "vmh00000099n0", Some(30)), // a tap nobody wants (VM gone)
            ours(Hook::Egress, 3, TAP_A, Some(77)),            // the tap was re-made: another ifindex
            ours(Hook::Ingress, 4, TAP_B, None),               // no mirred action at all
        ],
        ..seen()
    };
    let steps = run(&[both("a", TAP_A)], &s, Some(&ledger(false, true)));
    assert_eq!(
        steps,
        [
            Step::DelFilter(id(Hook::Ingress, 1)),
            Step::DelFilter(id(Hook::Ingress, 2)),
            Step::DelFilter(id(Hook::Egress, 3)),
            Step::DelFilter(id(Hook::Ingress, 4)),
            add(Hook::Ingress, TAP_A, A_INDEX),
            add(Hook::Egress, TAP_A, A_INDEX),
        ]
    );
    let mut s = s;
    let mut l = Some(ledger(false, true));
    converge(&[both("a", TAP_A)], &mut s, &mut l);
}

#[test]
fn a_duplicate_mirror_of_ours_is_removed() {
    let s = Observed {
        clsact: true,
        promisc: true,
        filters: vec![ours(Hook::Ingress, 1, TAP_A, Some(A_INDEX)), ours(Hook::Ingress, 2, TAP_A, Some(A_INDEX))],
        ..seen()
    };
    let steps = run(&[mon("a", TAP_A, CaptureDirection::Ingress)], &s, Some(&ledger(false, true)));
    assert_eq!(steps, [Step::DelFilter(id(Hook::Ingress, 2))]);
}

#[test]
fn a_missing_source_only_drops_its_ledger() {
    let gone = Observed { present: false, ifindex: 0, ..Observed::default() };
    assert_eq!(run(&[both("a", TAP_A)], &gone, Some(&ledger(false, true))), [Step::DropLedger]);
    assert_eq!(run(&[both("a", TAP_A)], &gone, None), []);
    assert_eq!(run(&[], &gone, Some(&ledger(true, false))), [Step::DropLedger]);
    // Back again: attached afresh, as found now.
    let mut s = seen();
    let mut l = None;
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(steps.first(), Some(&Step::WriteLedger(ledger(false, true))));
}

#[test]
fn a_ledger_of_another_boot_or_link_is_dropped_without_touching_the_link() {
    let s = Observed { promisc: true, clsact: true, filters: vec![foreign(Hook::Ingress, 1, None)], ..seen() };
    let other_boot = Ledger { boot_id: "boot-0".to_string(), ..ledger(false, true) };
    let other_link = Ledger { ifindex: SRC_INDEX + 1, ..ledger(false, true) };
    for old in [&other_boot, &other_link] {
        assert_eq!(run(&[], &s, Some(old)), [Step::DropLedger], "{old:?}");
        // Monitored: a new ledger replaces it, recording what is there now.
        let steps = run(&[both("a", TAP_A)], &s, Some(old));
        assert_eq!(steps.first(), Some(&Step::WriteLedger(ledger(true, false))), "{steps:?}");
        assert!(!steps.contains(&Step::DropLedger) && !steps.contains(&Step::SetPromisc(false)));
    }
}

#[test]
fn a_promiscuous_flag_found_set_is_never_cleared() {
    // The operator (or a boot script) set it before we came: the ledger says so.
    let mut s = Observed { promisc: true, ..seen() };
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(l.as_ref().map(|l| l.promisc_was), Some(true));
    let steps = converge(&[], &mut s, &mut l);
    assert!(!steps.contains(&Step::SetPromisc(false)), "{steps:?}");
    assert!(s.promisc);
}

#[test]
fn a_promiscuous_flag_cleared_while_monitored_is_set_again() {
    let mut s = seen();
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    s.promisc = false;
    assert_eq!(converge(&[both("a", TAP_A)], &mut s, &mut l), [Step::SetPromisc(true)]);
    assert_eq!(l, Some(ledger(false, true)), "the ledger keeps what was there before us");
}

#[test]
fn what_the_operator_took_meanwhile_and_vmhost_sets_again_is_recorded_first_and_given_back() {
    // Found promiscuous with a qdisc: neither is vmhost's...
    let mut s = Observed { promisc: true, clsact: true, ..seen() };
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(l, Some(ledger(true, false)));
    // ...then the operator clears the flag and deletes the qdisc (our filters go with it).
    s.promisc = false;
    s.clsact = false;
    s.filters.clear();
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(steps[..3], [Step::WriteLedger(ledger(false, true)), Step::SetPromisc(true), Step::AddClsact]);
    converge(&[], &mut s, &mut l);
    assert_eq!(s, seen(), "what vmhost set again is given back");
}

#[test]
fn a_lost_ledger_still_removes_our_filters_but_nothing_else() {
    let mut s = seen();
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    let mut l = None; // the ledger file was deleted
    let steps = converge(&[], &mut s, &mut l);
    assert_eq!(steps, [Step::DelFilter(id(Hook::Ingress, FIRST_PRIO)), Step::DelFilter(id(Hook::Egress, FIRST_PRIO))]);
    assert!(s.promisc && s.clsact, "without a ledger nothing says they were ours");
}

#[test]
fn crashes_between_steps_converge() {
    // Every prefix of the first attach, then the plan for "attached" and for "given back".
    let full = run(&[both("a", TAP_A)], &seen(), None);
    for cut in 0..=full.len() {
        for desired in [vec![both("a", TAP_A)], vec![]] {
            let mut s = seen();
            let mut l = None;
            simulate(&full[..cut], &mut s, &mut l);
            converge(&desired, &mut s, &mut l);
            if desired.is_empty() {
                assert_eq!(s, seen(), "cut {cut}: given back as found");
                assert_eq!(l, None);
            }
        }
    }
    // Every prefix of a give-back, then the plan again.
    let mut attached = seen();
    let mut l = None;
    converge(&[both("a", TAP_A)], &mut attached, &mut l);
    let back = run(&[], &attached, l.as_ref());
    for cut in 0..=back.len() {
        let mut s = attached.clone();
        let mut l2 = l.clone();
        simulate(&back[..cut], &mut s, &mut l2);
        converge(&[], &mut s, &mut l2);
        assert_eq!(s, seen(), "give-back cut {cut}");
        assert_eq!(l2, None);
    }
}

#[test]
fn a_missing_tap_gets_no_mirror_and_other_sources_monitors_are_ignored() {
    let mut s = Observed { taps: BTreeMap::new(), ..seen() };
    let mut l = None;
    // A VM still listed as live whose taps are gone (an undone start, a stop without QEMU)
    // holds nothing: the source is not taken, or taken back after a give-back.
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert_eq!(steps, []);
    let mut s = seen();
    converge(&[both("a", TAP_A)], &mut s, &mut l);
    s.taps.clear();
    let steps = converge(&[both("a", TAP_A)], &mut s, &mut l);
    assert!(steps.contains(&Step::SetPromisc(false)) && steps.last() == Some(&Step::DropLedger), "{steps:?}");
    let elsewhere = Monitor { source: "eth9".to_string(), ..both("b", TAP_B) };
    assert_eq!(run(&[elsewhere], &seen(), None), []);
}

// ---- sync against a fake kernel ----

#[tokio::test]
async fn a_source_name_the_kernel_would_refuse_is_failed_and_writes_nothing() {
    let (d, cap) = capture();
    let fake = fake_host();
    let bad = Monitor { source: "../x".into(), ..both("a", TAP_A) };
    let report = cap.sync_with(&fake, &[bad]).await;
    assert!(matches!(&report.monitors[0].1, MonitorState::Failed(e) if e.contains("invalid link name")), "{report:?}");
    assert_eq!(fake.k().changes, 0);
    assert!(!d.path().join("x.json").exists() && !d.path().join("capture").exists());
}

#[derive(Default)]
struct Kernel {
    links: Vec<LinkState>,
    clsact: BTreeSet<u32>,
    filters: BTreeMap<u32, Vec<FilterInfo>>,
    changes: usize,
    fail_mirror: bool,
    /// `add_mirror` into this target fails (a tap that vanished meanwhile).
    fail_target: Option<u32>,
}

#[derive(Default)]
struct Fake(Mutex<Kernel>);

impl Fake {
    fn with_links(links: &[(&str, u32, bool)]) -> Fake {
        let k = Kernel {
            links: links.iter().map(|&(n, i, p)| LinkState { index: i, name: n.to_string(), promisc: p }).collect(),
            ..Kernel::default()
        };
        Fake(Mutex::new(k))
    }
    fn k(&self) -> std::sync::MutexGuard<'_, Kernel> {
        self.0.lock().unwrap()
    }
}

fn gone(what: u32) -> NetError {
    NetError::NotFound(format!("link #{what}"))
}

impl TcOps for Fake {
    async fn links(&self) -> Result<Vec<LinkState>, NetError> {
        Ok(self.k().links.clone())
    }
    async fn clsact_links(&self) -> Result<BTreeSet<u32>, NetError> {
        Ok(self.k().clsact.clone())
    }
    async fn add_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        let mut k = self.k();
        k.changes += 1;
        if !k.clsact.insert(ifindex) {
            return Err(NetError::Exists("clsact".into()));
        }
        Ok(())
    }
    async fn del_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        let mut k = self.k();
        k.changes += 1;
        k.filters.remove(&ifindex);
        if !k.clsact.remove(&ifindex) {
            return Err(gone(ifindex));
        }
        Ok(())
    }
    async fn filters(&self, ifindex: u32, hook: Hook) -> Result<Vec<FilterInfo>, NetError> {
        let k = self.k();
        Ok(k.filters.get(&ifindex).into_iter().flatten().filter(|f| f.id.hook == hook).cloned().collect())
    }
    async fn add_mirror(
        &self,
        ifindex: u32,
        hook: Hook,
        prio: u16,
        target: u32,
        cookie: &[u8],
    ) -> Result<FilterId, NetError> {
        let mut k = self.k();
        k.changes += 1;
        if k.fail_mirror || k.fail_target == Some(target) {
            return Err(NetError::Unexpected("refused".into()));
        }
        if !k.clsact.contains(&ifindex) {
            return Err(gone(ifindex));
        }
        let list = k.filters.entry(ifindex).or_default();
        let f = FilterInfo {
            id: next_id(list, hook, prio),
            cookie: Some(cookie.to_vec()),
            mirred_to: Some(target),
            packets: 0,
        };
        list.push(f.clone());
        Ok(f.id)
    }
    async fn del_filter(&self, ifindex: u32, id: &FilterId) -> Result<(), NetError> {
        let mut k = self.k();
        k.changes += 1;
        let list = k.filters.entry(ifindex).or_default();
        let before = list.len();
        list.retain(|f| &f.id != id);
        if list.len() == before {
            return Err(gone(ifindex));
        }
        Ok(())
    }
    async fn set_promisc(&self, ifindex: u32, on: bool) -> Result<(), NetError> {
        let mut k = self.k();
        k.changes += 1;
        let link = k.links.iter_mut().find(|l| l.index == ifindex).ok_or_else(|| gone(ifindex))?;
        link.promisc = on;
        Ok(())
    }
}

fn capture() -> (tempfile::TempDir, Capture) {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("run")).unwrap();
    let c = Capture::new(d.path(), &d.path().join("run"));
    (d, c)
}

fn states(report: &SyncReport) -> Vec<&'static str> {
    report.monitors.iter().map(|(_, s)| s.name()).collect()
}

fn fake_host() -> Fake {
    Fake::with_links(&[(SRC, SRC_INDEX, false), (TAP_A, A_INDEX, false), (TAP_B, B_INDEX, false), ("eth2", 11, false)])
}

#[tokio::test]
async fn sync_attaches_is_idempotent_and_gives_back() {
    let (d, cap) = capture();
    let fake = fake_host();
    let want = [both("a", TAP_A), mon("b", TAP_B, CaptureDirection::Ingress)];
    let report = cap.sync_with(&fake, &want).await;
    assert_eq!(states(&report), ["attached", "attached"]);
    assert_eq!(report.sources, [SourceReport { source: SRC.into(), present: true, promisc: true, vmhost_filters: 3 }]);
    let path = ledger::path_of(&d.path().join("capture"), SRC);
    assert!(path.exists());
    assert_eq!(fake.k().filters[&SRC_INDEX].len(), 3);

    let changes = fake.k().changes;
    let again = cap.sync_with(&fake, &want).await;
    assert_eq!(again, report);
    assert_eq!(fake.k().changes, changes, "a second sync changes nothing");

    let report = cap.sync_with(&fake, &[]).await;
    assert!(report.monitors.is_empty());
    assert_eq!(report.sources, [SourceReport { source: SRC.into(), present: true, promisc: false, vmhost_filters: 0 }]);
    {
        let k = fake.k();
        assert!(k.clsact.is_empty() && k.links.iter().all(|l| !l.promisc));
    }
    assert!(!path.exists(), "the ledger goes last");
    let changes = fake.k().changes;
    assert!(cap.sync_with(&fake, &[]).await.sources.is_empty());
    assert_eq!(fake.k().changes, changes);
}

#[tokio::test]
async fn sync_reports_missing_source_and_tap_and_reattaches_a_returning_source() {
    let (d, cap) = capture();
    let fake = fake_host();
    let want = [both("a", TAP_A)];
    cap.sync_with(&fake, &want).await;
    // The source goes (its filters and qdisc with it); the tap of b never existed.
    {
        let mut k = fake.k();
        k.links.retain(|l| l.name != SRC);
        k.clsact.remove(&SRC_INDEX);
        k.filters.remove(&SRC_INDEX);
    }
    let want2 = [both("a", TAP_A), both("c", "vmh000000ccn0")];
    let report = cap.sync_with(&fake, &want2).await;
    assert_eq!(states(&report), ["source_missing", "source_missing"]);
    assert!(!ledger::path_of(&d.path().join("capture"), SRC).exists(), "a gone source's ledger is dropped");
    // Back with another ifindex.
    fake.k().links.push(LinkState { index: 40, name: SRC.into(), promisc: false });
    let report = cap.sync_with(&fake, &want2).await;
    assert_eq!(states(&report), ["attached", "tap_missing"]);
    {
        let k = fake.k();
        assert_eq!(k.filters[&40].len(), 2);
        assert!(k.filters[&40].iter().all(|f| f.mirred_to == Some(A_INDEX)));
    }
    let l = ledger::read_all(&d.path().join("capture"));
    assert_eq!(l.ok[SRC].ifindex, 40);
}

#[tokio::test]
async fn a_restarted_daemon_gives_back_what_the_previous_one_set() {
    let (d, cap) = capture();
    let fake = fake_host();
    cap.sync_with(&fake, &[both("a", TAP_A)]).await;
    drop(cap);
    // The VM died with the daemon: its tap is gone, the mirrors point at ifindex 0.
    {
        let mut k = fake.k();
        k.links.retain(|l| l.name != TAP_A);
        for f in k.filters.values_mut().flatten() {
            f.mirred_to = Some(0);
        }
    }
    let cap = Capture::new(d.path(), &d.path().join("run"));
    let report = cap.sync_with(&fake, &[]).await;
    assert_eq!(report.sources, [SourceReport { source: SRC.into(), present: true, promisc: false, vmhost_filters: 0 }]);
    let k = fake.k();
    assert!(k.clsact.is_empty() && k.links.iter().all(|l| !l.promisc));
}

#[tokio::test]
async fn sync_removes_our_filters_on_any_link_without_a_ledger() {
    let (d, cap) = capture();
    let fake = fake_host();
    cap.sync_with(&fake, &[both("a", TAP_A)]).await;
    std::fs::remove_dir_all(d.path().join("capture")).unwrap();
    // Also an old mirror of ours on another link, next to a foreign one.
    {
        let mut k = fake.k();
        k.clsact.insert(11);
        k.filters.insert(11, vec![ours(Hook::Ingress, 1, TAP_B, Some(B_INDEX)), foreign(Hook::Ingress, 2, None)]);
    }
    let report = cap.sync_with(&fake, &[]).await;
    let k = fake.k();
    assert!(k.filters[&SRC_INDEX].is_empty());
    assert_eq!(k.filters[&11], [foreign(Hook::Ingress, 2, None)]);
    assert!(k.clsact.contains(&SRC_INDEX) && k.clsact.contains(&11), "no ledger: the qdiscs stay");
    assert!(k.links[0].promisc, "no ledger: the flag stays");
    assert_eq!(report.sources.iter().map(|s| s.source.as_str()).collect::<Vec<_>>(), ["eth1", "eth2"]);
}

#[tokio::test]
async fn sync_treats_a_torn_ledger_as_absent_and_removes_it() {
    let (d, cap) = capture();
    let fake = fake_host();
    let dir = d.path().join("capture");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(ledger::path_of(&dir, "eth2"), b"{\"sour").unwrap();
    let report = cap.sync_with(&fake, &[]).await;
    assert_eq!(report.sources.len(), 1);
    assert!(!ledger::path_of(&dir, "eth2").exists());
    assert_eq!(fake.k().changes, 0, "nothing on the link was touched");
    // Torn and monitored: replaced by a good one.
    std::fs::write(ledger::path_of(&dir, SRC), b"").unwrap();
    let report = cap.sync_with(&fake, &[both("a", TAP_A)]).await;
    assert_eq!(states(&report), ["attached"]);
    assert!(!ledger::read_all(&dir).ok[SRC].promisc_was);
}

#[tokio::test]
async fn a_failing_source_fails_its_monitors_only() {
    let (d, cap) = capture();
    let fake = fake_host();
    fake.k().fail_mirror = true;
    let other = Monitor { source: "eth2".into(), ..both("b", TAP_B) };
    let report = cap.sync_with(&fake, &[both("a", TAP_A), other.clone()]).await;
    assert!(matches!(&report.monitors[0].1, MonitorState::Failed(e) if e.contains("cannot mirror eth1")), "{report:?}");
    assert!(matches!(&report.monitors[1].1, MonitorState::Failed(_)));
    // The ledger was written first, so the next sync (after the kernel recovers) finishes, and
    // giving back is exact.
    assert!(ledger::path_of(&d.path().join("capture"), SRC).exists());
    fake.k().fail_mirror = false;
    let report = cap.sync_with(&fake, &[both("a", TAP_A)]).await;
    assert_eq!(states(&report), ["attached"]);
    cap.sync_with(&fake, &[]).await;
    let k = fake.k();
    assert!(k.clsact.is_empty() && k.links.iter().all(|l| !l.promisc), "eth2 given back too");
}

#[tokio::test]
async fn one_mirror_failing_fails_that_monitor_only() {
    // A starting VM's mirror cannot be made (its tap went): the VM already attached to the same
    // source stays attached, no false alarm for it.
    let (_d, cap) = capture();
    let fake = fake_host();
    let report = cap.sync_with(&fake, &[both("a", TAP_A)]).await;
    assert_eq!(states(&report), ["attached"]);
    fake.k().fail_target = Some(B_INDEX);
    let report = cap.sync_with(&fake, &[both("a", TAP_A), both("b", TAP_B)]).await;
    assert_eq!(report.monitors[0].1, MonitorState::Attached, "{report:?}");
    assert!(matches!(&report.monitors[1].1, MonitorState::Failed(e) if e.contains(TAP_B)), "{report:?}");
    fake.k().fail_target = None;
    let report = cap.sync_with(&fake, &[both("a", TAP_A), both("b", TAP_B)]).await;
    assert_eq!(states(&report), ["attached", "attached"]);
}

/// The lifecycle runs syncs in spawned tasks: the future must be `Send`.
#[allow(dead_code)]
fn sync_future_is_send(cap: &Capture, nl: &Netlink) {
    fn send<T: Send>(_: &T) {}
    send(&cap.sync(nl, &[]));
}
