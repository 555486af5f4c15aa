//! The QEMU command line for a VM: a pure function of (spec, config, paths), built as an argv.
//!
//! Nothing here runs anything. [`VmPaths::for_vm`] fixes where each VM's files live,
//! [`passed_fds`] which descriptors QEMU is handed and in what order, and [`build_argv`] turns
//! a validated spec into arguments that name those descriptors. Values that go into QEMU option
//! lists have their commas doubled ([`escape_opt`]) so no path can inject an extra option.
//!
//! QEMU runs as an unprivileged user (docs/sandbox.md) and opens none of the VM's files by
//! path: the daemon opens them and passes descriptors. The QMP, agent and serial console sockets
//! are listening sockets the daemon bound (`-chardev socket,fd=N`); the serial log, the overlay, its base image
//! and the seed are fd sets (`-add-fd`, `/dev/fdset/N`). A direct-kernel VM's kernel and initrd
//! are sealed in-memory copies ([`crate::qemu::boot_files`]) that QEMU's loader, which takes
//! only a path, opens as `/proc/self/fd/N`. A UEFI VM's firmware (OVMF's code and the VM's own
//! variables store) is two more fd sets under `-blockdev` nodes the machine's flash devices
//! name.

use crate::api::Firmware;
use crate::config::{Accel, Config};
use crate::nic::{kernel_ip_params, NicAlloc};
use crate::placement::Placement;
use crate::qemu::boot_files::proc_path;
pub use crate::qemu::hotplug::data_drive;
use crate::qemu::launch::FIRST_PASSED_FD;
use crate::validate::{BootSource, ValidSpec};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// QEMU's name for an image-booted VM's boot disk (the overlay), which `block_resize` grows
/// live. It is the name QEMU gave the first `if=virtio` drive, which VMs started before the
/// disks were explicit devices still have.
pub const DISK_DRIVE: &str = "virtio0";

/// The file name of a UEFI VM's variables store in its disk directory
/// ([`VmPaths::uefi_vars`]); no disk there can have it, since their extension is their format
/// (`qcow2` or `raw`).
pub const UEFI_VARS_FILE: &str = "uefi-vars.fd";

/// The `-blockdev` node QEMU's first flash device (`pflash0`) reads OVMF's code from.
pub const UEFI_CODE_NODE: &str = "uefi-code";

/// The `-blockdev` node of the second flash device (`pflash1`), the VM's variables store.
pub const UEFI_VARS_NODE: &str = "uefi-vars";

/// virtio-serial port name the guest agent looks for.
pub const AGENT_PORT_NAME: &str = "org.vmhost.agent.0";

/// Exec ports (slots) every VM gets: `org.vmhost.exec.0` to `.7`, served by
/// `vmhost-agent --exec` ([`vmhost_agent_protocol::exec`]).
pub const EXEC_SLOTS: usize = vmhost_agent_protocol::exec::EXEC_SLOTS;

/// Where one VM's files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPaths {
    /// `RUN/NAME`: sockets and pid file; removed when the VM stops.
    pub run_dir: PathBuf,
    /// QMP control socket.
    pub qmp: PathBuf,
    /// A second QMP monitor the daemon only listens on for events (why QEMU ends).
    pub qmp_events: PathBuf,
    /// A third QMP monitor only `vm.stats` queries, so collecting figures never waits for (or
    /// delays) the control monitor a stop or a disk grow needs.
    pub qmp_stats: PathBuf,
    /// Guest agent chardev socket.
    pub agent: PathBuf,
    /// The exec ports' chardev sockets, slot `i` at index `i` (`RUN/NAME/execI`: no dot, so
    /// the longest is as long as `agent` and [`crate::config::MAX_RUN_DIR_LEN`] holds). A VM
    /// whose QEMU a vmhostd before issue 29 started has none of these files.
    pub exec: Vec<PathBuf>,
    /// The serial console's socket (`con`, short: every socket path must fit `sun_path` for a
    /// [`crate::config::MAX_RUN_DIR_LEN`] run dir); the daemon connects to it while clients are
    /// attached ([`crate::console`]).
    pub console: PathBuf,
    /// Serial console log, kept across restarts until destroy.
    pub serial_log: PathBuf,
    /// QEMU's own stderr (its warnings and why it failed to start), appended, kept like the
    /// serial log.
    pub qemu_log: PathBuf,
    /// qcow2 overlay for image-booted VMs.
    pub overlay: PathBuf,
    /// cloud-init NoCloud seed for image-booted VMs and direct-kernel VMs with `user_data`
    /// ([`crate::seed::has_seed`]), rebuilt at every start.
    pub seed: PathBuf,
    /// `STATE/disks/NAME`: the VM's data disks ([`VmPaths::data_disk`]).
    pub disk_dir: PathBuf,
    /// `STATE/kept-disks/NAME`: data disks a destroy kept, until a VM of this name takes them
    /// back or they are purged.
    pub kept_dir: PathBuf,
}

impl VmPaths {
    /// The paths of VM `name` under the configured directories.
    pub fn for_vm(config: &Config, name: &str) -> VmPaths {
        let run_dir = config.paths.run.join(name);
        VmPaths {
            qmp: run_dir.join("qmp"),
            qmp_events: run_dir.join("qmpev"),
            qmp_stats: run_dir.join("qmpst"),
            agent: run_dir.join("agent"),
            exec: (0..EXEC_SLOTS).map(|i| run_dir.join(format!("exec{i}"))).collect(),
            console: run_dir.join("con"),
            run_dir,
            serial_log: config.paths.state.join("logs").join(format!("{name}.serial.log")),
            qemu_log: config.paths.state.join("logs").join(format!("{name}.qemu.log")),
            overlay: config.paths.state.join("disks").join(format!("{name}.qcow2")),
            seed: config.paths.state.join("seeds").join(format!("{name}.img")),
            disk_dir: config.paths.state.join("disks").join(name),
            kept_dir: config.paths.state.join("kept-disks").join(name),
        }
    }

    /// The file of data disk `disk`: `STATE/disks/NAME/DISK.FORMAT`.
    pub fn data_disk(&self, disk: &crate::api::DataDiskSpec) -> PathBuf {
        self.disk_dir.join(disk.file_name())
    }

    /// Where a data disk is made before it is renamed to [`VmPaths::data_disk`].
    pub fn partial_data_disk(&self, disk: &crate::api::DataDiskSpec) -> PathBuf {
        self.disk_dir.join(format!("{}.partial", disk.file_name()))
    }

    /// The root disk a `boot.disk` import moved in: `STATE/disks/NAME/root.FORMAT`.
    pub fn root_disk(&self, format: crate::api::DiskFormat) -> PathBuf {
        self.disk_dir.join(format!("{}.{}", crate::validate::ROOT_DISK_NAME, format.as_str()))
    }

    /// A UEFI VM's own variables store (OVMF's NVRAM: boot entries, settings),
    /// `STATE/disks/NAME/uefi-vars.fd`: kept with its disks, from the first start to the
    /// destroy.
    pub fn uefi_vars(&self) -> PathBuf {
        self.disk_dir.join(UEFI_VARS_FILE)
    }

    /// Where [`VmPaths::uefi_vars`] is copied before it is renamed into place.
    pub fn partial_uefi_vars(&self) -> PathBuf {
        self.disk_dir.join(format!("{UEFI_VARS_FILE}.partial"))
    }

    /// Where a destroy keeps data disk `disk`: `STATE/kept-disks/NAME/DISK.FORMAT`.
    pub fn kept_disk(&self, disk: &crate::api::DataDiskSpec) -> PathBuf {
        self.kept_dir.join(disk.file_name())
    }

    /// The text that identifies this VM's QEMU in /proc/PID/cmdline: the description of the
    /// serial log's fd set. Unique per VM because the name is unique in a state dir.
    pub fn cmdline_marker(&self) -> String {
        format!("opaque={}", escape_opt(&self.serial_log))
    }
}

/// One descriptor QEMU is handed. [`passed_fds`] lists them in fd order from
/// [`FIRST_PASSED_FD`]; the launch opens each ([`crate::lifecycle`]) in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassedFd {
    /// The listening QMP socket (`VmPaths::qmp`).
    Qmp,
    /// The listening guest agent socket (`VmPaths::agent`).
    Agent,
    /// The serial log, write-only, appending.
    SerialLog,
    /// The tap of NIC `i`.
    Tap(usize),
    /// The overlay, read-write.
    OverlayRw,
    /// The overlay, read-only: QEMU opens an image read-only first, and a fd set must hold a
    /// descriptor of each access mode QEMU asks for.
    OverlayRo,
    /// The base image behind the overlay, read-only.
    Base,
    /// The cloud-init seed, read-only (image boot, or a direct-kernel VM with `user_data`).
    Seed,
    /// The sealed copy of a direct-kernel VM's kernel.
    Kernel,
    /// The sealed copy of its initrd.
    Initrd,
    /// The listening socket of the event monitor (`VmPaths::qmp_events`). After the others,
    /// so their numbers stay what VMs started before it existed had.
    QmpEvents,
    /// The listening socket of the serial console (`VmPaths::console`). After those, for the
    /// same reason.
    Console,
    /// The listening socket of the stats monitor (`VmPaths::qmp_stats`), after the event
    /// monitor for the same reason.
    QmpStats,
    /// Data disk `i` of the spec, read-write.
    DataDisk(usize),
    /// Data disk `i`, read-only, in the same fd set: QEMU opens it read-only first, like the
    /// overlay.
    DataDiskRo(usize),
    /// An imported root disk (`boot.disk`), read-write: the boot disk in place of an overlay.
    RootDisk,
    /// The imported root disk, read-only, in the same fd set.
    RootDiskRo,
    /// A UEFI VM's firmware code (`firmware.uefi_code`), read-only. The three UEFI entries
    /// come after every other, so a BIOS VM's descriptors keep their numbers.
    UefiCode,
    /// The VM's UEFI variables store ([`VmPaths::uefi_vars`]), read-write: the guest's
    /// firmware writes it.
    UefiVars,
    /// The variables store, read-only, in the same fd set (QEMU may open it read-only first,
    /// as an image).
    UefiVarsRo,
    /// The listening socket of exec port `i` ([`VmPaths::exec`]). Last of all, so every other
    /// descriptor keeps the number VMs started before exec ports had.
    Exec(usize),
    /// Queue `q` (1 and up) of NIC `i`'s multiqueue tap; queue 0 is [`PassedFd::Tap`]. After
    /// the exec ports ([`launch_fds`]), so a single-queue VM's numbers stay as they were.
    TapQueue(usize, usize),
    /// The `/dev/vhost-net` descriptor of queue `q` of NIC `i` ([`crate::net::vhost`]), after
    /// every tap queue.
    Vhost(usize, usize),
    /// A VM with `tpm`: QEMU's end of swtpm's control channel, a connected socket
    /// ([`crate::tpm::start`]). Last of all, so no other descriptor changes number.
    TpmCtrl,
}

/// The descriptors a VM's QEMU gets, in order (fd [`FIRST_PASSED_FD`] + index).
pub fn passed_fds(vm: &ValidSpec, nics: usize) -> Vec<PassedFd> {
    let mut fds = vec![PassedFd::Qmp, PassedFd::Agent, PassedFd::SerialLog];
    fds.extend((0..nics).map(PassedFd::Tap));
    match &vm.boot {
        BootSource::Image { .. } => {
            fds.extend([PassedFd::OverlayRw, PassedFd::OverlayRo, PassedFd::Base, PassedFd::Seed]);
        }
        BootSource::Kernel { initrd, .. } => {
            fds.push(PassedFd::Kernel);
            fds.extend(initrd.as_ref().map(|_| PassedFd::Initrd));
        }
        BootSource::Disk { .. } => fds.extend([PassedFd::RootDisk, PassedFd::RootDiskRo]),
    }
    fds.extend([PassedFd::QmpEvents, PassedFd::Console, PassedFd::QmpStats]);
    fds.extend((0..vm.spec.disks.len()).flat_map(|i| [PassedFd::DataDisk(i), PassedFd::DataDiskRo(i)]));
    // A direct-kernel VM's seed (with `user_data`) comes last, so every other descriptor keeps
    // the number it has without one.
    if matches!(vm.boot, BootSource::Kernel { .. }) && crate::seed::has_seed(vm) {
        fds.push(PassedFd::Seed);
    }
    if vm.spec.boot.firmware == Firmware::Uefi {
        fds.extend([PassedFd::UefiCode, PassedFd::UefiVars, PassedFd::UefiVarsRo]);
    }
    fds.extend((0..EXEC_SLOTS).map(PassedFd::Exec));
    fds
}

/// The descriptors a launch hands QEMU: [`passed_fds`], then each NIC's further tap queues and
/// its vhost-net descriptors (`nics[i].vhost`), in NIC order. A NIC with one queue and no
/// vhost-net adds nothing, so such a VM's numbers are exactly [`passed_fds`]'s.
pub fn launch_fds(vm: &ValidSpec, nics: &[NicAlloc]) -> Vec<PassedFd> {
    let mut fds = passed_fds(vm, nics.len());
    for i in 0..nics.len() {
        fds.extend((1..nic_queues(vm, i)).map(|q| PassedFd::TapQueue(i, q)));
    }
    for (i, _) in nics.iter().enumerate().filter(|(_, n)| n.vhost) {
        fds.extend((0..nic_queues(vm, i)).map(|q| PassedFd::Vhost(i, q)));
    }
    if vm.spec.tpm {
        fds.push(PassedFd::TpmCtrl);
    }
    fds
}

/// NIC `i`'s queue pairs (at least one).
fn nic_queues(vm: &ValidSpec, i: usize) -> usize {
    usize::from(vm.spec.nics.get(i).map_or(1, |n| n.queues.max(1)))
}

/// QEMU's own seccomp filter: no obsolete syscalls, no setuid, no fork or exec, no scheduler
/// or resource changes (docs/sandbox.md).
pub const QEMU_SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// What a migration's destination QEMU gets after [`build_argv`]'s argv
/// ([`crate::qemu::launch::LaunchRequest::incoming`]): it waits for `migrate-incoming` (the
/// daemon hands it the stream later, [`crate::qemu::migration::start_incoming`]) and stays
/// paused after the state arrived until the daemon's `cont`, so the guest never runs on both
/// hosts.
pub const INCOMING_ARGS: [&str; 3] = ["-incoming", "defer", "-S"];

/// The id of a VM's TPM backend (`-tpmdev`), its chardev (`-ctrl`) and device (`-dev`).
pub const TPM_ID: &str = "tpm0";

/// Doubles commas, QEMU's escape inside option lists.
pub fn escape_opt(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// The argv (without the binary) that launches `vm` in the foreground. Descriptors are numbered
/// as [`passed_fds`] lists them (see [`crate::qemu::launch::LaunchRequest::fds`]); NIC `i` gets
/// the MAC from `nics[i]`; a direct-kernel VM also gets the guest addresses as `ip=`
/// parameters. `base_format` is the format of an image-booted VM's base image ([`crate::disk::base_info`]),
/// needed because QEMU is given the base as a descriptor rather than the path in the overlay;
/// for a `boot.disk` VM it is its root disk's recorded format (`qcow2` or `raw`), pinned so that
/// QEMU never probes a disk a guest writes.
pub fn build_argv(
    vm: &ValidSpec,
    config: &Config,
    paths: &VmPaths,
    nics: &[NicAlloc],
    base_format: &str,
    placement: Option<&Placement>,
) -> Vec<OsString> {
    let layout = launch_fds(vm, nics);
    let fd = |which: PassedFd| {
        let i = layout.iter().position(|f| *f == which).unwrap_or(layout.len());
        FIRST_PASSED_FD + i as i32
    };
    let spec = &vm.spec;
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    push(&["-name", &format!("guest={},debug-threads=on", spec.name)]);
    let uefi = spec.boot.firmware == Firmware::Uefi;
    // A placement that binds memory or asks for hugepages: QEMU's RAM is that backend.
    let memory = placement.and_then(memory_backend);
    let mut machine = config.qemu.machine.clone();
    if uefi {
        // The machine's two flash devices are the blockdev nodes made below (validate.rs
        // allows uefi only on machine types that have them).
        machine.push_str(&format!(",pflash0={UEFI_CODE_NODE},pflash1={UEFI_VARS_NODE}"));
    }
    if uefi && spec.boot.secure_boot {
        // OVMF's Secure Boot build keeps the variables behind SMM (validate.rs: q35 only), so
        // that only the firmware writes the keys; TCG emulates SMM too.
        machine.push_str(",smm=on");
    }
    if memory.is_some() {
        machine.push_str(&format!(",memory-backend={MEMORY_BACKEND}"));
    }
    push(&["-machine", &machine]);
    push(&["-accel", config.qemu.accel.as_str()]);
    if let Some(model) = cpu_model(config) {
        push(&["-cpu", model]);
    }
    // The vCPU count stays `-smp N`: its threads are pinned after the launch
    // (`crate::placement::pin`).
    push(&["-smp", &spec.cpu.to_string(), "-m", &spec.memory_mib.to_string()]);
    if let Some(object) = &memory {
        push(&["-object", object]);
    }
    push(&["-nodefaults", "-no-user-config", "-display", "none"]);
    if config.qemu.sandbox {
        push(&["-sandbox", QEMU_SANDBOX]);
    }
    let fdset = |which: PassedFd, path: &Path| format!("fd={0},set={0},opaque={1}", fd(which), escape_opt(path));
    push(&["-chardev", &format!("socket,id=qmp,fd={},server=on,wait=off", fd(PassedFd::Qmp))]);
    push(&["-mon", "chardev=qmp,mode=control"]);
    push(&["-chardev", &format!("socket,id=qmpev,fd={},server=on,wait=off", fd(PassedFd::QmpEvents))]);
    push(&["-mon", "chardev=qmpev,mode=control"]);
    push(&["-chardev", &format!("socket,id=qmpst,fd={},server=on,wait=off", fd(PassedFd::QmpStats))]);
    push(&["-mon", "chardev=qmpst,mode=control"]);
    // The description of this fd set is the cmdline marker (VmPaths::cmdline_marker).
    push(&["-add-fd", &fdset(PassedFd::SerialLog, &paths.serial_log)]);
    // The serial port is a socket the daemon connects to while console clients are attached;
    // QEMU itself appends everything the guest prints to the log (`logfile`), connected or not,
    // so the log never depends on the daemon (docs/console.md).
    push(&[
        "-chardev",
        &format!(
            "socket,id=serial0,fd={},server=on,wait=off,logfile=/dev/fdset/{},logappend=on",
            fd(PassedFd::Console),
            fd(PassedFd::SerialLog)
        ),
    ]);
    push(&["-serial", "chardev:serial0"]);
    push(&["-device", "virtio-serial-pci,id=vser0"]);
    push(&["-chardev", &format!("socket,id=agent0,fd={},server=on,wait=off", fd(PassedFd::Agent))]);
    push(&["-device", &format!("virtserialport,bus=vser0.0,chardev=agent0,name={AGENT_PORT_NAME}")]);
    // Always there, also when exec is off: the clock, shutdown and SSH keys use them too.
    for slot in 0..EXEC_SLOTS {
        push(&["-chardev", &format!("socket,id=exec{slot},fd={},server=on,wait=off", fd(PassedFd::Exec(slot)))]);
        let port = vmhost_agent_protocol::exec::exec_port_name(slot);
        push(&["-device", &format!("virtserialport,bus=vser0.0,chardev=exec{slot},name={port}")]);
    }
    if uefi {
        // OVMF's code read-only and the VM's variables store read-write, each a `file` node
        // over its fd set under a `raw` node, as libvirt does with paths. QEMU never sees
        // either path: the code's is only the fd set's description.
        let pair = crate::qemu::firmware::Pair::of(&config.firmware, spec.boot.secure_boot);
        if pair.secure {
            // The flash devices answer writes only from SMM: the guest's kernel cannot bypass
            // the firmware to change the keys.
            push(&["-global", "driver=cfi.pflash01,property=secure,value=on"]);
        }
        push(&["-add-fd", &fdset(PassedFd::UefiCode, pair.code)]);
        let code_file = format!("{UEFI_CODE_NODE}-file");
        push(&[
            "-blockdev",
            &serde_json::json!({"driver": "file", "node-name": code_file,
                "filename": format!("/dev/fdset/{}", fd(PassedFd::UefiCode)), "read-only": true})
            .to_string(),
        ]);
        push(&[
            "-blockdev",
            &serde_json::json!({"driver": "raw", "node-name": UEFI_CODE_NODE, "file": code_file, "read-only": true})
                .to_string(),
        ]);
        push(&["-add-fd", &fdset(PassedFd::UefiVars, &paths.uefi_vars())]);
        push(&["-add-fd", &format!("fd={},set={}", fd(PassedFd::UefiVarsRo), fd(PassedFd::UefiVars))]);
        let vars_file = format!("{UEFI_VARS_NODE}-file");
        push(&[
            "-blockdev",
            &serde_json::json!({"driver": "file", "node-name": vars_file,
                "filename": format!("/dev/fdset/{}", fd(PassedFd::UefiVars))})
            .to_string(),
        ]);
        push(&[
            "-blockdev",
            &serde_json::json!({"driver": "raw", "node-name": UEFI_VARS_NODE, "file": vars_file}).to_string(),
        ]);
    }
    for (i, nic) in nics.iter().enumerate() {
        // One tap descriptor per queue pair, and with vhost-net one vhost descriptor each; QEMU
        // takes the queue count from how many `fds` it gets (it refuses `queues=` beside them).
        let queues = nic_queues(vm, i);
        let taps: Vec<String> = (0..queues)
            .map(|q| fd(if q == 0 { PassedFd::Tap(i) } else { PassedFd::TapQueue(i, q) }).to_string())
            .collect();
        let vhosts: Vec<String> = (0..queues).map(|q| fd(PassedFd::Vhost(i, q)).to_string()).collect();
        let netdev = match (queues, nic.vhost) {
            (1, false) => format!("tap,id=net{i},fd={}", taps[0]),
            (1, true) => format!("tap,id=net{i},fd={},vhost=on,vhostfd={}", taps[0], vhosts[0]),
            (_, false) => format!("tap,id=net{i},fds={}", taps.join(":")),
            (_, true) => format!("tap,id=net{i},fds={},vhost=on,vhostfds={}", taps.join(":"), vhosts.join(":")),
        };
        push(&["-netdev", &netdev]);
        // Multiqueue: an MSI-X vector per queue of each direction, one for the control queue
        // and one for configuration changes.
        let mq = if queues > 1 { format!(",mq=on,vectors={}", 2 * queues + 2) } else { String::new() };
        push(&["-device", &format!("virtio-net-pci,netdev=net{i},mac={}{mq}", nic.mac)]);
    }
    if spec.tpm {
        // swtpm's control channel, connected already (no server): QEMU hands swtpm the data
        // channel over it. A CRB interface, as libvirt gives a TPM 2.0 on x86.
        push(&["-chardev", &format!("socket,id={TPM_ID}-ctrl,fd={}", fd(PassedFd::TpmCtrl))]);
        push(&["-tpmdev", &format!("emulator,id={TPM_ID},chardev={TPM_ID}-ctrl")]);
        push(&["-device", &format!("tpm-crb,tpmdev={TPM_ID},id={TPM_ID}-dev")]);
    }
    // Passthrough devices after the virtio NICs: QEMU gives slots in command-line order, so the
    // declared NICs keep the first guest interface names (eth0, ...) that ip= and seeds use.
    for (i, addr) in crate::validate::requested_devices(spec, &config.hardware).iter().enumerate() {
        push(&["-device", &format!("vfio-pci,host={addr},id=hostdev{i}")]);
    }
    // Disks as explicit devices in guest order: the boot disk, the data disks in spec order,
    // the seed last (cloud-init finds it by its label), so the data disks are vdb, vdc, ...
    // (vda, vdb, ... for a kernel VM).
    if let BootSource::Image { image, .. } = &vm.boot {
        let base = config.paths.images.join(image);
        push(&["-add-fd", &fdset(PassedFd::OverlayRw, &paths.overlay)]);
        push(&["-add-fd", &format!("fd={},set={}", fd(PassedFd::OverlayRo), fd(PassedFd::OverlayRw))]);
        push(&["-add-fd", &fdset(PassedFd::Base, &base)]);
        let format: String = base_format.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        push(&[
            "-drive",
            &format!(
                "file=/dev/fdset/{},if=none,id={DISK_DRIVE},format=qcow2,discard=unmap,backing.driver={format},\
                 backing.file.filename=/dev/fdset/{}",
                fd(PassedFd::OverlayRw),
                fd(PassedFd::Base)
            ),
        ]);
        push(&["-device", &format!("virtio-blk-pci,drive={DISK_DRIVE},id=boot-disk")]);
    }
    if let BootSource::Disk { .. } = &vm.boot {
        // The same drive and device names as an overlay, so a live grow (`block_resize` of
        // virtio0) and the guest's vda are the same; no backing file (an import with one was
        // refused).
        let format = if base_format == "raw" { crate::api::DiskFormat::Raw } else { crate::api::DiskFormat::Qcow2 };
        push(&["-add-fd", &fdset(PassedFd::RootDisk, &paths.root_disk(format))]);
        push(&["-add-fd", &format!("fd={},set={}", fd(PassedFd::RootDiskRo), fd(PassedFd::RootDisk))]);
        push(&[
            "-drive",
            &format!(
                "file=/dev/fdset/{},if=none,id={DISK_DRIVE},format={},discard=unmap",
                fd(PassedFd::RootDisk),
                format.as_str()
            ),
        ]);
        push(&["-device", &format!("virtio-blk-pci,drive={DISK_DRIVE},id=boot-disk")]);
    }
    // On q35 each data disk sits behind its own root port, so it can be unplugged, and spare
    // ports take hot-plugged ones (qemu/hotplug.rs).
    let ports = crate::qemu::hotplug::root_port_args(&config.qemu.machine, spec.disks.len(), config.qemu.hotplug_ports);
    for port in &ports {
        push(&["-device", port]);
    }
    for (i, disk) in spec.disks.iter().enumerate() {
        let which = PassedFd::DataDisk(i);
        push(&["-add-fd", &fdset(which, &paths.data_disk(disk))]);
        push(&["-add-fd", &format!("fd={},set={}", fd(PassedFd::DataDiskRo(i)), fd(which))]);
        // A block node as hot-plug adds one (qemu/hotplug.rs), named as the drive was: with
        // `backing: null`, so no qcow2 header can make QEMU open a host file as its backing.
        let node = crate::qemu::hotplug::blockdev_args(disk, u64::try_from(fd(which)).unwrap_or_default());
        push(&["-blockdev", &node.to_string()]);
        // No image locking (`locking: off`): QEMU takes OFD locks through the descriptors it dups from the fd set,
        // and the set keeps the first (read-only) description and its locks alive, so a later
        // resize finds its own lock in the way ("Failed to get \"write\" lock"). The daemon
        // hands each disk to one QEMU only. The name is the serial: 1-20 of [a-z0-9-]
        // (validate.rs), within virtio-blk's 20 bytes.
        let bus = if ports.is_empty() { String::new() } else { format!(",bus={}", crate::qemu::hotplug::port_id(i)) };
        push(&[
            "-device",
            &format!("virtio-blk-pci,drive={0},id={0},serial={1}{bus}", data_drive(&disk.name), disk.name),
        ]);
    }
    // The seed, read-only, the last disk the guest finds (a kernel VM has no boot disk: its
    // data disks stay vda, vdb, ...): on q35 behind a root port of its own after the data disks'
    // (see seed_port_arg), on pc last in slot order.
    if crate::seed::has_seed(vm) {
        push(&["-add-fd", &fdset(PassedFd::Seed, &paths.seed)]);
        push(&["-drive", &format!("file=/dev/fdset/{},if=none,id=seed,format=raw,readonly=on", fd(PassedFd::Seed))]);
        match crate::qemu::hotplug::seed_port_arg(&config.qemu.machine) {
            Some(port) => {
                push(&["-device", &port]);
                push(&[
                    "-device",
                    &format!("virtio-blk-pci,drive=seed,id=seed,bus={}", crate::qemu::hotplug::SEED_PORT),
                ]);
            }
            None => push(&["-device", "virtio-blk-pci,drive=seed,id=seed"]),
        }
    }
    match &vm.boot {
        BootSource::Image { .. } => {}
        BootSource::Kernel { initrd, cmdline, .. } => {
            push(&["-kernel", &proc_path(fd(PassedFd::Kernel))]);
            if initrd.is_some() {
                push(&["-initrd", &proc_path(fd(PassedFd::Initrd))]);
            }
            let mut line = cmdline.clone();
            for p in kernel_ip_params(spec) {
                line = if line.is_empty() { p } else { format!("{line} {p}") };
            }
            if !line.is_empty() {
                push(&["-append", &line]);
            }
        }
        // An imported disk brings its own configuration: no cloud-init seed (a new instance
        // would make its cloud-init run again), no kernel.
        BootSource::Disk { .. } => {}
    }
    a.into_iter().map(OsString::from).collect()
}

/// `-cpu`'s model for `config` (pure): the configured one, else `host` under KVM (the guest
/// gets this host's CPU), else none (QEMU's default under TCG).
fn cpu_model(config: &Config) -> Option<&str> {
    match (config.qemu.cpu_model.as_str(), config.qemu.accel) {
        ("", Accel::Kvm) => Some("host"),
        ("", Accel::Tcg) => None,
        (model, _) => Some(model),
    }
}

/// The id of a placed VM's memory backend (`-machine memory-backend=`).
pub const MEMORY_BACKEND: &str = "ram0";

/// `nodes` in QEMU's `host-nodes` syntax: contiguous runs as `A-B`, runs after the first as
/// further `host-nodes=` keys (a comma inside one value would end it).
fn host_nodes(nodes: &[u32]) -> String {
    let mut sorted = nodes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for n in sorted {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == n => *end = n,
            _ => runs.push((n, n)),
        }
    }
    runs.iter()
        .map(|(a, b)| if a == b { format!("host-nodes={a}") } else { format!("host-nodes={a}-{b}") })
        .collect::<Vec<_>>()
        .join(",")
}

/// The `-object` of a placed VM's memory: `None` when the placement neither binds memory to
/// nodes nor asks for hugepages (QEMU's default RAM, transparent hugepages as the host does).
/// A memfd backend needs no hugetlbfs mount: QEMU makes an anonymous hugetlb file itself
/// (`hugetlb=on`), and `prealloc` takes every page at start, so a short pool fails the
/// launch instead of the guest later.
pub fn memory_backend(placement: &Placement) -> Option<String> {
    if placement.nodes.is_empty() && placement.hugepages.is_none() {
        return None;
    }
    let mut o = format!("memory-backend-memfd,id={MEMORY_BACKEND},size={}M,share=on", placement.memory_mib);
    if let Some(size) = placement.hugepages {
        o.push_str(&format!(",hugetlb=on,hugetlbsize={size},prealloc=on"));
    }
    if !placement.nodes.is_empty() {
        o.push_str(&format!(",{},policy=bind", host_nodes(&placement.nodes)));
    }
    Some(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{BootSpec, HugePageSize};
    use crate::validate::tests::{config, spec};
    use crate::validate::validate_spec;

    fn argv_of(s: &crate::api::VmSpec, c: &Config) -> Vec<String> {
        let v = validate_spec(s, c).unwrap();
        let p = VmPaths::for_vm(c, &s.name);
        build_argv(&v, c, &p, &[], "qcow2", None).into_iter().map(|o| o.into_string().unwrap()).collect()
    }

    /// The descriptors before the exec ports, which come last in every layout
    /// (`exec_ports_are_the_last_descriptors`).
    fn before_exec(v: &ValidSpec) -> Vec<PassedFd> {
        let mut fds = passed_fds(v, 0);
        fds.truncate(fds.len() - EXEC_SLOTS);
        fds
    }

    #[test]
    fn exec_ports_are_the_last_descriptors() {
        let c = config();
        let mut s = spec("vm-1");
        let argv = argv_of(&s, &c);
        let layout = passed_fds(&validate_spec(&s, &c).unwrap(), 0);
        let tail: Vec<PassedFd> = (0..EXEC_SLOTS).map(PassedFd::Exec).collect();
        assert_eq!(layout[layout.len() - EXEC_SLOTS..], tail);
        let first = 3 + layout.len() - EXEC_SLOTS;
        for slot in 0..EXEC_SLOTS {
            let chardev = format!("socket,id=exec{slot},fd={},server=on,wait=off", first + slot);
            assert!(argv.contains(&chardev), "{chardev} in {argv:?}");
            let port = format!("virtserialport,bus=vser0.0,chardev=exec{slot},name=org.vmhost.exec.{slot}");
            assert!(argv.contains(&port), "{port}");
        }
        // Also with a UEFI VM's three descriptors: still last.
        s.boot = BootSpec {
            image: Some("base.qcow2".into()),
            disk_gib: Some(4),
            firmware: Firmware::Uefi,
            ..BootSpec::default()
        };
        let layout = passed_fds(&validate_spec(&s, &c).unwrap(), 0);
        assert_eq!(layout[layout.len() - EXEC_SLOTS - 1], PassedFd::UefiVarsRo);
        assert_eq!(layout[layout.len() - EXEC_SLOTS..], tail);
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
        // The kernel and initrd are the sealed copies passed after the serial log; no path of
        // the spec reaches QEMU.
        assert_eq!(value_after(&argv, "-kernel"), ["/proc/self/fd/6"]);
        assert_eq!(value_after(&argv, "-initrd"), ["/proc/self/fd/7"]);
        assert!(!argv.iter().any(|a| a.contains("/boot/")), "{argv:?}");
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(
            before_exec(&v),
            [
                PassedFd::Qmp,
                PassedFd::Agent,
                PassedFd::SerialLog,
                PassedFd::Kernel,
                PassedFd::Initrd,
                PassedFd::QmpEvents,
                PassedFd::Console,
                PassedFd::QmpStats
            ]
        );
        // The event monitor and the stats monitor, after the console, on the last descriptors.
        assert!(argv.iter().any(|a| a == "socket,id=qmpev,fd=8,server=on,wait=off"), "{argv:?}");
        assert!(argv.iter().any(|a| a == "socket,id=qmpst,fd=10,server=on,wait=off"), "{argv:?}");
        assert_eq!(
            value_after(&argv, "-mon"),
            ["chardev=qmp,mode=control", "chardev=qmpev,mode=control", "chardev=qmpst,mode=control"]
        );
        s.boot.initrd = None;
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(before_exec(&v), KERNEL_ONLY_FDS);
        assert!(!argv_of(&s, &c).contains(&"-initrd".to_string()));
        assert_eq!(value_after(&argv, "-append"), ["console=ttyS0"]);
        // In the foreground (the spawner holds it), under QEMU's own seccomp filter.
        assert!(!argv.iter().any(|a| a == "-daemonize" || a == "-pidfile"));
        assert_eq!(value_after(&argv, "-sandbox"), [QEMU_SANDBOX]);
        assert!(argv.iter().any(|a| a.contains("name=org.vmhost.agent.0")));
        // Sockets and the serial log are descriptors, in passed_fds order; no VM path is opened.
        assert!(argv.iter().any(|a| a == "socket,id=qmp,fd=3,server=on,wait=off"));
        assert!(argv.iter().any(|a| a == "socket,id=agent0,fd=4,server=on,wait=off"));
        assert_eq!(value_after(&argv, "-add-fd"), ["fd=5,set=5,opaque=/var/lib/vmhost/logs/vm-1.serial.log"]);
        // The serial port: the console socket (last fd), logging to the serial log's fd set.
        assert!(
            argv.iter().any(|a| a == "socket,id=serial0,fd=9,server=on,wait=off,logfile=/dev/fdset/5,logappend=on"),
            "{argv:?}"
        );
        assert_eq!(value_after(&argv, "-serial"), ["chardev:serial0"]);
        assert!(!argv.iter().any(|a| a.contains("/run/vmhost")));
        assert!(!argv.contains(&"-drive".to_string()));
        let marker = VmPaths::for_vm(&c, "vm-1").cmdline_marker();
        assert_eq!(argv.iter().filter(|a| a.contains(&marker)).count(), 1);
    }

    /// What a direct-kernel VM without an initrd, disks or NICs is handed, in order.
    const KERNEL_ONLY_FDS: [PassedFd; 7] = [
        PassedFd::Qmp,
        PassedFd::Agent,
        PassedFd::SerialLog,
        PassedFd::Kernel,
        PassedFd::QmpEvents,
        PassedFd::Console,
        PassedFd::QmpStats,
    ];

    #[test]
    fn kernel_vms_with_user_data_get_the_seed_as_their_last_disk() {
        use crate::api::{DataDiskSpec, DiskCache, DiskFormat};
        let c = config();
        let mut s = spec("sensor1_sensor");
        s.user_data = Some("#cloud-config\n".into());
        let v = validate_spec(&s, &c).unwrap();
        // The seed after everything else: the other descriptors keep their numbers.
        assert_eq!(before_exec(&v), [KERNEL_ONLY_FDS.as_slice(), &[PassedFd::Seed]].concat());
        let argv = argv_of(&s, &c);
        assert_eq!(
            value_after(&argv, "-add-fd"),
            [
                "fd=5,set=5,opaque=/var/lib/vmhost/logs/sensor1_sensor.serial.log",
                "fd=10,set=10,opaque=/var/lib/vmhost/seeds/sensor1_sensor.img"
            ]
        );
        // Read-only, as a descriptor: QEMU never opens the path.
        assert_eq!(value_after(&argv, "-drive"), ["file=/dev/fdset/10,if=none,id=seed,format=raw,readonly=on"]);
        // Behind its own root port after the data disks' ports, so the guest finds it last.
        let devices = value_after(&argv, "-device");
        assert_eq!(devices.last(), Some(&"virtio-blk-pci,drive=seed,id=seed,bus=seedport"));
        assert_eq!(devices[devices.len() - 2], "pcie-root-port,id=seedport,bus=pcie.0,chassis=64,addr=0x1e.0x0");
        let last_hp = devices.iter().rposition(|d| d.starts_with("pcie-root-port,id=hp")).unwrap();
        assert!(last_hp < devices.len() - 2, "{devices:?}");
        assert_eq!(value_after(&argv, "-kernel"), ["/proc/self/fd/6"]);
        assert_eq!(value_after(&argv, "-name"), ["guest=sensor1_sensor,debug-threads=on"]);
        // With data disks: they stay vda, vdb, ...; the seed is the last disk and descriptor.
        s.disks = vec![DataDiskSpec {
            name: "nsm".into(),
            size_gib: 1,
            format: DiskFormat::Raw,
            preallocate: false,
            cache: DiskCache::None,
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }];
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(before_exec(&v)[7..], [PassedFd::DataDisk(0), PassedFd::DataDiskRo(0), PassedFd::Seed]);
        let argv = argv_of(&s, &c);
        let disks: Vec<&str> =
            value_after(&argv, "-device").into_iter().filter(|d| d.starts_with("virtio-blk")).collect();
        assert_eq!(
            disks,
            [
                "virtio-blk-pci,drive=data-nsm,id=data-nsm,serial=nsm,bus=hp0",
                "virtio-blk-pci,drive=seed,id=seed,bus=seedport"
            ]
        );
        assert_eq!(value_after(&argv, "-drive"), ["file=/dev/fdset/12,if=none,id=seed,format=raw,readonly=on"]);
        // Without user_data: no seed, as before (kernel_boot_argv checks the rest).
        s.user_data = None;
        let argv = argv_of(&s, &c);
        assert!(!argv.iter().any(|a| a.contains("seed")), "{argv:?}");
    }

    #[test]
    fn image_boot_uses_the_overlay_never_the_base() {
        let c = config();
        let mut s = spec("vm-2");
        s.boot = BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(4), ..BootSpec::default() };
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(
            before_exec(&v),
            [
                PassedFd::Qmp,
                PassedFd::Agent,
                PassedFd::SerialLog,
                PassedFd::OverlayRw,
                PassedFd::OverlayRo,
                PassedFd::Base,
                PassedFd::Seed,
                PassedFd::QmpEvents,
                PassedFd::Console,
                PassedFd::QmpStats
            ]
        );
        let argv = argv_of(&s, &c);
        assert_eq!(
            value_after(&argv, "-add-fd"),
            [
                "fd=5,set=5,opaque=/var/lib/vmhost/logs/vm-2.serial.log",
                "fd=6,set=6,opaque=/var/lib/vmhost/disks/vm-2.qcow2",
                "fd=7,set=6",
                "fd=8,set=8,opaque=/var/lib/vmhost/images/base.qcow2",
                "fd=9,set=9,opaque=/var/lib/vmhost/seeds/vm-2.img"
            ]
        );
        // The overlay, with its base given as a descriptor rather than the path in its header.
        assert_eq!(
            value_after(&argv, "-drive"),
            [
                "file=/dev/fdset/6,if=none,id=virtio0,format=qcow2,discard=unmap,backing.driver=qcow2,\
                 backing.file.filename=/dev/fdset/8",
                "file=/dev/fdset/9,if=none,id=seed,format=raw,readonly=on"
            ]
        );
        assert!(!argv.contains(&"-kernel".to_string()));
    }

    #[test]
    fn data_disks_follow_the_boot_disk_in_spec_order_named_by_their_serial() {
        use crate::api::{DataDiskSpec, DiskCache, DiskFormat};
        let c = config();
        let mut s = spec("vm-3");
        s.boot = BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(1), ..BootSpec::default() };
        let disk = |name: &str, format, cache| DataDiskSpec {
            name: name.into(),
            size_gib: 1,
            format,
            preallocate: false,
            cache,
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        };
        s.disks =
            vec![disk("nsm", DiskFormat::Raw, DiskCache::None), disk("logs", DiskFormat::Qcow2, DiskCache::Writeback)];
        let v = validate_spec(&s, &c).unwrap();
        let layout = before_exec(&v);
        assert_eq!(
            &layout[layout.len() - 4..],
            [PassedFd::DataDisk(0), PassedFd::DataDiskRo(0), PassedFd::DataDisk(1), PassedFd::DataDiskRo(1)]
        );
        let argv = argv_of(&s, &c);
        let devices: Vec<&str> =
            value_after(&argv, "-device").into_iter().filter(|d| d.starts_with("virtio-blk")).collect();
        assert_eq!(
            devices,
            [
                "virtio-blk-pci,drive=virtio0,id=boot-disk",
                "virtio-blk-pci,drive=data-nsm,id=data-nsm,serial=nsm,bus=hp0",
                "virtio-blk-pci,drive=data-logs,id=data-logs,serial=logs,bus=hp1",
                "virtio-blk-pci,drive=seed,id=seed,bus=seedport"
            ]
        );
        // Each data disk behind its own root port (so it can be unplugged), spare ones after,
        // all defined before the disks that name them.
        let ports: Vec<&str> =
            value_after(&argv, "-device").into_iter().filter(|d| d.starts_with("pcie-root-port,id=hp")).collect();
        assert_eq!(ports.len(), 2 + c.qemu.hotplug_ports);
        let position = |needle: &str| argv.iter().position(|a| a.starts_with(needle)).unwrap();
        assert!(position("pcie-root-port,id=hp1,") < position("virtio-blk-pci,drive=data-nsm"));
        let (nsm_fd, logs_fd) = (3 + layout.len() - 4, 3 + layout.len() - 2);
        // Block nodes as hot-plug adds them: a qcow2 with `backing: null`.
        assert_eq!(value_after(&argv, "-drive").len(), 2, "the boot disk and the seed only");
        let nodes: Vec<serde_json::Value> =
            value_after(&argv, "-blockdev").iter().map(|b| serde_json::from_str(b).unwrap()).collect();
        assert_eq!(
            nodes,
            [
                crate::qemu::hotplug::blockdev_args(&s.disks[0], nsm_fd as u64),
                crate::qemu::hotplug::blockdev_args(&s.disks[1], logs_fd as u64),
            ]
        );
        assert_eq!(
            nodes[0],
            serde_json::json!({"driver": "raw", "node-name": "data-nsm", "discard": "unmap",
                "cache": {"direct": true, "no-flush": false},
                "file": {"driver": "file", "filename": format!("/dev/fdset/{nsm_fd}"), "aio": "native",
                         "locking": "off", "discard": "unmap", "cache": {"direct": true, "no-flush": false}}})
        );
        assert_eq!(nodes[1]["backing"], serde_json::Value::Null);
        assert!(nodes[1].as_object().unwrap().contains_key("backing"));
        assert_eq!((nodes[1]["driver"].as_str(), nodes[1]["node-name"].as_str()), (Some("qcow2"), Some("data-logs")));
        assert_eq!(nodes[1]["file"]["filename"], format!("/dev/fdset/{logs_fd}"));
        assert!(value_after(&argv, "-add-fd")
            .contains(&format!("fd={nsm_fd},set={nsm_fd},opaque=/var/lib/vmhost/disks/vm-3/nsm.raw").as_str()));
    }

    #[test]
    fn an_imported_root_disk_is_the_boot_disk_with_its_format_pinned_and_no_seed() {
        let c = config();
        let mut s = spec("vm-4");
        s.boot = BootSpec { disk: Some("old-vm.qcow2".into()), ..BootSpec::default() };
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(
            before_exec(&v),
            [
                PassedFd::Qmp,
                PassedFd::Agent,
                PassedFd::SerialLog,
                PassedFd::RootDisk,
                PassedFd::RootDiskRo,
                PassedFd::QmpEvents,
                PassedFd::Console,
                PassedFd::QmpStats
            ]
        );
        let p = VmPaths::for_vm(&c, "vm-4");
        for (format, path) in
            [("qcow2", "/var/lib/vmhost/disks/vm-4/root.qcow2"), ("raw", "/var/lib/vmhost/disks/vm-4/root.raw")]
        {
            let argv: Vec<String> =
                build_argv(&v, &c, &p, &[], format, None).into_iter().map(|o| o.into_string().unwrap()).collect();
            assert_eq!(
                value_after(&argv, "-add-fd")[1..],
                [format!("fd=6,set=6,opaque={path}"), "fd=7,set=6".to_string()]
            );
            assert_eq!(
                value_after(&argv, "-drive"),
                [format!("file=/dev/fdset/6,if=none,id=virtio0,format={format},discard=unmap")]
            );
            let devices: Vec<&str> =
                value_after(&argv, "-device").into_iter().filter(|d| d.starts_with("virtio-blk")).collect();
            assert_eq!(devices, ["virtio-blk-pci,drive=virtio0,id=boot-disk"], "no seed");
            assert!(!argv.contains(&"-kernel".to_string()));
        }
        // Anything but raw is qcow2: a format text can never reach the option list.
        let argv: Vec<String> = build_argv(&v, &c, &p, &[], "raw,file.filename=/etc/shadow", None)
            .into_iter()
            .map(|o| o.into_string().unwrap())
            .collect();
        assert_eq!(value_after(&argv, "-drive"), ["file=/dev/fdset/6,if=none,id=virtio0,format=qcow2,discard=unmap"]);
    }

    #[test]
    fn uefi_adds_the_flash_devices_after_every_other_descriptor() {
        use crate::api::Firmware;
        let c = config();
        let mut s = spec("efi");
        s.boot.firmware = Firmware::Uefi;
        let uefi = [PassedFd::UefiCode, PassedFd::UefiVars, PassedFd::UefiVarsRo];
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(before_exec(&v), [KERNEL_ONLY_FDS.as_slice(), &uefi].concat());
        let argv = argv_of(&s, &c);
        assert_eq!(value_after(&argv, "-machine"), ["q35,pflash0=uefi-code,pflash1=uefi-vars"]);
        assert_eq!(
            value_after(&argv, "-add-fd"),
            [
                "fd=5,set=5,opaque=/var/lib/vmhost/logs/efi.serial.log",
                "fd=10,set=10,opaque=/usr/share/OVMF/OVMF_CODE_4M.fd",
                "fd=11,set=11,opaque=/var/lib/vmhost/disks/efi/uefi-vars.fd",
                "fd=12,set=11"
            ]
        );
        let nodes: Vec<serde_json::Value> =
            value_after(&argv, "-blockdev").iter().map(|b| serde_json::from_str(b).unwrap()).collect();
        assert_eq!(
            nodes,
            [
                serde_json::json!({"driver": "file", "node-name": "uefi-code-file", "filename": "/dev/fdset/10", "read-only": true}),
                serde_json::json!({"driver": "raw", "node-name": "uefi-code", "file": "uefi-code-file", "read-only": true}),
                serde_json::json!({"driver": "file", "node-name": "uefi-vars-file", "filename": "/dev/fdset/11"}),
                serde_json::json!({"driver": "raw", "node-name": "uefi-vars", "file": "uefi-vars-file"}),
            ]
        );
        // QEMU opens no firmware path: the code's is only an fd set's description.
        for a in argv.iter().filter(|a| a.contains("/usr/share/OVMF") || a.contains("uefi-vars.fd")) {
            assert!(a.starts_with("fd=") && a.contains(",opaque="), "{a}");
        }
        // Everything a BIOS VM has keeps its number: the kernel, the monitors, the console.
        assert_eq!(value_after(&argv, "-kernel"), ["/proc/self/fd/6"]);
        assert!(argv.iter().any(|a| a == "socket,id=qmpst,fd=9,server=on,wait=off"), "{argv:?}");
        // With a seed (user_data) and data disks: after those too.
        s.user_data = Some("#cloud-config\n".into());
        let v = validate_spec(&s, &c).unwrap();
        assert_eq!(before_exec(&v), [KERNEL_ONLY_FDS.as_slice(), &[PassedFd::Seed], &uefi].concat());
        // An image VM: after its overlay, base, seed and monitors.
        s.user_data = None;
        s.boot = BootSpec {
            image: Some("base.qcow2".into()),
            disk_gib: Some(4),
            firmware: Firmware::Uefi,
            ..BootSpec::default()
        };
        let v = validate_spec(&s, &c).unwrap();
        let layout = before_exec(&v);
        assert_eq!(layout[..10], before_exec(&validate_spec(&bios(&s), &c).unwrap())[..]);
        assert_eq!(layout[10..], uefi);
        // A BIOS VM's command line has none of it.
        let argv = argv_of(&bios(&s), &c);
        assert_eq!(value_after(&argv, "-machine"), ["q35"]);
        assert!(!argv.iter().any(|a| a.contains("uefi") || a.contains("OVMF") || a == "-blockdev"), "{argv:?}");
    }

    #[test]
    fn a_tpm_is_swtpms_channel_as_the_last_descriptor_and_a_crb_device() {
        let c = config();
        let mut s = spec("t");
        let plain = launch_fds(&validate_spec(&s, &c).unwrap(), &[]);
        assert!(!argv_of(&s, &c).iter().any(|a| a.contains("tpm")));
        s.tpm = true;
        let v = validate_spec(&s, &c).unwrap();
        // Every other descriptor keeps its number.
        assert_eq!(launch_fds(&v, &[]), [plain.as_slice(), &[PassedFd::TpmCtrl]].concat());
        let n = FIRST_PASSED_FD + plain.len() as i32;
        let argv = argv_of(&s, &c);
        assert!(argv.iter().any(|a| *a == format!("socket,id=tpm0-ctrl,fd={n}")), "{argv:?}");
        assert_eq!(value_after(&argv, "-tpmdev"), ["emulator,id=tpm0,chardev=tpm0-ctrl"]);
        assert!(argv.iter().any(|a| a == "tpm-crb,tpmdev=tpm0,id=tpm0-dev"), "{argv:?}");
    }

    #[test]
    fn a_secure_boot_vm_runs_the_secure_pair_with_smm_and_secure_flash() {
        let c = Config::parse(
            "[paths]\nboot = [\"/boot\"]\n[qemu]\naccel = \"tcg\"\n[hardware]\ncpu = 4\nmemory_gib = 4\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut s = spec("sb");
        s.boot.firmware = Firmware::Uefi;
        let plain = argv_of(&s, &c);
        s.boot.secure_boot = true;
        let secure = argv_of(&s, &c);
        assert_eq!(value_after(&secure, "-machine"), ["q35,pflash0=uefi-code,pflash1=uefi-vars,smm=on"]);
        assert_eq!(value_after(&secure, "-global"), ["driver=cfi.pflash01,property=secure,value=on"]);
        fn code(argv: &[String]) -> &str {
            value_after(argv, "-add-fd").into_iter().find(|a| a.contains("OVMF_CODE")).unwrap_or_default()
        }
        assert!(code(&secure).ends_with(",opaque=/usr/share/OVMF/OVMF_CODE_4M.secboot.fd"), "{secure:?}");
        assert!(code(&plain).ends_with(",opaque=/usr/share/OVMF/OVMF_CODE_4M.fd"), "{plain:?}");
        // The same descriptors and store: only the machine, the flash's mode and the code differ.
        assert_eq!(passed_fds(&validate_spec(&s, &c).unwrap(), 0).len(), {
            s.boot.secure_boot = false;
            passed_fds(&validate_spec(&s, &c).unwrap(), 0).len()
        });
        assert!(!plain.iter().any(|a| a.contains("smm") || a == "-global"), "{plain:?}");
        let differ: Vec<_> = secure.iter().filter(|a| !plain.contains(a)).collect();
        assert_eq!(differ.len(), 4, "{differ:?}");
    }

    /// `s` with the default firmware.
    fn bios(s: &crate::api::VmSpec) -> crate::api::VmSpec {
        let mut b = s.clone();
        b.boot.firmware = crate::api::Firmware::Bios;
        b
    }

    #[test]
    fn nics_use_passed_fds_and_direct_kernel_vms_get_ip_params() {
        let c = Config::parse(
            "[paths]\nboot = [\"/boot\"]\n[qemu]\naccel = \"tcg\"\n[hardware]\ncpu = 4\nmemory_gib = 4\n[networks.lan]\nbridge = \"br0\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut s = spec("web");
        let static_nic = crate::validate::tests::static_nic("lan", "10.0.0.5/24");
        s.nics = vec![static_nic, crate::api::NicSpec { network: "lan".into(), ..Default::default() }];
        let v = validate_spec(&s, &c).unwrap();
        let allocs = crate::nic::allocate(&s, &c, &[], &[]).unwrap();
        let argv: Vec<String> = build_argv(&v, &c, &VmPaths::for_vm(&c, "web"), &allocs, "", None)
            .into_iter()
            .map(|o| o.into_string().unwrap())
            .collect();
        assert_eq!(value_after(&argv, "-netdev"), ["tap,id=net0,fd=6", "tap,id=net1,fd=7"]);
        assert_eq!(
            passed_fds(&v, 2)[3..passed_fds(&v, 2).len() - EXEC_SLOTS],
            [
                PassedFd::Tap(0),
                PassedFd::Tap(1),
                PassedFd::Kernel,
                PassedFd::QmpEvents,
                PassedFd::Console,
                PassedFd::QmpStats
            ]
        );
        assert_eq!(value_after(&argv, "-kernel"), ["/proc/self/fd/8"]);
        let devs = value_after(&argv, "-device");
        assert!(devs.contains(&format!("virtio-net-pci,netdev=net1,mac={}", allocs[1].mac).as_str()), "{devs:?}");
        assert_eq!(value_after(&argv, "-append"), ["console=ttyS0 ip=10.0.0.5:::255.255.255.0:web:eth0:off::"]);
    }

    #[test]
    fn nic_queues_and_vhost_descriptors_come_after_every_other() {
        let c = Config::parse(
            "[paths]\nboot = [\"/boot\"]\n[qemu]\naccel = \"tcg\"\n[hardware]\ncpu = 4\nmemory_gib = 4\n[networks.lan]\nbridge = \"br0\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut s = spec("mq");
        let nic = |queues| crate::api::NicSpec {
            network: "lan".into(),
            vlan: None,
            mac: None,
            ipv4: None,
            queues,
            ..Default::default()
        };
        s.nics = vec![nic(1), nic(3)];
        let v = validate_spec(&s, &c).unwrap();
        let mut allocs = crate::nic::allocate(&s, &c, &[], &[]).unwrap();
        let argv_with = |allocs: &[NicAlloc]| -> Vec<String> {
            build_argv(&v, &c, &VmPaths::for_vm(&c, "mq"), allocs, "", None)
                .into_iter()
                .map(|o| o.into_string().unwrap())
                .collect()
        };
        let base = passed_fds(&v, 2);
        let n = 3 + base.len();
        // Without vhost-net: queue 0 keeps the number a single-queue NIC has, the others follow
        // the exec ports.
        assert_eq!(launch_fds(&v, &allocs)[..base.len()], base[..]);
        assert_eq!(launch_fds(&v, &allocs)[base.len()..], [PassedFd::TapQueue(1, 1), PassedFd::TapQueue(1, 2)]);
        let argv = argv_with(&allocs);
        assert_eq!(
            value_after(&argv, "-netdev"),
            ["tap,id=net0,fd=6".to_string(), format!("tap,id=net1,fds=7:{}:{}", n, n + 1)]
        );
        let devs = value_after(&argv, "-device");
        assert!(devs.contains(&format!("virtio-net-pci,netdev=net0,mac={}", allocs[0].mac).as_str()), "{devs:?}");
        assert!(
            devs.contains(&format!("virtio-net-pci,netdev=net1,mac={},mq=on,vectors=8", allocs[1].mac).as_str()),
            "{devs:?}"
        );
        // With vhost-net: one vhost descriptor per queue, after the tap queues.
        for a in &mut allocs {
            a.vhost = true;
        }
        let layout = launch_fds(&v, &allocs);
        assert_eq!(layout[..base.len()], base[..]);
        assert_eq!(
            layout[base.len()..],
            [
                PassedFd::TapQueue(1, 1),
                PassedFd::TapQueue(1, 2),
                PassedFd::Vhost(0, 0),
                PassedFd::Vhost(1, 0),
                PassedFd::Vhost(1, 1),
                PassedFd::Vhost(1, 2)
            ]
        );
        let argv = argv_with(&allocs);
        assert_eq!(
            value_after(&argv, "-netdev"),
            [
                format!("tap,id=net0,fd=6,vhost=on,vhostfd={}", n + 2),
                format!("tap,id=net1,fds=7:{}:{},vhost=on,vhostfds={}:{}:{}", n, n + 1, n + 3, n + 4, n + 5)
            ]
        );
        // Every other descriptor keeps its number: the kernel, the monitors.
        assert_eq!(value_after(&argv, "-kernel"), ["/proc/self/fd/8"]);
        // One queue, no vhost: exactly today's layout and arguments.
        s.nics = vec![nic(1)];
        let v = validate_spec(&s, &c).unwrap();
        let allocs = crate::nic::allocate(&s, &c, &[], &[]).unwrap();
        assert_eq!(launch_fds(&v, &allocs), passed_fds(&v, 1));
        let argv: Vec<String> = build_argv(&v, &c, &VmPaths::for_vm(&c, "mq"), &allocs, "", None)
            .into_iter()
            .map(|o| o.into_string().unwrap())
            .collect();
        assert_eq!(value_after(&argv, "-netdev"), ["tap,id=net0,fd=6"]);
        assert!(!argv.iter().any(|a| a.contains("mq=on") || a.contains("vhost")), "{argv:?}");
    }

    #[test]
    fn the_most_descriptors_a_vm_can_have_fit_one_launch() {
        use crate::api::{DiskFormat, Firmware};
        let c = Config::parse(
            "[paths]\nboot = [\"/boot\"]\n[qemu]\naccel = \"tcg\"\n[hardware]\ncpu = 4\nmemory_gib = 64\n[networks.lan]\nbridge = \"br0\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut s = spec("big");
        s.boot = BootSpec {
            image: Some("base.qcow2".into()),
            disk_gib: Some(4),
            firmware: Firmware::Uefi,
            ..BootSpec::default()
        };
        s.disks = (0..crate::api::disks::MAX_DATA_DISKS)
            .map(|i| crate::validate::tests::data_disk(&format!("d{i}"), 1, DiskFormat::Raw))
            .collect();
        // Every NIC, the VM's queues spread over them.
        let per_nic = u8::try_from(crate::nic::MAX_VM_QUEUES / crate::nic::MAX_NICS as u32).unwrap();
        s.nics = (0..crate::nic::MAX_NICS)
            .map(|_| crate::api::NicSpec {
                network: "lan".into(),
                vlan: None,
                mac: None,
                ipv4: None,
                queues: per_nic,
                ..Default::default()
            })
            .collect();
        let v = validate_spec(&s, &c).unwrap();
        let mut allocs = crate::nic::allocate(&s, &c, &[], &[]).unwrap();
        allocs.iter_mut().for_each(|a| a.vhost = true);
        let n = launch_fds(&v, &allocs).len();
        assert!(n <= crate::sandbox::spawn::MAX_PASSED_FDS, "{n}");
        assert_eq!(n, passed_fds(&v, crate::nic::MAX_NICS).len() + 2 * 64 - crate::nic::MAX_NICS);
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
        c.qemu.cpu_model = "qemu64".into();
        assert_eq!(value_after(&argv_of(&spec("a"), &c), "-cpu"), ["qemu64"]);
        c.qemu.accel = Accel::Tcg;
        assert_eq!(value_after(&argv_of(&spec("a"), &c), "-cpu"), ["qemu64"]);
    }

    #[test]
    fn commas_in_paths_cannot_inject_options() {
        let mut c = config();
        c.paths.state = "/srv/a,readonly=on".into();
        let argv = argv_of(&spec("a"), &c);
        assert!(argv.iter().any(|a| a == "fd=5,set=5,opaque=/srv/a,,readonly=on/logs/a.serial.log"));
    }

    #[test]
    fn base_format_cannot_inject_options() {
        let c = config();
        let mut s = spec("vm-2");
        s.boot = BootSpec { image: Some("base.img".into()), disk_gib: Some(4), ..BootSpec::default() };
        let v = validate_spec(&s, &c).unwrap();
        let argv = build_argv(&v, &c, &VmPaths::for_vm(&c, "vm-2"), &[], "raw,file.filename=/etc/shadow", None);
        let drive = argv.iter().find(|a| a.to_string_lossy().starts_with("file=/dev/fdset/6")).unwrap();
        assert!(drive.to_string_lossy().contains("backing.driver=rawfilefilenameetcshadow,"), "{drive:?}");
    }

    #[test]
    fn qemu_sandbox_can_be_turned_off() {
        let mut c = config();
        c.qemu.sandbox = false;
        assert!(!argv_of(&spec("a"), &c).contains(&"-sandbox".to_string()));
    }

    #[test]
    fn socket_paths_fit_sun_path() {
        let mut c = config();
        c.paths.run = PathBuf::from("/").join("r".repeat(crate::config::MAX_RUN_DIR_LEN - 1));
        let p = VmPaths::for_vm(&c, &"n".repeat(63));
        assert_eq!(p.agent.as_os_str().len(), 107);
        assert!(p.qmp.as_os_str().len() <= 107);
        assert_eq!(p.exec.len(), EXEC_SLOTS);
        assert!(p.exec.iter().all(|e| e.as_os_str().len() <= 107), "{:?}", p.exec);
    }

    fn placement(nodes: Vec<u32>, hugepages: Option<HugePageSize>) -> Placement {
        Placement {
            policy: crate::api::CpuPolicy::Dedicated,
            vcpus: vec![2, 3],
            cpus: crate::placement::CpuSet::from_cpus([2, 3]),
            emulator: crate::placement::CpuSet::from_cpus([0]),
            nodes,
            hugepages,
            hugepages_per_node: Default::default(),
            memory_mib: 256,
        }
    }

    #[test]
    fn a_placed_vm_gets_a_bound_memfd_backend() {
        let c = config();
        let mut s = spec("vm-1");
        s.memory_mib = 256;
        let plain = argv_of(&s, &c);
        let v = validate_spec(&s, &c).unwrap();
        let paths = VmPaths::for_vm(&c, &s.name);
        let with = |p: &Placement| {
            let argv = build_argv(&v, &c, &paths, &[], "qcow2", Some(p));
            argv.into_iter().map(|o| o.into_string().unwrap()).collect::<Vec<String>>()
        };
        // CPUs only (no nodes, no hugepages): the argv is unchanged.
        assert_eq!(with(&placement(vec![], None)), plain);
        let argv = with(&placement(vec![1], Some(HugePageSize::M2)));
        assert_eq!(value_after(&argv, "-machine"), [format!("{},memory-backend=ram0", c.qemu.machine)]);
        assert_eq!(
            value_after(&argv, "-object"),
            ["memory-backend-memfd,id=ram0,size=256M,share=on,hugetlb=on,hugetlbsize=2M,prealloc=on,host-nodes=1,policy=bind"]
        );
        // Right after the memory size, which stays.
        let m = argv.iter().position(|a| a == "-m").unwrap();
        assert_eq!((argv[m + 1].as_str(), argv[m + 2].as_str()), ("256", "-object"));
        assert_eq!(value_after(&argv, "-smp"), value_after(&plain, "-smp"));
        assert_eq!(argv.len(), plain.len() + 2);
        let argv = with(&placement(vec![0, 1, 3], Some(HugePageSize::G1)));
        assert_eq!(
            value_after(&argv, "-object"),
            ["memory-backend-memfd,id=ram0,size=256M,share=on,hugetlb=on,hugetlbsize=1G,prealloc=on,host-nodes=0-1,host-nodes=3,policy=bind"]
        );
        let argv = with(&placement(vec![0], None));
        assert_eq!(
            value_after(&argv, "-object"),
            ["memory-backend-memfd,id=ram0,size=256M,share=on,host-nodes=0,policy=bind"]
        );
    }
}
