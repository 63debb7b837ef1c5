//! GPU stand-ins (no GPU and no NVIDIA driver exist on the machines that run the tests):
//!
//! * driver time: a device node with the serial port's major:minor under a
//!   configured "GPU" path prefix and driver name. `ioctl(TCSBRKP, n)` on it
//!   is a real character-device ioctl that the tty layer holds for n x 100 ms
//!   (send_break), so the test knows what the probe must see.
//! * CUDA: a libcuda.so.1 built here from C with the driver API's real
//!   signatures, loaded with dlopen by a client program.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{compile_c, value, wait_for, Agent, CgroupSandbox, Layout, Pod};

pub fn wait_file(path: &Path, what: &str) {
    assert!(
        wait_for(Duration::from_secs(20), || path.exists().then_some(())).is_some(),
        "{what}: {} did not appear",
        path.display()
    );
}

/// /proc/devices name of the serial driver that stands in for the GPU's.
pub const UART_DRIVER: &str = "ttyS";

/// The driver-time stand-in: a device node with the 8250 UART's numbers at
/// `<dir>/nvidia0`, and the client program that holds ioctls on it.
pub struct StandInDevice {
    pub hold: PathBuf,
    pub node: PathBuf,
}

impl StandInDevice {
    pub fn new(dir: &Path) -> StandInDevice {
        let hold = dir.join("ioctl_hold");
        // static: after its exec, no loader opens a file and takes back the
        // device's fd number before main() runs (its close would hide
        // whether exec itself forgot the fd)
        compile_c("gpu/ioctl_hold.c", &hold, &["-static"]);
        let uart = std::fs::metadata("/dev/ttyS0")
            .expect("the driver-time stand-in needs /dev/ttyS0 (an 8250 UART)");
        let node = dir.join("nvidia0");
        let c_node = std::ffi::CString::new(node.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string path; mknod creates a device node there.
        let rc = unsafe { libc::mknod(c_node.as_ptr(), libc::S_IFCHR | 0o600, uart.rdev()) };
        assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
        StandInDevice { hold, node }
    }

    /// The shell command for `calls` ioctls of `tenths` x 100 ms once `go`
    /// exists, then one of each NVIDIA request class; `mode` "fork": made by
    /// a forked child on the inherited fd; "exec": none, the program execs
    /// and reuses the device's fd number for a pipe.
    pub fn command(&self, calls: u32, tenths: u32, go: &Path, out: &Path, mode: &str) -> String {
        format!(
            "exec {} {} {calls} {tenths} {} {} {mode}",
            self.hold.display(),
            self.node.display(),
            go.display(),
            out.display(),
        )
    }
}

/// (calls, total ns) the client measured itself.
pub fn measured(out: &Path) -> (u64, u64) {
    let text = std::fs::read_to_string(out).unwrap();
    let mut f = text.split_whitespace().map(|v| v.parse::<u64>().unwrap());
    (f.next().unwrap(), f.next().unwrap())
}

pub fn within_10_percent(got: f64, want: f64) -> bool {
    (got - want).abs() <= 0.1 * want
}

/// Expected numbers of one cuda_app run with scale `s` after phases 1..=4.
pub struct Expect {
    pub s: u64,
}

pub const MIB: u64 = 1024 * 1024;

impl Expect {
    pub fn pitched(&self) -> u64 {
        (1000 * self.s).div_ceil(512) * 512 * 300
    }
    pub fn managed(&self) -> u64 {
        64 * 1024 * self.s
    }
    pub fn after_alloc(&self) -> i64 {
        (self.s * MIB + self.pitched() + self.managed() + 128 * 1024 * self.s) as i64
    }
    pub fn after_free(&self) -> i64 {
        (self.pitched() + self.managed()) as i64
    }
    pub fn after_vmm(&self) -> i64 {
        // two physical allocations; the import aliases the second one
        self.after_free() + (4 * self.s * MIB) as i64
    }
    pub fn h2d(&self) -> u64 {
        (4096 + 1000) * self.s
    }
    pub fn d2h(&self) -> u64 {
        (2048 + 24) * self.s
    }
    /// After phase 3's unified copies into and out of VMM mappings.
    pub fn h2d_after_vmm(&self) -> u64 {
        self.h2d() + 512 * self.s
    }
    pub fn d2h_after_vmm(&self) -> u64 {
        self.d2h() + 256 * self.s
    }
}

/// The CUDA stand-in: libcuda.so.1 built from C in `<dir>/lib`, a copy in a
/// container root where distributions put it, and the client program.
pub struct StandInCuda {
    pub lib_dir: PathBuf,
    pub app: PathBuf,
    pub root: PathBuf,
    /// control directory of a client that runs on the host's root
    pub host_ctl: PathBuf,
}

impl StandInCuda {
    pub fn new(dir: &Path) -> StandInCuda {
        StandInCuda::build(dir, &[])
    }

    /// The stand-in that records its device's idle gaps when `STANDIN_GAPS` names a file
    /// ([`FeedGap`]); the others' build has none of that code.
    pub fn with_gaps(dir: &Path) -> StandInCuda {
        StandInCuda::build(dir, &["-DSTANDIN_GAPS"])
    }

    fn build(dir: &Path, defines: &[&str]) -> StandInCuda {
        let lib_dir = dir.join("lib");
        std::fs::create_dir(&lib_dir).unwrap();
        let lib = lib_dir.join("libcuda.so.1");
        let mut flags = vec!["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"];
        flags.extend_from_slice(defines);
        compile_c("cuda/fake_libcuda.c", &lib, &flags);
        let app = dir.join("cuda_app");
        compile_c("cuda/cuda_app.c", &app, &["-ldl"]);
        let root = dir.join("rootfs");
        let root_lib = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&root_lib).unwrap();
        std::fs::create_dir_all(root.join("ctl")).unwrap();
        std::fs::copy(&lib, root_lib.join("libcuda.so.1")).unwrap();
        let host_ctl = dir.join("ctl");
        std::fs::create_dir(&host_ctl).unwrap();
        StandInCuda {
            lib_dir,
            app,
            root,
            host_ctl,
        }
    }

    /// The client with scale `s` on the host's root.
    pub fn host_command(&self, s: u64) -> String {
        self.host_command_in(&self.host_ctl, s)
    }

    /// [`StandInCuda::host_command`] with its own control directory `ctl` (for several
    /// clients at once).
    pub fn host_command_in(&self, ctl: &Path, s: u64) -> String {
        format!(
            "LD_LIBRARY_PATH={} exec {} {} {s}",
            self.lib_dir.display(),
            self.app.display(),
            ctl.display()
        )
    }
}

/// The busy client (fixtures/cuda/cuda_busy.c) built in a test's directory:
/// five phases of kernels waited for in each way the probes watch; it writes
/// "BUSY_NS SYNC_NS" as it measured them (read with [`measured`]).
pub struct BusyClient {
    bin: PathBuf,
}

impl BusyClient {
    pub fn new(dir: &Path) -> BusyClient {
        let bin = dir.join("cuda_busy");
        compile_c("cuda/cuda_busy.c", &bin, &["-ldl"]);
        BusyClient { bin }
    }

    /// The shell command: the client at scale `s` on `cuda`'s library,
    /// starting once `go` exists, its result in `out`.
    pub fn command(&self, cuda: &StandInCuda, go: &Path, out: &Path, s: u32) -> String {
        format!(
            "LD_LIBRARY_PATH={} exec {} {} {} {s}",
            cuda.lib_dir.display(),
            self.bin.display(),
            go.display(),
            out.display()
        )
    }
}

/// The feeding loop (fixtures/cuda/cuda_feed.c) built in a test's directory: one thread
/// launching a kernel and waiting for it, in phases the test starts (`go<i>`) and sees end
/// (`paused<i>`) through its control directory, the stand-in library recording its device's
/// idle gaps ([`FeedGap`]) to a file.
pub struct FeedClient {
    bin: PathBuf,
}

impl FeedClient {
    pub fn new(dir: &Path) -> FeedClient {
        let bin = dir.join("cuda_feed");
        compile_c("cuda/cuda_feed.c", &bin, &["-ldl"]);
        FeedClient { bin }
    }

    /// The shell command: `phases` phases of `phase_ms` of `kernel_us` kernels, pinned to
    /// CPU `cpu`, on `cuda`'s library recording its gaps in `gaps`.
    #[allow(clippy::too_many_arguments)]
    pub fn command(
        &self,
        cuda: &StandInCuda,
        ctl: &Path,
        gaps: &Path,
        cpu: usize,
        phases: u32,
        phase_ms: u32,
        kernel_us: u32,
    ) -> String {
        format!(
            "STANDIN_GAPS={} LD_LIBRARY_PATH={} exec taskset -c {cpu} {} {} {phases} {phase_ms} {kernel_us}",
            gaps.display(),
            cuda.lib_dir.display(),
            self.bin.display(),
            ctl.display()
        )
    }
}

/// [`FeedClient::command`]'s command with a synchronous copy of `bytes` to the device before
/// each launch, taking bytes / the bandwidth written in `link` (bytes a second), each copy
/// recorded in `copies` ([`FeedCopy`]).
pub fn with_copies(command: String, bytes: u64, link: &Path, copies: &Path) -> String {
    format!(
        "STANDIN_LINK={} STANDIN_COPIES={} {command} {bytes}",
        link.display(),
        copies.display()
    )
}

/// One synchronous copy to the stand-in's device (fake_libcuda.c, `STANDIN_COPIES`): when it
/// began and ended (CLOCK_MONOTONIC ns) and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct FeedCopy {
    pub start_ns: u64,
    pub end_ns: u64,
    pub bytes: u64,
}

impl FeedCopy {
    /// Every copy recorded in `path` so far.
    pub fn read_all(path: &Path) -> Vec<FeedCopy> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace().map(|w| w.parse::<u64>().ok());
                Some(FeedCopy {
                    start_ns: f.next()??,
                    end_ns: f.next()??,
                    bytes: f.next()??,
                })
            })
            .collect()
    }
}

/// One idle gap of the stand-in's device (fake_libcuda.c, `STANDIN_GAPS`): from the end of its
/// last work to the launch that ended the gap (CLOCK_MONOTONIC us), how much the launching
/// thread's schedstat run_delay grew from its sleep waiting for the device to that launch, and
/// the wake-up path: from the device's end to the thread running again, less its run-queue wait
/// in between (0 when it did not sleep).
#[derive(Debug, Clone, Copy)]
pub struct FeedGap {
    pub start_us: u64,
    pub end_us: u64,
    pub run_delay_ns: u64,
    pub wake_ns: u64,
}

impl FeedGap {
    /// Every gap recorded in `path` so far.
    pub fn read_all(path: &Path) -> Vec<FeedGap> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace().map(|w| w.parse::<u64>().ok());
                Some(FeedGap {
                    start_us: f.next()??,
                    end_us: f.next()??,
                    run_delay_ns: f.next()??,
                    wake_ns: f.next()??,
                })
            })
            .collect()
    }
}

/// The inference-path client (fixtures/cuda/cuda_paths.c) built in a test's directory: CUDA
/// graphs, the per-thread default stream's exports, unified-address copies and stream-ordered
/// allocations, in phases driven through its control directory, each ending with the stand-in
/// library's record of what it was asked.
pub struct PathsClient {
    bin: PathBuf,
}

impl PathsClient {
    pub fn new(dir: &Path) -> PathsClient {
        let bin = dir.join("cuda_paths");
        compile_c("cuda/cuda_paths.c", &bin, &["-ldl", "-pthread"]);
        PathsClient { bin }
    }

    /// The shell command: the client at scale `s` on `cuda`'s library, controlled through
    /// `ctl` (which must exist).
    pub fn command(&self, cuda: &StandInCuda, ctl: &Path, s: u64) -> String {
        format!(
            "LD_LIBRARY_PATH={} exec {} {} {s}",
            cuda.lib_dir.display(),
            self.bin.display(),
            ctl.display()
        )
    }
}

/// The stand-in library's record of what a client asked of it (fake_libcuda.c's
/// `standin_record`): launches, graph_launches, h2d, d2h, d2d, h2h, vram.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaRecord(pub std::collections::BTreeMap<String, i64>);

impl CudaRecord {
    pub fn read(path: &Path) -> CudaRecord {
        let text = std::fs::read_to_string(path).unwrap();
        CudaRecord(
            text.lines()
                .filter_map(|l| l.split_once(' '))
                .map(|(k, v)| (k.to_string(), v.trim().parse().unwrap()))
                .collect(),
        )
    }

    pub fn get(&self, name: &str) -> i64 {
        *self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("{name} in {self:?}"))
    }
}

/// A running pod as the API lists it: one container `main` with id `cid`, on `node`.
pub fn api_pod(
    uid: &str,
    cid: &str,
    (namespace, name): (&str, &str),
    node: &str,
    labels: &[(&str, &str)],
) -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    serde_json::json!({
        "metadata": {
            "name": name, "namespace": namespace, "uid": uid,
            "resourceVersion": "100", "labels": labels
        },
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{
                "name": "main", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                "containerID": format!("containerd://{cid}")
            }]
        }
    })
}

/// A PodList of `items` for [`super::fake_kube::FakeKube::start`].
pub fn api_pod_list(items: Vec<serde_json::Value>) -> String {
    serde_json::json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": "100"},
        "items": items
    })
    .to_string()
}

/// A pod to make: its name, cgroup layout and pod labels.
pub type PodSpec<'a> = (&'a str, Layout, &'a [(&'a str, &'a str)]);

/// Pods in namespace `ml` with the given names, cgroup layouts and pod labels, and the PodList
/// that shows them running on `node`, for the fake API server.
pub fn labelled_pods(sb: &CgroupSandbox, node: &str, specs: &[PodSpec<'_>]) -> (Vec<Pod>, String) {
    let pods: Vec<Pod> = specs
        .iter()
        .map(|(_, layout, _)| Pod::random(sb, *layout, "burstable"))
        .collect();
    let items = pods
        .iter()
        .zip(specs)
        .map(|(p, (name, _, labels))| api_pod(&p.uid, &p.container_id, ("ml", name), node, labels))
        .collect();
    (pods, api_pod_list(items))
}

/// The pod label that names a pod's tenant in the FinOps tests.
pub const TENANT_KEY: &str = "team.example.com/tenant";

/// The agent flags of a FinOps test on `node` (`extra`: its probes and their stand-ins): a
/// 200 ms tick, a duty window of 2 s, [`two_tenants`]' labels exported as `tenant` and `app`,
/// a GPU at 3.6 an hour.
pub fn finops_flags<'a>(node: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut flags = vec!["--interval", "200ms", "--node-name", node];
    flags.extend(extra);
    flags.extend([
        "--gpu-duty-window",
        "2s",
        "--pod-label",
        "tenant=team.example.com/tenant",
        "--pod-label",
        "app=app.kubernetes.io/name",
        "--gpu-hourly-rate",
        "3.6",
    ]);
    flags
}

/// A tenant's app: the tenant, the app's name and its two pods' names.
pub type TenantApp<'a> = (&'a str, &'a str, [&'a str; 2]);

/// Two tenants' apps: team-a's chat (chat-0, chat-1) and team-b's embed (embed-0, embed-1).
pub const CHAT_AND_EMBED: [TenantApp<'static>; 2] = [
    ("team-a", "chat", ["chat-0", "chat-1"]),
    ("team-b", "embed", ["embed-0", "embed-1"]),
];

/// Two pods of each app in `apps` (the first on the cgroupfs layout, the second on systemd's),
/// labelled with the app's tenant under [`TENANT_KEY`] and its name under
/// `app.kubernetes.io/name`, on `node`: the pods, each running `sleep 120`, their pids, and the
/// fake API server that lists them.
pub async fn two_tenants(
    sb: &CgroupSandbox,
    node: &str,
    apps: [TenantApp<'_>; 2],
) -> (Vec<Pod>, Vec<u32>, super::fake_kube::FakeKube) {
    let labels =
        apps.map(|(tenant, app, _)| [(TENANT_KEY, tenant), ("app.kubernetes.io/name", app)]);
    let specs: Vec<PodSpec<'_>> = apps
        .iter()
        .zip(&labels)
        .flat_map(|((_, _, [first, second]), l)| {
            [
                (*first, Layout::Cgroupfs, &l[..]),
                (*second, Layout::Systemd, &l[..]),
            ]
        })
        .collect();
    let (mut pods, list) = labelled_pods(sb, node, &specs);
    let pids = pods.iter_mut().map(|p| p.spawn("exec sleep 120")).collect();
    let kube = super::fake_kube::FakeKube::start(node, list, vec![]).await;
    (pods, pids, kube)
}

/// Both stand-ins in a scratch directory that goes with them.
pub struct StandIns {
    pub dev: StandInDevice,
    pub cuda: StandInCuda,
    pub scratch: tempfile::TempDir,
}

impl StandIns {
    pub fn new() -> StandIns {
        let scratch = tempfile::tempdir().unwrap();
        StandIns {
            dev: StandInDevice::new(scratch.path()),
            cuda: StandInCuda::new(scratch.path()),
            scratch,
        }
    }

    pub fn dir(&self) -> &Path {
        self.scratch.path()
    }

    /// The agent flags that load both GPU probes on these stand-ins.
    pub fn probe_flags(&self) -> Vec<String> {
        vec![
            "--probes".into(),
            "gpu_driver,cuda".into(),
            "--gpu-device-prefix".into(),
            format!("{}/nvidia", self.dir().display()),
            "--gpu-driver-name".into(),
            UART_DRIVER.into(),
        ]
    }
}

/// Waits until the agent's GPU driver probe has put its uprobes on at least `n` processes:
/// with the default hook a process holding a GPU file is timed from the agent's next tick
/// after it opened it, so a test's calls start only then.
pub fn wait_probed(agent: &Agent, n: usize) {
    let probed = wait_for(Duration::from_secs(10), || {
        value(&agent.scrape(), "gpufeed_gpu_ioctl_processes_probed", &[]).filter(|v| *v >= n as f64)
    });
    assert!(probed.is_some(), "the agent probed {n} GPU processes");
}

/// The NVML stand-in (fixtures/nvml/fake_nvml.c) built in `dir`: two GPUs (80 GiB gen 4 x16,
/// 24 GiB gen 3 x8), the processes the test writes, utilisation sampled every
/// [`NVML_SAMPLE_US`], and what the GPUs did written to a truth file.
#[derive(Clone)]
pub struct StandInNvml {
    pub lib: PathBuf,
    procs: PathBuf,
    truth: PathBuf,
    link: PathBuf,
    control: PathBuf,
    errors: PathBuf,
}

/// The stand-in's sample period.
pub const NVML_SAMPLE_US: u64 = 100_000;

/// One line of the stand-in's truth file: a sample period in which a process computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TruthPeriod {
    pub gpu: u32,
    pub pid: u32,
    pub sm_percent: u32,
    pub period_us: u64,
    pub timestamp_us: u64,
}

impl StandInNvml {
    pub fn new(dir: &Path) -> StandInNvml {
        StandInNvml::variant(dir, &[])
    }

    /// A stand-in built with `defines` too: `OMIT_<function>` leaves a function out (an NVML
    /// that lacks it).
    pub fn variant(dir: &Path, defines: &[&str]) -> StandInNvml {
        let n = StandInNvml {
            lib: dir.join("libnvidia-ml.so.1"),
            procs: dir.join("nvml-procs"),
            truth: dir.join("nvml-truth"),
            link: dir.join("nvml-link"),
            control: dir.join("nvml-control"),
            errors: dir.join("nvml-errors"),
        };
        std::fs::write(&n.procs, "").unwrap();
        n.build(&n.lib, defines);
        n
    }

    /// Builds the library at `lib` (a test may build it late, where the agent looks).
    pub fn build(&self, lib: &Path, defines: &[&str]) {
        let define = |name: &str, p: &Path| format!("-D{name}=\"{}\"", p.display());
        let mut args = vec![
            "-shared".to_string(),
            "-fPIC".into(),
            "-Wl,-soname,libnvidia-ml.so.1".into(),
            define("STANDIN_PROCS", &self.procs),
            define("STANDIN_TRUTH", &self.truth),
            define("STANDIN_LINK", &self.link),
            define("STANDIN_CONTROL", &self.control),
            define("STANDIN_ERRORS", &self.errors),
            format!("-DSAMPLE_US={NVML_SAMPLE_US}ULL"),
        ];
        args.extend(defines.iter().map(|d| format!("-D{d}")));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // built beside, then renamed: an agent looking for it never opens half a library
        let tmp = lib.with_extension("building");
        compile_c("nvml/fake_nvml.c", &tmp, &args);
        std::fs::rename(&tmp, lib).unwrap();
    }

    /// The stand-in's faults from now on (lines of its control file: `count N`, `init CODE`,
    /// `fail GPU CALL CODE`, `grow GPU K`; see fake_nvml.c).
    pub fn set_control(&self, lines: &[&str]) {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        let tmp = self.control.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, &self.control).unwrap();
    }

    /// How many times the stand-in answered `code` to `call` about GPU `gpu` (-1: no GPU).
    pub fn errors_answered(&self, gpu: i32, call: &str, code: i32) -> usize {
        std::fs::read_to_string(&self.errors)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == format!("{gpu} {call} {code}"))
            .count()
    }

    /// Every error the stand-in answered: (GPU, call, code).
    pub fn errors(&self) -> Vec<(i32, String, i32)> {
        std::fs::read_to_string(&self.errors)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((
                    f.first()?.parse().ok()?,
                    f.get(1)?.to_string(),
                    f.get(2)?.parse().ok()?,
                ))
            })
            .collect()
    }

    pub fn path(&self) -> &str {
        self.lib.to_str().unwrap()
    }

    /// The processes on the GPUs from now on: (pid, GPU, memory bytes, SM percent).
    pub fn set_processes(&self, procs: &[(u32, u32, u64, u32)]) {
        let text: String = procs
            .iter()
            .map(|(pid, gpu, mem, sm)| format!("{pid} {gpu} {mem} {sm}\n"))
            .collect();
        // written whole, then renamed: the library never reads half a file
        let tmp = self.procs.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, &self.procs).unwrap();
    }

    /// Each GPU's link from now on: (GPU, generation, width, TX KiB/s, RX KiB/s).
    pub fn set_links(&self, links: &[(u32, u32, u32, u32, u32)]) {
        let text: String = links
            .iter()
            .map(|(g, gen, w, tx, rx)| format!("{g} {gen} {w} {tx} {rx}\n"))
            .collect();
        let tmp = self.link.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, &self.link).unwrap();
    }

    /// Every sample period the stand-in simulated so far.
    pub fn truth(&self) -> Vec<TruthPeriod> {
        let text = std::fs::read_to_string(&self.truth).unwrap_or_default();
        text.lines()
            .map(|l| {
                let f: Vec<u64> = l.split_whitespace().map(|v| v.parse().unwrap()).collect();
                TruthPeriod {
                    gpu: f[0] as u32,
                    pid: f[1] as u32,
                    sm_percent: f[2] as u32,
                    period_us: f[3],
                    timestamp_us: f[4],
                }
            })
            .collect()
    }

    /// What the GPUs computed for all processes, in SM seconds.
    pub fn sm_seconds_all(&self) -> f64 {
        let pids: Vec<u32> = self.truth().iter().map(|t| t.pid).collect();
        self.sm_seconds(&pids, None)
    }

    /// What the GPUs computed for the processes `pids` on GPU `gpu` (None: any), in SM
    /// seconds: each simulated period's utilisation × its length.
    pub fn sm_seconds(&self, pids: &[u32], gpu: Option<u32>) -> f64 {
        self.truth()
            .iter()
            .filter(|t| pids.contains(&t.pid) && gpu.is_none_or(|g| g == t.gpu))
            .map(|t| f64::from(t.sm_percent) / 100.0 * t.period_us as f64 / 1e6)
            .sum()
    }
}
