//! The exec slots of each VM: which of its [`EXEC_SLOTS`] exec ports a call may use.
//!
//! A port carries one host session at a time, so every call that talks to the guest's exec
//! server takes a slot first ([`ExecSlots::try_acquire`]): the lowest free one, without waiting
//! (all busy is the caller's 4096 at once, never a queue a flooding client could grow). The
//! [`SlotGuard`] gives it back when dropped, so every path out of a call (an answer, an error, a
//! timeout, a client gone, a panic) releases it. Slots are per VM: one VM's busy slots never
//! hold up another's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
pub use vmhost_agent_protocol::exec::EXEC_SLOTS;

/// All of a VM's slots are in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("all {EXEC_SLOTS} exec slots of the VM are in use")]
pub struct SlotsBusy;

/// The slots of one VM: `true` while taken.
#[derive(Debug, Default)]
struct VmSlots {
    taken: [AtomicBool; EXEC_SLOTS],
}

/// The exec slots of every VM, created on first use.
#[derive(Debug, Default)]
pub struct ExecSlots {
    vms: Mutex<HashMap<String, Arc<VmSlots>>>,
}

/// One taken slot; dropping it frees the slot.
#[derive(Debug)]
pub struct SlotGuard {
    vm: Arc<VmSlots>,
    slot: usize,
}

impl SlotGuard {
    /// The slot's index (its port is `org.vmhost.exec.INDEX`).
    pub fn slot(&self) -> usize {
        self.slot
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(taken) = self.vm.taken.get(self.slot) {
            taken.store(false, Ordering::Release);
        }
    }
}

impl ExecSlots {
    /// Takes the lowest free slot of `vm` without waiting.
    ///
    /// # Errors
    /// [`SlotsBusy`] when all [`EXEC_SLOTS`] are taken.
    pub fn try_acquire(&self, vm: &str) -> Result<SlotGuard, SlotsBusy> {
        let slots = {
            let mut vms = self.vms.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(vms.entry(vm.to_string()).or_default())
        };
        for (slot, taken) in slots.taken.iter().enumerate() {
            if taken.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Ok(SlotGuard { vm: slots, slot });
            }
        }
        Err(SlotsBusy)
    }

    /// How many slots of `vm` are taken now.
    pub fn in_use(&self, vm: &str) -> usize {
        let vms = self.vms.lock().unwrap_or_else(PoisonError::into_inner);
        vms.get(vm).map_or(0, |s| s.taken.iter().filter(|t| t.load(Ordering::Acquire)).count())
    }

    /// Forgets `vm`'s entry when none of its slots is taken (a destroyed VM); a guard still
    /// held keeps its own reference, so nothing is freed under it.
    pub fn forget(&self, vm: &str) {
        let mut vms = self.vms.lock().unwrap_or_else(PoisonError::into_inner);
        if vms.get(vm).is_some_and(|s| s.taken.iter().all(|t| !t.load(Ordering::Acquire))) {
            vms.remove(vm);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_free_slot_is_taken_and_a_ninth_is_refused() {
        let slots = ExecSlots::default();
        let guards: Vec<SlotGuard> = (0..EXEC_SLOTS).map(|_| slots.try_acquire("a").unwrap()).collect();
        assert_eq!(guards.iter().map(SlotGuard::slot).collect::<Vec<_>>(), (0..EXEC_SLOTS).collect::<Vec<_>>());
        assert_eq!(slots.try_acquire("a").unwrap_err(), SlotsBusy);
        assert_eq!(slots.in_use("a"), EXEC_SLOTS);
        // Another VM is not affected.
        assert_eq!(slots.try_acquire("b").unwrap().slot(), 0);
        // A freed slot in the middle is the next one taken.
        let mut guards = guards;
        drop(guards.remove(3));
        assert_eq!(slots.try_acquire("a").unwrap().slot(), 3);
        drop(guards);
        assert_eq!(slots.in_use("a"), 0);
        slots.forget("a");
        assert_eq!(slots.in_use("a"), 0);
    }

    #[test]
    fn a_slot_is_freed_when_its_holder_panics() {
        let slots = Arc::new(ExecSlots::default());
        let s = Arc::clone(&slots);
        let r = std::thread::spawn(move || {
            let _g = s.try_acquire("a").unwrap();
            panic!("holder fails");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(slots.in_use("a"), 0);
    }

    #[test]
    fn concurrent_takers_never_share_a_slot() {
        let slots = Arc::new(ExecSlots::default());
        let got: Vec<Option<usize>> = (0..32)
            .map(|_| {
                let s = Arc::clone(&slots);
                std::thread::spawn(move || {
                    s.try_acquire("a").ok().map(|g| {
                        let n = g.slot();
                        std::mem::forget(g);
                        n
                    })
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let mut taken: Vec<usize> = got.into_iter().flatten().collect();
        taken.sort_unstable();
        assert_eq!(taken, (0..EXEC_SLOTS).collect::<Vec<_>>());
    }
}
