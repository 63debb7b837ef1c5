//! Pod interfaces are found without the host PID namespace and without CAP_SYS_PTRACE, as the
//! DaemonSet runs the agent: a "pod" network namespace pinned in /run/netns with a veth to
//! the node and the pod's IP on its end; the discovery runs in a child that has its own PID
//! namespace (no process of the pod is visible) and no CAP_SYS_PTRACE, and still maps the
//! host-side veth to the pod, with the pod side's ifindex and namespace inode.

use crate::common;

use std::os::unix::fs::MetadataExt;
use std::process::Command;

use common::{require_root, sh, sh_quiet};
use gpufeed_guest::ifaces::{self, NodeDevices};

const CHILD: &str = "GPUFEED_IFACES_CHILD_IP";
/// Bit of CAP_SYS_PTRACE in the capability sets (linux/capability.h).
const CAP_SYS_PTRACE: u32 = 19;

/// The child: prints `uid host_ifindex pod_ifindex pod_netns` per pod interface found, after
/// checking that it really lacks what the DaemonSet no longer grants.
#[test]
fn child_discover() {
    let Ok(ip) = std::env::var(CHILD) else {
        return;
    };
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        eff & (1 << CAP_SYS_PTRACE),
        0,
        "CAP_SYS_PTRACE still effective"
    );
    // Its own PID namespace: it is pid 1's child there, and no other process is visible.
    let pids = std::fs::read_dir("/proc")
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .count();
    assert!(pids <= 3, "{pids} processes visible");
    let ip: std::net::IpAddr = ip.parse().unwrap();
    let pod_of_ip = |a| (a == ip).then(|| "pod-uid-1".to_string());
    // Its processes are not looked for: none is visible here.
    let no_pids = std::collections::HashMap::new;
    let d = ifaces::discover(
        &pod_of_ip,
        &no_pids,
        std::path::Path::new(ifaces::PINNED_NETNS),
        &NodeDevices::None,
    )
    .unwrap();
    for p in d.pods {
        println!(
            "FOUND {} {} {} {}",
            p.uid, p.host_ifindex, p.pod_ifindex, p.pod_netns
        );
    }
}

#[test]
fn pod_veths_found_without_host_pids_or_ptrace() {
    let Some(_lock) = require_root() else {
        return;
    };
    let id = std::process::id();
    let (ns, host) = (format!("gpf-if-{id}"), format!("gpfif{}", id % 100_000));
    let ip = format!("10.251.{}.2", id % 250);
    struct Cleanup(String, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            sh_quiet(&format!("ip link del {}", self.1));
            sh_quiet(&format!("ip netns del {}", self.0));
        }
    }
    let _c = Cleanup(ns.clone(), host.clone());
    sh(&format!(
        "ip netns add {ns} && ip link add {host} type veth peer name eth0 netns {ns} && \
         ip link set {host} up && ip -n {ns} addr add {ip}/24 dev eth0 && \
         ip -n {ns} link set eth0 up && ip -n {ns} link set lo up"
    ));
    let host_ifindex: u32 = std::fs::read_to_string(format!("/sys/class/net/{host}/ifindex"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let pod_ifindex: u32 = sh(&format!("ip -n {ns} -o link show eth0"))
        .split(':')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let inode = std::fs::metadata(format!("/run/netns/{ns}")).unwrap().ino() as u32;

    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "setpriv"])
        .args(["--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "ifaces_kernel::child_discover",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &ip)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let found: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split_once("FOUND ").map(|(_, f)| f))
        .collect();
    assert_eq!(
        found,
        [format!("pod-uid-1 {host_ifindex} {pod_ifindex} {inode}")],
        "{stdout}"
    );

    // Without the pod's IP (no Kubernetes API), its processes stand in where they can be
    // read (here: as root in the host PID namespace).
    let mut sleeper = Command::new("ip")
        .args(["netns", "exec", &ns, "sleep", "30"])
        .spawn()
        .unwrap();
    let pid = sleeper.id() as i32;
    let pids = || {
        std::collections::HashMap::from([(
            "pod-uid-2".to_string(),
            vec![std::process::id() as i32, pid],
        )])
    };
    let mut got = None;
    for _ in 0..50 {
        // `ip netns exec` enters the namespace right after it starts
        let d = ifaces::discover(
            &|_| None,
            &pids,
            std::path::Path::new(ifaces::PINNED_NETNS),
            &NodeDevices::None,
        )
        .unwrap();
        got = d.pods.into_iter().find(|p| p.host_ifindex == host_ifindex);
        if got.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let got = got.expect("found through the pod's process");
    assert_eq!(
        (got.uid.as_str(), got.pod_ifindex, got.pod_netns),
        ("pod-uid-2", pod_ifindex, inode)
    );
}
