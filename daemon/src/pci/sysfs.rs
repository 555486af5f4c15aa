//! The narrow door through which the PCI layer talks to the kernel: five sysfs operations.
//!
//! Everything vmhostd does to PCI devices (read what a device is, which driver holds it, which
//! IOMMU group it is in; unbind it, set `driver_override`, reprobe it) is a read, a `readlink`, a
//! directory listing or a short write below `/sys`. Putting exactly those five operations behind
//! [`SysfsIo`] lets the same inspection, checking and binding code run on the real kernel
//! ([`RealSysfs`]) and, in tests, on `FakeSysfs`, which models how the kernel reacts to the writes.
//!
//! Paths are relative to the sysfs root (`bus/pci/devices/0000:00:05.0/driver`); [`RealSysfs`]
//! joins them to its root (`/sys`, or a directory tree a test builds).

use std::fs;
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

/// The real sysfs mount point.
pub const SYSFS_ROOT: &str = "/sys";

/// The five sysfs operations the PCI layer needs. Paths are relative to the sysfs root.
pub trait SysfsIo: Send + Sync {
    /// The whole content of an attribute file (`vendor` reads `"0x8086\n"`).
    ///
    /// # Errors
    /// `NotFound` when the attribute does not exist; whatever the kernel returns otherwise.
    fn read(&self, rel: &Path) -> io::Result<String>;

    /// The target of a symbolic link (`driver` reads `../../../bus/pci/drivers/e1000e`).
    ///
    /// # Errors
    /// `NotFound` when there is no such link (a device without a driver has no `driver` link).
    fn read_link(&self, rel: &Path) -> io::Result<PathBuf>;

    /// Writes `data` to an existing attribute in one `write` call, as the kernel expects.
    ///
    /// # Errors
    /// `NotFound` when the attribute does not exist; the kernel's refusal otherwise (`ENODEV`
    /// when unbinding a device from a driver that does not hold it, `EBUSY`, ...).
    fn write(&self, rel: &Path, data: &str) -> io::Result<()>;

    /// The names in a directory, sorted.
    ///
    /// # Errors
    /// `NotFound` when the directory does not exist; `NotADirectory` (or similar) for a file.
    fn list(&self, rel: &Path) -> io::Result<Vec<String>>;

    /// Whether the path exists (following symbolic links).
    fn exists(&self, rel: &Path) -> bool;
}

/// A shared handle works like the sysfs it points to (one fake shared by code and test).
impl<T: SysfsIo + ?Sized> SysfsIo for std::sync::Arc<T> {
    fn read(&self, rel: &Path) -> io::Result<String> {
        (**self).read(rel)
    }

    fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        (**self).read_link(rel)
    }

    fn write(&self, rel: &Path, data: &str) -> io::Result<()> {
        (**self).write(rel, data)
    }

    fn list(&self, rel: &Path) -> io::Result<Vec<String>> {
        (**self).list(rel)
    }

    fn exists(&self, rel: &Path) -> bool {
        (**self).exists(rel)
    }
}

/// [`SysfsIo`] on a real directory tree: `/sys` in production, a temporary tree in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealSysfs {
    /// The directory relative paths are resolved against.
    root: PathBuf,
}

impl Default for RealSysfs {
    fn default() -> Self {
        RealSysfs { root: PathBuf::from(SYSFS_ROOT) }
    }
}

impl RealSysfs {
    /// Sysfs rooted at `root` instead of `/sys`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        RealSysfs { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `root/rel`, refusing absolute paths and `..`, which would leave the root.
    fn path(&self, rel: &Path) -> io::Result<PathBuf> {
        if rel.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)) {
            Ok(self.root.join(rel))
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a path below the sysfs root", rel.display()),
            ))
        }
    }
}

impl SysfsIo for RealSysfs {
    fn read(&self, rel: &Path) -> io::Result<String> {
        fs::read_to_string(self.path(rel)?)
    }

    fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        fs::read_link(self.path(rel)?)
    }

    fn write(&self, rel: &Path, data: &str) -> io::Result<()> {
        // Sysfs attributes exist or not; never create, never truncate (not supported there).
        let mut file = fs::OpenOptions::new().write(true).open(self.path(rel)?)?;
        file.write_all(data.as_bytes())
    }

    fn list(&self, rel: &Path) -> io::Result<Vec<String>> {
        let mut names = fs::read_dir(self.path(rel)?)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<io::Result<Vec<_>>>()?;
        names.sort();
        Ok(names)
    }

    fn exists(&self, rel: &Path) -> bool {
        self.path(rel).is_ok_and(|p| p.exists())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn reads_lists_links_and_writes_below_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/vendor"), "0x8086\n").unwrap();
        fs::write(root.join("a/b/driver_override"), "").unwrap();
        symlink("../../x/y", root.join("a/b/driver")).unwrap();
        let io = RealSysfs::new(root);
        assert_eq!(io.root(), root);

        assert_eq!(io.read(Path::new("a/b/vendor")).unwrap(), "0x8086\n");
        assert_eq!(io.read_link(Path::new("a/b/driver")).unwrap(), PathBuf::from("../../x/y"));
        assert_eq!(io.list(Path::new("a/b")).unwrap(), ["driver", "driver_override", "vendor"]);
        assert!(io.exists(Path::new("a/b/vendor")));
        // A dangling link does not count as existing, as on sysfs.
        assert!(!io.exists(Path::new("a/b/driver")));

        io.write(Path::new("a/b/driver_override"), "vfio-pci").unwrap();
        assert_eq!(fs::read_to_string(root.join("a/b/driver_override")).unwrap(), "vfio-pci");

        // Attributes are never created.
        let e = io.write(Path::new("a/b/new"), "x").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!root.join("a/b/new").exists());
        assert_eq!(io.read(Path::new("a/missing")).unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(io.read_link(Path::new("a/b/vendor")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn paths_cannot_leave_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let io = RealSysfs::new(dir.path().join("sys"));
        fs::create_dir(io.root()).unwrap();
        fs::write(dir.path().join("secret"), "x").unwrap();
        for rel in ["../secret", "/etc/hostname", "a/../../secret"] {
            assert_eq!(io.read(Path::new(rel)).unwrap_err().kind(), io::ErrorKind::InvalidInput, "{rel}");
            assert!(!io.exists(Path::new(rel)), "{rel}");
        }
        assert_eq!(RealSysfs::default().root(), Path::new("/sys"));
    }
}
