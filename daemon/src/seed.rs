//! cloud-init NoCloud seeds: how a disk-image VM learns its hostname and network.
//!
//! [`render`] is pure: spec, NIC allocations and instance id in, the four seed files out
//! (`meta-data`, `user-data`, `vendor-data`, `network-config` version 1 with each NIC matched by
//! its MAC). [`write_seed`] puts them on a small FAT volume labelled `CIDATA` (what cloud-init's
//! NoCloud source looks for), written to a temp file and renamed into place. The lifecycle
//! rebuilds the seed at every start, so it always matches the current spec, and attaches it
//! read-only. [`has_seed`] says which VMs get one: image-booted VMs, and direct-kernel VMs with
//! `user_data`.
//!
//! The instance id is not derived from the spec: it is recorded with the VM
//! ([`new_instance_id`] when its root disk is made, by a create or a replace) and stays the same
//! through every other change, so cloud-init runs its per-instance modules (user-data's
//! `runcmd`, SSH host keys, ...) once per root disk. A changed network still reaches the guest:
//! `vendor-data` ([`VENDOR_DATA`]) asks cloud-init to apply the network config at every boot,
//! not only a new instance's. [`legacy_instance_id`] is the id vmhost used to derive from the
//! spec, given once to VMs recorded before ids were.
//!
//! `user-data` is the spec's `user_data` verbatim when it is set, else a generated
//! `#cloud-config` setting the hostname. The spec's `ssh` account is a `users` entry of the
//! generated user-data, or of `vendor-data` when the user-data is the spec's (cloud-init merges
//! user-data over vendor-data: a `user_data` with its own `users` replaces it). The hostname (`local-hostname`, `hostname`) is the
//! VM name with `_` as `-` ([`crate::validate::hostname_of`]).
//!
//! The network config is cloud-init's version 1, which every cloud-init from 22.4 (Debian 12)
//! on turns into each renderer's own form (ENI for ifupdown, netplan, systemd-networkd,
//! NetworkManager): see [`network_config`] for why not version 2. It is emitted as JSON, which is
//! valid YAML: every value in it comes from a validated spec, and serde_json does the quoting,
//! so no guest-visible text is hand-escaped.

use crate::api::{DesiredState, Ipv4Spec, NicMode, SshSpec, VmSpec};
use crate::nic::NicAlloc;
use crate::validate::{hostname_of, ValidSpec};
use serde_json::{json, Map, Value};
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Size of the seed volume: small, but above FAT12's minimum, and room for the largest
/// `user_data` ([`crate::validate::MAX_USER_DATA`], 64 KiB) many times over beside the other
/// files (a generated network config of 8 NICs is a few KiB).
const SEED_BYTES: u64 = 1024 * 1024;

/// The seed's `vendor-data`: cloud-init applies the network config at every boot, not only at
/// a new instance's first (its default), so a changed NIC reaches a guest whose instance id
/// stays. cloud-init merges user-data over vendor-data: a `user_data` with its own `updates`
/// wins (and one with `vendor_data: {enabled: false}` turns this off).
pub const VENDOR_DATA: &str = "#cloud-config\nupdates:\n  network:\n    when: [boot-new-instance, boot]\n";

/// What can go wrong giving a VM its seed.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The record of a VM that gets a seed has no instance id: a daemon fault (every record
    /// gets one), never a reason to make a new instance.
    #[error("the record of VM {vm:?} has no cloud-init instance id")]
    NoInstanceId {
        /// The VM.
        vm: String,
    },
    /// The seed volume could not be written; the previous one, if any, is unchanged.
    #[error("cannot write the cloud-init seed: {0}")]
    Write(#[source] io::Error),
    /// `/dev/urandom` could not be read for a new instance id.
    #[error("cannot make a cloud-init instance id (/dev/urandom): {0}")]
    InstanceId(#[source] io::Error),
}

impl SeedError {
    /// The launch step the API names (`details.step`).
    pub fn step(&self) -> &'static str {
        match self {
            SeedError::NoInstanceId { .. } | SeedError::Write(_) => "seed",
            SeedError::InstanceId(_) => "instance_id",
        }
    }
}

/// Whether VM `vm` gets a seed: an image-booted VM always (its hostname and network come from
/// it); a direct-kernel VM only with `user_data` (its network comes from `ip=`, and a guest that
/// did not ask for a seed gets no extra disk); an imported disk never (a new instance would make
/// its cloud-init run again).
pub fn has_seed(vm: &ValidSpec) -> bool {
    spec_has_seed(&vm.spec)
}

/// [`has_seed`] of a validated or recorded spec, which names exactly one boot source (`image`,
/// `kernel` or `disk`): also what views use to show the instance id only of VMs with a seed.
pub fn spec_has_seed(spec: &VmSpec) -> bool {
    if spec.boot.image.is_some() {
        true
    } else {
        spec.boot.kernel.is_some() && spec.user_data.is_some()
    }
}

/// The files of a seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedFiles {
    /// `meta-data`: instance id and hostname.
    pub meta_data: String,
    /// `user-data`: the spec's `user_data`, else a cloud-config setting the hostname.
    pub user_data: String,
    /// `vendor-data`: [`VENDOR_DATA`].
    pub vendor_data: String,
    /// `network-config`: version 1, NICs matched by MAC.
    pub network_config: String,
}

/// Renders the seed of `spec`, whose NICs got `allocs` (their MACs, in spec order), for the
/// instance `instance_id` (the VM record's: [`new_instance_id`], or [`legacy_instance_id`] for
/// a VM recorded before ids were). Pure: the same arguments give the same files.
pub fn render(spec: &VmSpec, allocs: &[NicAlloc], instance_id: &str) -> SeedFiles {
    let hostname = hostname_of(&spec.name);
    let meta = json!({ "instance-id": instance_id, "local-hostname": hostname });
    let users = spec.ssh.as_ref().map(users);
    let mut vendor_data = VENDOR_DATA.to_string();
    let user_data = match &spec.user_data {
        Some(text) => {
            // The user's text is not ours to edit (it may be a script or a MIME archive):
            // the account goes into vendor-data, which cloud-init merges under it.
            if let Some(users) = &users {
                vendor_data.push_str(&format!("users: {users}\n"));
            }
            text.clone()
        }
        None => {
            let mut config = json!({ "hostname": hostname, "preserve_hostname": false });
            if let Some(users) = users {
                config["users"] = users;
            }
            format!("#cloud-config\n{config}\n")
        }
    };
    SeedFiles { meta_data: format!("{}\n", meta), user_data, vendor_data, network_config: network_config(spec, allocs) }
}

/// cloud-init's `users` for the spec's `ssh`: the distribution's default user as without it
/// (`default`), then the account with the keys, its password locked and no `sudo`. cloud-init
/// creates it at a new instance's first boot only (`users` is a per-instance module); a key
/// changed later reaches the guest through the exec server's `ssh.authorize`.
fn users(ssh: &SshSpec) -> Value {
    json!(["default", {
        "name": ssh.user,
        "lock_passwd": true,
        "shell": "/bin/sh",
        "ssh_authorized_keys": ssh.keys,
    }])
}

/// The `network-config` of `spec`'s NICs, in cloud-init's network config **version 1**: one
/// `physical` entry per NIC, named `eth<i>` and matched by its MAC, with one subnet: `static`
/// (address, gateway, `dns_nameservers`, `dns_search`, each only when declared), `dhcp4`, or
/// `manual` with `control: auto` (a NIC without an address is brought up, as `vm.check`
/// expects). A monitor NIC is always `manual`: listed, up, no address (the guest agent sets it
/// promiscuous).
///
/// Why version 1 and not 2: cloud-init itself turns version 1 into each renderer's own form
/// (ifupdown's `gateway` line, netplan's default route, networkd's `[Route]`), so every version
/// from 22.4 gets it right. Version 2 is passed to netplan almost verbatim but translated by
/// cloud-init for the others, and 22.4 (Debian 12) drops the whole config over `to: default`,
/// over a `nameservers` with `search` and no `addresses`, renders a default route as
/// `post-up route add` (net-tools, absent from most images) and writes a stray `dns` option
/// into the interface stanza. `tests/tests/real_guests.rs` renders every form with the real
/// cloud-init of Debian 12 and 13.
fn network_config(spec: &VmSpec, allocs: &[NicAlloc]) -> String {
    let config: Vec<Value> = spec
        .nics
        .iter()
        .zip(allocs)
        .enumerate()
        .map(|(i, (nic, alloc))| {
            // A monitor NIC is brought up and never addressed, whatever else the spec says:
            // it only receives copies of its source's frames.
            let ipv4 = if nic.mode == NicMode::Monitor { &None } else { &nic.ipv4 };
            let subnet = match ipv4 {
                Some(Ipv4Spec::Static { address, gateway, dns, search }) => {
                    let mut sub = Map::new();
                    sub.insert("type".into(), json!("static"));
                    sub.insert("address".into(), json!(address));
                    if let Some(g) = gateway {
                        sub.insert("gateway".into(), json!(g));
                    }
                    if !dns.is_empty() {
                        sub.insert("dns_nameservers".into(), json!(dns));
                    }
                    if !search.is_empty() {
                        sub.insert("dns_search".into(), json!(search));
                    }
                    Value::Object(sub)
                }
                Some(Ipv4Spec::Dhcp {}) => json!({ "type": "dhcp4" }),
                None => json!({ "type": "manual", "control": "auto" }),
            };
            json!({ "type": "physical", "name": format!("eth{i}"), "mac_address": alloc.mac, "subnets": [subnet] })
        })
        .collect();
    let network = json!({ "version": 1, "config": config });
    format!("{}\n", serde_json::to_string_pretty(&network).unwrap_or_default())
}

/// A new instance id for VM `name`: `vmhost-NAME-` and 128 random bits in hex (from
/// `/dev/urandom`), made when the VM gets a new root disk.
///
/// # Errors
/// [`SeedError::InstanceId`] when `/dev/urandom` cannot be read.
pub fn new_instance_id(name: &str) -> Result<String, SeedError> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).map_err(SeedError::InstanceId)?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("vmhost-{name}-{hex}"))
}

/// The instance id vmhost derived from the spec before it recorded one (`vmhost-NAME-` and a
/// 64-bit FNV-1a digest of the spec without `user_data`, as serialized JSON): a VM recorded by
/// such a version keeps the id its guest last booted with.
pub fn legacy_instance_id(spec: &VmSpec) -> String {
    let without_user_data = VmSpec { user_data: None, ..spec.clone() };
    let spec_text = serde_json::to_string(&without_user_data).unwrap_or_default();
    let digest =
        spec_text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("vmhost-{}-{digest:016x}", spec.name)
}

/// The instance id a VM recorded before ids were gets, once: the one in its seed volume at
/// `seed` (the seed its guest was last started with, rebuilt at every start) when that holds a
/// `vmhost-NAME-HEX` id; else [`legacy_instance_id`] of `booted`, the spec its guest last booted
/// (as launched: desired state running).
pub fn adopted_instance_id(seed: &Path, booted: &VmSpec) -> String {
    let prefix = format!("vmhost-{}-", booted.name);
    let from_seed = read_seed_file(seed, "meta-data")
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .and_then(|meta| meta.get("instance-id").and_then(Value::as_str).map(str::to_string))
        .filter(|id| {
            id.strip_prefix(&prefix)
                .is_some_and(|hex| !hex.is_empty() && hex.len() <= 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        });
    from_seed.unwrap_or_else(|| legacy_instance_id(&VmSpec { state: DesiredState::Running, ..booted.clone() }))
}

/// The text of file `name` on the seed volume at `path` (at most [`SEED_BYTES`]).
///
/// # Errors
/// The volume or the file cannot be read, or the file is not UTF-8.
pub fn read_seed_file(path: &Path, name: &str) -> io::Result<String> {
    let file = std::fs::File::open(path)?;
    let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new())?;
    let mut text = String::new();
    fs.root_dir().open_file(name)?.take(SEED_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// Writes `files` as a FAT volume labelled CIDATA at `path` (temp file, then rename).
///
/// # Errors
/// [`SeedError::Write`]; the previous seed, if any, is then unchanged.
pub fn write_seed(path: &Path, files: &SeedFiles) -> Result<(), SeedError> {
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
                    ("vendor-data", &files.vendor_data),
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
    result.map_err(SeedError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NicSpec;

    const ID: &str = "vmhost-web1-0123456789abcdef0123456789abcdef";

    fn static_nic(gateway: Option<&str>, dns: &[&str], search: &[&str]) -> NicSpec {
        NicSpec {
            network: "lan".into(),
            vlan: None,
            mac: None,
            ipv4: Some(Ipv4Spec::Static {
                address: "10.0.0.5/24".into(),
                gateway: gateway.map(str::to_string),
                dns: dns.iter().map(|s| s.to_string()).collect(),
                search: search.iter().map(|s| s.to_string()).collect(),
            }),
            queues: 1,
            ..Default::default()
        }
    }

    fn spec() -> VmSpec {
        let mut s = crate::validate::tests::spec("web1");
        s.nics = vec![
            static_nic(Some("10.0.0.1"), &["10.0.0.1"], &["example.org"]),
            NicSpec { network: "lan".into(), ipv4: Some(Ipv4Spec::Dhcp {}), ..Default::default() },
        ];
        s
    }

    fn alloc(i: usize) -> NicAlloc {
        NicAlloc { mac: format!("02:00:00:00:00:{:02x}", i + 1), tap: format!("vmh0n{i}"), vhost: false }
    }

    fn allocs() -> Vec<NicAlloc> {
        (0..2).map(alloc).collect()
    }

    /// The `config` entries of the network config of `spec` (with `allocs` for its NICs).
    fn entries(spec: &VmSpec) -> Vec<Value> {
        let allocs: Vec<NicAlloc> = (0..spec.nics.len()).map(alloc).collect();
        let net: Value = serde_json::from_str(&render(spec, &allocs, ID).network_config).unwrap();
        assert_eq!(net.as_object().unwrap().len(), 2, "version and config only: {net}");
        assert_eq!(net["version"], 1);
        net["config"].as_array().unwrap().clone()
    }

    /// The one subnet of the network config of a VM with the one NIC `nic`, checking the entry
    /// around it.
    fn one_nic(nic: NicSpec) -> Value {
        let mut s = spec();
        s.nics = vec![nic];
        let e = entries(&s);
        assert_eq!(e.len(), 1);
        let subnets = e[0]["subnets"].as_array().unwrap();
        assert_eq!(subnets.len(), 1, "{e:?}");
        let mut entry = e[0].clone();
        entry.as_object_mut().unwrap().remove("subnets");
        assert_eq!(entry, json!({"type": "physical", "name": "eth0", "mac_address": "02:00:00:00:00:01"}));
        subnets[0].clone()
    }

    #[test]
    fn a_static_nic_with_gateway_dns_and_search() {
        let sub = one_nic(static_nic(Some("10.0.0.1"), &["10.0.0.1", "10.0.0.2"], &["example.org", "lab.example"]));
        assert_eq!(
            sub,
            json!({
                "type": "static",
                "address": "10.0.0.5/24",
                // A subnet's gateway: cloud-init writes each renderer's own default route
                // (ifupdown's `gateway` line, not `post-up route add`, which needs net-tools).
                "gateway": "10.0.0.1",
                "dns_nameservers": ["10.0.0.1", "10.0.0.2"],
                "dns_search": ["example.org", "lab.example"],
            })
        );
    }

    #[test]
    fn a_static_nic_without_gateway_has_no_route() {
        let sub = one_nic(static_nic(None, &["10.0.0.1"], &[]));
        assert_eq!(sub, json!({"type": "static", "address": "10.0.0.5/24", "dns_nameservers": ["10.0.0.1"]}));
    }

    #[test]
    fn dns_lists_hold_only_what_is_declared() {
        let sub = one_nic(static_nic(Some("10.0.0.1"), &[], &[]));
        assert_eq!(sub, json!({"type": "static", "address": "10.0.0.5/24", "gateway": "10.0.0.1"}));
        // Search domains without servers are kept (version 1 takes them; version 2 made 22.4
        // drop everything).
        let sub = one_nic(static_nic(Some("10.0.0.1"), &[], &["example.org"]));
        assert_eq!(sub["dns_search"], json!(["example.org"]));
        assert!(sub.get("dns_nameservers").is_none(), "{sub}");
        let sub = one_nic(static_nic(Some("10.0.0.1"), &["192.0.2.53"], &[]));
        assert_eq!(sub["dns_nameservers"], json!(["192.0.2.53"]));
        assert!(sub.get("dns_search").is_none(), "{sub}");
    }

    #[test]
    fn dhcp_and_unconfigured_nics() {
        let sub = one_nic(NicSpec { network: "lan".into(), ipv4: Some(Ipv4Spec::Dhcp {}), ..Default::default() });
        assert_eq!(sub, json!({"type": "dhcp4"}));
        // Brought up without an address (vm.check expects every NIC up).
        let sub = one_nic(NicSpec { network: "lan".into(), ..Default::default() });
        assert_eq!(sub, json!({"type": "manual", "control": "auto"}));
    }

    #[test]
    fn several_nics_are_matched_by_mac_and_named_in_order() {
        let mut s = spec();
        s.nics = (0..8)
            .map(|i| match i % 3 {
                0 => static_nic(Some("10.0.0.1"), &["10.0.0.1"], &[]),
                1 => NicSpec {
                    network: "lan".into(),
                    vlan: Some(7),
                    mac: None,
                    ipv4: Some(Ipv4Spec::Dhcp {}),
                    queues: 1,
                    ..Default::default()
                },
                _ => NicSpec { network: "lan".into(), ..Default::default() },
            })
            .collect();
        let e = entries(&s);
        assert_eq!(e.len(), 8);
        for (i, n) in e.iter().enumerate() {
            assert_eq!(n["type"], "physical");
            assert_eq!(n["name"], format!("eth{i}"));
            assert_eq!(n["mac_address"], format!("02:00:00:00:00:{:02x}", i + 1), "{i}");
            let kind = ["static", "dhcp4", "manual"][i % 3];
            assert_eq!(n["subnets"][0]["type"], kind, "{i}");
        }
        // No NICs: an empty config list, still a valid version 1 config.
        s.nics.clear();
        assert!(entries(&s).is_empty());
    }

    #[test]
    fn meta_data_holds_the_given_instance_id_and_the_hostname() {
        let files = render(&spec(), &allocs(), ID);
        let meta: Value = serde_json::from_str(&files.meta_data).unwrap();
        assert_eq!(meta, json!({"instance-id": ID, "local-hostname": "web1"}));
        assert!(files.user_data.starts_with("#cloud-config\n"));
    }

    #[test]
    fn vendor_data_re_reads_the_network_config_at_every_boot() {
        let files = render(&spec(), &allocs(), ID);
        assert_eq!(files.vendor_data, VENDOR_DATA);
        assert_eq!(
            files.vendor_data,
            "#cloud-config\nupdates:\n  network:\n    when: [boot-new-instance, boot]\n",
            "cloud-init's `updates` (stages.update_event_enabled): apply the network at a new instance and at every boot"
        );
        // The same whatever the spec: user-data stays the user's, vendor-data stays ours.
        let mut s = spec();
        s.user_data = Some("#cloud-config\nupdates: {network: {when: [boot-new-instance]}}\n".into());
        let with = render(&s, &allocs(), ID);
        assert_eq!(with.vendor_data, VENDOR_DATA);
        assert_eq!(with.user_data, s.user_data.unwrap());
    }

    #[test]
    fn the_instance_id_is_the_one_given_whatever_the_spec() {
        let base = render(&spec(), &allocs(), ID);
        let id = |s: &VmSpec, a: &[NicAlloc]| -> String {
            let meta: Value = serde_json::from_str(&render(s, a, ID).meta_data).unwrap();
            meta["instance-id"].as_str().unwrap().to_string()
        };
        let changes: Vec<fn(&mut VmSpec)> = vec![
            |s| s.memory_mib += 1,
            |s| s.cpu = 4,
            |s| s.state = DesiredState::Stopped,
            |s| s.role = Some("sensor".into()),
            |s| s.nics[0] = static_nic(None, &[], &[]),
            |s| s.nics.push(NicSpec { network: "lan".into(), ..Default::default() }),
            |s| s.nics.clear(),
            |s| s.disks = vec![crate::validate::tests::data_disk("nsm", 2, crate::api::DiskFormat::Raw)],
            |s| s.restart_policy = crate::api::RestartPolicy::Always,
            |s| s.boot.cmdline = Some("console=ttyS0 quiet".into()),
            |s| s.boot.firmware = crate::api::Firmware::Uefi,
            |s| {
                s.boot = crate::api::BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(9), ..Default::default() }
            },
            |s| s.user_data = Some("#cloud-config\nruncmd: [true]\n".into()),
            |s| s.user_data = Some(String::new()),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut s = spec();
            change(&mut s);
            assert_eq!(id(&s, &allocs()), ID, "change {i}");
            assert_eq!(render(&s, &allocs(), ID).meta_data, base.meta_data, "change {i}");
        }
        // Other MACs (a NIC taken by another VM meanwhile) neither.
        let other: Vec<NicAlloc> = (5..7).map(alloc).collect();
        assert_eq!(id(&spec(), &other), ID);
        assert_eq!(base, render(&spec(), &allocs(), ID), "deterministic");
    }

    #[test]
    fn new_instance_ids_are_128_random_bits_after_the_name() {
        let a = new_instance_id("sensor1_sensor").unwrap();
        let b = new_instance_id("sensor1_sensor").unwrap();
        assert_ne!(a, b);
        for id in [&a, &b] {
            let hex = id.strip_prefix("vmhost-sensor1_sensor-").unwrap();
            assert_eq!(hex.len(), 32, "{id}");
            assert!(hex.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)), "{id}");
        }
    }

    #[test]
    fn the_legacy_id_is_the_old_digest_of_the_spec() {
        // What vmhost's render wrote into meta-data before ids were recorded (computed by that
        // code for these specs): an upgraded VM keeps it.
        assert_eq!(legacy_instance_id(&spec()), "vmhost-web1-5d1e5f0897a5bd7d");
        let mut k = crate::validate::tests::spec("sensor1_sensor");
        k.user_data = Some("x".into());
        assert_eq!(legacy_instance_id(&k), "vmhost-sensor1_sensor-6b4d1520cbede52a");
        // user_data was left out of it; every other field was in.
        k.user_data = Some("y".into());
        assert_eq!(legacy_instance_id(&k), "vmhost-sensor1_sensor-6b4d1520cbede52a");
        k.memory_mib += 1;
        assert_ne!(legacy_instance_id(&k), "vmhost-sensor1_sensor-6b4d1520cbede52a");
    }

    #[test]
    fn an_adopted_id_is_the_seed_s_else_the_legacy_digest_of_the_booted_spec() {
        let d = tempfile::tempdir().unwrap();
        let seed = d.path().join("web1.img");
        // No seed: the digest of the spec as launched (desired state running).
        let mut stopped = spec();
        stopped.state = DesiredState::Stopped;
        assert_eq!(adopted_instance_id(&seed, &stopped), "vmhost-web1-5d1e5f0897a5bd7d");
        // A seed written by an older vmhost: its id, whatever the spec says now (a restart
        // policy or guest interfaces changed live since, without a new seed).
        let mut then = spec();
        then.memory_mib = 1024;
        let old = legacy_instance_id(&then);
        write_seed(&seed, &render(&then, &allocs(), &old)).unwrap();
        assert_eq!(adopted_instance_id(&seed, &spec()), old);
        // A seed whose id is not this VM's vmhost id (hand-made, another VM's): the digest.
        for bad in ["vmhost-web2-5d1e5f0897a5bd7d", "other", "vmhost-web1-", "vmhost-web1-xyz", "vmhost-web1-0/../x"] {
            write_seed(&seed, &render(&then, &allocs(), bad)).unwrap();
            assert_eq!(adopted_instance_id(&seed, &spec()), "vmhost-web1-5d1e5f0897a5bd7d", "{bad}");
        }
        // Not a FAT volume: the digest.
        std::fs::write(&seed, b"junk").unwrap();
        assert_eq!(adopted_instance_id(&seed, &spec()), "vmhost-web1-5d1e5f0897a5bd7d");
    }

    #[test]
    fn hostnames_map_underscores_to_hyphens() {
        let mut s = spec();
        s.name = "sensor1_sensor".into();
        let files = render(&s, &allocs(), "vmhost-sensor1_sensor-00");
        let meta: Value = serde_json::from_str(&files.meta_data).unwrap();
        assert_eq!(meta["local-hostname"], "sensor1-sensor");
        // The instance id keeps the VM's own name (it is no hostname).
        assert_eq!(meta["instance-id"], "vmhost-sensor1_sensor-00");
        let user: Value = serde_json::from_str(files.user_data.strip_prefix("#cloud-config\n").unwrap()).unwrap();
        assert_eq!(user["hostname"], "sensor1-sensor");
    }

    const KEYS: [&str; 2] = [
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@example",
        "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY= \"quoted\" comment",
    ];

    fn with_ssh(mut s: VmSpec) -> VmSpec {
        s.ssh = Some(SshSpec { user: "ops".into(), keys: KEYS.iter().map(|k| k.to_string()).collect() });
        s
    }

    /// The `users` the spec's ssh makes, as cloud-init reads it.
    fn expected_users() -> Value {
        json!(["default", {"name": "ops", "lock_passwd": true, "shell": "/bin/sh", "ssh_authorized_keys": KEYS}])
    }

    #[test]
    fn ssh_keys_are_a_users_entry_of_the_generated_user_data() {
        let plain = render(&spec(), &allocs(), ID);
        let with = render(&with_ssh(spec()), &allocs(), ID);
        let user: Value = serde_json::from_str(with.user_data.strip_prefix("#cloud-config\n").unwrap()).unwrap();
        assert_eq!(user, json!({"hostname": "web1", "preserve_hostname": false, "users": expected_users()}));
        // No sudo, no other file changed.
        assert!(!with.user_data.contains("sudo"), "{}", with.user_data);
        assert_eq!(
            (&with.meta_data, &with.vendor_data, &with.network_config),
            (&plain.meta_data, &plain.vendor_data, &plain.network_config)
        );
        // Without ssh the generated user-data is as it always was.
        assert_eq!(plain.user_data, "#cloud-config\n{\"hostname\":\"web1\",\"preserve_hostname\":false}\n");
    }

    #[test]
    fn with_the_spec_s_user_data_ssh_keys_go_to_vendor_data() {
        let text = "#!/bin/sh\necho not a cloud-config\n";
        let mut s = with_ssh(spec());
        s.user_data = Some(text.into());
        let files = render(&s, &allocs(), ID);
        assert_eq!(files.user_data, text, "the user's text is never edited");
        let users_line = files.vendor_data.strip_prefix(VENDOR_DATA).unwrap();
        let users: Value = serde_json::from_str(users_line.strip_prefix("users: ").unwrap().trim_end()).unwrap();
        assert_eq!(users, expected_users());
        assert!(users_line.ends_with('\n') && users_line.lines().count() == 1, "{users_line:?}");
    }

    #[test]
    fn a_seed_with_ssh_keys_is_written_and_read_back() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("seed.img");
        let mut s = with_ssh(spec());
        s.ssh.as_mut().unwrap().keys =
            vec![format!("ssh-rsa {}", "A".repeat(crate::validate::MAX_SSH_KEY_LINE - 8)); 16];
        for user_data in [None, Some("#cloud-config\n".to_string())] {
            s.user_data = user_data;
            let files = render(&s, &allocs(), ID);
            write_seed(&path, &files).unwrap();
            assert_eq!(read_seed_file(&path, "user-data").unwrap(), files.user_data);
            assert_eq!(read_seed_file(&path, "vendor-data").unwrap(), files.vendor_data);
        }
    }

    #[test]
    fn user_data_is_written_verbatim_and_changes_no_other_file() {
        let plain = render(&spec(), &allocs(), ID);
        let mut s = spec();
        let text = "#cloud-config\nruncmd:\n  - [sh, -c, 'echo {\"a\": 1} > /x']\nno newline at the end";
        s.user_data = Some(text.into());
        let with = render(&s, &allocs(), ID);
        assert_eq!(with.user_data, text);
        assert_eq!(
            (&with.meta_data, &with.vendor_data, &with.network_config),
            (&plain.meta_data, &plain.vendor_data, &plain.network_config)
        );
        // An empty user_data is an empty file, not the generated one.
        s.user_data = Some(String::new());
        assert_eq!(render(&s, &allocs(), ID).user_data, "");
    }

    #[test]
    fn kernel_vms_get_a_seed_only_with_user_data() {
        let c = crate::validate::tests::config();
        let mut s = crate::validate::tests::spec("k");
        let valid = |s: &VmSpec| crate::validate::validate_spec(s, &c).unwrap();
        // spec_has_seed says the same of the spec.
        let seeded = |s: &VmSpec| {
            let v = has_seed(&valid(s));
            assert_eq!(spec_has_seed(s), v, "{s:?}");
            v
        };
        assert!(!seeded(&s));
        s.user_data = Some("#cloud-config\n".into());
        assert!(seeded(&s));
        s.user_data = None;
        s.boot = crate::api::BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(1), ..Default::default() };
        assert!(seeded(&s));
        s.user_data = Some("#cloud-config\n".into());
        assert!(seeded(&s));
        s.boot = crate::api::BootSpec { disk: Some("old.qcow2".into()), ..Default::default() };
        assert!(!seeded(&s), "an imported disk never gets a seed");
        s.user_data = None;
        assert!(!seeded(&s));
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
        s.nics = (0..8).map(|_| static_nic(Some("10.0.0.1"), &["10.0.0.1"; 3], &["example.org"; 6])).collect();
        let allocs: Vec<NicAlloc> = (0..8).map(alloc).collect();
        let files = render(&s, &allocs, ID);
        write_seed(&path, &files).unwrap();
        assert_eq!(read_seed_file(&path, "user-data").unwrap(), text);
        assert_eq!(read_seed_file(&path, "network-config").unwrap(), files.network_config);
    }

    #[test]
    fn seed_volume_is_a_cidata_fat_with_the_files() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("seed.img");
        let files = render(&spec(), &allocs(), ID);
        write_seed(&path, &files).unwrap();
        write_seed(&path, &files).unwrap(); // rebuilding replaces it
        let file = std::fs::File::open(&path).unwrap();
        let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label().trim(), "CIDATA");
        let mut names: Vec<String> = fs.root_dir().iter().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["meta-data", "network-config", "user-data", "vendor-data"]);
        for (name, want) in [
            ("meta-data", &files.meta_data),
            ("user-data", &files.user_data),
            ("vendor-data", &files.vendor_data),
            ("network-config", &files.network_config),
        ] {
            assert_eq!(&read_seed_file(&path, name).unwrap(), want, "{name}");
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temp file left");
    }

    #[test]
    fn monitor_nics_are_listed_up_without_an_address() {
        let monitor = NicSpec { mode: NicMode::Monitor, source: Some("eth1".into()), ..Default::default() };
        assert_eq!(one_nic(monitor.clone()), json!({"type": "manual", "control": "auto"}));
        // Even an ipv4 that validation would refuse never reaches the guest as an address.
        let sub = one_nic(NicSpec { ipv4: Some(Ipv4Spec::Dhcp {}), ..monitor });
        assert_eq!(sub, json!({"type": "manual", "control": "auto"}));
    }
}
