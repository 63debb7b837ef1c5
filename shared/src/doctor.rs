//! The doctor's common ground: a finding (pass, fail with its fix, or not applicable), the
//! report both `gpufeed-guest doctor` and `gpufeed-host doctor` print, the checks both agents
//! make the same way (capabilities, kernel lockdown, a file system mounted where expected),
//! and with the `stream` feature the `gpufeed_check_ok{check}` gauge the running agents export.
//!
//! Every check takes its inputs (a `/proc/<pid>` directory, a file, a mount point) so that a
//! test can hand it real kernel state in the state it wants to see.

use std::fmt::Write as _;
use std::path::Path;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    /// Not applicable here (e.g. the stream check when the stream is off): printed, not
    /// counted as a failure, not exported.
    Skip,
}

/// One check's result: what was found and, for a failure, what to do about it. A running
/// agent serves its latest findings as JSON (the guest at `/doctor`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Finding {
    /// Stable name, the `check` label of `gpufeed_check_ok`.
    pub check: String,
    pub status: Status,
    /// What was looked at and what it said.
    pub detail: String,
    /// For a failure: the fix.
    pub fix: Option<String>,
}

impl Finding {
    pub fn pass(check: impl Into<String>, detail: impl Into<String>) -> Finding {
        Finding {
            check: check.into(),
            status: Status::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn fail(
        check: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding {
            check: check.into(),
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub fn skip(check: impl Into<String>, detail: impl Into<String>) -> Finding {
        Finding {
            check: check.into(),
            status: Status::Skip,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn passed(&self) -> bool {
        self.status == Status::Pass
    }
}

/// The report, one line per check and an indented `fix:` line under each failure.
pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    let width = findings.iter().map(|f| f.check.len()).max().unwrap_or(0);
    for f in findings {
        let word = match f.status {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        let _ = writeln!(out, "{word}  {:<width$}  {}", f.check, f.detail);
        if let Some(fix) = &f.fix {
            let _ = writeln!(out, "      {:<width$}  fix: {fix}", "");
        }
    }
    let failed = findings.iter().filter(|f| f.status == Status::Fail).count();
    let _ = writeln!(
        out,
        "{} checks, {failed} failed",
        findings.iter().filter(|f| f.status != Status::Skip).count()
    );
    out
}

/// True when any check failed (the command then exits non-zero).
pub fn any_failed(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.status == Status::Fail)
}

/// A capability an agent needs, and what it is for (printed with a failure).
#[derive(Debug, Clone, Copy)]
pub struct Capability {
    pub number: u32,
    pub name: &'static str,
    pub used_for: &'static str,
    /// Another capability that grants the same (CAP_SYS_ADMIN covers CAP_BPF and CAP_PERFMON
    /// on kernels before 5.8 and still does after).
    pub or: Option<u32>,
}

pub const CAP_SYSLOG: u32 = 34;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_SYS_PTRACE: u32 = 19;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// Effective capability set from a `/proc/<pid>/status` text.
pub fn effective_caps(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

/// The capabilities of `needed` missing from the effective set.
pub fn missing_caps(caps: u64, needed: &[Capability]) -> Vec<Capability> {
    let has = |c: u32| caps & (1u64 << c) != 0;
    needed
        .iter()
        .filter(|c| !has(c.number) && !c.or.is_some_and(has))
        .copied()
        .collect()
}

/// `capabilities`: the effective set of the process whose `/proc/<pid>` is `proc_pid` (the
/// agent's own: `/proc/self`) holds every capability in `needed`. `grant` says how they are
/// granted where this agent runs (the DaemonSet, the unit).
pub fn capabilities(proc_pid: &Path, needed: &[Capability], grant: &str) -> Finding {
    const CHECK: &str = "capabilities";
    let status_file = proc_pid.join("status");
    let caps = match std::fs::read_to_string(&status_file) {
        Ok(text) => effective_caps(&text),
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("cannot read {}: {e}", status_file.display()),
                "run the doctor where the agent runs (same container or unit)",
            )
        }
    };
    let Some(caps) = caps else {
        return Finding::fail(
            CHECK,
            format!("no CapEff line in {}", status_file.display()),
            "run the doctor where the agent runs (same container or unit)",
        );
    };
    let missing = missing_caps(caps, needed);
    if missing.is_empty() {
        let names: Vec<&str> = needed.iter().map(|c| c.name).collect();
        return Finding::pass(
            CHECK,
            format!("CapEff {caps:016x} holds {}", names.join(", ")),
        );
    }
    let what: Vec<String> = missing
        .iter()
        .map(|c| format!("{} ({})", c.name, c.used_for))
        .collect();
    Finding::fail(
        CHECK,
        format!("CapEff {caps:016x} lacks {}", what.join("; ")),
        grant.to_string(),
    )
}

/// The active mode of a `/sys/kernel/security/lockdown` text ("none [integrity]
/// confidentiality" → "integrity").
pub fn lockdown_mode(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = text[start..].find(']')? + start;
    Some(&text[start..end])
}

/// `lockdown`: the kernel lockdown mode read from `file` (`/sys/kernel/security/lockdown`),
/// with what each mode turns off for this agent (`effects(mode)`, `None` when nothing).
/// No file: the lockdown LSM is not built in or securityfs is not mounted, which is a pass
/// (nothing is locked down that the agent could see).
pub fn lockdown(file: &Path, effects: impl Fn(&str) -> Option<String>) -> Finding {
    const CHECK: &str = "lockdown";
    let text =
        match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Finding::pass(
                    CHECK,
                    format!(
                        "{} absent: no lockdown LSM or securityfs not mounted",
                        file.display()
                    ),
                )
            }
            Err(e) => return Finding::fail(
                CHECK,
                format!("cannot read {}: {e}", file.display()),
                "mount securityfs read-only where the agent runs, so that it can adapt to the mode",
            ),
        };
    let Some(mode) = lockdown_mode(&text) else {
        return Finding::fail(
            CHECK,
            format!("{} says {:?}: no active mode", file.display(), text.trim()),
            "mount the host's securityfs (/sys/kernel/security) where the agent runs",
        );
    };
    match effects(mode) {
        None => Finding::pass(
            CHECK,
            format!("lockdown={mode}: nothing of the agent's is off"),
        ),
        Some(off) => Finding::fail(
            CHECK,
            format!("lockdown={mode} turns off: {off}"),
            "boot without lockdown (kernel command line lockdown=none; SecureBoot kernels \
             enforce it) or accept what is off",
        ),
    }
}

/// File system magic numbers (statfs f_type) of the mounts the doctor looks for.
pub const CGROUP2_MAGIC: i64 = 0x6367_7270;
pub const TRACEFS_MAGIC: i64 = 0x7472_6163;
pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The statfs f_type of the file system holding `path`.
pub fn fs_type(path: &Path) -> std::io::Result<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between architectures
    Ok(st.f_type as i64)
}

/// A file system that must be mounted at one of `paths`: passes at the first path that has
/// file system `magic`; fails with `fix` otherwise.
pub fn mounted(check: &str, what: &str, paths: &[&Path], magic: i64, fix: &str) -> Finding {
    for p in paths {
        if fs_type(p).ok() == Some(magic) {
            return Finding::pass(check, format!("{what} at {}", p.display()));
        }
    }
    let looked: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    Finding::fail(
        check,
        format!("no {what} at {}", looked.join(" or ")),
        fix.to_string(),
    )
}

#[cfg(feature = "stream")]
pub use gauge::CheckGauge;

#[cfg(feature = "stream")]
mod gauge {
    use super::{Finding, Status};
    use prometheus::{IntGaugeVec, Opts, Registry};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    /// `gpufeed_check_ok{check}`: 1 when the check passed at its last evaluation, 0 when it
    /// failed; no series for a check that does not apply. A running agent's checks also go to
    /// its log: a line when one fails, one when it passes again.
    #[derive(Clone)]
    pub struct CheckGauge {
        gauge: IntGaugeVec,
        before: Arc<Mutex<HashMap<String, Status>>>,
    }

    impl CheckGauge {
        pub fn register(registry: &Registry) -> prometheus::Result<CheckGauge> {
            let gauge = IntGaugeVec::new(
                Opts::new(
                    "gpufeed_check_ok",
                    "Doctor check passed (1) or failed (0) at its last evaluation",
                ),
                &["check"],
            )?;
            registry.register(Box::new(gauge.clone()))?;
            Ok(CheckGauge {
                gauge,
                before: Arc::default(),
            })
        }

        /// Sets the gauge from one evaluation (a check that became not applicable loses its
        /// series) and logs the checks whose status changed to or from a failure.
        pub fn update(&self, findings: &[Finding]) {
            let mut before = self.before.lock().unwrap_or_else(|e| e.into_inner());
            for f in findings {
                let was = before.insert(f.check.clone(), f.status);
                match (was, f.status) {
                    (Some(Status::Fail), Status::Fail) => {}
                    (_, Status::Fail) => tracing::warn!(
                        check = %f.check,
                        "doctor: {}; fix: {}",
                        f.detail,
                        f.fix.as_deref().unwrap_or("")
                    ),
                    (Some(Status::Fail), _) => {
                        tracing::info!(check = %f.check, "doctor: passes now: {}", f.detail)
                    }
                    _ => {}
                }
                match f.status {
                    Status::Pass => self.gauge.with_label_values(&[&f.check]).set(1),
                    Status::Fail => self.gauge.with_label_values(&[&f.check]).set(0),
                    Status::Skip => {
                        let _ = self.gauge.remove_label_values(&[&f.check]);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEEDED: &[Capability] = &[
        Capability {
            number: CAP_BPF,
            name: "CAP_BPF",
            used_for: "load programs",
            or: Some(CAP_SYS_ADMIN),
        },
        Capability {
            number: CAP_NET_ADMIN,
            name: "CAP_NET_ADMIN",
            used_for: "tc",
            or: None,
        },
    ];

    #[test]
    fn capability_sets_decide() {
        assert!(missing_caps(u64::MAX, NEEDED).is_empty());
        let m = missing_caps(0, NEEDED);
        assert_eq!(
            m.iter().map(|c| c.name).collect::<Vec<_>>(),
            ["CAP_BPF", "CAP_NET_ADMIN"]
        );
        // SYS_ADMIN stands in for BPF, not for NET_ADMIN
        let m = missing_caps(1 << CAP_SYS_ADMIN, NEEDED);
        assert_eq!(
            m.iter().map(|c| c.name).collect::<Vec<_>>(),
            ["CAP_NET_ADMIN"]
        );
        assert_eq!(
            effective_caps("Name:\tx\nCapEff:\t000001ffffffffff\n"),
            Some(0x1ff_ffff_ffff)
        );
        assert_eq!(effective_caps("garbage"), None);
    }

    #[test]
    fn lockdown_modes_parse() {
        assert_eq!(
            lockdown_mode("none [integrity] confidentiality\n"),
            Some("integrity")
        );
        assert_eq!(
            lockdown_mode("[none] integrity confidentiality"),
            Some("none")
        );
        assert_eq!(lockdown_mode("none"), None);
    }

    #[test]
    fn report_names_failures_and_fixes() {
        let f = [
            Finding::pass("a", "fine"),
            Finding::fail("bbb", "broken", "mend it"),
            Finding::skip("c", "not here"),
        ];
        let r = render(&f);
        assert!(r.contains("pass  a    fine\n"), "{r}");
        assert!(r.contains("FAIL  bbb  broken\n"), "{r}");
        assert!(r.contains("fix: mend it"), "{r}");
        assert!(r.contains("skip  c    not here\n"), "{r}");
        assert!(r.ends_with("2 checks, 1 failed\n"), "{r}");
        assert!(any_failed(&f));
        assert!(!any_failed(&f[..1]));
    }
}
