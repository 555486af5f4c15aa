//! The pure half of capture: what must change on one source for it to match what is wanted.
//!
//! [`super::Capture::sync`] collects an [`Observed`] per source (the kernel's view) and the
//! source's [`Ledger`] (what vmhostd changed on it), calls [`plan`] and applies the returned
//! [`Step`]s in order. Everything that decides *whether* to touch a link lives here, so it can
//! be tested exhaustively without a kernel.
//!
//! The rules, in the order the steps come out:
//! - a ledger from another boot or for another ifindex describes settings that died with that
//!   boot or link: it is dropped and the link is not touched on its behalf;
//! - a source that is gone keeps nothing: its ledger is dropped (the kernel took its filters);
//! - a monitored source gets its ledger written before anything else changes (what the
//!   promiscuous flag and the clsact qdisc were), then the flag, then clsact, then mirrors;
//! - our filters (action cookie, [`super::tap_of`]) that are not wanted, point at another
//!   ifindex than the tap has now, or at nothing, are deleted; any other filter is never touched;
//! - an unmonitored source is given back: our filters go, clsact goes only when we made it and
//!   nothing is left on it, the promiscuous flag is cleared only when it was clear before, and
//!   the ledger goes last.

use std::collections::{BTreeMap, BTreeSet};

use super::ledger::Ledger;
use super::{tap_of, FilterId, FilterInfo, Hook, Monitor};
use crate::api::CaptureDirection;

/// What the kernel shows for one source, collected before planning.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    /// A link with the source's name exists.
    pub present: bool,
    /// Its ifindex (0 when absent).
    pub ifindex: u32,
    /// The user-set `IFF_PROMISC` bit.
    pub promisc: bool,
    /// It has a clsact qdisc.
    pub clsact: bool,
    /// Every filter on both clsact hooks (ours and foreign).
    pub filters: Vec<FilterInfo>,
    /// Tap name -> ifindex of the links that exist now.
    pub taps: BTreeMap<String, u32>,
}

/// One change to one source, applied in the order [`plan`] returns them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Write the source's ledger (before any change it describes).
    WriteLedger(Ledger),
    /// Delete the source's ledger (after everything it describes is given back, or when it is
    /// stale).
    DropLedger,
    /// Set or clear the user-set promiscuous flag.
    SetPromisc(bool),
    /// Add the clsact qdisc.
    AddClsact,
    /// Delete the clsact qdisc.
    DelClsact,
    /// Add a mirror of `hook` to the tap `tap` (ifindex `target`), carrying `cookie(tap)`.
    AddMirror {
        /// Which side of the source.
        hook: Hook,
        /// The priority to add it at ([`mirror_prio`]); 0 lets the kernel choose.
        prio: u16,
        /// The tap's name (its cookie).
        tap: String,
        /// The tap's ifindex.
        target: u32,
    },
    /// Delete one of our filters.
    DelFilter(FilterId),
}

/// The hooks a monitor mirrors: ingress always, egress too for [`CaptureDirection::Both`].
pub fn hooks_of(direction: CaptureDirection) -> &'static [Hook] {
    match direction {
        CaptureDirection::Both => &[Hook::Ingress, Hook::Egress],
        CaptureDirection::Ingress => &[Hook::Ingress],
    }
}

/// The priority a new mirror on `hook` gets: the one our mirrors there already share (the
/// classic-BPF classifier runs every filter of one priority in turn, and ours say `continue`),
/// else one below every other filter on the hook, so that no filter of the operator's that
/// ends classification hides a frame from the monitors (ours continue, so theirs still see
/// every frame). 0 (the kernel picks one after the others) only when an operator's filter
/// already holds priority 1; then a frame it ends classification for is not mirrored
/// (docs/capture.md). `leaving` are filters about to be deleted.
pub fn mirror_prio(seen: &Observed, hook: Hook, leaving: &[FilterId]) -> u16 {
    let staying = || seen.filters.iter().filter(move |f| f.id.hook == hook && !leaving.contains(&f.id));
    if let Some(ours) = staying().find(|f| tap_of(f).is_some()) {
        return ours.id.prio;
    }
    match staying().map(|f| f.id.prio).min() {
        None => FIRST_PRIO,
        Some(lowest) => lowest.saturating_sub(1),
    }
}

/// The priority of the first mirror on a hook without filters: the kernel's own first choice,
/// so a source with only our filters looks as `tc` users expect.
pub const FIRST_PRIO: u16 = 0xc000;

/// Whether `ledger` describes the link the kernel shows now (same boot, same ifindex).
pub fn ledger_is_current(ledger: &Ledger, seen: &Observed, boot_id: &str) -> bool {
    seen.present && ledger.boot_id == boot_id && ledger.ifindex == seen.ifindex
}

/// What to do on `source` so that exactly the mirrors of `desired` (the monitors naming this
/// source) exist, given what the kernel shows (`seen`) and the source's ledger.
///
/// Pure; applying the steps and planning again gives no steps.
pub fn plan(source: &str, desired: &[&Monitor], seen: &Observed, ledger: Option<&Ledger>, boot_id: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let current = ledger.filter(|l| ledger_is_current(l, seen, boot_id));
    if !seen.present {
        // The kernel took the filters and the qdisc with the link; nothing to give back.
        if ledger.is_some() {
            steps.push(Step::DropLedger);
        }
        return steps;
    }

    // (hook, tap) -> target ifindex of every mirror wanted; taps that do not exist get none.
    let mut wanted: BTreeMap<(Hook, String), u32> = BTreeMap::new();
    for m in desired.iter().filter(|m| m.source == source) {
        let Some(&target) = seen.taps.get(&m.tap) else { continue };
        for &hook in hooks_of(m.direction) {
            wanted.insert((hook, m.tap.clone()), target);
        }
    }
    // Only a monitor whose tap exists holds the source: a VM still listed as starting or
    // stopping after its taps went (an undone start, a stop without QEMU) must not take back a
    // source the sync that followed its taps' removal gave back.
    let monitored = !wanted.is_empty();

    // Our filters: keep the first that matches a wanted mirror exactly, delete the rest.
    let mut kept: BTreeSet<(Hook, String)> = BTreeSet::new();
    let mut stale: Vec<FilterId> = Vec::new();
    let mut foreign = 0usize;
    for f in &seen.filters {
        let Some(tap) = tap_of(f) else {
            foreign += 1;
            continue;
        };
        let key = (f.id.hook, tap);
        let good = matches!(wanted.get(&key), Some(&t) if f.mirred_to == Some(t) && t != 0);
        if good && kept.insert(key) {
            continue;
        }
        stale.push(f.id.clone());
    }

    if monitored {
        let mut adds = Vec::new();
        match current {
            // Written before any change. When our filters are already there (the ledger was
            // lost) the flag and the qdisc may be ours; recording them as found keeps them
            // later, and never clearing what may be the operator's is the safe side.
            None => steps.push(Step::WriteLedger(Ledger {
                source: source.to_string(),
                ifindex: seen.ifindex,
                boot_id: boot_id.to_string(),
                promisc_was: seen.promisc,
                clsact_made: !seen.clsact,
            })),
            // Someone took the flag or the qdisc the ledger says were there before us: what
            // this sync sets again is then ours, recorded before it is made, and given back.
            Some(l) if (l.promisc_was && !seen.promisc) || (!l.clsact_made && !seen.clsact) => {
                steps.push(Step::WriteLedger(Ledger {
                    promisc_was: l.promisc_was && seen.promisc,
                    clsact_made: l.clsact_made || !seen.clsact,
                    ..l.clone()
                }))
            }
            Some(_) => {}
        }
        if !seen.promisc {
            steps.push(Step::SetPromisc(true));
        }
        if !seen.clsact {
            steps.push(Step::AddClsact);
        }
        for ((hook, tap), target) in wanted {
            if !kept.contains(&(hook, tap.clone())) {
                let prio = mirror_prio(seen, hook, &stale);
                adds.push(Step::AddMirror { hook, prio, tap, target });
            }
        }
        steps.extend(stale.into_iter().map(Step::DelFilter));
        steps.extend(adds);
        return steps;
    }

    // Not monitored: give the source back.
    steps.extend(stale.into_iter().map(Step::DelFilter));
    match current {
        Some(l) => {
            if l.clsact_made && seen.clsact && foreign == 0 {
                steps.push(Step::DelClsact);
            }
            if !l.promisc_was && seen.promisc {
                steps.push(Step::SetPromisc(false));
            }
            steps.push(Step::DropLedger);
        }
        None if ledger.is_some() => steps.push(Step::DropLedger),
        None => {}
    }
    steps
}
