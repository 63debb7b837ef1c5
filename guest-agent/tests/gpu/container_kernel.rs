//! The DaemonSet of `talos/kubernetes/overlays/stream` (and of the Helm chart with its `stream`
//! values: the same pod spec, checked; the `full` one likewise below), run for real: the image that
//! `scripts/build-image.sh` builds, started by a container runtime (podman with runc) with
//! exactly the manifest's security context (capabilities dropped to its list, read-only root,
//! no privilege escalation, its user), host network namespace (and PID namespace, were the
//! manifest to ask for it: the stream overlay does not), and its volumes. The
//! probes must all come up, and a pod's bytes, run-queue latency and RTT must appear, the bytes
//! equal to the pod veth's own counters. A capability the manifest grants must be needed: the
//! same container without CAP_BPF must fail with the agent's clear message.
//!
//! Where this machine differs from a Kubernetes node, and what stands in:
//! * `seccompProfile: RuntimeDefault` is containerd's default profile, which allows `bpf` to
//!   holders of CAP_BPF and `perf_event_open` to holders of CAP_PERFMON. Debian 12's podman
//!   profile allows them only with CAP_SYS_ADMIN, so the test runs podman's profile with those
//!   two rules changed to containerd's.
//! * The `cgroup` hostPath `/sys/fs/cgroup` is this machine's cgroup2 mount (a hybrid host
//!   mounts it at `/sys/fs/cgroup/unified`); the Secret is a `certs init` directory; an
//!   emptyDir is a temporary directory; the listen ports are 127.0.0.1:0 instead of the fixed
//!   ones, which other processes on this machine may hold.
//! * runc, not crun: crun refuses hybrid cgroup hosts.
//!
//! The Talos system extension (`build-image.sh --talos-extension`) is checked the same way: its
//! layout (`manifest.yaml`, the service definition where Talos reads it, the container root
//! where Talos derives it from the name), then its container root run as Talos runs an
//! extension service: all privileges, host network, no host PID namespace, an ephemeral root,
//! the service's mounts and the ExtensionServiceConfig's files and environment.

use crate::common;
use crate::manifests;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::gpu::*;
use common::*;
use gpufeed_guest::probes;
use serde_yaml::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpufeed-guest");
const BYTES: &str = "ebpf_tc_bytes_total";

use gpufeed_testkit::repo;

use gpufeed_testkit::sh::have;

/// The pod template spec of the DaemonSet, as `kubectl apply -k` applies it with the host
/// stream on (the Secret volume and the QUIC listener included).
fn daemonset_pod_spec() -> Value {
    overlay_pod_spec("overlays/stream")
}

/// The DaemonSet's pod template spec as the kustomization at `rel` renders it, which the Helm
/// chart with the values set of the same name (`charts/gpufeed/examples/<name>.yaml`) must
/// render exactly: the pod run here is the one both install.
fn overlay_pod_spec(rel: &str) -> Value {
    let pod =
        |objs: &[Value]| manifests::object(objs, "DaemonSet")["spec"]["template"]["spec"].clone();
    let kustomized = pod(&manifests::kustomize(rel));
    let set = rel.trim_start_matches("overlays/");
    let values = manifests::chart_dir().join(format!("examples/{set}.yaml"));
    let charted = pod(&manifests::helm_template(&[values.to_str().unwrap()]));
    assert_eq!(
        charted, kustomized,
        "the chart's pod spec ({set}) is {rel}'s"
    );
    charted
}

/// Removes the image (unmounting it first) and any container left behind, even when the test
/// fails.
struct Image(String);
impl Drop for Image {
    fn drop(&mut self) {
        sh_quiet(&format!(
            "podman image unmount {0} >/dev/null 2>&1; podman rmi -f {0} >/dev/null 2>&1",
            self.0
        ));
    }
}

fn build_image(extra: &[&str], image: &str) -> Image {
    let out = Command::new(repo().join("scripts/build-image.sh"))
        .args(["--binary", BIN, "--tag", image])
        .args(extra)
        .output()
        .unwrap();
    let guard = Image(image.to_string());
    assert!(
        out.status.success(),
        "build-image.sh: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    guard
}

/// podman, buildah and runc, or (outside CI) a skip.
fn container_tools() -> bool {
    for tool in ["podman", "buildah", "runc"] {
        if !have(tool) {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{tool} is not installed (scripts/setup.sh installs it)"
            );
            eprintln!("SKIP: {tool} is not installed");
            return false;
        }
    }
    true
}

fn listen_on_loopback(arg: &str) -> String {
    if arg.starts_with("--metrics-listen=") {
        "--metrics-listen=127.0.0.1:0".into()
    } else if arg.starts_with("--quic-listen=") {
        "--quic-listen=127.0.0.1:0".into()
    } else if arg.starts_with("--health-listen=") {
        "--health-listen=127.0.0.1:0".into()
    } else {
        arg.into()
    }
}
struct Container(String);
impl Drop for Container {
    fn drop(&mut self) {
        sh_quiet(&format!("podman rm -f -t 0 {} >/dev/null 2>&1", self.0));
    }
}

/// containerd's RuntimeDefault, as far as this agent is concerned: podman's default profile
/// with `bpf` allowed to CAP_BPF and `perf_event_open` to CAP_PERFMON.
fn runtime_default_seccomp(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string("/usr/share/containers/seccomp.json")
        .expect("podman's default seccomp profile (containers-common)");
    let mut p: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rules = p["syscalls"].as_array_mut().unwrap();
    for r in rules.iter_mut() {
        if r["action"] == "SCMP_ACT_ERRNO" {
            let names = r["names"].as_array_mut().unwrap();
            names.retain(|n| n != "bpf" && n != "perf_event_open");
        }
    }
    rules.retain(|r| !r["names"].as_array().unwrap().is_empty());
    for (call, cap) in [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")] {
        rules.push(serde_json::json!({
            "names": [call], "action": "SCMP_ACT_ALLOW", "includes": {"caps": [cap]}
        }));
    }
    let out = dir.join("seccomp-runtime-default.json");
    std::fs::write(&out, serde_json::to_vec(&p).unwrap()).unwrap();
    out
}

/// `podman run` arguments that reproduce the DaemonSet's pod spec. Panics on anything in the
/// manifest it does not know how to reproduce, so the test cannot silently run something else.
fn podman_args(spec: &Value, image: &str, name: &str, tls: &Path, scratch: &Path) -> Vec<String> {
    podman_args_with(spec, image, name, tls, scratch, None)
}

/// [`podman_args`], with the NVIDIA container toolkit's injection reproduced from `toolkit`
/// where the pod asks for its runtime class.
fn podman_args_with(
    spec: &Value,
    image: &str,
    name: &str,
    tls: &Path,
    scratch: &Path,
    toolkit: Option<&Toolkit>,
) -> Vec<String> {
    let c = &spec["containers"][0];
    let sc = &c["securityContext"];
    let mut a: Vec<String> = vec![
        "--runtime".into(),
        "runc".into(),
        "run".into(),
        "--rm".into(),
        "--name".into(),
        name.into(),
        // this machine's hard limits are below podman's defaults
        "--ulimit".into(),
        "nofile=4096:4096".into(),
        "--ulimit".into(),
        "nproc=4096:4096".into(),
    ];
    if spec["hostNetwork"].as_bool() == Some(true) {
        a.extend(["--network".into(), "host".into()]);
    }
    if spec["hostPID"].as_bool() == Some(true) {
        a.extend(["--pid".into(), "host".into()]);
    }
    match spec["runtimeClassName"].as_str() {
        None => {}
        Some("nvidia") => {
            let toolkit = toolkit.expect("runtimeClassName nvidia: the test gives a toolkit");
            a.extend(toolkit.injection(c));
        }
        Some(other) => panic!("runtimeClassName {other}: not reproduced by this test"),
    }
    assert_ne!(
        sc["privileged"].as_bool(),
        Some(true),
        "the DaemonSet must not be privileged"
    );
    let caps = &sc["capabilities"];
    let drop: Vec<&str> = caps["drop"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(drop, ["ALL"], "capabilities.drop");
    a.extend(["--cap-drop".into(), "all".into()]);
    for cap in caps["add"].as_sequence().unwrap() {
        a.extend(["--cap-add".into(), cap.as_str().unwrap().to_string()]);
    }
    if sc["readOnlyRootFilesystem"].as_bool() == Some(true) {
        // Kubernetes mounts no tmpfs on a read-only root; podman would by default
        a.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    if sc["allowPrivilegeEscalation"].as_bool() == Some(false) {
        a.extend(["--security-opt".into(), "no-new-privileges".into()]);
    }
    if let Some(uid) = sc["runAsUser"].as_u64() {
        a.extend(["--user".into(), uid.to_string()]);
    }
    match sc["seccompProfile"]["type"].as_str() {
        Some("RuntimeDefault") => a.extend([
            "--security-opt".into(),
            format!("seccomp={}", runtime_default_seccomp(scratch).display()),
        ]),
        other => panic!("seccompProfile {other:?}: not reproduced by this test"),
    }
    for e in c["env"].as_sequence().into_iter().flatten() {
        let k = e["name"].as_str().unwrap();
        let v = if let Some(v) = e["value"].as_str() {
            v.to_string()
        } else if e["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("spec.nodeName") {
            NODE.to_string()
        } else {
            panic!("env {k}: not reproduced by this test");
        };
        a.extend(["--env".into(), format!("{k}={v}")]);
    }
    for m in c["volumeMounts"].as_sequence().unwrap() {
        let vname = m["name"].as_str().unwrap();
        let vol = spec["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some(vname))
            .unwrap_or_else(|| panic!("volumeMount {vname} has no volume"));
        let src: PathBuf = if let Some(p) = vol["hostPath"]["path"].as_str() {
            // the checks the kubelet makes by the volume's type before the runtime mounts it
            // (a fresh node has no /run/netns until something pins a namespace)
            match vol["hostPath"]["type"].as_str() {
                None | Some("") => {}
                Some("DirectoryOrCreate") => std::fs::create_dir_all(p).unwrap(),
                Some("Directory") => assert!(Path::new(p).is_dir(), "hostPath {p}: no directory"),
                Some(other) => panic!("hostPath type {other}: not reproduced by this test"),
            }
            if p == "/sys/fs/cgroup" {
                cgroup2_root()
            } else {
                PathBuf::from(p)
            }
        } else if vol["secret"].is_mapping() {
            tls.to_path_buf()
        } else if vol["emptyDir"].is_mapping() {
            let d = scratch.join(vname);
            std::fs::create_dir_all(&d).unwrap();
            d
        } else {
            panic!("volume {vname}: kind not reproduced by this test");
        };
        let mut opts = Vec::new();
        if m["readOnly"].as_bool() == Some(true) {
            opts.push("ro");
        }
        match m["mountPropagation"].as_str() {
            None | Some("None") => {}
            // mounts made on the host later (a pinned pod namespace) reach the container
            Some("HostToContainer") => opts.push("rslave"),
            Some(other) => panic!("mountPropagation {other}: not reproduced by this test"),
        }
        let opts = if opts.is_empty() {
            String::new()
        } else {
            format!(":{}", opts.join(","))
        };
        a.extend([
            "--volume".into(),
            format!(
                "{}:{}{opts}",
                src.display(),
                m["mountPath"].as_str().unwrap()
            ),
        ]);
    }
    let command = c["command"].as_sequence().unwrap();
    assert_eq!(command.len(), 1, "command is the binary alone");
    a.extend([
        "--entrypoint".into(),
        command[0].as_str().unwrap().to_string(),
    ]);
    a.push(image.into());
    for arg in c["args"].as_sequence().unwrap() {
        a.push(listen_on_loopback(arg.as_str().unwrap()));
    }
    a
}

/// Every probe loaded and attached (`gpufeed_probe_up` 1), `context` naming how it was run;
/// all but NVML's, which needs the NVIDIA library this machine lacks.
fn assert_all_probes_up(agent: &Agent, context: &str) {
    let s = agent.scrape();
    let reported = probes::registry::UNITS
        .iter()
        .flat_map(|u| u.reports.iter());
    for &probe in reported.filter(|p| **p != probes::nvml::NAME) {
        assert_eq!(
            value(&s, "gpufeed_probe_up", &[("probe", probe)]),
            Some(1.0),
            "probe {probe} {context}"
        );
    }
}

/// The node name `podman_args` gives the agent (NODE_NAME from the downward API).
const NODE: &str = "container-test-node";

/// The API's pod list: one running pod on [`NODE`] named by its uid (so that its series are
/// labelled `pod=<uid>` as without the API), with its IP.
fn api_pod_list(uid: &str, ip: &str) -> String {
    serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "100"},
        "items": [{
            "metadata": {"name": uid, "namespace": "default", "uid": uid, "resourceVersion": "100",
                         "creationTimestamp": "2026-11-29T10:00:00Z"},
            "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "busybox"}]},
            "status": {"phase": "Running", "qosClass": "Burstable", "podIP": ip, "podIPs": [{"ip": ip}]}
        }]})
    .to_string()
}

/// A scratch directory with `certs init`'s files (`certs/`) and the stand-in NVML (`nvml/`:
/// the stand-in writes what its GPUs did beside it, so its directory is where the agent's
/// process finds it, at the paths compiled into the library: a test-only mount).
fn scratch_with_nvml() -> (tempfile::TempDir, PathBuf, PathBuf, StandInNvml) {
    let scratch = tempfile::tempdir().unwrap();
    let certs = scratch.path().join("certs");
    certs_init_ok(&certs, "127.0.0.1:7845", "pve1");
    let standin = scratch.path().join("nvml");
    std::fs::create_dir_all(&standin).unwrap();
    let nvml = StandInNvml::new(&standin);
    (scratch, certs, standin, nvml)
}

/// The fake API server's kubeconfig for an agent in a container, written in `dir`. The image
/// has no system CA bundle (a pod gets its API CA from the service account); the client wants
/// a root even for this plain-HTTP server: the deployment CA in `certs` stands in.
fn container_kubeconfig(kube: &common::fake_kube::FakeKube, dir: &Path, certs: &Path) -> PathBuf {
    let kubeconfig = kube.write_kubeconfig(dir);
    let ca = sh(&format!("base64 -w0 {}", certs.join("ca/ca.pem").display()));
    let text = std::fs::read_to_string(&kubeconfig).unwrap().replace(
        "    server: ",
        &format!(
            "    certificate-authority-data: {}\n    server: ",
            ca.trim()
        ),
    );
    std::fs::write(&kubeconfig, text).unwrap();
    kubeconfig
}

fn podman(args: &[String]) -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(args);
    cmd
}

#[test]
fn daemonset_container_runs_with_its_capabilities_and_counts_a_pod() {
    let Some(_lock) = require_root() else { return };
    if !container_tools() {
        return;
    }
    let tag = uniq();
    let image = format!("localhost/gpufeed-guest:test-{tag}");
    let _image = build_image(&[], &image);
    let scratch = tempfile::tempdir().unwrap();
    let certs = scratch.path().join("certs");
    certs_init_ok(&certs, "127.0.0.1:7845", "pve1");
    let spec = daemonset_pod_spec();

    // Without CAP_BPF the agent must stop with its one-line reason: the manifest's grant is
    // needed, and a missing one is diagnosed.
    let name = format!("gf-ct-nobpf-{tag}");
    let _c = Container(name.clone());
    let mut args = podman_args(&spec, &image, &name, &certs.join("guest"), scratch.path());
    let i = args
        .iter()
        .position(|a| a == "BPF")
        .expect("the manifest adds BPF");
    args.drain(i - 1..=i);
    let out = podman(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ran without CAP_BPF: {err}");
    assert!(err.contains("grant CAP_BPF"), "{err}");

    // As the manifest says, with a Kubernetes API that knows the pod (the fake API server on
    // loopback, reached through the host network; a kubeconfig stands in for the service
    // account's in-cluster configuration).
    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (server_ns, server_ip, _) = net.server();
    let _server = spawn_in_ns(&server_ns, "exec iperf3 -s");
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    net.join(&mut pod);
    let uid = pod.uid.clone();
    let hif = pod.host_if.clone().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let kube = rt.block_on(common::fake_kube::FakeKube::start(
        NODE,
        api_pod_list(&uid, pod.ip.as_deref().unwrap()),
        vec![],
    ));
    let kubeconfig = container_kubeconfig(&kube, scratch.path(), &certs);
    let name = format!("gf-ct-{tag}");
    let _c = Container(name.clone());
    let mut args = podman_args(&spec, &image, &name, &certs.join("guest"), scratch.path());
    let run = args.iter().position(|a| a == "run").unwrap();
    args.splice(
        run + 1..run + 1,
        [
            "--volume".to_string(),
            format!("{}:/etc/gpufeed-test/kubeconfig:ro", kubeconfig.display()),
            "--env".into(),
            "KUBECONFIG=/etc/gpufeed-test/kubeconfig".into(),
        ],
    );
    let agent = Agent::launch(podman(&args));
    assert_all_probes_up(&agent, "in the container");

    pod.spawn("exec sleep 120");
    // The agent found the pod's veth without seeing any of its processes (no hostPID, no
    // SYS_PTRACE): rtnetlink names the veth peer's namespace and its address, the pod's IP,
    // and attached to it (NET_ADMIN): the pod's series exist.
    let attached = wait_for(Duration::from_secs(20), || {
        value(
            &agent.scrape(),
            BYTES,
            &[("pod", &uid), ("direction", "egress")],
        )
    });
    assert!(
        attached.is_some(),
        "pod {uid} bytes never appeared; log:\n{}",
        agent.log.lock().unwrap()
    );
    let egress = || {
        value(
            &agent.scrape(),
            BYTES,
            &[("pod", &uid), ("direction", "egress")],
        )
        .unwrap()
    };
    let ingress = || {
        value(
            &agent.scrape(),
            BYTES,
            &[("pod", &uid), ("direction", "ingress")],
        )
        .unwrap_or(0.0)
    };
    let (e0, i0) = (egress(), ingress());
    let (rx0, tx0) = (if_stat(&hif, "rx_bytes"), if_stat(&hif, "tx_bytes"));
    // An upload, then a download (-R): megabytes both ways, so that 1% is far more than a
    // stray packet between reading the agent and reading the veth.
    let client = pod.spawn(&format!(
        "exec sh -c 'iperf3 -c {server_ip} -t 3 -b 40M && iperf3 -c {server_ip} -t 2 -b 40M -R'"
    ));
    pod.spawn("exec sh -c 'while :; do :; done'");
    pod.spawn("exec sh -c 'while :; do :; done'");
    pod.wait_exit(client, Duration::from_secs(30));
    let (drx, dtx) = (
        (if_stat(&hif, "rx_bytes") - rx0) as f64,
        (if_stat(&hif, "tx_bytes") - tx0) as f64,
    );
    // the traffic is over: the agent's counters reach the veth's within a map-reading interval
    // or two (longer on a machine busy with other tests), and never pass them
    let close = |got: f64, want: f64| (got - want).abs() <= want * 0.01;
    let settled = wait_for(Duration::from_secs(10), || {
        let (de, di) = (egress() - e0, ingress() - i0);
        (close(de, drx) && close(di, dtx)).then_some(())
    });
    let (de, di) = (egress() - e0, ingress() - i0);
    eprintln!("pod egress {de} vs veth rx {drx}; ingress {di} vs veth tx {dtx} ({settled:?})");
    assert!(drx > 10e6, "iperf3 sent {drx} bytes");
    assert!(dtx > 5e6, "iperf3 -R received {dtx} bytes");
    assert!(close(de, drx), "egress {de} vs veth rx {drx}");
    assert!(close(di, dtx), "ingress {di} vs veth tx {dtx}");

    let s = agent.scrape();
    let waits = value(
        &s,
        "ebpf_sched_latency_microseconds_count",
        &[("pod", &uid)],
    )
    .unwrap_or(0.0);
    assert!(waits > 100.0, "two spinning threads waited {waits} times");
    let rtts = value(&s, "ebpf_tcp_rtt_microseconds_count", &[("pod", &uid)]).unwrap_or(0.0);
    // one sample per socket per interval (1 s): a 2 s upload's data and
    // control connections give a few
    assert!(rtts >= 2.0, "iperf3 gave {rtts} RTT samples");
    let mean = value(&s, "ebpf_tcp_rtt_microseconds_sum", &[("pod", &uid)]).unwrap() / rtts;
    assert!(
        (5.0..100_000.0).contains(&mean),
        "mean RTT over a local bridge {mean} us"
    );
}

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Talos's content rules for an extension's rootfs; panics naming the first offender.
fn assert_extension_rootfs_valid(rootfs: &Path) {
    use std::os::unix::fs::PermissionsExt;
    fn walk(dir: &Path, rootfs: &Path, files: &mut usize) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let rel = Path::new("/").join(p.strip_prefix(rootfs).unwrap());
            assert_eq!(
                meta.permissions().mode() & 0o002,
                0,
                "world-writable in the extension: {}",
                rel.display()
            );
            let t = meta.file_type();
            if t.is_dir() {
                walk(&p, rootfs, files);
            } else if t.is_file() {
                assert!(
                    rel.starts_with("/usr/local"),
                    "{} is outside the paths Talos allows extensions",
                    rel.display()
                );
                *files += 1;
            } else {
                assert!(
                    t.is_symlink(),
                    "special file in the extension: {}",
                    rel.display()
                );
            }
        }
    }
    let mut files = 0;
    walk(rootfs, rootfs, &mut files);
    assert!(files > 3, "{files} files in the extension rootfs");
}

#[test]
fn extension_rootfs_check_catches_a_world_writable_directory() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    for f in [
        "usr/local/a",
        "usr/local/b",
        "usr/local/c",
        "usr/local/lib/d",
    ] {
        let p = d.path().join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, "x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    for dir in ["usr", "usr/local", "usr/local/lib"] {
        std::fs::set_permissions(d.path().join(dir), std::fs::Permissions::from_mode(0o755))
            .unwrap();
    }
    assert_extension_rootfs_valid(d.path());
    let tmp = d.path().join("usr/local/tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = std::panic::catch_unwind(|| assert_extension_rootfs_valid(d.path()));
    assert!(r.is_err(), "a 1777 directory passed");
}

#[test]
fn talos_extension_image_layout_and_service_run() {
    let Some(_lock) = require_root() else { return };
    if !container_tools() {
        return;
    }
    let tag = uniq();
    let image = format!("localhost/gpufeed-guest-extension:test-{tag}");
    let _image = build_image(&["--talos-extension"], &image);
    let mnt = PathBuf::from(sh(&format!("podman image mount {image}")).trim());

    // Layout, as Talos reads it.
    let service_file = repo().join("talos/extension-service.yaml");
    let service = yaml(&service_file);
    let name = service["name"].as_str().unwrap();
    let manifest = yaml(&mnt.join("manifest.yaml"));
    assert_eq!(manifest["version"].as_str(), Some("v1alpha1"));
    assert_eq!(manifest["metadata"]["name"].as_str(), Some(name));
    assert_eq!(
        manifest["metadata"]["version"].as_str(),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert!(manifest["metadata"]["compatibility"]["talos"]["version"]
        .as_str()
        .is_some_and(|v| v.starts_with(">= v1.")));
    assert_eq!(
        std::fs::read(mnt.join(format!("rootfs/usr/local/etc/containers/{name}.yaml"))).unwrap(),
        std::fs::read(&service_file).unwrap(),
        "the service definition is talos/extension-service.yaml"
    );
    // What Talos's extension loader and validator accept (siderolabs/talos,
    // pkg/machinery/extensions): the image holds manifest.yaml and rootfs/ only; the manifest
    // has its required metadata; under rootfs/ nothing is world-writable, there are only
    // directories, regular files and symlinks, and every file is under a path Talos allows
    // extensions to add to (here: /usr/local).
    let mut top: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(
        top,
        ["manifest.yaml", "rootfs"],
        "extension image top level"
    );
    for key in ["name", "version", "author", "description"] {
        assert!(
            manifest["metadata"][key]
                .as_str()
                .is_some_and(|v| !v.trim().is_empty()),
            "manifest metadata.{key}"
        );
    }
    assert_extension_rootfs_valid(&mnt.join("rootfs"));
    let root = mnt.join(format!("rootfs/usr/local/lib/containers/{name}"));
    let entry = service["container"]["entrypoint"].as_str().unwrap();
    let meta = std::fs::metadata(root.join(entry.trim_start_matches('/'))).unwrap();
    assert!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0,
        "{entry} is executable"
    );
    let config = yaml(&repo().join("talos/extension-service-config.yaml"));
    for m in service["container"]["mounts"].as_sequence().unwrap() {
        let d = m["destination"].as_str().unwrap();
        if ["/sys/", "/proc/", "/dev/"]
            .iter()
            .any(|k| d.starts_with(k))
        {
            continue; // inside the kernel filesystems the runtime mounts
        }
        assert!(
            root.join(d.trim_start_matches('/')).is_dir(),
            "mount point {d} exists in the read-only container root"
        );
    }
    for f in config["configFiles"].as_sequence().unwrap() {
        let p = Path::new(f["mountPath"].as_str().unwrap());
        assert!(root
            .join(p.parent().unwrap().strip_prefix("/").unwrap())
            .is_dir());
    }

    // Run, as Talos runs an extension service.
    let (scratch, certs, standin, nvml) = scratch_with_nvml();
    // The node's /usr/local with the Talos NVIDIA extensions' NVML where they put it.
    let usr_local = scratch.path().join("usr-local");
    let glibc = usr_local.join("glibc/usr/lib");
    std::fs::create_dir_all(&glibc).unwrap();
    std::fs::copy(&nvml.lib, glibc.join("libnvidia-ml.so.1")).unwrap();
    let cname = format!("gf-ext-{tag}");
    let _c = Container(cname.clone());
    let mut args: Vec<String> = [
        "--runtime",
        "runc",
        "run",
        "--rm",
        "--name",
        &cname,
        "--privileged",
        "--network",
        "host",
        "--no-hosts",
        "--dns",
        "none",
        "--ulimit",
        "nofile=4096:4096",
        "--ulimit",
        "nproc=4096:4096",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for m in service["container"]["mounts"].as_sequence().unwrap() {
        assert_eq!(m["type"].as_str(), Some("bind"));
        let src = match m["source"].as_str().unwrap() {
            "/sys/fs/cgroup" => cgroup2_root(),
            "/usr/local" => usr_local.clone(),
            "/var/lib/gpufeed" => {
                let d = scratch.path().join("var-lib-gpufeed");
                std::fs::create_dir_all(&d).unwrap();
                d
            }
            other => PathBuf::from(other),
        };
        let ro = m["options"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|o| o.as_str() == Some("ro"));
        args.extend([
            "--mount".into(),
            format!(
                "type=bind,source={},destination={}{}",
                src.display(),
                m["destination"].as_str().unwrap(),
                if ro { ",ro" } else { "" }
            ),
        ]);
    }
    for f in config["configFiles"].as_sequence().unwrap() {
        let dst = f["mountPath"].as_str().unwrap();
        let file = Path::new(dst).file_name().unwrap();
        args.extend([
            "--volume".into(),
            format!("{}:{dst}:ro", certs.join("guest").join(file).display()),
        ]);
    }
    for e in config["environment"]
        .as_sequence()
        .into_iter()
        .chain(service["container"]["environment"].as_sequence())
        .flatten()
    {
        args.extend(["--env".into(), e.as_str().unwrap().to_string()]);
    }
    args.extend(["--volume".into(), format!("{0}:{0}", standin.display())]);
    // Talos gives the service an ephemeral root over the extension's files.
    args.extend([
        "--entrypoint".into(),
        entry.into(),
        "--rootfs".into(),
        format!("{}:O", root.display()),
    ]);
    for a in service["container"]["args"].as_sequence().unwrap() {
        args.push(listen_on_loopback(a.as_str().unwrap()));
    }

    let sb = CgroupSandbox::new();
    let mut net = TestNet::new();
    let (server_ns, server_ip, _) = net.server();
    let _server = spawn_in_ns(&server_ns, "exec iperf3 -s");
    let agent = Agent::launch(podman(&args));
    assert_all_probes_up(&agent, "in the extension service");
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "guaranteed");
    net.join(&mut pod);
    let uid = pod.uid.clone();
    pod.spawn("exec sh -c 'while :; do :; done'");
    pod.spawn("exec sh -c 'while :; do :; done'");
    let client = pod.spawn(&format!("exec iperf3 -c {server_ip} -t 2 -b 20M"));
    pod.wait_exit(client, Duration::from_secs(20));
    let seen = wait_for(Duration::from_secs(10), || {
        let s = agent.scrape();
        let waits = value(
            &s,
            "ebpf_sched_latency_microseconds_count",
            &[("pod", &uid)],
        )?;
        let rtts = value(&s, "ebpf_tcp_rtt_microseconds_count", &[("pod", &uid)])?;
        // one RTT sample per socket per interval: a few from a 2 s upload
        (waits > 100.0 && rtts >= 2.0).then_some(s)
    });
    let s = seen.unwrap_or_else(|| {
        let text = agent.try_get("/metrics").unwrap_or_default();
        let ours: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(&uid) || l.starts_with("gpufeed_cgroup"))
            .collect();
        let log = agent.log.lock().map(|l| l.clone()).unwrap_or_default();
        panic!("pod {uid}: no run-queue latency or RTT from the extension service\n{ours:#?}\nlog:\n{log}")
    });
    // What the service definition says it cannot do: without the host PID namespace the
    // agent cannot map the pod's network namespace to its veth.
    assert_eq!(
        value(&s, BYTES, &[("pod", &uid)]),
        None,
        "pod veth bytes without the host PID namespace"
    );

    // NVML, from the NVIDIA extensions' path through the /usr/local mount: the node's GPUs as
    // the stand-in has them, and a pod's GPU process, which the service cannot see (no host
    // PID namespace), counted as the node's: its memory exactly, its SM time as the stand-in's
    // GPUs did it (all but the first sample's period).
    let gib = 1u64 << 30;
    let gpu_process = pod.spawn("exec sleep 60");
    nvml.set_processes(&[(gpu_process, 1, 6 * gib, 50)]);
    let outside = |s: &[Sample]| {
        (
            value(s, "gpufeed_nvml_outside_pods_memory_bytes", &[("gpu", "1")]),
            value(
                s,
                "gpufeed_nvml_outside_pods_sm_seconds_total",
                &[("gpu", "1")],
            ),
        )
    };
    let s = wait_for(Duration::from_secs(20), || {
        let s = agent.scrape();
        (outside(&s).0 == Some((6 * gib) as f64)).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "NVML in the extension service: {:?}; log:\n{}",
            outside(&agent.scrape()),
            agent.log.lock().unwrap()
        )
    });
    assert_eq!(
        value(&s, "gpufeed_gpu_compute_source", &[("source", "nvml")]),
        Some(1.0)
    );
    assert_eq!(value(&s, "gpufeed_nvml_gpus", &[]), Some(2.0));
    let total: f64 = find(&s, "gpufeed_gpu_memory_total_bytes", &[])
        .iter()
        .map(|x| x.value)
        .sum();
    assert_eq!(total, (104 * gib) as f64, "the stand-in's 80 and 24 GiB");
    std::thread::sleep(Duration::from_secs(2));
    nvml.set_processes(&[(gpu_process, 1, 6 * gib, 0)]);
    std::thread::sleep(Duration::from_millis(2500));
    let booked = outside(&agent.scrape()).1.unwrap_or(0.0);
    let truth = nvml.sm_seconds(&[gpu_process], Some(1));
    let period = NVML_SAMPLE_US as f64 / 1e6;
    eprintln!("outside pods on GPU 1: {booked:.3} SM-s booked, {truth:.3} computed");
    assert!(truth > 0.5, "the process computed {truth} SM-s");
    assert!(
        booked <= truth + 1e-6 && booked >= truth - 0.5 * period - 1e-6,
        "booked {booked} SM-s, the stand-in's GPU computed {truth}"
    );
}

/// What the NVIDIA container toolkit does for a container of the `nvidia` runtime class
/// (nvidia-container-runtime's prestart hook, libnvidia-container): for the GPUs
/// `NVIDIA_VISIBLE_DEVICES` names, their device nodes and `/dev/nvidiactl`; for the
/// `utility` capability of `NVIDIA_DRIVER_CAPABILITIES`, the driver's `libnvidia-ml.so.1`
/// bind-mounted read-only into the container's library directory. Here the library is the
/// stand-in NVML and the device nodes are character devices with the NVIDIA driver's numbers
/// (major 195: minor N for GPU N, 255 for the control device) that no driver answers: NVML,
/// not the device files, is what the agent reads through them.
struct Toolkit {
    nvml: PathBuf,
    dev: PathBuf,
    gpus: u32,
}

impl Toolkit {
    /// The stand-in's library and `gpus` device nodes made in `dir`.
    fn new(nvml: &Path, dir: &Path, gpus: u32) -> Toolkit {
        let dev = dir.join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        let mut nodes: Vec<(String, u32)> = (0..gpus).map(|g| (format!("nvidia{g}"), g)).collect();
        nodes.push(("nvidiactl".into(), 255));
        for (name, minor) in nodes {
            sh(&format!(
                "mknod -m 666 {}/{name} c 195 {minor}",
                dev.display()
            ));
        }
        Toolkit {
            nvml: nvml.to_path_buf(),
            dev,
            gpus,
        }
    }

    /// The `podman run` arguments for the container `c` (its env read as the hook reads it).
    fn injection(&self, c: &Value) -> Vec<String> {
        let env = |k: &str| {
            c["env"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|e| e["name"].as_str() == Some(k))
                .and_then(|e| e["value"].as_str())
                .map(str::to_string)
        };
        let visible = env("NVIDIA_VISIBLE_DEVICES").expect("NVIDIA_VISIBLE_DEVICES");
        let caps = env("NVIDIA_DRIVER_CAPABILITIES").expect("NVIDIA_DRIVER_CAPABILITIES");
        let gpus: Vec<u32> = match visible.as_str() {
            "all" => (0..self.gpus).collect(),
            "none" | "void" | "" => vec![],
            list => list.split(',').map(|g| g.trim().parse().unwrap()).collect(),
        };
        let mut a = Vec::new();
        if !gpus.is_empty() {
            a.extend([
                "--device".into(),
                format!("{}/nvidiactl:/dev/nvidiactl", self.dev.display()),
            ]);
        }
        for g in gpus {
            a.extend([
                "--device".into(),
                format!("{}/nvidia{g}:/dev/nvidia{g}", self.dev.display()),
            ]);
        }
        if caps.split(',').any(|c| c == "utility" || c == "all") {
            a.extend([
                "--volume".into(),
                format!(
                    "{}:/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1:ro",
                    self.nvml.display()
                ),
            ]);
        }
        a
    }
}

/// The `full` overlay (host stream, the GPU processes' view, the GPU component) run as the
/// runtime would, with NVML injected the way the NVIDIA container toolkit injects it for the
/// runtime class the GPU component asks for: four pods of two tenants on the stand-in's two
/// GPUs, and the agent inside the container reports each pod's memory exactly, its duty cycle
/// within 0.02 of the utilisation the stand-in's GPUs ran it at, its compute time against the
/// stand-in's own record, and its cost over a steady stretch within 2% of the price of that
/// compute and memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_overlay_reads_nvml_injected_as_the_toolkit_does() {
    let Some(_lock) = require_root() else { return };
    if !container_tools() {
        return;
    }
    const GIB: u64 = 1 << 30;
    const RATE_PER_S: f64 = 0.001; // 3.6 an hour
    const MEMORY: f64 = (104 * GIB) as f64; // the stand-in's 80 + 24 GiB
    const W_COMPUTE: f64 = 0.55;
    const W_VRAM: f64 = 0.35;
    let tag = uniq();
    let image = format!("localhost/gpufeed-guest:test-{tag}");
    let _image = build_image(&[], &image);
    let (scratch, certs, standin, nvml) = scratch_with_nvml();
    let toolkit = Toolkit::new(&nvml.lib, scratch.path(), 2);

    let sb = CgroupSandbox::new();
    let (_pods, pids, kube) = two_tenants(&sb, NODE, CHAT_AND_EMBED).await;
    let kubeconfig = container_kubeconfig(&kube, scratch.path(), &certs);

    let spec = overlay_pod_spec("overlays/full");
    assert_eq!(spec["runtimeClassName"].as_str(), Some("nvidia"));
    let name = format!("gf-ct-gpu-{tag}");
    let _c = Container(name.clone());
    let mut args = podman_args_with(
        &spec,
        &image,
        &name,
        &certs.join("guest"),
        scratch.path(),
        Some(&toolkit),
    );
    let run = args.iter().position(|a| a == "run").unwrap();
    args.splice(
        run + 1..run + 1,
        [
            "--volume".to_string(),
            format!("{}:/etc/gpufeed-test/kubeconfig:ro", kubeconfig.display()),
            "--env".into(),
            "KUBECONFIG=/etc/gpufeed-test/kubeconfig".into(),
            "--volume".into(),
            format!("{0}:{0}", standin.display()),
        ],
    );
    // the cost settings a FinOps user adds (docs/finops.md), at the FinOps tests' tick; the
    // pods' app label is the manifest's own (components/finops), not given again
    let app = "--pod-label=app=app.kubernetes.io/name";
    assert!(
        spec["containers"][0]["args"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|a| a.as_str() == Some(app)),
        "the full overlay labels the GPU series with the pods' app"
    );
    let mut finops: Vec<String> = finops_flags(NODE, &[])
        .into_iter()
        .skip(4) // --interval 200ms --node-name: the interval below, the node from NODE_NAME
        .map(str::to_string)
        .collect();
    let i = finops
        .windows(2)
        .position(|w| w[0] == "--pod-label" && w[1] == "app=app.kubernetes.io/name")
        .expect("the FinOps tests' app label");
    finops.drain(i..i + 2);
    args.extend(["--interval".into(), "200ms".into()]);
    args.extend(finops);
    args.extend(["--gpu-cost-currency".into(), "EUR".into()]);
    let agent = Agent::launch(podman(&args));

    // NVML found where the toolkit put it, and elected
    let source = wait_for(Duration::from_secs(20), || {
        value(
            &agent.scrape(),
            "gpufeed_gpu_compute_source",
            &[("source", "nvml")],
        )
        .filter(|v| *v == 1.0)
    });
    assert!(
        source.is_some(),
        "NVML is the compute source in the container; log:\n{}",
        agent.log.lock().unwrap()
    );
    let names = ["chat-0", "chat-1", "embed-0", "embed-1"];
    let (util, gpu, mem) = (
        [90u32, 40, 10, 0],
        [0u32, 1, 0, 1],
        [20 * GIB, 8 * GIB, 4 * GIB, 12 * GIB],
    );
    nvml.set_processes(
        &(0..4)
            .map(|i| (pids[i], gpu[i], mem[i], util[i]))
            .collect::<Vec<_>>(),
    );
    let started = std::time::Instant::now();

    // every pod's memory, as NVML lists it, exactly
    let memory = |s: &[Sample], i: usize| {
        value(
            s,
            "gpufeed_nvml_process_memory_bytes",
            &[("namespace", "ml"), ("pod", names[i])],
        )
    };
    let listed = wait_for(Duration::from_secs(20), || {
        let s = agent.scrape();
        (0..4)
            .all(|i| memory(&s, i) == Some(mem[i] as f64))
            .then_some(())
    });
    assert!(
        listed.is_some(),
        "memory per pod: {:?}",
        find(&agent.scrape(), "gpufeed_nvml_process_memory_bytes", &[])
            .iter()
            .map(|x| (x.label("pod").to_string(), x.value))
            .collect::<Vec<_>>()
    );
    // a full duty window (2 s) of steady use: each pod's duty cycle on its GPU is its use
    let duty = |s: &[Sample], i: usize| {
        value(
            s,
            "ebpf_gpu_active_compute_duty_cycle",
            &[("pod", names[i]), ("gpu", &gpu[i].to_string())],
        )
    };
    let steady = wait_for(Duration::from_secs(20), || {
        let s = agent.scrape();
        (0..4)
            .all(|i| duty(&s, i).is_some_and(|d| (d - f64::from(util[i]) / 100.0).abs() <= 0.02))
            .then_some(s)
    });
    assert!(
        steady.is_some(),
        "duty cycles within 0.02 of 90/40/10/0%: {:?}",
        (0..4).map(|i| duty(&agent.scrape(), i)).collect::<Vec<_>>()
    );

    // the cost over a steady stretch: the time the agent booked (the node's cost ÷ its rate)
    // at each pod's compute (its utilisation of one of two GPUs) and memory (of 104 GiB)
    let cost = |s: &[Sample], pod: &str| {
        value(
            s,
            "gpufeed_gpu_cost_total",
            &[("namespace", "ml"), ("pod", pod), ("currency", "EUR")],
        )
        .unwrap_or(0.0)
    };
    let node = |s: &[Sample]| {
        value(s, "gpufeed_gpu_node_cost_total", &[("currency", "EUR")]).expect("the node's cost")
    };
    let before = agent.scrape();
    std::thread::sleep(Duration::from_secs(4));
    let after = agent.scrape();
    let booked = (node(&after) - node(&before)) / RATE_PER_S;
    assert!(booked > 3.0, "{booked} s booked in 4 s");
    for i in 0..4 {
        let got = cost(&after, names[i]) - cost(&before, names[i]);
        let share = W_COMPUTE * f64::from(util[i]) / 100.0 / 2.0 + W_VRAM * mem[i] as f64 / MEMORY;
        let want = RATE_PER_S * booked * share;
        eprintln!(
            "{}: cost {got:.6} over {booked:.2} s, priced {want:.6}",
            names[i]
        );
        assert!(
            (got - want).abs() <= 0.02 * want,
            "{}: cost {got} over {booked} s, its compute and memory price {want}",
            names[i]
        );
    }

    // compute time against the stand-in's own record of what each process did: all of it
    // but the first sample's period (the agent books a process from its first read)
    nvml.set_processes(
        &(0..4)
            .map(|i| (pids[i], gpu[i], mem[i], 0))
            .collect::<Vec<_>>(),
    );
    std::thread::sleep(Duration::from_millis(1500));
    let s = agent.scrape();
    let period = NVML_SAMPLE_US as f64 / 1e6;
    for i in 0..4 {
        let truth = nvml.sm_seconds(&[pids[i]], None);
        let got: f64 = find(
            &s,
            "ebpf_gpu_compute_time_seconds_total",
            &[("pod", names[i])],
        )
        .iter()
        .map(|x| x.value)
        .sum();
        let u = f64::from(util[i]) / 100.0;
        eprintln!("{}: {got:.3} SM-s booked, {truth:.3} computed", names[i]);
        assert!(
            got <= truth + 1e-6 && got >= truth - u * period - 1e-6,
            "{}: booked {got} SM-s, the stand-in's GPUs computed {truth}",
            names[i]
        );
    }
    assert!(
        nvml.sm_seconds(&[pids[0]], None) > 0.9 * 4.0,
        "chat-0 ran at 90% for {:?}",
        started.elapsed()
    );
}
