//! Privileges and kernel features the probes need: capabilities, BTF, cgroup v2, tracefs, and
//! what the lockdown mode turns off.

use std::path::Path;

use gpufeed_shared::doctor::{
    self as common, Capability, Finding, CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON, CAP_SYS_ADMIN,
    CAP_SYS_PTRACE, CGROUP2_MAGIC, TRACEFS_MAGIC,
};

/// What the DaemonSet grants (talos/kubernetes/base/daemonset.yaml), each for what it is used.
pub const NEEDED: &[Capability] = &[
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
    Capability {
        number: CAP_NET_ADMIN,
        name: "CAP_NET_ADMIN",
        used_for: "tc programs on veths and node devices",
        or: None,
    },
    Capability {
        number: CAP_SYS_PTRACE,
        name: "CAP_SYS_PTRACE",
        used_for: "pods' /proc/<pid>/ns/net, which maps veths to pods",
        or: None,
    },
];

/// `capabilities`: the effective set of `proc_pid` holds [`NEEDED`].
pub fn capabilities(proc_pid: &Path) -> Finding {
    common::capabilities(
        proc_pid,
        NEEDED,
        "add the missing ones to the container's securityContext.capabilities.add (the \
         DaemonSet of talos/kubernetes/base lists them) and run it as uid 0",
    )
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
