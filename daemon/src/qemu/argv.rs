//! The QEMU command line for a VM: a pure function of (spec, config, paths), built as an argv.
//!
//! Nothing here runs anything. [`VmPaths::for_vm`] fixes where each VM's files live, and
//! [`build_argv`] turns a validated spec into arguments. Values that go into QEMU option lists
//! have their commas doubled ([`escape_opt`]) so no path can inject an extra option.

use crate::config::{Accel, Config};
use crate::nic::{kernel_ip_params, NicAlloc};
use crate::qemu::launch::FIRST_PASSED_FD;
use crate::validate::{BootSource, ValidSpec};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// virtio-serial port name the guest agent looks for.
pub const AGENT_PORT_NAME: &str = "org.vmhost.agent.0";

/// Longest `paths.run` for which every VM socket path fits in `sun_path` (107 bytes + NUL):
/// `RUN/` + 63-byte name + `/agent`.
pub const MAX_RUN_DIR_LEN: usize = 107 - 1 - 63 - 6;

/// Where one VM's files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPaths {
    /// `RUN/NAME`: sockets and pid file; removed when the VM stops.
    pub run_dir: PathBuf,
    /// QMP control socket.
    pub qmp: PathBuf,
    /// Guest agent chardev socket.
    pub agent: PathBuf,
    /// QEMU's pid file.
    pub pidfile: PathBuf,
    /// Serial console log, kept across restarts until destroy.
    pub serial_log: PathBuf,
    /// qcow2 overlay for image-booted VMs.
    pub overlay: PathBuf,
    /// cloud-init NoCloud seed for image-booted VMs, rebuilt at every start.
    pub seed: PathBuf,
}

impl VmPaths {
    /// The paths of VM `name` under the configured directories.
    pub fn for_vm(config: &Config, name: &str) -> VmPaths {
        let run_dir = config.paths.run.join(name);
        VmPaths {
            qmp: run_dir.join("qmp"),
            agent: run_dir.join("agent"),
            pidfile: run_dir.join("qemu.pid"),
            run_dir,
            serial_log: config.paths.state.join("logs").join(format!("{name}.serial.log")),
            overlay: config.paths.state.join("disks").join(format!("{name}.qcow2")),
            seed: config.paths.state.join("seeds").join(format!("{name}.img")),
        }
    }

    /// The text that identifies this VM's QEMU in /proc/PID/cmdline: its QMP socket path as it
    /// appears in the argv. Unique per VM because the name is unique.
    pub fn cmdline_marker(&self) -> String {
        format!("path={}", escape_opt(&self.qmp))
    }
}

/// Doubles commas, QEMU's escape inside option lists.
pub fn escape_opt(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// The argv (without the binary) that launches `vm` daemonized. NIC `i` uses the tap passed
/// as fd `FIRST_PASSED_FD + i` (see [`crate::qemu::launch::LaunchRequest::fds`]) with the MAC
/// from `nics[i]`; a direct-kernel VM also gets the guest addresses as `ip=` parameters.
pub fn build_argv(vm: &ValidSpec, config: &Config, paths: &VmPaths, nics: &[NicAlloc]) -> Vec<OsString> {
    let spec = &vm.spec;
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    push(&["-name", &format!("guest={},debug-threads=on", spec.name)]);
    push(&["-machine", &config.qemu.machine]);
    push(&["-accel", config.qemu.accel.as_str()]);
    if config.qemu.accel == Accel::Kvm {
        push(&["-cpu", "host"]);
    }
    push(&["-smp", &spec.cpu.to_string(), "-m", &spec.memory_mib.to_string()]);
    push(&["-nodefaults", "-no-user-config", "-display", "none"]);
    push(&["-daemonize", "-pidfile", &paths.pidfile.to_string_lossy()]);
    push(&["-chardev", &format!("socket,id=qmp,{},server=on,wait=off", paths.cmdline_marker())]);
    push(&["-mon", "chardev=qmp,mode=control"]);
    push(&["-chardev", &format!("file,id=serial0,path={},append=on", escape_opt(&paths.serial_log))]);
    push(&["-serial", "chardev:serial0"]);
    push(&["-device", "virtio-serial-pci,id=vser0"]);
    push(&["-chardev", &format!("socket,id=agent0,path={},server=on,wait=off", escape_opt(&paths.agent))]);
    push(&["-device", &format!("virtserialport,bus=vser0.0,chardev=agent0,name={AGENT_PORT_NAME}")]);
    for (i, nic) in nics.iter().enumerate() {
        let fd = FIRST_PASSED_FD + i as i32;
        push(&["-netdev", &format!("tap,id=net{i},fd={fd}")]);
        push(&["-device", &format!("virtio-net-pci,netdev=net{i},mac={}", nic.mac)]);
    }
    // Passthrough devices after the virtio NICs: QEMU gives slots in command-line order, so the
    // declared NICs keep the first guest interface names (eth0, ...) that ip= and seeds use.
    for (i, addr) in crate::validate::requested_devices(spec, &config.hardware).iter().enumerate() {
        push(&["-device", &format!("vfio-pci,host={addr},id=hostdev{i}")]);
    }
    match &vm.boot {
        BootSource::Image { .. } => {
            push(&["-drive", &format!("file={},if=virtio,format=qcow2,discard=unmap", escape_opt(&paths.overlay))]);
            push(&["-drive", &format!("file={},if=virtio,format=raw,readonly=on", escape_opt(&paths.seed))]);
        }
        BootSource::Kernel { kernel, initrd, cmdline } => {
            push(&["-kernel", &kernel.to_string_lossy()]);
            if let Some(i) = initrd {
                push(&["-initrd", &i.to_string_lossy()]);
            }
            let mut line = cmdline.clone();
            for p in kernel_ip_params(spec) {
                line = if line.is_empty() { p } else { format!("{line} {p}") };
            }
            if !line.is_empty() {
                push(&["-append", &line]);
            }
        }
    }
    a.into_iter().map(OsString::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::BootSpec;
    use crate::validate::tests::{config, spec};
    use crate::validate::validate_spec;

    fn argv_of(s: &crate::api::VmSpec, c: &Config) -> Vec<String> {
        let v = validate_spec(s, c).unwrap();
        let p = VmPaths::for_vm(c, &s.name);
        build_argv(&v, c, &p, &[]).into_iter().map(|o| o.into_string().unwrap()).collect()
    }

    fn value_after<'a>(argv: &'a [String], flag: &str) -> Vec<&'a str> {
        argv.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    #[test]
    fn kernel_boot_argv() {
        let c = config();
        let mut s = spec("vm-1");
        s.cpu = 2;
        s.boot.initrd = Some("/boot/initrd.img".into());
        let argv = argv_of(&s, &c);
        assert_eq!(value_after(&argv, "-accel"), ["tcg"]);
        assert!(!argv.contains(&"-cpu".to_string()), "no -cpu host under tcg");
        assert_eq!(value_after(&argv, "-smp"), ["2"]);
        assert_eq!(value_after(&argv, "-m"), ["256"]);
        assert_eq!(value_after(&argv, "-kernel"), ["/boot/vmlinuz"]);
        assert_eq!(value_after(&argv, "-initrd"), ["/boot/initrd.img"]);
        assert_eq!(value_after(&argv, "-append"), ["console=ttyS0"]);
        assert_eq!(value_after(&argv, "-pidfile"), ["/run/vmhost/vm-1/qemu.pid"]);
        assert!(argv.contains(&"-daemonize".to_string()));
        assert!(argv.iter().any(|a| a.contains("name=org.vmhost.agent.0")));
        assert!(argv.iter().any(|a| a == "socket,id=agent0,path=/run/vmhost/vm-1/agent,server=on,wait=off"));
        assert!(argv.iter().any(|a| a == "file,id=serial0,path=/var/lib/vmhost/logs/vm-1.serial.log,append=on"));
        assert!(!argv.contains(&"-drive".to_string()));
        let marker = VmPaths::for_vm(&c, "vm-1").cmdline_marker();
        assert_eq!(argv.iter().filter(|a| a.contains(&marker)).count(), 1);
    }

    #[test]
    fn image_boot_uses_the_overlay_never_the_base() {
        let c = config();
        let mut s = spec("vm-2");
        s.boot = BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(4), ..BootSpec::default() };
        let argv = argv_of(&s, &c);
        assert_eq!(
            value_after(&argv, "-drive")[0],
            "file=/var/lib/vmhost/disks/vm-2.qcow2,if=virtio,format=qcow2,discard=unmap"
        );
        assert!(!argv.iter().any(|a| a.contains("base.qcow2")));
        assert_eq!(
            value_after(&argv, "-drive")[1],
            "file=/var/lib/vmhost/seeds/vm-2.img,if=virtio,format=raw,readonly=on"
        );
        assert!(!argv.contains(&"-kernel".to_string()));
    }

    #[test]
    fn nics_use_passed_fds_and_direct_kernel_vms_get_ip_params() {
        let c = Config::parse(
            "[qemu]\naccel = \"tcg\"\n[hardware]\ncpu = 4\nmemory_gib = 4\n[networks.lan]\nbridge = \"br0\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut s = spec("web");
        let static_nic = crate::validate::tests::static_nic("lan", "10.0.0.5/24");
        s.nics = vec![static_nic, crate::api::NicSpec { network: "lan".into(), vlan: None, mac: None, ipv4: None }];
        let v = validate_spec(&s, &c).unwrap();
        let allocs = crate::nic::allocate(&s, &c, &[], &[]).unwrap();
        let argv: Vec<String> = build_argv(&v, &c, &VmPaths::for_vm(&c, "web"), &allocs)
            .into_iter()
            .map(|o| o.into_string().unwrap())
            .collect();
        assert_eq!(value_after(&argv, "-netdev"), ["tap,id=net0,fd=3", "tap,id=net1,fd=4"]);
        let devs = value_after(&argv, "-device");
        assert!(devs.contains(&format!("virtio-net-pci,netdev=net1,mac={}", allocs[1].mac).as_str()), "{devs:?}");
        assert_eq!(value_after(&argv, "-append"), ["console=ttyS0 ip=10.0.0.5:::255.255.255.0:web:eth0:off::"]);
    }

    #[test]
    fn passthrough_devices_by_index_and_address() {
        let mut c = config();
        c.hardware.allow_raw_pci = true;
        let mut s = spec("pt");
        s.hardware.sfp = vec![5];
        s.hardware.disk = vec![2];
        s.pci = vec!["pci_0000_d0_00_1".into()];
        let argv = argv_of(&s, &c);
        let devs: Vec<&str> = value_after(&argv, "-device").into_iter().filter(|d| d.starts_with("vfio-pci")).collect();
        assert_eq!(
            devs,
            [
                "vfio-pci,host=0000:c7:00.1,id=hostdev0",
                "vfio-pci,host=0000:ca:00.0,id=hostdev1",
                "vfio-pci,host=0000:d0:00.1,id=hostdev2"
            ]
        );
    }

    #[test]
    fn kvm_asks_for_the_host_cpu() {
        let mut c = config();
        c.qemu.accel = Accel::Kvm;
        let argv = argv_of(&spec("a"), &c);
        assert_eq!(value_after(&argv, "-accel"), ["kvm"]);
        assert_eq!(value_after(&argv, "-cpu"), ["host"]);
    }

    #[test]
    fn commas_in_paths_cannot_inject_options() {
        let mut c = config();
        c.paths.state = "/srv/a,readonly=on".into();
        let argv = argv_of(&spec("a"), &c);
        assert!(argv.iter().any(|a| a == "file,id=serial0,path=/srv/a,,readonly=on/logs/a.serial.log,append=on"));
    }

    #[test]
    fn socket_paths_fit_sun_path() {
        let mut c = config();
        c.paths.run = PathBuf::from("/").join("r".repeat(MAX_RUN_DIR_LEN - 1));
        let p = VmPaths::for_vm(&c, &"n".repeat(63));
        assert_eq!(p.agent.as_os_str().len(), 107);
        assert!(p.qmp.as_os_str().len() <= 107);
    }
}
