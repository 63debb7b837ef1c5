//! libbpf's own log: routed into tracing (debug level), so that a failed load shows the
//! agent's one-line summary rather than a wall of verifier output (still there with
//! RUST_LOG=debug), and captured while a unit loads, so that a probe the kernel refuses is
//! reported down with the kernel's own reason (the verifier's last word, or the map or kfunc
//! libbpf could not set up).

use std::cell::RefCell;

thread_local! {
    /// libbpf's warnings, one buffer per [`Capture`] running on this thread (units load on
    /// one thread; a unit's storage fallback captures inside the unit's own capture).
    static CAPTURED: RefCell<Vec<Vec<String>>> = const { RefCell::new(Vec::new()) };
}

/// Sends libbpf's log into tracing, and into a running [`Capture`].
pub fn route() {
    fn cb(level: libbpf_rs::PrintLevel, msg: String) {
        let msg = msg.trim_end();
        match level {
            libbpf_rs::PrintLevel::Warn => {
                tracing::debug!(target: "libbpf", "{msg}");
                CAPTURED.with(|c| {
                    if let Some(lines) = c.borrow_mut().last_mut() {
                        lines.extend(msg.lines().map(str::to_string));
                    }
                });
            }
            _ => tracing::trace!(target: "libbpf", "{msg}"),
        }
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, cb)));
}

/// libbpf's warnings while it lives (on this thread); a capture started inside another
/// hands what it saw to the outer one when it ends.
pub struct Capture(());

impl Capture {
    pub fn start() -> Capture {
        CAPTURED.with(|c| c.borrow_mut().push(Vec::new()));
        Capture(())
    }

    /// Why the kernel (or libbpf) refused, in one line, if the log says.
    pub fn refusal(&self) -> Option<String> {
        CAPTURED.with(|c| c.borrow().last().and_then(|l| refusal(l)))
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        CAPTURED.with(|c| {
            let mut c = c.borrow_mut();
            if let Some(mine) = c.pop() {
                if let Some(outer) = c.last_mut() {
                    outer.extend(mine);
                }
            }
        });
    }
}

/// The verifier's last line before its statistics, with the program it was about; else
/// libbpf's first complaint (a map it could not create, a kfunc it could not resolve).
pub fn refusal(lines: &[String]) -> Option<String> {
    let program = lines.iter().find_map(|l| {
        let rest = l.split("prog '").nth(1)?;
        Some(rest.split('\'').next()?.to_string())
    });
    if let Some(begin) = lines
        .iter()
        .rposition(|l| l.contains("-- BEGIN PROG LOAD LOG --"))
    {
        let end = lines[begin..]
            .iter()
            .position(|l| l.contains("-- END PROG LOAD LOG --"))
            .map_or(lines.len(), |e| begin + e);
        let last = lines[begin + 1..end]
            .iter()
            .rev()
            .map(|l| l.trim())
            .find(|l| {
                !l.is_empty()
                    && !l.starts_with("processed ")
                    && !l.starts_with("verification time")
                    && !l.starts_with("stack depth")
            });
        if let Some(last) = last {
            return Some(match program {
                Some(p) => format!("program {p}: {last}"),
                None => last.to_string(),
            });
        }
    }
    lines
        .iter()
        .map(|l| l.trim().trim_start_matches("libbpf: ").to_string())
        .find(|l| {
            l.contains("failed to create")
                || l.contains("wasn't resolved")
                || l.contains("failed to find")
                || l.contains("not supported")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_string).collect()
    }

    #[test]
    fn the_kernels_reason_in_one_line() {
        let verifier = lines(
            "libbpf: prog 'cu_launch_kernel': BPF program load failed: Invalid argument\n\
             libbpf: prog 'cu_launch_kernel': -- BEGIN PROG LOAD LOG --\n\
             0: R1=ctx() R10=fp0\n\
             ; int BPF_UPROBE(cu_launch_kernel, ...\n\
             12: (85) call bpf_probe_read#4\n\
             program of this type cannot use helper bpf_probe_read#4\n\
             processed 13 insns (limit 1000000) max_states_per_insn 0 total_states 0\n\
             -- END PROG LOAD LOG --\n\
             libbpf: prog 'cu_launch_kernel': failed to load: -22",
        );
        assert_eq!(
            refusal(&verifier).as_deref(),
            Some(
                "program cu_launch_kernel: program of this type cannot use helper bpf_probe_read#4"
            )
        );
        let map = lines(
            "libbpf: map 'sched_hist': failed to create: Invalid argument(-22)\n\
             libbpf: failed to load object 'sched_bpf'",
        );
        assert_eq!(
            refusal(&map).as_deref(),
            Some("map 'sched_hist': failed to create: Invalid argument(-22)")
        );
        assert_eq!(refusal(&lines("libbpf: loading object")), None);
    }
}
