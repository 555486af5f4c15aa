//! Blocking calls made from async code without stalling the runtime.
//!
//! vmhostd's runtime has one worker thread per core. A task that blocks its worker (a record
//! write and fsync, unlinking a disk of many gigabytes, a rename, a directory read, a /proc
//! scan) would hold up every task queued on that worker, `vm.list` and `vm.get` answers
//! included. [`run`] hands those tasks to another worker for the duration of the call.
//!
//! Use it for each file system step of an operation, as close to the call as possible, so a
//! lock is never held across one by accident; long, self-contained work that needs nothing
//! borrowed belongs on `tokio::task::spawn_blocking` instead.

/// Runs `f`, which blocks, without stalling the other tasks of a runtime worker: they move to
/// another worker meanwhile (tokio's `block_in_place`).
pub fn run<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        // A current-thread runtime (unit tests) or none: nothing else to move away.
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn other_tasks_of_the_worker_run_while_a_call_blocks() {
        // One worker: a task that blocked it outright could not let the other task run.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = tokio::spawn(async move {
            tx.send(()).unwrap();
        });
        let got = run(|| rx.recv_timeout(std::time::Duration::from_secs(10)));
        assert!(got.is_ok(), "the other task did not run while the call blocked");
        other.await.unwrap();
    }

    #[test]
    fn outside_a_runtime_it_just_calls() {
        assert_eq!(run(|| 7), 7);
    }
}
