//! cloud-init NoCloud seeds: how a disk-image VM learns its hostname and network.
//!
//! [`render`] is pure: spec and NIC allocations in, the three seed files out (`meta-data`,
//! `user-data`, `network-config` version 2 with each NIC matched by its MAC). [`write_seed`]
//! puts them on a small FAT volume labelled `CIDATA` (what cloud-init's NoCloud source looks
//! for), written to a temp file and renamed into place. The lifecycle rebuilds the seed at every
//! start, so it always matches the current spec, and attaches it read-only. [`has_seed`] says
//! which VMs get one: image-booted VMs, and direct-kernel VMs with `user_data`.
//!
//! `user-data` is the spec's `user_data` verbatim when it is set, else a generated
//! `#cloud-config` setting the hostname. The hostname (`local-hostname`, `hostname`) is the
//! VM name with `_` as `-` ([`crate::validate::hostname_of`]).
//!
//! The network config is emitted as JSON, which is valid YAML: every value in it comes from a
//! validated spec, and serde_json does the quoting, so no guest-visible text is hand-escaped.

use crate::api::{Ipv4Spec, VmSpec};
use crate::nic::NicAlloc;
use crate::validate::{hostname_of, BootSource, ValidSpec};
use serde_json::{json, Map, Value};
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Size of the seed volume: small, but above FAT12's minimum, and room for the largest
/// `user_data` ([`crate::validate::MAX_USER_DATA`], 64 KiB) many times over beside the other
/// two files (a generated network config of 8 NICs is a few KiB).
const SEED_BYTES: u64 = 1024 * 1024;

/// Whether VM `vm` gets a seed: an image-booted VM always (its hostname and network come from
/// it); a direct-kernel VM only with `user_data` (its network comes from `ip=`, and a guest that
/// did not ask for a seed gets no extra disk); an imported disk never (a new instance would make
/// its cloud-init run again).
pub fn has_seed(vm: &ValidSpec) -> bool {
    match vm.boot {
        BootSource::Image { .. } => true,
        BootSource::Kernel { .. } => vm.spec.user_data.is_some(),
        BootSource::Disk { .. } => false,
    }
}

/// The files of a seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedFiles {
    /// `meta-data`: instance id and hostname.
    pub meta_data: String,
    /// `user-data`: a cloud-config document.
    pub user_data: String,
    /// `network-config`: version 2, NICs matched by MAC.
    pub network_config: String,
}

/// Renders the seed of `spec`. The instance id changes with the spec, so cloud-init applies
/// a changed network config on the next boot; `user_data` is left out of it, so a new
/// user-data alone does not make cloud-init see a new instance and run its first-boot modules
/// again (user-data is for the first boot; a changed one only reaches a VM booting for the
/// first time, or one whose other spec fields changed too).
pub fn render(spec: &VmSpec, allocs: &[NicAlloc]) -> SeedFiles {
    let without_user_data = VmSpec { user_data: None, ..spec.clone() };
    let spec_text = serde_json::to_string(&without_user_data).unwrap_or_default();
    let digest =
        spec_text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let hostname = hostname_of(&spec.name);
    let meta = json!({ "instance-id": format!("vmhost-{}-{digest:016x}", spec.name), "local-hostname": hostname });
    let mut ethernets = Map::new();
    for (i, (nic, alloc)) in spec.nics.iter().zip(allocs).enumerate() {
        let mut e = Map::new();
        e.insert("match".into(), json!({ "macaddress": alloc.mac }));
        e.insert("set-name".into(), json!(format!("eth{i}")));
        match &nic.ipv4 {
            Some(Ipv4Spec::Dhcp {}) => {
                e.insert("dhcp4".into(), json!(true));
            }
            Some(Ipv4Spec::Static { address, gateway, dns, search }) => {
                e.insert("dhcp4".into(), json!(false));
                e.insert("addresses".into(), json!([address]));
                if let Some(g) = gateway {
                    e.insert("routes".into(), json!([{ "to": "default", "via": g }]));
                }
                if !dns.is_empty() || !search.is_empty() {
                    e.insert("nameservers".into(), json!({ "addresses": dns, "search": search }));
                }
            }
            None => {
                e.insert("dhcp4".into(), json!(false));
            }
        }
        ethernets.insert(format!("eth{i}"), Value::Object(e));
    }
    let network = json!({ "version": 2, "ethernets": ethernets });
    SeedFiles {
        meta_data: format!("{}\n", meta),
        user_data: match &spec.user_data {
            Some(text) => text.clone(),
            None => format!("#cloud-config\n{}\n", json!({ "hostname": hostname, "preserve_hostname": false })),
        },
        network_config: format!("{}\n", serde_json::to_string_pretty(&network).unwrap_or_default()),
    }
}

/// Writes `files` as a FAT volume labelled CIDATA at `path` (temp file, then rename).
///
/// # Errors
/// I/O errors; the previous seed, if any, is then unchanged.
pub fn write_seed(path: &Path, files: &SeedFiles) -> io::Result<()> {
    let tmp = path.with_extension("img.partial");
    let result = (|| {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        file.set_len(SEED_BYTES)?;
        let mut disk = file;
        fatfs::format_volume(&mut disk, fatfs::FormatVolumeOptions::new().volume_label(*b"CIDATA     "))?;
        {
            let fs = fatfs::FileSystem::new(&mut disk, fatfs::FsOptions::new())?;
            {
                let root = fs.root_dir();
                for (name, text) in [
                    ("meta-data", &files.meta_data),
                    ("user-data", &files.user_data),
                    ("network-config", &files.network_config),
                ] {
                    let mut f = root.create_file(name)?;
                    f.truncate()?;
                    f.write_all(text.as_bytes())?;
                    f.flush()?;
                }
            }
            fs.unmount()?;
        }
        disk.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NicSpec;
    use std::io::Read;

    fn spec() -> VmSpec {
        let mut s = crate::validate::tests::spec("web1");
        s.nics = vec![
            NicSpec {
                network: "lan".into(),
                vlan: None,
                mac: None,
                ipv4: Some(Ipv4Spec::Static {
                    address: "10.0.0.5/24".into(),
                    gateway: Some("10.0.0.1".into()),
                    dns: vec!["10.0.0.1".into()],
                    search: vec!["example.org".into()],
                }),
            },
            NicSpec { network: "lan".into(), vlan: None, mac: None, ipv4: Some(Ipv4Spec::Dhcp {}) },
        ];
        s
    }

    fn allocs() -> Vec<NicAlloc> {
        vec![
            NicAlloc { mac: "02:00:00:00:00:01".into(), tap: "vmh0n0".into() },
            NicAlloc { mac: "02:00:00:00:00:02".into(), tap: "vmh0n1".into() },
        ]
    }

    #[test]
    fn network_config_matches_nics_by_mac() {
        let files = render(&spec(), &allocs());
        let net: Value = serde_json::from_str(&files.network_config).unwrap();
        assert_eq!(net["version"], 2);
        let e0 = &net["ethernets"]["eth0"];
        assert_eq!(e0["match"]["macaddress"], "02:00:00:00:00:01");
        assert_eq!(e0["addresses"], json!(["10.0.0.5/24"]));
        assert_eq!(e0["routes"], json!([{"to": "default", "via": "10.0.0.1"}]));
        assert_eq!(e0["nameservers"], json!({"addresses": ["10.0.0.1"], "search": ["example.org"]}));
        assert_eq!(net["ethernets"]["eth1"]["dhcp4"], true);
        let meta: Value = serde_json::from_str(&files.meta_data).unwrap();
        assert_eq!(meta["local-hostname"], "web1");
        assert!(files.user_data.starts_with("#cloud-config\n"));
    }

    #[test]
    fn instance_id_changes_with_the_spec() {
        let a = render(&spec(), &allocs());
        let mut changed = spec();
        changed.memory_mib += 1;
        let b = render(&changed, &allocs());
        assert_ne!(a.meta_data, b.meta_data);
        assert_eq!(a, render(&spec(), &allocs()), "deterministic");
    }

    #[test]
    fn hostnames_map_underscores_to_hyphens() {
        let mut s = spec();
        s.name = "sensor1_sensor".into();
        let files = render(&s, &allocs());
        let meta: Value = serde_json::from_str(&files.meta_data).unwrap();
        assert_eq!(meta["local-hostname"], "sensor1-sensor");
        // The instance id keeps the VM's own name (it is no hostname).
        assert!(meta["instance-id"].as_str().unwrap().starts_with("vmhost-sensor1_sensor-"), "{meta}");
        let user: Value = serde_json::from_str(files.user_data.strip_prefix("#cloud-config\n").unwrap()).unwrap();
        assert_eq!(user["hostname"], "sensor1-sensor");
    }

    #[test]
    fn user_data_is_written_verbatim_and_leaves_the_instance_id_alone() {
        let plain = render(&spec(), &allocs());
        let mut s = spec();
        let text = "#cloud-config\nruncmd:\n  - [sh, -c, 'echo {\"a\": 1} > /x']\nno newline at the end";
        s.user_data = Some(text.into());
        let with = render(&s, &allocs());
        assert_eq!(with.user_data, text);
        // meta-data (instance id, hostname) and network-config are as without user_data: a new
        // user-data alone does not make cloud-init see a new instance.
        assert_eq!((&with.meta_data, &with.network_config), (&plain.meta_data, &plain.network_config));
        s.user_data = Some("#cloud-config\n{}\n".into());
        assert_eq!(render(&s, &allocs()).meta_data, plain.meta_data);
        // An empty user_data is an empty file, not the generated one.
        s.user_data = Some(String::new());
        assert_eq!(render(&s, &allocs()).user_data, "");
    }

    #[test]
    fn kernel_vms_get_a_seed_only_with_user_data() {
        let c = crate::validate::tests::config();
        let mut s = crate::validate::tests::spec("k");
        let valid = |s: &VmSpec| crate::validate::validate_spec(s, &c).unwrap();
        assert!(!has_seed(&valid(&s)));
        s.user_data = Some("#cloud-config\n".into());
        assert!(has_seed(&valid(&s)));
        s.user_data = None;
        s.boot = crate::api::BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(1), ..Default::default() };
        assert!(has_seed(&valid(&s)));
        s.boot = crate::api::BootSpec { disk: Some("old.qcow2".into()), ..Default::default() };
        s.user_data = Some("#cloud-config\n".into());
        assert!(!has_seed(&valid(&s)), "an imported disk never gets a seed");
    }

    #[test]
    fn the_largest_user_data_fits_the_seed_volume() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("seed.img");
        let mut s = spec();
        let line = "# 0123456789 abcdefghijklmnopqrstuvwxyz {\"'}\n";
        let mut text = "#cloud-config\n".to_string();
        while text.len() + line.len() <= crate::validate::MAX_USER_DATA {
            text.push_str(line);
        }
        text.push_str(&"x".repeat(crate::validate::MAX_USER_DATA - text.len()));
        assert_eq!(text.len(), crate::validate::MAX_USER_DATA);
        s.user_data = Some(text.clone());
        let files = render(&s, &allocs());
        write_seed(&path, &files).unwrap();
        let fs = fatfs::FileSystem::new(std::fs::File::open(&path).unwrap(), fatfs::FsOptions::new()).unwrap();
        let mut read = String::new();
        fs.root_dir().open_file("user-data").unwrap().read_to_string(&mut read).unwrap();
        assert_eq!(read, text);
    }

    #[test]
    fn seed_volume_is_a_cidata_fat_with_the_files() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("seed.img");
        let files = render(&spec(), &allocs());
        write_seed(&path, &files).unwrap();
        write_seed(&path, &files).unwrap(); // rebuilding replaces it
        let file = std::fs::File::open(&path).unwrap();
        let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label().trim(), "CIDATA");
        for (name, want) in [("meta-data", &files.meta_data), ("network-config", &files.network_config)] {
            let mut text = String::new();
            fs.root_dir().open_file(name).unwrap().read_to_string(&mut text).unwrap();
            assert_eq!(&text, want);
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temp file left");
    }
}
