//! QEMU processes: the argv for a VM, the files it is handed, launching it, and talking QMP to it.

pub mod argv;
pub mod boot_files;
pub mod firmware;
pub mod hotplug;
pub mod identity;
pub mod integrity;
pub mod kvm;
pub mod launch;
pub mod migration;
pub mod qmp;
pub mod session;
