//! Capture: mirrors of host interfaces into monitor NICs' taps, owned and crash-safe.
//!
//! A monitor NIC gets a copy of every frame its source (a host interface) receives and, for
//! `direction: both`, sends. The kernel does the copying: a clsact qdisc on the source carries
//! one classic-BPF match-everything filter per mirror with a `mirred` egress-mirror action to the
//! tap (`super::tc`). This module decides and applies those filters, the source's promiscuous
//! flag and the qdisc, for every source at once; it is the only code that changes them.
//!
//! Order of use: [`Capture::new`] once (with the manager); [`Capture::sync`] with every monitor
//! every live VM should have now, whenever that set or the host's links change (a start after
//! its taps, a VM's QEMU gone, daemon start, a link watcher); its report is the caller's to
//! keep (the lifecycle diffs it for events and views). One sync: collect what the kernel shows ([`Observed`]) and the ledgers ([`Ledger`]), [`plan`] each
//! source (pure), apply its [`Step`]s in order, report per monitor ([`MonitorState`]).
//!
//! # Ownership
//! A filter vmhostd adds carries the action cookie [`cookie`] (`vmhc` + the tap name after its
//! `vmh`); a filter without it is never changed or deleted, whoever made it. Before the first
//! change to a source its ledger (`STATE/capture/<source>.json`) records whether the
//! promiscuous flag was set and whether a clsact qdisc was there, so giving the source back
//! restores exactly that. A ledger from another boot or another ifindex is dropped without
//! touching the link. Our filters are found by their cookie on every link that has a clsact
//! qdisc, ledger or not, so a lost ledger never leaves a mirror behind.

pub mod ledger;
pub mod plan;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use self::ledger::Ledger;
pub use self::plan::{mirror_prio, plan, Observed, Step, FIRST_PRIO};
use super::link::Netlink;
pub use super::tc::{FilterId, FilterInfo, Hook};
use super::{validate_link_name, NetError};
use crate::api::CaptureDirection;

/// The start of the action cookie of every filter vmhostd adds.
pub const COOKIE_PREFIX: &[u8] = b"vmhc";

/// The prefix of every vmhost tap name, which the cookie leaves out to fit the kernel's 16 bytes.
const TAP_PREFIX: &str = "vmh";

/// The action cookie of a mirror into `tap`: `vmhc` + the tap name after `vmh` (at most 16 bytes
/// for a tap name of at most 15).
pub fn cookie(tap: &str) -> Vec<u8> {
    let rest = tap.strip_prefix(TAP_PREFIX).unwrap_or(tap);
    [COOKIE_PREFIX, rest.as_bytes()].concat()
}

/// The tap a cookie names, or `None` when it is not one [`cookie`] makes (a filter that is not
/// vmhost's).
pub fn parse_cookie(bytes: &[u8]) -> Option<String> {
    let rest = std::str::from_utf8(bytes.strip_prefix(COOKIE_PREFIX)?).ok()?;
    if rest.is_empty() {
        return None;
    }
    let tap = format!("{TAP_PREFIX}{rest}");
    validate_link_name(&tap).ok()?;
    Some(tap)
}

/// The tap a filter of vmhost's mirrors into, by its cookie; `None` for anyone else's filter.
pub fn tap_of(filter: &FilterInfo) -> Option<String> {
    filter.cookie.as_deref().and_then(parse_cookie)
}

/// One wanted monitor NIC: mirrors of `source` into `tap` (one per hook of `direction`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Monitor {
    /// The VM's name.
    pub vm: String,
    /// The NIC's index in `spec.nics`.
    pub nic: usize,
    /// The host interface mirrored.
    pub source: String,
    /// The NIC's tap.
    pub tap: String,
    /// Which frames of the source.
    pub direction: CaptureDirection,
}

/// Where one monitor stands after a sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MonitorState {
    /// Its mirrors are on the source.
    Attached,
    /// The source does not exist now; the mirrors come when it does (the next sync).
    SourceMissing,
    /// The NIC's tap does not exist (its QEMU is gone or not started yet).
    TapMissing,
    /// A kernel request or the ledger write failed; the text says which.
    Failed(String),
}

impl MonitorState {
    /// The state's name as views and events show it: `attached`, `source_missing`,
    /// `tap_missing`, `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            MonitorState::Attached => "attached",
            MonitorState::SourceMissing => "source_missing",
            MonitorState::TapMissing => "tap_missing",
            MonitorState::Failed(_) => "failed",
        }
    }
}

/// One source after a sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceReport {
    /// The host interface.
    pub source: String,
    /// It exists.
    pub present: bool,
    /// Its user-set promiscuous flag after the sync.
    pub promisc: bool,
    /// How many of vmhostd's filters are on it after the sync.
    pub vmhost_filters: usize,
}

/// What a sync did: every wanted monitor's state and every source it looked at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncReport {
    /// Each monitor passed to the sync, in order, with its state.
    pub monitors: Vec<(Monitor, MonitorState)>,
    /// Each source that is wanted, has a ledger or carries our filters, by name.
    pub sources: Vec<SourceReport>,
}

/// A link as capture needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkState {
    /// Ifindex.
    pub index: u32,
    /// Name.
    pub name: String,
    /// The user-set promiscuous flag.
    pub promisc: bool,
}

/// The kernel requests the applier makes: [`Netlink`] implements it, unit tests use a fake.
///
/// # Errors
/// Each method answers the kernel's refusal as [`NetError`], as the [`Netlink`] method of the
/// same name documents; the applier takes `Exists` from `add_clsact` and `NotFound` from
/// `del_clsact`/`del_filter` as done.
pub trait TcOps: Sync {
    /// Every link.
    fn links(&self) -> impl Future<Output = Result<Vec<LinkState>, NetError>> + Send;
    /// The links that have a clsact qdisc.
    fn clsact_links(&self) -> impl Future<Output = Result<BTreeSet<u32>, NetError>> + Send;
    /// Adds a clsact qdisc ([`NetError::Exists`] when there).
    fn add_clsact(&self, ifindex: u32) -> impl Future<Output = Result<(), NetError>> + Send;
    /// Deletes the clsact qdisc ([`NetError::NotFound`] when gone).
    fn del_clsact(&self, ifindex: u32) -> impl Future<Output = Result<(), NetError>> + Send;
    /// The filters on one hook.
    fn filters(&self, ifindex: u32, hook: Hook) -> impl Future<Output = Result<Vec<FilterInfo>, NetError>> + Send;
    /// Adds a mirror of `hook` to `target` carrying `cookie`, at priority `prio` (0: the
    /// kernel's choice).
    fn add_mirror(
        &self,
        ifindex: u32,
        hook: Hook,
        prio: u16,
        target: u32,
        cookie: &[u8],
    ) -> impl Future<Output = Result<FilterId, NetError>> + Send;
    /// Deletes one filter.
    fn del_filter(&self, ifindex: u32, id: &FilterId) -> impl Future<Output = Result<(), NetError>> + Send;
    /// Sets or clears the user-set promiscuous flag.
    fn set_promisc(&self, ifindex: u32, on: bool) -> impl Future<Output = Result<(), NetError>> + Send;
}

impl TcOps for Netlink {
    async fn links(&self) -> Result<Vec<LinkState>, NetError> {
        Ok(Netlink::links(self)
            .await?
            .into_iter()
            .map(|l| LinkState { index: l.index, name: l.name, promisc: l.promisc })
            .collect())
    }
    async fn clsact_links(&self) -> Result<BTreeSet<u32>, NetError> {
        Netlink::clsact_links(self).await
    }
    async fn add_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        Netlink::add_clsact(self, ifindex).await
    }
    async fn del_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        Netlink::del_clsact(self, ifindex).await
    }
    async fn filters(&self, ifindex: u32, hook: Hook) -> Result<Vec<FilterInfo>, NetError> {
        Netlink::filters(self, ifindex, hook).await
    }
    async fn add_mirror(
        &self,
        ifindex: u32,
        hook: Hook,
        prio: u16,
        target: u32,
        cookie: &[u8],
    ) -> Result<FilterId, NetError> {
        Netlink::add_mirror(self, ifindex, hook, prio, target, cookie).await
    }
    async fn del_filter(&self, ifindex: u32, id: &FilterId) -> Result<(), NetError> {
        Netlink::del_filter(self, ifindex, id).await
    }
    async fn set_promisc(&self, ifindex: u32, on: bool) -> Result<(), NetError> {
        Netlink::set_promisc(self, ifindex, on).await
    }
}

/// Where the kernel says which boot this is.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's id; empty (logged) when it cannot be read, which makes every ledger look like
/// another boot's: dropped without touching its link.
fn boot_id() -> String {
    match std::fs::read_to_string(BOOT_ID) {
        Ok(s) => s.trim().to_string(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read {BOOT_ID}; capture ledgers will look stale");
            String::new()
        }
    }
}

/// The owner of every mirror, promiscuous flag and clsact qdisc vmhostd sets on host
/// interfaces; one per daemon, next to `HostNet`.
pub struct Capture {
    /// `STATE/capture`: the ledgers.
    dir: PathBuf,
    /// The run dir, where crash points are armed.
    run: PathBuf,
    /// One sync at a time: two would plan from the same view and add a mirror twice.
    lock: tokio::sync::Mutex<()>,
}

/// What applying one source's steps left, for its report.
struct Applied {
    /// The promiscuous flag now.
    promisc: bool,
    /// Our filters on it now.
    ours: usize,
    /// The first failure of a step the others depend on (ledger, flag, qdisc, a delete); steps
    /// after it were not tried.
    error: Option<String>,
    /// Mirrors that could not be added, by tap: only that monitor failed, the source's other
    /// mirrors were still tried.
    mirror_errors: BTreeMap<String, String>,
    /// A ledger was written.
    wrote_ledger: bool,
}

impl Capture {
    /// The capture owner keeping its ledgers in `STATE/capture` (made at the first write).
    pub fn new(state_dir: &Path, run_dir: &Path) -> Capture {
        Capture { dir: state_dir.join(ledger::DIR), run: run_dir.to_path_buf(), lock: tokio::sync::Mutex::new(()) }
    }

    /// Makes every monitored source match `desired` (every monitor every live VM should have
    /// now, across all VMs): missing mirrors added, ours that are not wanted (stale target,
    /// ifindex 0, VM gone) deleted, the promiscuous flag set while monitored and given back
    /// after, clsact made when absent and removed when we made it and nothing is left on it,
    /// ledgers written first and removed last. Sources only in a ledger, and links carrying our
    /// filters, are given back. Serialized by an internal mutex; never fails as a whole: each
    /// monitor's state is in the report.
    pub async fn sync(&self, nl: &Netlink, desired: &[Monitor]) -> SyncReport {
        self.sync_with(nl, desired).await
    }

    /// [`Capture::sync`] through any [`TcOps`].
    pub async fn sync_with<T: TcOps>(&self, ops: &T, desired: &[Monitor]) -> SyncReport {
        let _one_at_a_time = self.lock.lock().await;
        self.sync_locked(ops, desired, &boot_id()).await
    }

    /// Kills the daemon here when the test armed `step` (debug builds).
    fn crashpoint(&self, step: &str) {
        crate::crashpoint::hit(&self.run, step);
    }

    async fn sync_locked<T: TcOps>(&self, ops: &T, desired: &[Monitor], boot_id: &str) -> SyncReport {
        let links = match ops.links().await {
            Ok(links) => links,
            Err(e) => {
                let why = format!("cannot list links: {e}");
                tracing::warn!("capture sync: {why}");
                return SyncReport {
                    monitors: desired.iter().map(|m| (m.clone(), MonitorState::Failed(why.clone()))).collect(),
                    sources: Vec::new(),
                };
            }
        };
        let by_name: BTreeMap<&str, &LinkState> = links.iter().map(|l| (l.name.as_str(), l)).collect();
        let taps: BTreeMap<String, u32> = links.iter().map(|l| (l.name.clone(), l.index)).collect();
        let ledgers = ledger::read_all(&self.dir);

        // Every link with a clsact qdisc is looked at: our filters are found by cookie even
        // where no ledger names the link.
        let mut tc: BTreeMap<u32, Result<(bool, Vec<FilterInfo>), String>> = BTreeMap::new();
        match ops.clsact_links().await {
            Ok(with_clsact) => {
                for link in &links {
                    let seen = observe_tc(ops, link.index, with_clsact.contains(&link.index)).await;
                    tc.insert(link.index, seen.map_err(|e| e.to_string()));
                }
            }
            Err(e) => {
                for link in &links {
                    tc.insert(link.index, Err(format!("cannot list qdiscs: {e}")));
                }
            }
        }

        let mut sources: BTreeSet<String> = desired.iter().map(|m| m.source.clone()).collect();
        sources.extend(ledgers.ok.keys().cloned());
        sources.extend(ledgers.unreadable.iter().cloned());
        for link in &links {
            if let Some(Ok((_, filters))) = tc.get(&link.index) {
                if filters.iter().any(|f| tap_of(f).is_some()) {
                    sources.insert(link.name.clone());
                }
            }
        }

        let mut errors: BTreeMap<String, String> = BTreeMap::new();
        let mut mirror_errors: BTreeMap<String, String> = BTreeMap::new();
        let mut present: BTreeSet<String> = BTreeSet::new();
        let mut reports = Vec::new();
        for source in &sources {
            if let Err(e) = validate_link_name(source) {
                // Config and spec checks keep such names out; this keeps a ledger path inside
                // STATE/capture whatever a caller passes.
                errors.insert(source.clone(), e.to_string());
                continue;
            }
            let link = by_name.get(source.as_str());
            let mut seen = Observed { taps: taps.clone(), ..Observed::default() };
            if let Some(link) = link {
                present.insert(source.clone());
                seen.present = true;
                seen.ifindex = link.index;
                seen.promisc = link.promisc;
                match tc.remove(&link.index) {
                    Some(Ok((clsact, filters))) => {
                        seen.clsact = clsact;
                        seen.filters = filters;
                    }
                    Some(Err(e)) => {
                        let why = format!("cannot read the filters of {source}: {e}");
                        tracing::warn!("capture sync: {why}");
                        errors.insert(source.clone(), why);
                        reports.push(SourceReport {
                            source: source.clone(),
                            present: true,
                            promisc: link.promisc,
                            vmhost_filters: 0,
                        });
                        continue;
                    }
                    None => {}
                }
            }
            let mine: Vec<&Monitor> = desired.iter().filter(|m| &m.source == source).collect();
            let steps = plan(source, &mine, &seen, ledgers.ok.get(source), boot_id);
            let applied = self.apply(ops, source, &seen, &steps).await;
            if ledgers.unreadable.contains(source) && !applied.wrote_ledger && applied.error.is_none() {
                // Nothing usable in it, and nothing of ours left that it could describe.
                if let Err(e) = ledger::remove(&self.dir, source) {
                    tracing::warn!(source, error = %e, "cannot remove an unreadable capture ledger");
                }
            }
            if let Some(e) = &applied.error {
                tracing::warn!(source, error = %e, "capture sync failed on a source");
                errors.insert(source.clone(), e.clone());
            }
            for (tap, e) in &applied.mirror_errors {
                tracing::warn!(source, tap, error = %e, "capture sync failed on a mirror");
            }
            mirror_errors.extend(applied.mirror_errors.clone());
            reports.push(SourceReport {
                source: source.clone(),
                present: seen.present,
                promisc: applied.promisc,
                vmhost_filters: applied.ours,
            });
        }

        let monitors = desired
            .iter()
            .map(|m| {
                let state = if let Some(e) = errors.get(&m.source).or_else(|| mirror_errors.get(&m.tap)) {
                    MonitorState::Failed(e.clone())
                } else if !present.contains(&m.source) {
                    MonitorState::SourceMissing
                } else if !taps.contains_key(&m.tap) {
                    MonitorState::TapMissing
                } else {
                    MonitorState::Attached
                };
                (m.clone(), state)
            })
            .collect();
        SyncReport { monitors, sources: reports }
    }

    /// Applies one source's steps in order, stopping at the first failure (later steps depend
    /// on earlier ones: nothing is changed before its ledger is written).
    async fn apply<T: TcOps>(&self, ops: &T, source: &str, seen: &Observed, steps: &[Step]) -> Applied {
        let ifindex = seen.ifindex;
        let mut applied = Applied {
            promisc: seen.promisc,
            ours: seen.filters.iter().filter(|f| tap_of(f).is_some()).count(),
            error: None,
            mirror_errors: BTreeMap::new(),
            wrote_ledger: false,
        };
        // The crash point between the removal of the filters and the rest of a give-back.
        let removal = steps.contains(&Step::DropLedger);
        let mut mirrored = false;
        for (i, step) in steps.iter().enumerate() {
            let result = match step {
                Step::WriteLedger(l) => ledger::write(&self.dir, l)
                    .map(|()| {
                        applied.wrote_ledger = true;
                        self.crashpoint("capture:ledger");
                    })
                    .map_err(|e| format!("cannot write {}: {e}", ledger::path_of(&self.dir, source).display())),
                Step::DropLedger => ledger::remove(&self.dir, source)
                    .map_err(|e| format!("cannot remove {}: {e}", ledger::path_of(&self.dir, source).display())),
                Step::SetPromisc(on) => ops
                    .set_promisc(ifindex, *on)
                    .await
                    .map(|()| {
                        applied.promisc = *on;
                        if *on {
                            self.crashpoint("capture:promisc");
                        }
                    })
                    .map_err(|e| format!("cannot set the promiscuous flag of {source}: {e}")),
                Step::AddClsact => match ops.add_clsact(ifindex).await {
                    Ok(()) | Err(NetError::Exists(_)) => Ok(()),
                    Err(e) => Err(format!("cannot add a clsact qdisc to {source}: {e}")),
                },
                Step::DelClsact => match ops.del_clsact(ifindex).await {
                    Ok(()) | Err(NetError::NotFound(_)) => Ok(()),
                    Err(e) => Err(format!("cannot delete the clsact qdisc of {source}: {e}")),
                },
                Step::AddMirror { hook, prio, tap, target } => {
                    match ops.add_mirror(ifindex, *hook, *prio, *target, &cookie(tap)).await {
                        Ok(_) => {
                            applied.ours += 1;
                            if !mirrored {
                                mirrored = true;
                                self.crashpoint("capture:mirror");
                            }
                        }
                        Err(e) => {
                            let why = format!("cannot mirror {source} into {tap}: {e}");
                            applied.mirror_errors.entry(tap.clone()).or_insert(why);
                        }
                    }
                    Ok(())
                }
                Step::DelFilter(id) => match ops.del_filter(ifindex, id).await {
                    Ok(()) | Err(NetError::NotFound(_)) => {
                        applied.ours = applied.ours.saturating_sub(1);
                        let last_filter = !matches!(steps.get(i + 1), Some(Step::DelFilter(_)));
                        if removal && last_filter {
                            self.crashpoint("capture:removed");
                        }
                        Ok(())
                    }
                    Err(e) => Err(format!("cannot delete a vmhost filter of {source}: {e}")),
                },
            };
            if let Err(e) = result {
                applied.error = Some(e);
                break;
            }
        }
        applied
    }
}

/// Whether `ifindex` has a clsact qdisc (`clsact`, from the one dump of a sync), and if so the
/// filters of both hooks.
async fn observe_tc<T: TcOps>(ops: &T, ifindex: u32, clsact: bool) -> Result<(bool, Vec<FilterInfo>), NetError> {
    if !clsact {
        return Ok((false, Vec::new()));
    }
    let mut filters = ops.filters(ifindex, Hook::Ingress).await?;
    filters.extend(ops.filters(ifindex, Hook::Egress).await?);
    Ok((true, filters))
}

#[cfg(test)]
mod netns_tests;
#[cfg(test)]
mod tests;
