//! How often guest-agent calls may reach one VM: a token bucket per VM and role.
//!
//! `vm.check`, `vm.guest_info` and `vm.guest_network` are read methods, so a read-only peer could
//! make the daemon and the guest's agent answer probes in a loop, and the VM's one agent session
//! would be busy for everyone else (5002). Read-only peers together get [`READONLY`] per VM;
//! admins (root and the admin group) have their own bucket per VM ([`ADMIN`]), so read-only
//! traffic never spends theirs. A refused call gets 1004 before anything is dispatched.
//!
//! Used per call of a method whose rate class is `Agent` in the method table
//! ([`super::methods::METHODS`]), once its params are parsed: [`AgentRate::check`] (its `name`
//! param and the peer's role), which runs the pure [`Bucket::take`] under a lock.

use crate::api::{ApiError, Code};
use crate::rpc::auth::Role;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A rate: `burst` calls at once, then one call per `every`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Calls that may come at once.
    pub burst: u32,
    /// Time to earn one more call.
    pub every: Duration,
}

/// Read-only peers, together, per VM: 5 at once, then 1 per second.
pub const READONLY: Rate = Rate { burst: 5, every: Duration::from_secs(1) };

/// Admins, together, per VM: 200 at once, then 100 per second. Generous (an admin may stop or
/// destroy the VM anyway); it only keeps a runaway admin loop from holding the agent session, and
/// lets the benchmark's 200 back-to-back `vm.check`s through.
pub const ADMIN: Rate = Rate { burst: 200, every: Duration::from_millis(10) };

/// Buckets kept at most; beyond that, calls for names without a bucket share one overflow
/// bucket per role (so that made-up names cannot grow the map).
pub const MAX_BUCKETS: usize = 1024;

/// Longest name that gets its own bucket (longer ones are no VM's name and share the overflow).
const MAX_NAME: usize = 64;

/// One token bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Calls available at `at`.
    tokens: f64,
    /// When `tokens` was counted.
    at: Instant,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn full(rate: Rate, now: Instant) -> Bucket {
        Bucket { tokens: f64::from(rate.burst), at: now }
    }

    /// Takes one call at `now`; `Err(wait)` with the time until one is available.
    ///
    /// # Errors
    /// The wait until the next call is allowed.
    pub fn take(&mut self, rate: Rate, now: Instant) -> Result<(), Duration> {
        let earned = now.saturating_duration_since(self.at).as_secs_f64() / rate.every.as_secs_f64();
        self.tokens = (self.tokens + earned).min(f64::from(rate.burst));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(rate.every.mul_f64(1.0 - self.tokens))
        }
    }

    /// True when the bucket has refilled by `now` (it can be forgotten without changing anything).
    fn is_full(&self, rate: Rate, now: Instant) -> bool {
        let earned = now.saturating_duration_since(self.at).as_secs_f64() / rate.every.as_secs_f64();
        self.tokens + earned >= f64::from(rate.burst)
    }
}

/// The buckets of every VM name and role.
#[derive(Debug, Default)]
pub struct AgentRate {
    buckets: Mutex<HashMap<(String, bool), Bucket>>,
}

impl AgentRate {
    /// Counts a guest-agent call for VM `name` by a peer of `role`.
    ///
    /// # Errors
    /// 1004 with `field: "name"` and `details.retry_after_ms`.
    pub fn check(&self, name: &str, role: Role) -> Result<(), ApiError> {
        let readonly = role == Role::ReadOnly;
        let rate = if readonly { READONLY } else { ADMIN };
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|(_, ro), b| !b.is_full(if *ro { READONLY } else { ADMIN }, now));
        }
        let mut key = (name.to_string(), readonly);
        if key.0.len() > MAX_NAME || (buckets.len() >= MAX_BUCKETS && !buckets.contains_key(&key)) {
            key.0 = String::new();
        }
        let bucket = buckets.entry(key).or_insert_with(|| Bucket::full(rate, now));
        bucket.take(rate, now).map_err(|wait| {
            let per = if readonly { "read-only peers" } else { "admins" };
            let retry_after_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
            ApiError::new(
                Code::RateLimited,
                format!(
                    "too many guest-agent calls for this VM by {per} (at most {} at once, then one per {} ms); \
                     retry in {retry_after_ms} ms",
                    rate.burst,
                    rate.every.as_millis()
                ),
            )
            .field("name")
            .details(serde_json::json!({ "retry_after_ms": retry_after_ms }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let start = Instant::now();
        let mut b = Bucket::full(READONLY, start);
        for _ in 0..READONLY.burst {
            assert_eq!(b.take(READONLY, start), Ok(()));
        }
        let wait = b.take(READONLY, start).unwrap_err();
        assert_eq!(wait, READONLY.every);
        let half = start + READONLY.every / 2;
        let wait = b.take(READONLY, half).unwrap_err();
        assert!(wait <= READONLY.every / 2 + Duration::from_millis(1), "{wait:?}");
        assert_eq!(b.take(READONLY, start + READONLY.every), Ok(()));
        assert!(b.take(READONLY, start + READONLY.every).is_err());
        assert!(b.is_full(READONLY, start + READONLY.every * (READONLY.burst + 1)));
    }

    #[test]
    fn readonly_peers_do_not_spend_the_admins_calls() {
        let rate = AgentRate::default();
        for _ in 0..READONLY.burst {
            rate.check("sensor1", Role::ReadOnly).unwrap();
        }
        let err = rate.check("sensor1", Role::ReadOnly).unwrap_err();
        assert_eq!((err.code, err.field.as_deref()), (Code::RateLimited, Some("name")));
        assert!(err.details["retry_after_ms"].as_u64().unwrap() >= 1);
        // The same VM's admin bucket is full, another VM's read-only bucket too.
        rate.check("sensor1", Role::Admin).unwrap();
        rate.check("other", Role::ReadOnly).unwrap();
        assert!(rate.check("sensor1", Role::ReadOnly).is_err());
    }

    #[test]
    fn made_up_names_cannot_grow_the_map() {
        let rate = AgentRate::default();
        for i in 0..MAX_BUCKETS * 3 {
            let _ = rate.check(&format!("junk{i}"), Role::ReadOnly);
        }
        assert!(rate.buckets.lock().unwrap().len() <= MAX_BUCKETS + 1);
    }
}
