//! Side effects of a placement: which host CPUs a QEMU's threads may run on.
//!
//! The allocator ([`super::allocate`]) only decides; this file is the one place that asks the
//! kernel. A VM's QEMU starts on its emulator (or shared) CPUs already: the spawner sets the
//! child's affinity before the exec ([`crate::sandbox::spawn::Command::affinity`]), so every
//! thread it makes inherits it. What is left, in the order the lifecycle uses it:
//!
//! 1. [`set_affinity`] / [`pin_threads`]: each vCPU thread of a dedicated VM on its CPU, once
//!    QMP named the threads (`query-cpus-fast`);
//! 2. [`pin_process`]: every task of a shared VM's QEMU onto a new shared pool when a
//!    dedicated placement is made or released;
//! 3. [`tasks`], [`task_name`] and [`allowed`] ([`parse_allowed`] is the pure part): recovery
//!    reads what each thread may use now, compares it with the record and re-pins.
//!
//! A thread that exits between being listed and being pinned is not an error (QEMU starts and
//! ends worker threads as it pleases; a new one inherits the process's first thread's mask).
//! Needs CAP_SYS_NICE for a QEMU running as another user (docs/sandbox.md).

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sched::sched_setaffinity;
use nix::unistd::Pid;

use super::cpuset::CpuSet;

/// Why a QEMU's threads could not be placed or read.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// sched_setaffinity refused (EPERM without CAP_SYS_NICE, EINVAL for CPUs not online or
    /// outside the task's cpuset cgroup).
    #[error("cannot pin thread {tid} to CPUs {cpus}: {source}")]
    SetAffinity {
        /// The thread (task) id.
        tid: i32,
        /// The CPUs asked for, as a cpulist.
        cpus: String,
        /// The kernel's answer.
        #[source]
        source: Errno,
    },
    /// A CPU number does not fit the kernel's affinity mask.
    #[error("CPU {cpu} is beyond the affinity mask")]
    CpuOutOfRange {
        /// The CPU number.
        cpu: u32,
    },
    /// /proc/PID/task or a task's status could not be read (the process is gone).
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A task's status has no readable `Cpus_allowed_list` line.
    #[error("{path} has no readable Cpus_allowed_list")]
    NoAllowedList {
        /// The status file.
        path: PathBuf,
    },
}

fn task_dir(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/task"))
}

/// Sets the CPUs thread `tid` may run on (`cpus` not empty).
///
/// # Errors
/// [`PinError::CpuOutOfRange`], or the kernel refused ([`PinError::SetAffinity`]; ESRCH when
/// the thread is gone).
pub fn set_affinity(tid: i32, cpus: &CpuSet) -> Result<(), PinError> {
    let mask = super::cpuset::kernel_mask(cpus.iter()).map_err(|cpu| PinError::CpuOutOfRange { cpu })?;
    sched_setaffinity(Pid::from_raw(tid), &mask).map_err(|source| PinError::SetAffinity {
        tid,
        cpus: cpus.to_string(),
        source,
    })
}

/// The thread ids of process `pid`, ascending (the first is the main thread).
///
/// # Errors
/// /proc/PID/task cannot be read (the process is gone).
pub fn tasks(pid: i32) -> Result<Vec<i32>, PinError> {
    let dir = task_dir(pid);
    let read = |source| PinError::Read { path: dir.clone(), source };
    let mut tids: Vec<i32> = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(read)? {
        let entry = entry.map_err(read)?;
        if let Some(tid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
            tids.push(tid);
        }
    }
    tids.sort_unstable();
    Ok(tids)
}

/// The CPUs a task may run on, from the text of its `/proc/.../status`. Pure.
pub fn parse_allowed(status: &str) -> Option<CpuSet> {
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    CpuSet::parse(list.trim()).ok()
}

/// The CPUs thread `tid` of process `pid` may run on now.
///
/// # Errors
/// Its status cannot be read (gone), or has no readable list.
pub fn allowed(pid: i32, tid: i32) -> Result<CpuSet, PinError> {
    let path = task_dir(pid).join(tid.to_string()).join("status");
    let status = std::fs::read_to_string(&path).map_err(|source| PinError::Read { path: path.clone(), source })?;
    parse_allowed(&status).ok_or(PinError::NoAllowedList { path })
}

/// A thread's name (`comm`, e.g. `CPU 0/KVM`, which QEMU sets with `debug-threads=on`).
///
/// # Errors
/// It cannot be read (gone).
pub fn task_name(pid: i32, tid: i32) -> Result<String, PinError> {
    let path = task_dir(pid).join(tid.to_string()).join("comm");
    let comm = std::fs::read_to_string(&path).map_err(|source| PinError::Read { path, source })?;
    Ok(comm.trim_end_matches('\n').to_string())
}

/// The vCPU index a QEMU thread name stands for: `CPU 3/KVM` or `CPU 3/TCG` is 3. Pure.
pub fn vcpu_of_name(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("CPU ")?;
    let (index, _accel) = rest.split_once('/')?;
    index.parse().ok()
}

/// Pins each `(tid, cpus)`; threads gone meanwhile are skipped.
///
/// # Errors
/// The first refusal other than a vanished thread.
pub fn pin_threads(threads: &[(i32, CpuSet)]) -> Result<(), PinError> {
    for (tid, cpus) in threads {
        match set_affinity(*tid, cpus) {
            Err(PinError::SetAffinity { source: Errno::ESRCH, .. }) => {}
            other => other?,
        }
    }
    Ok(())
}

/// Pins every task of process `pid` to `cpus` (a shared VM onto its pool).
///
/// # Errors
/// The task list cannot be read, or a thread was refused.
pub fn pin_process(pid: i32, cpus: &CpuSet) -> Result<(), PinError> {
    let threads: Vec<(i32, CpuSet)> = tasks(pid)?.into_iter().map(|tid| (tid, cpus.clone())).collect();
    pin_threads(&threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gettid() -> i32 {
        nix::unistd::gettid().as_raw()
    }

    #[test]
    fn parses_the_allowed_list_of_a_status() {
        let status = "Name:\tqemu\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1,4\nMems_allowed:\t1\n";
        assert_eq!(parse_allowed(status), Some(CpuSet::from_cpus([0, 1, 4])));
        assert_eq!(parse_allowed("Name:\tx\n"), None);
        assert_eq!(parse_allowed("Cpus_allowed_list:\t\n"), None);
    }

    #[test]
    fn names_of_vcpu_threads() {
        assert_eq!(vcpu_of_name("CPU 0/TCG"), Some(0));
        assert_eq!(vcpu_of_name("CPU 12/KVM"), Some(12));
        assert_eq!(vcpu_of_name("qemu-system-x86"), None);
        assert_eq!(vcpu_of_name("CPU x/KVM"), None);
        assert_eq!(vcpu_of_name("call_rcu"), None);
    }

    /// Pins a real thread of this test process, reads it back from /proc, and lists it among
    /// the process's tasks; then the whole process (this thread included) is listed and a
    /// pin of a vanished thread is skipped.
    #[test]
    fn pins_real_threads_and_reads_them_back() {
        let pid = i32::try_from(std::process::id()).unwrap();
        let online = allowed(pid, pid).unwrap();
        let last = online.iter().last().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            tx.send(gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert!(tasks(pid).unwrap().contains(&tid));
        let one = CpuSet::from_cpus([last]);
        pin_threads(&[(tid, one.clone())]).unwrap();
        assert_eq!(allowed(pid, tid).unwrap(), one);
        // Back to every CPU, through the whole-process pin (this thread too).
        pin_process(pid, &online).unwrap();
        assert_eq!(allowed(pid, tid).unwrap(), online);
        stop_tx.send(()).unwrap();
        worker.join().unwrap();
        // A thread that is gone (no tid is this high: pid_max is at most 2^22) is skipped.
        pin_threads(&[(i32::MAX - 1, one)]).unwrap();
        // A CPU the mask cannot hold is refused before the kernel is asked.
        assert!(matches!(set_affinity(gettid(), &CpuSet::from_cpus([1 << 20])), Err(PinError::CpuOutOfRange { .. })));
        assert!(task_name(pid, pid).is_ok());
    }
}
