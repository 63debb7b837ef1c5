//! A PCI device's AER counters as the kernel prints them in sysfs (`aer_dev_correctable`,
//! `aer_dev_nonfatal`, `aer_dev_fatal`): one `NAME count` line per error the kernel names, in
//! its order, then the file's total. Recorded trees and the tests that raise counters in them
//! write these files through here, so that every crate's tests spell the kernel's names once.

use std::path::Path;

/// The correctable errors, in the kernel's order (`aer_correctable_error_string`).
pub const CORRECTABLE: &[&str] = &[
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
];

/// The uncorrectable errors, in the kernel's order (`aer_uncorrectable_error_string`); the
/// non-fatal and the fatal file list the same names.
pub const UNCORRECTABLE: &[&str] = &[
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
];

/// One of a device's three AER counter files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aer {
    Correctable,
    Nonfatal,
    Fatal,
}

impl Aer {
    /// The file's name in the device's sysfs directory.
    pub fn file(self) -> &'static str {
        match self {
            Aer::Correctable => "aer_dev_correctable",
            Aer::Nonfatal => "aer_dev_nonfatal",
            Aer::Fatal => "aer_dev_fatal",
        }
    }

    /// The errors the file counts, in its order.
    pub fn names(self) -> &'static [&'static str] {
        match self {
            Aer::Correctable => CORRECTABLE,
            Aer::Nonfatal | Aer::Fatal => UNCORRECTABLE,
        }
    }

    /// The name of the file's last line, the sum of the others.
    pub fn total(self) -> &'static str {
        match self {
            Aer::Correctable => "TOTAL_ERR_COR",
            Aer::Nonfatal => "TOTAL_ERR_NONFATAL",
            Aer::Fatal => "TOTAL_ERR_FATAL",
        }
    }

    /// The file's text with the counts in `set` (every other error 0) and their total.
    pub fn text(self, set: &[(&str, u64)]) -> String {
        let mut s = String::new();
        let mut sum = 0;
        for n in self.names() {
            let v = set.iter().find(|(k, _)| k == n).map(|x| x.1).unwrap_or(0);
            sum += v;
            s.push_str(&format!("{n} {v}\n"));
        }
        s.push_str(&format!("{} {sum}\n", self.total()));
        s
    }

    /// Writes the file into the device directory `dev` whole and renames it into place, so
    /// that a watcher polling it never reads half of it.
    pub fn write(self, dev: &Path, set: &[(&str, u64)]) {
        let tmp = dev.join(".aer.tmp");
        std::fs::write(&tmp, self.text(set)).unwrap();
        std::fs::rename(&tmp, dev.join(self.file())).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_is_the_sum_and_comes_last() {
        let t = Aer::Correctable.text(&[("BadTLP", 3), ("BadDLLP", 1)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), CORRECTABLE.len() + 1);
        assert_eq!(lines[1], "BadTLP 3");
        assert_eq!(lines[2], "BadDLLP 1");
        assert_eq!(lines[0], "RxErr 0");
        assert_eq!(*lines.last().unwrap(), "TOTAL_ERR_COR 4");
        let f = Aer::Fatal.text(&[]);
        assert!(f.starts_with("Undefined 0\n"));
        assert!(f.ends_with("TOTAL_ERR_FATAL 0\n"));
    }
}
