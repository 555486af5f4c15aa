//! One run of an expensive read at a time; callers that arrive while it runs share its result.
//!
//! `host.check` probes the host by starting processes (QEMU as `qemu.user`, the sandbox probe)
//! and reading sysfs: a read-only peer sending it many times at once must not make the daemon
//! start as many probes. [`SingleFlight::run`] starts the work only when none is running, in a
//! task of its own (a caller that disconnects does not cancel it for the others), and every
//! caller waiting at that time gets a clone of its result.

use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// At most one run of a computation of `T` at a time.
#[derive(Debug)]
pub struct SingleFlight<T> {
    running: Mutex<Option<watch::Receiver<Option<T>>>>,
}

impl<T> Default for SingleFlight<T> {
    fn default() -> Self {
        SingleFlight { running: Mutex::new(None) }
    }
}

impl<T: Clone + Send + Sync + 'static> SingleFlight<T> {
    /// The result of `work`, or of the run already in progress when there is one; `None` only
    /// when the run panicked.
    pub async fn run<F, Fut>(self: &Arc<Self>, work: F) -> Option<T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        let mut rx = {
            let mut running = self.slot();
            match running.as_ref() {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    *running = Some(rx.clone());
                    let fut = work();
                    let this = Arc::clone(self);
                    let mine = rx.clone();
                    tokio::spawn(async move {
                        // A panic drops `tx` unsent: the waiters get `None` and the slot is freed.
                        let guard = Clear { flight: &this, mine: &mine };
                        let value = fut.await;
                        drop(guard);
                        let _ = tx.send(Some(value));
                    });
                    rx
                }
            }
        };
        rx.wait_for(Option::is_some).await.ok().and_then(|v| v.clone())
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<watch::Receiver<Option<T>>>> {
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Frees the slot when a run ends (also by panic), so later callers start a fresh run and never
/// get a stale result.
struct Clear<'a, T> {
    flight: &'a SingleFlight<T>,
    mine: &'a watch::Receiver<Option<T>>,
}

impl<T> Drop for Clear<'_, T> {
    fn drop(&mut self) {
        let mut running = self.flight.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if running.as_ref().is_some_and(|current| current.same_channel(self.mine)) {
            *running = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_callers_share_one_run_and_later_ones_start_another() {
        let flight = Arc::new(SingleFlight::<usize>::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let mut callers = Vec::new();
        for _ in 0..20 {
            let (flight, runs, mut released) = (Arc::clone(&flight), Arc::clone(&runs), released.clone());
            callers.push(tokio::spawn(async move {
                flight
                    .run(|| async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        let _ = released.wait_for(|r| *r).await;
                        n
                    })
                    .await
            }));
        }
        // Every caller is waiting on the one run before it may finish.
        while Arc::strong_count(&flight) > 1 && runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        release.send(true).unwrap();
        for caller in callers {
            assert_eq!(caller.await.unwrap(), Some(1));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let runs2 = Arc::clone(&runs);
        let again = flight.run(|| async move { runs2.fetch_add(1, Ordering::SeqCst) + 1 }).await;
        assert_eq!(again, Some(2), "a caller after the run gets a fresh one");
    }

    #[tokio::test]
    async fn a_panicking_run_gives_none_and_does_not_stick() {
        let flight = Arc::new(SingleFlight::<u8>::default());
        assert_eq!(flight.run(|| async { panic!("probe failed") }).await, None);
        assert_eq!(flight.run(|| async { 7 }).await, Some(7));
    }
}
