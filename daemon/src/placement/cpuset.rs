//! A set of host CPU numbers, written the way the kernel writes them (the cpulist form of
//! `/sys/devices/system/node/node0/cpulist`, `Cpus_allowed_list`, `taskset -c`), so the config,
//! records, views and sysfs all read alike.
//!
//! [`CpuSet::parse`] reads the text (config keys, sysfs files), the set operations build the
//! allocator's answers, and [`std::fmt::Display`] / serde write it back in the same form.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeSet;

/// The highest CPU number a cpulist may name: far above any host's, low enough that a typo
/// (`0-4000000000`) cannot make a set of billions of entries.
pub const MAX_CPU: u32 = 65_535;

/// A set of host CPU numbers. Serializes as the Linux cpulist string (`"1-3,8"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuSet(BTreeSet<u32>);

/// The kernel's affinity mask (`cpu_set_t`) of `cpus`: the one place a CPU list becomes one
/// (the spawner's child and [`super::pin`] install it).
///
/// # Errors
/// The first CPU a `cpu_set_t` cannot hold.
pub fn kernel_mask(cpus: impl IntoIterator<Item = u32>) -> Result<nix::sched::CpuSet, u32> {
    let mut mask = nix::sched::CpuSet::new();
    for cpu in cpus {
        let index = usize::try_from(cpu).map_err(|_| cpu)?;
        mask.set(index).map_err(|_| cpu)?;
    }
    Ok(mask)
}

impl CpuSet {
    /// Reads a cpulist: comma-separated `N` and `A-B` items (A <= B), spaces around items
    /// allowed, each CPU at most [`MAX_CPU`]. Items may overlap and come in any order.
    ///
    /// # Errors
    /// The text is empty, or an item is not a number or a range, or a range runs backwards,
    /// with the item in the message.
    pub fn parse(text: &str) -> Result<CpuSet, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("an empty CPU list names no CPU".into());
        }
        let number = |s: &str, item: &str| -> Result<u32, String> {
            let s = s.trim();
            match s.parse::<u32>() {
                Ok(n) if n <= MAX_CPU && s.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
                Ok(_) if s.bytes().all(|b| b.is_ascii_digit()) => {
                    Err(format!("CPU {s} in {item:?} is above the highest CPU number {MAX_CPU}"))
                }
                _ => Err(format!("{item:?} is not a CPU number or a range like \"2-5\"")),
            }
        };
        let mut set = BTreeSet::new();
        for item in text.split(',') {
            let item = item.trim();
            match item.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (number(a, item)?, number(b, item)?);
                    if a > b {
                        return Err(format!("the range {item:?} runs backwards"));
                    }
                    set.extend(a..=b);
                }
                None => {
                    set.insert(number(item, item)?);
                }
            }
        }
        Ok(CpuSet(set))
    }

    /// The CPUs, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    /// How many CPUs.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when it names no CPU.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// True when `cpu` is in the set.
    pub fn contains(&self, cpu: u32) -> bool {
        self.0.contains(&cpu)
    }

    /// The CPUs in either set.
    pub fn union(&self, o: &CpuSet) -> CpuSet {
        CpuSet(self.0.union(&o.0).copied().collect())
    }

    /// The CPUs in this set and not in `o`.
    pub fn difference(&self, o: &CpuSet) -> CpuSet {
        CpuSet(self.0.difference(&o.0).copied().collect())
    }

    /// The CPUs in both sets.
    pub fn intersection(&self, o: &CpuSet) -> CpuSet {
        CpuSet(self.0.intersection(&o.0).copied().collect())
    }

    /// The set of the given CPUs.
    pub fn from_cpus(it: impl IntoIterator<Item = u32>) -> CpuSet {
        CpuSet(it.into_iter().collect())
    }

    /// The highest CPU, if any.
    pub fn last(&self) -> Option<u32> {
        self.0.last().copied()
    }
}

impl std::fmt::Display for CpuSet {
    /// The cpulist form: runs of two or more as `A-B`, the rest single, lowest first; `""`
    /// for the empty set.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        let mut cpus = self.iter().peekable();
        while let Some(start) = cpus.next() {
            let mut end = start;
            while cpus.peek() == Some(&(end + 1)) {
                end += 1;
                cpus.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if end == start {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

impl Serialize for CpuSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for CpuSet {
    /// The cpulist form; `""` is the empty set here (a record's or view's empty holding), unlike
    /// [`CpuSet::parse`], which refuses it for config keys.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<CpuSet, D::Error> {
        let text = String::deserialize(d)?;
        if text.trim().is_empty() {
            return Ok(CpuSet::default());
        }
        CpuSet::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_forms_and_writes_them_back_canonical() {
        let cases = [
            ("0", "0", 1),
            ("0-1", "0-1", 2),
            ("2-31,34-63", "2-31,34-63", 60),
            ("8,1-3", "1-3,8", 4),
            (" 1 , 2-2 ,3\n", "1-3", 3),
            ("5,5,4-6", "4-6", 3),
            ("0,2,4", "0,2,4", 3),
            ("65535", "65535", 1),
        ];
        for (text, shown, len) in cases {
            let s = CpuSet::parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!((s.to_string().as_str(), s.len()), (shown, len), "{text:?}");
            assert_eq!(CpuSet::parse(shown).unwrap(), s);
        }
    }

    #[test]
    fn refuses_what_is_not_a_cpulist() {
        let cases = [
            ("", "empty"),
            ("  ", "empty"),
            ("a", "not a CPU number"),
            ("1,", "not a CPU number"),
            ("-1", "not a CPU number"),
            ("1-", "not a CPU number"),
            ("3-1", "backwards"),
            ("1-2-3", "not a CPU number"),
            ("+1", "not a CPU number"),
            ("65536", "above the highest"),
            ("0-4000000000", "above the highest"),
        ];
        for (text, why) in cases {
            let e = CpuSet::parse(text).expect_err(text);
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn set_operations() {
        let a = CpuSet::parse("0-5").unwrap();
        let b = CpuSet::parse("4-9").unwrap();
        assert_eq!(a.union(&b).to_string(), "0-9");
        assert_eq!(a.difference(&b).to_string(), "0-3");
        assert_eq!(a.intersection(&b).to_string(), "4-5");
        assert_eq!(b.difference(&a).difference(&b), CpuSet::default());
        assert!(a.contains(5) && !a.contains(6));
        assert_eq!(CpuSet::from_cpus([7, 3, 3]).iter().collect::<Vec<_>>(), vec![3, 7]);
        assert!(CpuSet::default().is_empty());
        assert_eq!(CpuSet::default().to_string(), "");
        assert_eq!((a.last(), CpuSet::default().last()), (Some(5), None));
    }

    #[test]
    fn serde_is_the_cpulist_string() {
        let s = CpuSet::parse("1-3,8").unwrap();
        assert_eq!(serde_json::to_value(&s).unwrap(), serde_json::json!("1-3,8"));
        assert_eq!(serde_json::from_value::<CpuSet>(serde_json::json!("8,1-3")).unwrap(), s);
        assert_eq!(serde_json::from_value::<CpuSet>(serde_json::json!("")).unwrap(), CpuSet::default());
        assert_eq!(serde_json::to_value(CpuSet::default()).unwrap(), serde_json::json!(""));
        assert!(serde_json::from_value::<CpuSet>(serde_json::json!("x")).is_err());
        assert!(serde_json::from_value::<CpuSet>(serde_json::json!([1, 2])).is_err());
    }
}
