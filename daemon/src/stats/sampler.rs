//! Keeps the last QMP figures of every running QEMU, so a `vm.stats` call asks no QEMU anything.
//!
//! Asking 50 QEMUs for `query-blockstats` on every call cost them ~40 ms of CPU per call
//! (docs/performance.md). Instead one sampler task per running QEMU process holds its stats
//! monitor open (see [`crate::qemu::argv::VmPaths::qmp_stats`]), asks for the vCPU threads once
//! and the block counters every [`SAMPLE_INTERVAL`], and publishes each answer with the instant
//! it was taken.
//!
//! Use: [`Samplers::get`] (from [`super::collect`]) starts the sampler of a VM's current process
//! on first use and returns its latest [`Cache`]; [`Samplers::wait_first`] bounds the wait for the
//! first sample; [`judge`] decides whether a sample is still current ([`STALE_AFTER`]).
//! A sampler stops when its process is gone (it checks `/proc` before every query and clears
//! its figures then), when it is replaced by the sampler of a new process of the same VM, or when
//! [`Samplers::keep_only`] drops a VM that no longer runs. A query that fails or times out keeps
//! the last sample (marked with the error) and reconnects at the next tick.

use super::procfs;
use crate::process::ProcessIdentity;
use crate::qemu::qmp::{BlockStats, Qmp, QmpError, VcpuThread};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often each sampler asks its QEMU for block counters.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(2);

/// A sample older than this is not served as current: three missed ticks.
pub const STALE_AFTER: Duration = Duration::from_secs(6);

/// Bound on connecting to a stats monitor and on each query.
pub const QMP_TIMEOUT: Duration = Duration::from_millis(1500);

/// One answer of a QEMU, with when it was taken.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// When the block counters were read, for staleness.
    pub at: Instant,
    /// The same instant, milliseconds since the Unix epoch (reported to clients).
    pub at_ms: u64,
    /// vCPU index and host thread (fixed for the life of a QEMU: vmhost hot-plugs no CPUs).
    pub threads: Arc<Vec<VcpuThread>>,
    /// Block counters as QEMU gave them.
    pub blocks: Arc<Vec<BlockStats>>,
}

/// What a sampler has published.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cache {
    /// The last successful sample, if any.
    pub sample: Option<Sample>,
    /// Why the last attempt failed, when it did (cleared by a success).
    pub error: Option<String>,
    /// The process is gone: nothing here is current any more.
    pub gone: bool,
}

/// How a reader may use a [`Cache`] at a given instant.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Serve this sample.
    Current(Sample),
    /// Serve nothing; name this reason in `missing`.
    Missing(String),
}

/// Whether `cache` may be served at `now`: a sample older than `stale_after`, or of a gone
/// process, is not; the reason names the last error if there was one.
pub fn judge(cache: &Cache, now: Instant, stale_after: Duration) -> Verdict {
    if cache.gone {
        return Verdict::Missing("QEMU process is gone".into());
    }
    let why = |base: String| match &cache.error {
        Some(e) => format!("{base}: {e}"),
        None => base,
    };
    match &cache.sample {
        None => Verdict::Missing(why("QEMU's stats monitor has not answered yet".into())),
        Some(s) => {
            let age = now.saturating_duration_since(s.at);
            if age > stale_after {
                Verdict::Missing(why(format!("last sample of QEMU's stats monitor is {} s old", age.as_secs())))
            } else {
                Verdict::Current(s.clone())
            }
        }
    }
}

/// The running sampler of one QEMU process; dropping it stops the task.
struct Running {
    process: ProcessIdentity,
    rx: watch::Receiver<Cache>,
    task: tokio::task::AbortHandle,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The samplers, by VM name (owned by the lifecycle manager).
#[derive(Default)]
pub struct Samplers {
    running: std::sync::Mutex<BTreeMap<String, Running>>,
}

impl std::fmt::Debug for Samplers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Samplers").finish_non_exhaustive()
    }
}

impl Samplers {
    /// The cache of `process` (VM `name`, monitor at `socket`), starting its sampler if there is
    /// none for this process yet. Never waits.
    pub fn get(&self, name: &str, process: &ProcessIdentity, socket: &Path) -> watch::Receiver<Cache> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = running.get(name) {
            if r.process == *process && !r.task.is_finished() {
                return r.rx.clone();
            }
        }
        let (tx, rx) = watch::channel(Cache::default());
        let task = tokio::spawn(sample(socket.to_path_buf(), process.clone(), tx)).abort_handle();
        // Replacing the entry drops (and so stops) the sampler of an older process.
        running.insert(name.to_string(), Running { process: process.clone(), rx: rx.clone(), task });
        rx
    }

    /// The cache once the sampler has answered or failed once, or as it is after `bound`.
    pub async fn wait_first(rx: &mut watch::Receiver<Cache>, bound: Duration) -> Cache {
        let first = rx.wait_for(|c| c.sample.is_some() || c.error.is_some() || c.gone);
        let waited = match tokio::time::timeout(bound, first).await {
            Ok(Ok(c)) => Some(c.clone()),
            _ => None,
        };
        waited.unwrap_or_else(|| rx.borrow().clone())
    }

    /// Stops the samplers of VMs not in `running` (stopped, destroyed).
    pub fn keep_only(&self, names: &[&str]) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.retain(|name, _| names.contains(&name.as_str()));
    }
}

/// The sampler task of one QEMU process: until the process is gone, ask and publish every tick.
async fn sample(socket: PathBuf, process: ProcessIdentity, tx: watch::Sender<Cache>) {
    let mut monitor: Option<(Qmp, Arc<Vec<VcpuThread>>)> = None;
    let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if procfs::open_process_in(Path::new(crate::process::PROC_ROOT), &process).is_err() {
            // A dead QEMU's figures are never current: clear them and stop.
            tx.send_replace(Cache { sample: None, error: None, gone: true });
            return;
        }
        let answer = match monitor.take() {
            Some(m) => Ok(m),
            None => tokio::time::timeout(QMP_TIMEOUT, connect(&socket))
                .await
                .unwrap_or_else(|_| Err(QmpError::Protocol(format!("no answer within {QMP_TIMEOUT:?}")))),
        };
        let result = match answer {
            Ok((mut qmp, threads)) => match qmp.blockstats().await {
                Ok(blocks) => {
                    let sample = Sample {
                        at: Instant::now(),
                        at_ms: super::now().0,
                        threads: threads.clone(),
                        blocks: Arc::new(blocks),
                    };
                    // Only a connection that answered is kept; a failed one is reopened next tick.
                    monitor = Some((qmp, threads));
                    Ok(sample)
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        tx.send_modify(|c| match result {
            Ok(s) => {
                c.sample = Some(s);
                c.error = None;
            }
            Err(e) => c.error = Some(format!("QEMU's stats monitor: {e}")),
        });
        if tx.is_closed() {
            return;
        }
    }
}

/// Opens the stats monitor at `socket` and asks for the vCPU threads once.
async fn connect(socket: &Path) -> Result<(Qmp, Arc<Vec<VcpuThread>>), QmpError> {
    // The socket is made before QEMU starts: absent now, it never comes (a QEMU started by a
    // vmhostd without the stats monitor).
    if !socket.exists() {
        return Err(QmpError::Connect {
            path: socket.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no stats monitor (QEMU started by an older vmhostd)",
            ),
        });
    }
    let mut qmp = Qmp::connect(socket, QMP_TIMEOUT).await?;
    qmp.set_timeout(QMP_TIMEOUT);
    let threads = qmp.vcpu_threads().await?;
    Ok((qmp, Arc::new(threads)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant) -> Sample {
        Sample { at, at_ms: 1, threads: Arc::new(Vec::new()), blocks: Arc::new(Vec::new()) }
    }

    #[test]
    fn a_sample_is_served_until_it_is_stale_and_never_for_a_gone_process() {
        let t0 = Instant::now();
        let fresh = Cache { sample: Some(sample(t0)), error: None, gone: false };
        assert_eq!(judge(&fresh, t0 + STALE_AFTER, STALE_AFTER), Verdict::Current(sample(t0)));
        // A failed query keeps the last sample while it is young enough.
        let failing = Cache { error: Some("timeout".into()), ..fresh.clone() };
        assert_eq!(judge(&failing, t0 + Duration::from_secs(1), STALE_AFTER), Verdict::Current(sample(t0)));
        // Past the bound it is marked, with the last error, not served.
        let late = t0 + STALE_AFTER + Duration::from_secs(1);
        assert_eq!(
            judge(&failing, late, STALE_AFTER),
            Verdict::Missing("last sample of QEMU's stats monitor is 7 s old: timeout".into())
        );
        assert!(matches!(judge(&fresh, late, STALE_AFTER), Verdict::Missing(m) if m.contains("7 s old")));
        let gone = Cache { gone: true, ..fresh };
        assert_eq!(judge(&gone, t0, STALE_AFTER), Verdict::Missing("QEMU process is gone".into()));
        let none = Cache { error: Some("refused".into()), ..Cache::default() };
        assert_eq!(
            judge(&none, t0, STALE_AFTER),
            Verdict::Missing("QEMU's stats monitor has not answered yet: refused".into())
        );
    }

    #[tokio::test]
    async fn the_sampler_of_a_process_that_exits_clears_its_figures_and_stops() {
        let mut child = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        let process = crate::process::identify(child.id() as i32).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let samplers = Samplers::default();
        let mut rx = samplers.get("a", &process, &dir.path().join("qmpst"));
        // No monitor socket: the first attempt fails and says so, the process still runs.
        let first = Samplers::wait_first(&mut rx, Duration::from_secs(10)).await;
        assert!(first.error.as_deref().is_some_and(|e| e.contains("no stats monitor")) && !first.gone, "{first:?}");
        child.kill().unwrap();
        child.wait().unwrap();
        let gone = tokio::time::timeout(SAMPLE_INTERVAL * 5, rx.wait_for(|c| c.gone)).await;
        assert!(gone.is_ok_and(|c| c.is_ok_and(|c| c.sample.is_none())));
        // The task ends (it returns right after publishing `gone`); a next call starts a new one.
        let finished = || samplers.running.lock().unwrap().get("a").is_some_and(|r| r.task.is_finished());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !finished() && Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
        assert!(finished());
    }
}
