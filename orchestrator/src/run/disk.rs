//! How busy the disks a run reads from were, step by step: the kernel's own count of the
//! milliseconds each block device had I/O in flight (`io_ticks`, the tenth field of
//! `/sys/dev/block/MAJ:MIN/stat`, the figure `iostat` turns into `%util`).
//!
//! A streamed run is at the disk's limit when its device is busy for the whole step; the
//! gap between a step's wall time and its busy time is the time compute did not overlap
//! reads. Unlike a separate bandwidth probe (whose figure on a shared virtual disk moves by
//! a factor of two from one minute to the next), this is measured during the step itself.
//!
//! Observation only: a path whose device has no stat file (tmpfs, overlay, a container's
//! anonymous device) is left out, and with none left there is no figure at all, never a
//! guessed one.

use std::path::{Path, PathBuf};

/// The block devices under a set of paths.
#[derive(Debug)]
pub struct DiskBusy {
    /// (device name for messages, its stat file).
    devices: Vec<(String, PathBuf)>,
}

/// `io_ticks` (milliseconds) from the text of a block device's `stat` file.
pub fn io_ticks(stat: &str) -> Option<u64> {
    stat.split_whitespace().nth(9)?.parse().ok()
}

impl DiskBusy {
    /// The distinct block devices holding `paths` (files or directories); None when none
    /// of them is on a block device with a stat file.
    pub fn of(paths: &[&Path]) -> Option<DiskBusy> {
        let mut devices: Vec<(String, PathBuf)> = Vec::new();
        for p in paths {
            let Ok(st) = rustix::fs::stat(*p) else {
                continue;
            };
            let (maj, min) = (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
            let dir = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
            let stat = dir.join("stat");
            if devices.iter().any(|(_, s)| *s == stat) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&stat) else {
                continue;
            };
            if io_ticks(&text).is_none() {
                continue;
            }
            let name = std::fs::read_link(&dir)
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| format!("{maj}:{min}"));
            devices.push((name, stat));
        }
        (!devices.is_empty()).then_some(DiskBusy { devices })
    }

    /// The devices' names, comma-separated.
    pub fn names(&self) -> String {
        self.devices
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every device's `io_ticks` now (None for one that could not be read this time).
    pub fn sample(&self) -> Vec<Option<u64>> {
        self.devices
            .iter()
            .map(|(_, s)| std::fs::read_to_string(s).ok().and_then(|t| io_ticks(&t)))
            .collect()
    }

    /// Seconds the busiest device was busy between two samples (None when no device was
    /// read both times).
    pub fn busy_seconds(before: &[Option<u64>], after: &[Option<u64>]) -> Option<f64> {
        before
            .iter()
            .zip(after)
            .filter_map(|(b, a)| Some(a.as_ref()?.saturating_sub(*b.as_ref()?)))
            .max()
            .map(|ms| ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_ticks_is_the_tenth_field() {
        // A real /sys/block/vda/stat line (17 fields on Linux 5.5+).
        let line = "  112261    10794 146954858  3571638    31712    32948 46071152   226682        0   107500  3815896     9414       92   647784     8180     3003     9394\n";
        assert_eq!(io_ticks(line), Some(107_500));
        assert_eq!(io_ticks("1 2 3"), None);
        assert_eq!(io_ticks("1 2 3 4 5 6 7 8 9 x"), None);
    }

    #[test]
    fn busy_is_the_busiest_device_and_skips_unread_ones() {
        let b = [Some(1_000), Some(5_000), None];
        let a = [Some(1_900), Some(5_250), Some(9_000)];
        assert_eq!(DiskBusy::busy_seconds(&b, &a), Some(0.9));
        assert_eq!(DiskBusy::busy_seconds(&[None], &[Some(3)]), None);
    }

    #[test]
    fn a_path_on_no_block_device_gives_no_figure() {
        // /proc is not on a block device: no stat file, so no figure rather than a guess.
        assert!(DiskBusy::of(&[Path::new("/proc/self")]).is_none());
        assert!(DiskBusy::of(&[Path::new("/nonexistent/k3")]).is_none());
    }
}
