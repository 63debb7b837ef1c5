//! GPU probe overhead benchmark (not a test; root; needs perf and cc):
//!
//! 1. What the driver-time probe costs a process that never touches a GPU:
//!    a pinned pipe ping-pong (`perf bench sched pipe`, wall time) and a
//!    loop of cheap syscalls (`getppid`, CPU time of the thread, which other
//!    load on the machine disturbs far less), side by side with nothing
//!    loaded and with `gpu_driver` loaded in each of its modes, in rounds
//!    (the configurations interleaved), median of the rounds. A
//!    process holding a stand-in GPU device (the serial port's numbers) runs
//!    throughout, so that in uprobe mode the C library the ping-pong also
//!    uses carries probes (in that process only).
//! 2. What the CUDA uprobes cost per call on the stand-in libcuda.so.1 (entry
//!    probe; entry and return probe; the launch probes; a unified copy's
//!    address lookups; a pool allocation and free), against no probe.
//! 3. What the default CUDA probe set, and the launch set on top, add to two
//!    stand-in inference loops: kernels (per step: 200 launches, three
//!    copies, an allocation and a free, a stream synchronisation), and a
//!    CUDA-graph decode loop on the per-thread default stream (per step: a
//!    graph, 20 kernels, three unified copies, a pool allocation and free, a
//!    synchronisation; fixtures/cuda/cuda_bench.c).
//!
//! cargo bench -p gpufeed-guest --bench gpu_overhead
//! (`GPU_OVERHEAD_ONLY=cuda` or `=driver` runs one half)

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::{cc, pingpong_us, Killed};
use gpufeed_guest::probes::cuda::{CudaOptions, CudaProbe};
use gpufeed_guest::probes::gpu_driver::{GpuDevices, GpuDriverProbe, Hook};
use gpufeed_guest::probes::gpu_process::GpuProcessUnit;
use gpufeed_guest::probes::tick::PodProcesses;
use gpufeed_guest::probes::KernelBtf;

const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// CPU ns of this thread per getppid() over a million calls.
fn syscall_cpu_ns() -> f64 {
    const N: u32 = 1_000_000;
    let cpu = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 * 1e9 + ts.tv_nsec as f64
    };
    let t0 = cpu();
    for _ in 0..N {
        // SAFETY: getppid takes no arguments.
        unsafe { libc::syscall(libc::SYS_getppid) };
    }
    (cpu() - t0) / f64::from(N)
}

fn driver_time(dir: &Path) {
    // the stand-in GPU device and a (dynamically linked) process holding it
    let uart = std::fs::metadata("/dev/ttyS0").expect("needs /dev/ttyS0 (an 8250 UART)");
    let node = dir.join("nvidia0");
    let c_node = std::ffi::CString::new(node.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string path; mknod creates a device node there.
    assert_eq!(
        unsafe { libc::mknod(c_node.as_ptr(), libc::S_IFCHR | 0o600, uart.rdev()) },
        0
    );
    let holder = Killed(
        Command::new("sh")
            .arg("-c")
            .arg(format!("exec sleep 600 3<{}", node.display()))
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(300));
    let devices = GpuDevices {
        path_prefixes: vec![format!("{}/nvidia", dir.display())],
        driver_names: vec!["ttyS".into()],
    };
    let btf = KernelBtf::load();
    let configs: [(&str, Option<Hook>); 4] = [
        ("nothing loaded", None),
        ("gpu_driver, uprobes (default)", Some(Hook::Uprobes)),
        ("gpu_driver, per-syscall tracepoints", Some(Hook::Syscalls)),
        ("gpu_driver, raw_syscalls", Some(Hook::RawSyscalls)),
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut sys: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let load = |hook: Option<Hook>, pids: &[i32]| {
        hook.map(|h| {
            let mut p = GpuDriverProbe::load(&devices, h, &btf)
                .expect("gpu_driver loads")
                .expect("the kernel has the hooks");
            // (the cgroups are not looked at: 0 for each)
            p.scan(&pids.iter().map(|&t| (t, 0)).collect(), None);
            p
        })
    };
    for round in 0..ROUNDS {
        // every other round in reverse order: no configuration always runs
        // right after another
        let mut order: Vec<usize> = (0..configs.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let _probe = load(configs[i].1, &[holder.0.id() as i32]);
            runs[i].push(pingpong_us());
            sys[i].push(syscall_cpu_ns());
        }
    }
    println!(
        "## A process that never touches a GPU (median of {ROUNDS} rounds, configurations interleaved)\n"
    );
    println!(
        "| configuration | ping-pong µs/op | slowdown | getppid CPU ns | slowdown | getppid rounds |"
    );
    println!("|---|---|---|---|---|---|");
    let base = median(runs[0].clone());
    let sys_base = median(sys[0].clone());
    for (i, (name, _)) in configs.iter().enumerate() {
        let (m, c) = (median(runs[i].clone()), median(sys[i].clone()));
        println!(
            "| {name} | {m:.3} | {:+.1}% | {c:.1} | {:+.1}% | {:?} |",
            (m / base - 1.0) * 100.0,
            (c / sys_base - 1.0) * 100.0,
            sys[i].iter().map(|v| v.round()).collect::<Vec<_>>()
        );
    }
    println!();

    // What a GPU process pays per ioctl(): this process holds the device
    // (and so is probed in uprobe mode) and times FIONREAD on a pipe (not a
    // GPU fd: entry and return probes run, nothing is recorded) and on the
    // device (timed and recorded).
    let dev = std::fs::File::open(&node).unwrap();
    let mut pipe = [0i32; 2];
    // SAFETY: a valid two-int array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let per_ioctl = |fd: i32| {
        const N: u32 = 100_000;
        let mut n: libc::c_int = 0;
        let t0 = std::time::Instant::now();
        for _ in 0..N {
            // SAFETY: FIONREAD writes one int through a valid pointer.
            unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
        }
        t0.elapsed().as_nanos() as f64 / f64::from(N)
    };
    println!("## Per ioctl() in a process holding a GPU file (ns/call, median of 5)\n");
    println!("| configuration | ioctl on a pipe | ioctl on the GPU file |");
    println!("|---|---|---|");
    for (name, hook) in configs {
        let _probe = load(hook, &[std::process::id() as i32]);
        let on_pipe = median((0..5).map(|_| per_ioctl(pipe[0])).collect());
        let on_dev = median((0..5).map(|_| per_ioctl(dev.as_raw_fd())).collect());
        println!("| {name} | {on_pipe:.0} | {on_dev:.0} |");
    }
    println!();
    // SAFETY: closing the pipe this function made.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
}

/// Runs the benchmark client once with `opts` attached (or nothing); its stdout.
fn client(
    dir: &Path,
    lib_dir: &Path,
    bin: &Path,
    args: &[&str],
    opts: Option<&CudaOptions>,
) -> String {
    let (ready, go) = (dir.join("ready"), dir.join("go"));
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&go);
    let child = Command::new(bin)
        .arg(&ready)
        .arg(&go)
        .args(args)
        .env("LD_LIBRARY_PATH", lib_dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    while !ready.exists() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let _probe = opts.map(|o| {
        let mut p = CudaProbe::load(o.clone(), &KernelBtf::load())
            .expect("cuda probe loads")
            .expect("the kernel has the hooks");
        assert_eq!(
            p.scan(&PodProcesses::from_iter([(child.id() as i32, 0)]), None),
            1,
            "attached"
        );
        p
    });
    std::fs::File::create(&go).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "client failed");
    String::from_utf8(out.stdout).unwrap()
}

fn cuda(dir: &Path) {
    let lib_dir = dir.join("lib");
    std::fs::create_dir(&lib_dir).unwrap();
    cc(
        "cuda/fake_libcuda.c",
        &lib_dir.join("libcuda.so.1"),
        &["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"],
    );
    let bin = dir.join("cuda_bench");
    cc("cuda/cuda_bench.c", &bin, &["-ldl"]);
    let default = CudaOptions::default();
    let launches = CudaOptions {
        launches: true,
        ..CudaOptions::default()
    };
    let configs: [(&str, Option<&CudaOptions>); 3] = [
        ("no probe", None),
        ("default probe set", Some(&default)),
        ("default + launch set (--cuda-launches)", Some(&launches)),
    ];

    // per call
    let what = [
        "entry uprobe + uretprobe timing the copy (default set)",
        "entry uprobe + uretprobe (default set; busy-estimate work with the launch set)",
        "entry uprobe, stack read, map update (launch set)",
        "entry uprobe, two address-range lookups (default set)",
        "entry uprobe, map update (launch set)",
        "the pair: two entry uprobes, a uretprobe, the range recorded and forgotten (default set)",
    ];
    let mut per_call: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); what.len()]; configs.len()];
    let mut names = Vec::new();
    for _ in 0..5 {
        for (i, (_, opts)) in configs.iter().enumerate() {
            let out = client(dir, &lib_dir, &bin, &["calls", "200000"], *opts);
            names.clear();
            for (k, line) in out.lines().enumerate() {
                let mut f = line.split_whitespace();
                names.push(f.next().unwrap().to_string());
                per_call[i][k].push(f.next().unwrap().parse().unwrap());
            }
        }
    }
    println!("## CUDA uprobes per call on the stand-in library (ns/call, median of 5 runs of 200000 calls)\n");
    println!("| function (probes) | no probe | default probe set | with --cuda-launches |");
    println!("|---|---|---|---|");
    for (k, name) in names.iter().enumerate() {
        println!(
            "| {name} ({}) | {:.0} | {:.0} | {:.0} |",
            what[k],
            median(per_call[0][k].clone()),
            median(per_call[1][k].clone()),
            median(per_call[2][k].clone())
        );
    }
    println!();

    for (mode, title) in [
        ("loop", "Stand-in inference loop"),
        (
            "paths",
            "Stand-in CUDA-graph decode loop (per-thread default stream)",
        ),
    ] {
        inference_loop(dir, &lib_dir, &bin, &configs, mode, title);
    }
}

/// Five runs of 300 steps of the client's loop `mode` in each configuration (interleaved);
/// the median step of each run after 20 warm-up steps, the median of the runs.
fn inference_loop(
    dir: &Path,
    lib_dir: &Path,
    bin: &Path,
    configs: &[(&str, Option<&CudaOptions>)],
    mode: &str,
    title: &str,
) {
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for _ in 0..5 {
        for (i, (_, opts)) in configs.iter().enumerate() {
            let out = client(dir, lib_dir, bin, &[mode, "300"], *opts);
            let steps: Vec<(f64, f64)> = out
                .lines()
                .skip(20) // warm-up
                .map(|l| {
                    let mut f = l.split_whitespace().map(|v| v.parse::<f64>().unwrap());
                    (f.next().unwrap(), f.next().unwrap())
                })
                .collect();
            wall[i].push(median(steps.iter().map(|s| s.0).collect()));
            cpu[i].push(median(steps.iter().map(|s| s.1).collect()));
        }
    }
    println!(
        "## {title} (median step of 280, median of 5 runs; the runs' step wall µs in brackets)\n"
    );
    println!("| configuration | step wall µs | added | step CPU µs | added CPU |");
    println!("|---|---|---|---|---|");
    let (w0, c0) = (median(wall[0].clone()), median(cpu[0].clone()));
    for (i, (name, _)) in configs.iter().enumerate() {
        let (w, c) = (median(wall[i].clone()), median(cpu[i].clone()));
        let runs: Vec<String> = wall[i].iter().map(|r| format!("{:.0}", r / 1e3)).collect();
        println!(
            "| {name} | {:.1} [{}] | {:+.2}% | {:.1} | {:+.1} µs |",
            w / 1e3,
            runs.join(", "),
            (w / w0 - 1.0) * 100.0,
            c / 1e3,
            (c - c0) / 1e3
        );
    }
    println!();
}

fn main() {
    if std::env::args().any(|a| a == "--list") || unsafe { libc::geteuid() } != 0 {
        eprintln!("gpu_overhead benchmark: needs root; skipped");
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let only = std::env::var("GPU_OVERHEAD_ONLY").unwrap_or_default();
    if only != "cuda" {
        driver_time(scratch.path());
    }
    if only != "driver" {
        cuda(scratch.path());
    }
}
