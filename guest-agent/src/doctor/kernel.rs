//! Privileges and kernel features the probes need: capabilities, BTF, cgroup v2, tracefs, and
//! what the lockdown mode turns off.

use std::path::Path;

use gpufeed_shared::doctor::{
    self as common, Capability, Finding, Status, CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON,
    CAP_SYS_ADMIN, CAP_SYS_PTRACE, CGROUP2_MAGIC, TRACEFS_MAGIC,
};

/// CAP_BPF and CAP_PERFMON: what every probe needs (CAP_SYS_ADMIN grants both).
const TRACING: &[Capability] = &[
    Capability {
        number: CAP_BPF,
        name: "CAP_BPF",
        used_for: "maps, BTF, programs, links",
        or: Some(CAP_SYS_ADMIN),
    },
    Capability {
        number: CAP_PERFMON,
        name: "CAP_PERFMON",
        used_for: "tracing programs and their kernel pointer reads",
        or: Some(CAP_SYS_ADMIN),
    },
];

/// What the tc probe needs besides.
const TC: Capability = Capability {
    number: CAP_NET_ADMIN,
    name: "CAP_NET_ADMIN",
    used_for: "tc programs on veths and node devices",
    or: None,
};

/// The probes that read other processes' `/proc/<pid>/maps` and `fd/` (a ptrace-read access
/// check): without CAP_SYS_PTRACE and the host PID namespace (components/gpu-processes) they
/// load and see no pod process, and everything else works. Not required, so the base
/// DaemonSet, which leaves them out on purpose, passes; the finding says what is missing.
const POD_PROCESS_PROBES: &[&str] = &[crate::probes::cuda::NAME, crate::probes::gpu_driver::NAME];

/// The capabilities the selected probes (by name) cannot load without, each for what it is
/// used: what talos/kubernetes/base/daemonset.yaml grants for `--probes=all`.
pub fn needed(probes: &[&str]) -> Vec<Capability> {
    let mut out = Vec::new();
    if !probes.is_empty() {
        out.extend_from_slice(TRACING);
    }
    if probes.contains(&crate::probes::tc::NAME) {
        out.push(TC);
    }
    out
}

/// `capabilities`: the effective set of `proc_pid` holds what the selected `probes` need
/// ([`needed`]); where a probe that looks at pod processes is selected, the detail says
/// whether it can (CAP_SYS_PTRACE).
pub fn capabilities(proc_pid: &Path, probes: &[&str]) -> Finding {
    if probes.is_empty() {
        return Finding::pass("capabilities", "no probe selected: none needed");
    }
    let mut f = common::capabilities(
        proc_pid,
        &needed(probes),
        "add the missing ones to the container's securityContext.capabilities.add (the \
         DaemonSet of talos/kubernetes/base lists them) and run it as uid 0",
    );
    let gpu: Vec<&str> = POD_PROCESS_PROBES
        .iter()
        .copied()
        .filter(|p| probes.contains(p))
        .collect();
    if f.status != Status::Pass || gpu.is_empty() {
        return f;
    }
    let caps = std::fs::read_to_string(proc_pid.join("status"))
        .ok()
        .and_then(|t| common::effective_caps(&t))
        .unwrap_or(0);
    let probes = gpu.join(" and ");
    if caps & (1 << CAP_SYS_PTRACE) != 0 {
        f.detail += &format!("; CAP_SYS_PTRACE: the {probes} probes see pod processes");
    } else {
        f.detail += &format!(
            "; no CAP_SYS_PTRACE: the {probes} probes see no pod process (not needed by the \
             others; components/gpu-processes grants it with the host PID namespace)"
        );
    }
    f
}

/// `btf`: the kernel's own BTF, which every CO-RE probe is relocated against.
pub fn btf(sys: &Path) -> Finding {
    let file = sys.join("kernel/btf/vmlinux");
    if file.exists() {
        Finding::pass("btf", format!("{} present", file.display()))
    } else {
        Finding::fail(
            "btf",
            format!("{} missing: no probe can load", file.display()),
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (every major distribution and \
             Talos ship one)",
        )
    }
}

/// `cgroup2`: the root the agent walks for pods is a cgroup v2 hierarchy.
pub fn cgroup2(root: Option<&Path>) -> Finding {
    let found;
    let root = match root {
        Some(r) => r,
        None => match crate::cgroups::cgroup2_mount() {
            Ok(r) => {
                found = r;
                &found
            }
            Err(e) => {
                return Finding::fail(
                    "cgroup2",
                    format!("no cgroup2 mount in /proc/self/mountinfo ({e})"),
                    CGROUP2_FIX,
                )
            }
        },
    };
    common::mounted("cgroup2", "cgroup v2", &[root], CGROUP2_MAGIC, CGROUP2_FIX)
}

const CGROUP2_FIX: &str =
    "run the node on the unified hierarchy (systemd.unified_cgroup_hierarchy=1; \
     the kubelet's cgroupDriver systemd) and mount the host's /sys/fs/cgroup at --cgroup-root";

/// `tracefs`: per-syscall tracepoints for the GPU driver probe.
pub fn tracefs(sys: &Path) -> Finding {
    let a = sys.join("kernel/tracing");
    let b = sys.join("kernel/debug/tracing");
    common::mounted(
        "tracefs",
        "tracefs",
        &[&a, &b],
        TRACEFS_MAGIC,
        "without it the GPU driver probe times ioctls with the raw sys_enter/sys_exit hooks, \
         which run for every syscall: mount tracefs at /sys/kernel/tracing (mount -t tracefs \
         nodev /sys/kernel/tracing) where the agent runs, or keep --gpu-driver-hook=raw-syscalls (this check is then skipped)",
    )
}

/// `lockdown`: what the mode in `sys/kernel/security/lockdown` turns off for the probes.
pub fn lockdown(sys: &Path) -> Finding {
    common::lockdown(&sys.join("kernel/security/lockdown"), lockdown_effects)
}

/// What each lockdown mode turns off here. `integrity` forbids only what the agent never does
/// (bpf_probe_write_user, module loading, kernel memory writes).
pub fn lockdown_effects(mode: &str) -> Option<String> {
    (mode == "confidentiality").then(|| {
        "bpf_probe_read_kernel (tc drops are attributed by socket and device only, not by IP) \
         and tracefs (the GPU driver probe uses the raw sys_enter/sys_exit hooks)"
            .to_string()
    })
}
