//! gpufeed-guest: per-pod eBPF probes served to Prometheus.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use gpufeed_guest::probes::unit::LoadContext;
use gpufeed_guest::{
    certs, cgroups, collect, correlate, doctor, exporter, finops, hub, incident, join, pods,
    privileges, probes, readiness, tick_loop, web,
};

/// Default /metrics port: not used by any well-known exporter.
pub const DEFAULT_METRICS_PORT: u16 = 9745;
/// The probe listener's port (on loopback).
pub const DEFAULT_HEALTH_PORT: u16 = 9746;

#[derive(Parser)]
#[command(
    name = "gpufeed-guest",
    version,
    about = "Is the GPU getting fed in time? Per-pod eBPF probes for GPU nodes."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load the probes and serve /metrics, /healthz and /readyz.
    Run(Box<RunArgs>),
    /// Certificates for the host → guest event stream.
    Certs {
        #[command(subcommand)]
        cmd: certs::CertsCmd,
    },
    /// Run every probe on this node for a while and print its figures beside
    /// the kernel's own (schedstat, nstat, ss, interface and qdisc counters).
    Selftest {
        /// How long to measure.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// How often kernel maps are read (as `run --interval`).
        #[arg(long, default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
    },
    /// What a running agent has joined: host links now, host events with the pods they hit,
    /// spikes no host event explains (the page at / as text).
    Explain(ExplainArgs),
    /// Check what the field gets wrong on this node (privileges, kernel features, BBR, the
    /// bandwidth manager, the host stream): pass or fail with the fix; exits non-zero on a
    /// failure. Run it in the agent's container (`kubectl exec`).
    Doctor(DoctorArgs),
}

#[derive(Parser, Debug)]
struct DoctorArgs {
    /// The running agent's HTTP address: the pods' annotations and the host stream are
    /// checked by it (its /doctor).
    #[arg(long, default_value_t = format!("http://127.0.0.1:{DEFAULT_METRICS_PORT}"))]
    url: String,
    /// cgroup v2 root, as given to `run`; found in /proc/self/mountinfo when not given.
    #[arg(long)]
    cgroup_root: Option<PathBuf>,
    /// Look at this network namespace (an nsfs file such as /run/netns/NAME) instead of
    /// the doctor's own; needs CAP_SYS_ADMIN.
    #[arg(long)]
    netns: Option<PathBuf>,
    /// Only the checks of this node, not the running agent's.
    #[arg(long)]
    local: bool,
    /// `--probes` as given to `run` (it decides which capabilities are needed).
    #[arg(long, default_value = "all")]
    probes: String,
    /// The probes' flags as given to `run` (`--gpu-driver-hook` decides whether tracefs is
    /// needed, `--node-devices` which devices are checked).
    #[command(flatten)]
    units: probes::UnitOptions,
}

#[derive(Parser, Debug)]
struct ExplainArgs {
    /// How far back to look.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    since: Duration,
    /// The agent's HTTP address (what it serves /metrics on).
    #[arg(long, default_value_t = format!("http://127.0.0.1:{DEFAULT_METRICS_PORT}"))]
    url: String,
}

#[derive(Parser, Debug)]
struct RunArgs {
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_METRICS_PORT)), env = "GPUFEED_METRICS_LISTEN")]
    metrics_listen: SocketAddr,
    /// Address for the kubelet's probes alone (/healthz, /readyz), with limits of its own.
    /// Default 127.0.0.1:9746 (loopback: the kubelet of a hostNetwork pod reaches it, pods do
    /// not), or an ephemeral loopback port when --metrics-listen has port 0.
    #[arg(long, env = "GPUFEED_HEALTH_LISTEN")]
    health_listen: Option<SocketAddr>,
    /// How often kernel maps are read (100ms .. 60s).
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    interval: Duration,
    /// How long a gone pod's series stay after its cgroups vanish or the API deletes it.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pod_grace: Duration,
    #[arg(long, default_value = "all", help = probes::probes_help())]
    probes: String,
    /// Each probe's own flags (declared by its unit).
    #[command(flatten)]
    units: probes::UnitOptions,
    /// How a tick reads the active cgroups' kernel aggregates: `auto` (one
    /// batch syscall per probe where the kernel allows it) or `each` (one
    /// lookup per cgroup, the way older kernels are read).
    #[arg(long, value_enum, default_value = "auto")]
    cgroup_reads: probes::cgroup_batch::Reads,
    /// Where the probes keep per-cgroup values: `auto` (cgroup-local storage where the
    /// kernel loads it, else a hash map keyed by cgroup id, as on 6.1), `local` or `by-id`.
    #[arg(long, value_enum, default_value = "auto")]
    cgroup_storage: probes::cgroup_storage::StorageChoice,
    /// Window of ebpf_gpu_active_compute_duty_cycle.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    gpu_duty_window: Duration,
    /// cgroup v2 mount point; found in /proc/self/mountinfo when not given.
    #[arg(long)]
    cgroup_root: Option<PathBuf>,
    /// This node's name, to watch only its pods.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Do not contact the Kubernetes API; label pods by UID.
    #[arg(long)]
    no_kube: bool,
    /// Accept host agents' event streams (QUIC, mutual TLS) on this UDP address, e.g.
    /// 0.0.0.0:7845. Off when not given.
    #[arg(long, env = "GPUFEED_QUIC_LISTEN")]
    quic_listen: Option<SocketAddr>,
    /// Directory with ca.pem, guest.pem, guest-key.pem and allowed-hosts (made by
    /// `gpufeed-guest certs init`); re-read when the files change.
    #[arg(long, default_value = "/etc/gpufeed/tls", env = "GPUFEED_TLS_DIR")]
    tls_dir: PathBuf,
    /// Append received host events to this JSON-lines file; at start it seeds
    /// de-duplication, so a restarted guest neither repeats nor re-requests events.
    #[arg(long, env = "GPUFEED_EVENT_JOURNAL")]
    event_journal: Option<PathBuf>,
    /// Where sysfs is: the hub names this VM to host agents by
    /// `class/dmi/id/product_uuid` under it (its SMBIOS system UUID, by which a Proxmox host
    /// sends it its VM's events) and looks there for the KVM PTP clock.
    #[arg(long, default_value = "/sys", env = "GPUFEED_SYSFS_ROOT")]
    sysfs_root: PathBuf,
    /// A spike joins a host event up to this long before it...
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    join_before: Duration,
    /// ...and up to this long after it.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    join_after: Duration,
    /// A window is a spike when it exceeds the baseline median by this many robust standard
    /// deviations (1.4826 × MAD); lower finds more spikes.
    #[arg(long, default_value_t = 6.0, value_parser = parse_sensitivity)]
    spike_sensitivity: f64,
    /// A host (its certificate name) that is a simulation, e.g. the quickstart demo's: its
    /// events are labelled simulated on /, /events and in the log. Repeatable.
    #[arg(long = "simulated-host", value_name = "HOST")]
    simulated_hosts: Vec<String>,
    /// Link template for a pod's profiles around a spike (Parca, Pyroscope, ...), with
    /// {namespace}, {pod}, {node}, {from_ms}, {to_ms}, {from_s}, {to_s}; shown on /, in
    /// /events and /api/state. See docs/profiles.md.
    #[arg(long, value_name = "URL", env = "GPUFEED_PROFILE_URL")]
    profile_url: Option<incident::ProfileTemplate>,
    #[command(flatten)]
    finops: finops::FinopsArgs,
    /// OTLP metrics push (`--otlp-endpoint`, ...), beside /metrics.
    #[command(flatten)]
    otlp: gpufeed_shared::otlp::OtlpArgs,
}

fn parse_sensitivity(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(k) if (1.0..=100.0).contains(&k) => Ok(k),
        Ok(k) => Err(format!("{k} is outside 1..100")),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(100) || d > Duration::from_secs(60) {
        return Err(format!("{s} is outside 100ms..60s"));
    }
    Ok(d)
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            // kube's client logs every failed request at ERROR; our watcher says it once.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_client=off,netlink_packet_route=error".into()),
        )
        .with_writer(std::io::stderr)
        // colours only for a person at a terminal, not in kubectl logs or journald
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.cmd {
        Cmd::Run(args) => run(*args),
        Cmd::Certs { cmd } => certs::run(cmd),
        Cmd::Explain(args) => explain(args),
        Cmd::Selftest { duration, interval } => selftest(duration, interval),
        Cmd::Doctor(args) => doctor_cmd(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpufeed-guest: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn selftest(duration: Duration, interval: Duration) -> anyhow::Result<()> {
    let root = cgroups::cgroup2_mount().context("cannot find the cgroup v2 hierarchy")?;
    probes::route_libbpf_logs();
    let btf = probes::KernelBtf::load();
    let options = gpufeed_guest::selftest::unit_options();
    let lockdown = privileges::lockdown();
    let ctx = LoadContext {
        btf: &btf,
        options: &options,
        interval,
        lockdown: lockdown.as_deref(),
    };
    let (units, statuses) = probes::load(&ctx, &probes::select("all")?).map_err(load_error)?;
    for s in statuses.iter().filter(|s| !s.up) {
        println!(
            "{}: not loaded ({})",
            s.name,
            s.reason.as_deref().unwrap_or("")
        );
    }
    let mut collector = collect::Collector::new(
        cgroups::CgroupTree::following(root.clone()),
        units,
        pods::PodStore::default(),
        Duration::from_secs(3600),
    );
    collector.elect_compute(Duration::from_secs(30));
    let rows = gpufeed_guest::selftest::run(&mut collector, &root, duration, interval);
    print!("{}", gpufeed_guest::selftest::render(&rows));
    Ok(())
}

fn node_name(arg: Option<String>) -> String {
    arg.or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
    })
    .unwrap_or_default()
}

/// The OTLP resource of this agent: `service.name` and `service.instance.id` (a Prometheus
/// receiver's `job` and `instance`), `k8s.node.name` (the node whose pods it watches) and
/// `host.name`.
fn otlp_resource(node: &str) -> Vec<(String, String)> {
    [
        ("service.name", "gpufeed-guest".to_string()),
        ("service.instance.id", node.to_string()),
        ("k8s.node.name", node.to_string()),
        ("host.name", gpufeed_shared::otlp::hostname()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    // The cost shares' denominators not configured come from NVML at each tick (finops::live):
    // no GPU capacity at start is no reason to refuse it.
    let finops_cfg = args.finops.settings().validate()?;
    let otlp_cfg = args
        .otlp
        .config(otlp_resource(&node_name(args.node_name.clone())))
        .map_err(anyhow::Error::msg)?;
    let selected = probes::select(&args.probes).context("--probes")?;
    let cgroup_root = match args.cgroup_root {
        Some(p) => p,
        None => cgroups::cgroup2_mount()
            .context("cannot find the cgroup v2 hierarchy (is cgroup2 mounted?)")?,
    };
    if !selected.is_empty() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let missing = privileges::missing(&status, std::path::Path::new("/sys/kernel/btf/vmlinux"));
        if !missing.is_empty() {
            bail!("cannot load probes: {}", missing.join("; "));
        }
    }
    let lockdown = privileges::lockdown();
    if let Some(mode) = &lockdown {
        tracing::info!(lockdown = %mode, "kernel lockdown mode");
    }

    probes::route_libbpf_logs();
    probes::cgroup_batch::choose(args.cgroup_reads);
    probes::cgroup_storage::choose(args.cgroup_storage);
    let btf = probes::KernelBtf::load();
    let ctx = LoadContext {
        btf: &btf,
        options: &args.units,
        interval: args.interval,
        lockdown: lockdown.as_deref(),
    };
    let (units, statuses) = probes::load(&ctx, &selected).map_err(load_error)?;
    for s in &statuses {
        match &s.reason {
            None => tracing::info!(probe = s.name, "probe attached"),
            Some(r) => tracing::warn!(probe = s.name, "probe down, the others run: {r}"),
        }
    }
    let probes_finding = doctor::probes::from_statuses(&statuses);
    let probes_down: Vec<String> = statuses
        .iter()
        .filter(|s| !s.up)
        .map(|s| {
            format!(
                "probe {} is down: {}",
                s.name,
                s.reason.as_deref().unwrap_or("")
            )
        })
        .collect();

    let pods = pods::PodStore::default();
    let mut collector = collect::Collector::new(
        cgroups::CgroupTree::following(cgroup_root.clone()),
        units,
        pods.clone(),
        args.pod_grace,
    );
    collector.elect_compute(args.gpu_duty_window);
    let gpu_store = collector.store.clone();
    collector.tick().with_context(|| {
        format!(
            "cannot read the cgroup hierarchy at {}",
            cgroup_root.display()
        )
    })?;

    let registry = prometheus::Registry::new();
    // the join splits the pods' feed stall by cause; the scrape writes it
    let feed_stall = join::FeedStallShare::default();
    let finops = finops::FinOps::new(finops_cfg, pods.clone());
    // The agent's series are written straight into the exposition, beside the registry's.
    let agent_series = Arc::new(
        exporter::AgentCollector::new(
            collector.store.clone(),
            pods.clone(),
            collector.families(),
            statuses,
        )
        .with_pod_labels(finops.pod_labels())
        .with_feed_stall(feed_stall.clone()),
    );
    registry.register(Box::new(finops.clone()))?;
    let join_cfg = correlate::Config {
        before: args.join_before,
        after: args.join_after,
        detector: correlate::DetectorConfig {
            k: args.spike_sensitivity,
            window_secs: args.interval.as_secs_f64(),
            ..Default::default()
        },
        ..Default::default()
    };
    let node = node_name(args.node_name.clone());
    if let Some(t) = &args.profile_url {
        tracing::info!(template = %t, "profile links on the incident page");
    }
    let joined = join::Join::start(
        join::Settings {
            correlate: join_cfg,
            node,
            simulated: args.simulated_hosts.clone(),
            profile: args.profile_url.clone(),
            feed_stall,
        },
        pods.clone(),
    )?;
    registry.register(Box::new(joined.series()))?;

    let last_tick = tick_loop::LastTick::new();
    let ticks = tick_loop::TickLoop::start(
        collector,
        args.interval,
        joined.clone(),
        finops,
        last_tick.clone(),
    )?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = rt.block_on(async move {
        if !args.no_kube {
            let cfg = pods::WatchConfig {
                node_name: node_name(args.node_name),
            };
            tracing::info!(node = %cfg.node_name, "watching this node's pods");
            tokio::spawn(pods::run_watcher(pods.clone(), cfg));
        }
        // The hub: host events and host state in, joined with the pods' signals.
        let stream = match args.quic_listen {
            Some(listen) => {
                let mut hc = hub::HubConfig::new(listen, args.tls_dir.clone());
                hc.journal = args.event_journal.clone();
                hc.sysfs_root = args.sysfs_root.clone();
                readiness::start_stream(hc, &registry, joined.clone()).await?
            }
            None => {
                tracing::info!("{}", readiness::STREAM_OFF);
                readiness::Stream::new(readiness::StreamState::Off)
            }
        };
        let findings = doctor_loop(
            &registry,
            doctor::Inputs {
                cgroup_root: Some(cgroup_root.clone()),
                ..doctor::Inputs::for_run(&args.probes, &args.units)
            },
            probes_finding,
            (!args.no_kube).then(|| pods.clone()),
            stream.clone(),
            gpu_store,
        )?;
        let listener = gpufeed_shared::http::bind(args.metrics_listen)
            .map_err(|e| exporter::bind_error(args.metrics_listen, e))?;
        tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz, /doctor, /events, /api/state and the page at /");
        let stale_after = args.interval * 3 + Duration::from_secs(1);
        let healthy: Arc<dyn Fn() -> bool + Send + Sync> =
            Arc::new(move || last_tick.age() <= stale_after);
        let health_listen = args.health_listen.unwrap_or_else(|| {
            let port = if args.metrics_listen.port() == 0 { 0 } else { DEFAULT_HEALTH_PORT };
            SocketAddr::from(([127, 0, 0, 1], port))
        });
        let health = gpufeed_shared::http::bind(health_listen)
            .map_err(|e| anyhow::anyhow!("cannot listen on {health_listen} for the probes: {e} (choose another with --health-listen)"))?;
        tracing::info!(addr = %health.local_addr()?, "serving the probes (/healthz, /readyz)");
        let probes = exporter::health_router(healthy.clone())
            .merge(readiness::readyz_router(stream.clone(), healthy.clone(), probes_down.clone()));
        let routes = web::router(joined).merge(readiness::router(stream, healthy.clone(), findings, probes_down));
        let exposition = exporter::Exposition::new(registry.clone(), agent_series);
        if let Some(cfg) = otlp_cfg {
            let metrics = gpufeed_shared::otlp::OtlpMetrics::new(&registry, "gpufeed")?;
            let e = exposition.clone();
            gpufeed_shared::otlp::spawn(cfg, Arc::new(move || e.render()), metrics, ("gpufeed-guest", env!("CARGO_PKG_VERSION")))
                .map_err(anyhow::Error::msg)?;
        }
        tokio::select! {
            r = exporter::serve(listener, exposition, healthy, routes) => r.context("metrics server"),
            r = exporter::serve_health(health, probes) => r.context("probe server"),
            _ = shutdown_signal() => {
                tracing::info!("shutting down");
                Ok(())
            }
        }
    });
    // the tick in progress ends first; then its thread drops the units
    ticks.stop();
    served
}

/// The running agent's doctor: every check at start and every [`doctor::PERIOD`], the
/// agent's own (pods, stream: in memory) every 5 s; the gauge and `/doctor` follow, and a check whose
/// status changes is logged.
fn doctor_loop(
    registry: &prometheus::Registry,
    inputs: doctor::Inputs,
    probes: doctor::Finding,
    pods: Option<pods::PodStore>,
    stream: readiness::Stream,
    store: Arc<std::sync::Mutex<collect::Store>>,
) -> anyhow::Result<doctor::Latest> {
    const OWN_EVERY: Duration = Duration::from_secs(5);
    let gauge = doctor::CheckGauge::register(registry)?;
    let latest = doctor::Latest::default();
    let out = latest.clone();
    std::thread::Builder::new()
        .name("doctor".into())
        .spawn(move || {
            let mut local = Vec::new();
            let mut local_at: Option<Instant> = None;
            loop {
                if local_at.is_none_or(|t| t.elapsed() >= doctor::PERIOD) {
                    local = doctor::local(&inputs);
                    local_at = Some(Instant::now());
                }
                let mut all = local.clone();
                all.push(probes.clone());
                if let Some(p) = &pods {
                    all.push(doctor::pods::bandwidth_annotations(p));
                }
                all.push(doctor::stream::host_stream(&stream));
                // the store's lock is held for the check only: a few map walks
                let (gpu, tc) = {
                    let store = store.lock().unwrap_or_else(|e| e.into_inner());
                    (
                        doctor::gpu::compute_source(&store),
                        doctor::network::tc_seen(&store),
                    )
                };
                all.push(gpu);
                all.push(match tc {
                    Some(tc) => doctor::network::datapath_now(
                        inputs.netns.as_deref(),
                        &inputs.node_devices,
                        Some(tc),
                    ),
                    None => doctor::Finding::skip("datapath", "the tc probe is not running"),
                });
                gauge.update(&all);
                out.set(all);
                std::thread::sleep(OWN_EVERY);
            }
        })?;
    Ok(latest)
}

/// The running agent's latest findings (its /doctor).
fn fetch_findings(url: &str) -> anyhow::Result<Vec<doctor::Finding>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let r = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?
            .get(url)
            .send()
            .await?
            .error_for_status()?;
        Ok(r.json().await?)
    })
}

/// `gpufeed-guest doctor`: this node's checks, then the running agent's.
fn doctor_cmd(args: DoctorArgs) -> anyhow::Result<()> {
    let inputs = doctor::Inputs {
        cgroup_root: args.cgroup_root,
        netns: args.netns,
        ..doctor::Inputs::for_run(&args.probes, &args.units)
    };
    let mut findings = doctor::local(&inputs);
    // what the agent will load here, by loading it (and letting it go again)
    probes::route_libbpf_logs();
    findings.push(doctor::probes::predict(&args.probes, &args.units));
    if !args.local {
        let url = format!("{}/doctor", args.url.trim_end_matches('/'));
        match fetch_findings(&url) {
            Ok(theirs) => {
                // The agent evaluates the local checks too, in its own process: this run's
                // stand; its own (pods, stream) come from it.
                let mine: Vec<String> = findings.iter().map(|f| f.check.clone()).collect();
                findings.extend(theirs.into_iter().filter(|f| !mine.contains(&f.check)));
            }
            Err(e) => findings.push(doctor::Finding::fail(
                "agent",
                format!("cannot ask the running agent at {url}: {e:#}"),
                "run the doctor in the agent's container (kubectl -n gpufeed exec ds/gpufeed-guest \
                 -- gpufeed-guest doctor), pass --url, or --local for this node's checks only",
            )),
        }
    }
    // the datapath as this node's links show it, where the agent did not say (what it
    // saw of peer redirects is its own)
    if !findings.iter().any(|f| f.check == "datapath") {
        findings.push(doctor::network::datapath_now(
            inputs.netns.as_deref(),
            &inputs.node_devices,
            None,
        ));
    }
    print!("{}", doctor::render(&findings));
    let failed = findings
        .iter()
        .filter(|f| f.status == doctor::Status::Fail)
        .count();
    if failed > 0 {
        bail!("{failed} checks failed");
    }
    Ok(())
}

fn explain(args: ExplainArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let base = args.url.trim_end_matches('/').to_string();
    let (events, state, metrics) = rt.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let get = |path: &'static str| {
            let url = format!("{base}{path}");
            let client = client.clone();
            async move {
                let r = client
                    .get(&url)
                    .send()
                    .await
                    .with_context(|| {
                        format!("cannot reach the agent at {url} (is it running? see --url)")
                    })?
                    .error_for_status()
                    .with_context(|| url.clone())?;
                r.json::<serde_json::Value>()
                    .await
                    .with_context(|| format!("{url} did not answer JSON (an older agent?)"))
            }
        };
        let metrics = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .and_then(|r| r.error_for_status());
        let metrics = match metrics {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        anyhow::Ok((get("/events").await?, get("/api/state").await?, metrics))
    })?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    print!(
        "{}",
        incident::explain::explain_with_feed(&events, &state, &metrics, args.since, now_ms)
    );
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

fn load_error(e: probes::ProbeError) -> anyhow::Error {
    if e.is_permission() {
        anyhow::anyhow!("{e}\nthe kernel refused to load BPF programs: grant CAP_BPF and CAP_PERFMON (or run as root); under lockdown=integrity|confidentiality check the kernel log")
    } else {
        anyhow::anyhow!("{e}\n(set RUST_LOG=debug to see libbpf's log)")
    }
}
