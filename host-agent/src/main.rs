//! `gpufeed-host`: the host agent binary.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gpufeed_host::agent::Agent;
use gpufeed_host::config::{Config, DEFAULT_PATH};
use gpufeed_shared::event::Stamped;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "gpufeed-host",
    version,
    about = "gpufeed host agent: PCIe/Thunderbolt links, AER, bridge traffic and VM state of a Proxmox VE host"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent (as the systemd service does).
    Run {
        #[command(flatten)]
        common: Common,
        /// Validate the configuration and exit.
        #[arg(long)]
        check_config: bool,
        /// OTLP metrics push (`--otlp-endpoint`, ...; override `[otlp]` of the file).
        #[command(flatten)]
        otlp: gpufeed_shared::otlp::OtlpArgs,
    },
    /// Print events live for a person (or as JSON lines with --json).
    Watch {
        #[command(flatten)]
        common: Common,
        /// One JSON object per line (`{"realtime_ns":..,"monotonic_ns":..,"event":{..}}`).
        #[arg(long)]
        json: bool,
    },
    /// Check what the field gets wrong on this host (capabilities, tracefs, lockdown, AER
    /// ownership, GPU links below their capability): pass or fail with the fix; exits
    /// non-zero on a failure.
    Doctor {
        #[command(flatten)]
        common: Common,
    },
    /// Certificates for the host → guest event stream: `certs init` writes the CA (kept
    /// apart), the guest's files and one bundle per host to copy into /etc/gpufeed.
    Certs {
        #[command(subcommand)]
        cmd: gpufeed_shared::certs::CertsCmd,
    },
}

#[derive(Args)]
struct Common {
    /// Configuration file (TOML).
    #[arg(long, default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Prefix for /sys, /etc/pve, /run, /proc, /dev (overrides `root` of the config).
    #[arg(long)]
    root: Option<PathBuf>,
    /// Address of the host-local /metrics (overrides `metrics_listen`; `watch` serves
    /// /metrics only when this is given).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

impl Common {
    fn load(&self) -> anyhow::Result<Config> {
        let mut cfg = Config::load(&self.config)?;
        for key in &cfg.ignored_keys {
            // A file written for another version: the agent starts, the admin is told.
            tracing::warn!(
                "{}: unknown key `{key}` ignored (not a setting of this version: removed, renamed or misspelled)",
                self.config.display()
            );
        }
        if let Some(r) = &self.root {
            cfg.root =
                std::fs::canonicalize(r).with_context(|| format!("--root {}", r.display()))?;
        }
        if let Some(a) = self.metrics_listen {
            cfg.metrics_listen = a;
        }
        cfg.validate(&self.config)?;
        Ok(cfg)
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let quiet = matches!(
        cli.cmd,
        Cmd::Watch { .. } | Cmd::Doctor { .. } | Cmd::Certs { .. }
    );
    gpufeed_host::logging::init(if quiet { "warn" } else { "info" });
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpufeed-host: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(real_main(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpufeed-host: {e:#}");
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Run {
            common,
            check_config,
            otlp,
        } => {
            let cfg = common.load()?;
            if let Some(s) = &cfg.stream {
                // What `run` refuses when it starts the stream, with the same message.
                s.check(&cfg.host_id()).context(STREAM_START)?;
            }
            let otlp = cfg
                .otlp
                .config(&otlp, &cfg.host_id())
                .map_err(anyhow::Error::msg)
                .context("OTLP metrics push")?;
            if check_config {
                println!("{}: configuration OK", common.config.display());
                return Ok(());
            }
            run(cfg, otlp).await
        }
        Cmd::Doctor { common } => {
            let cfg = common.load()?;
            let findings = gpufeed_host::doctor::checks(&cfg);
            print!("{}", gpufeed_host::doctor::render(&findings));
            let failed = findings
                .iter()
                .filter(|f| f.status == gpufeed_host::doctor::Status::Fail)
                .count();
            if failed > 0 {
                anyhow::bail!("{failed} checks failed");
            }
            Ok(())
        }
        Cmd::Certs { cmd } => Ok(gpufeed_shared::certs::run(cmd)?),
        Cmd::Watch { common, json } => {
            // Only an explicit --metrics-listen serves /metrics while watching: the configured
            // address is the service's, which usually runs beside a person's `watch`.
            let serve = common.metrics_listen;
            let cfg = common.load()?;
            watch(cfg, json, serve).await
        }
    }
}

const STREAM_START: &str = "starting the host → guest stream";

/// On a Proxmox host guests are bound to the VMs they name; elsewhere (no `/etc/pve` under
/// the root) there are no VMs to bind to, and a guest without a filter gets every event.
fn stream_vms(agent: &Agent) -> Option<gpufeed_host::stream::Vms> {
    let roots = &agent.ctx.roots;
    if !roots.pve().is_dir() {
        tracing::info!(pve = %roots.pve().display(), "no Proxmox configuration: guests are not bound to VMs; a guest without vmids or devices gets every event");
        return None;
    }
    Some(gpufeed_host::stream::Vms {
        roots: roots.clone(),
        topo: agent.ctx.topo.clone(),
    })
}

async fn run(cfg: Config, otlp: Option<gpufeed_shared::otlp::OtlpConfig>) -> anyhow::Result<()> {
    let listener = gpufeed_shared::http::bind(cfg.metrics_listen)
        .with_context(|| format!("cannot listen on {} (metrics_listen)", cfg.metrics_listen))?;
    let agent = Arc::new(Agent::new(cfg));
    // Subscribe before the watchers start, so their first events are streamed too.
    let stream = match agent.cfg.stream.clone() {
        Some(s) if !s.guests.is_empty() => Some(
            gpufeed_host::stream::spawn(
                s,
                agent.node().to_string(),
                agent.bus.subscribe(),
                &agent.metrics.registry,
                stream_vms(&agent),
            )
            .context(STREAM_START)?,
        ),
        _ => None,
    };
    let running = agent.start().await;
    spawn_doctor(&agent.cfg, &agent.metrics.registry)?;
    if let Some(o) = otlp {
        gpufeed_host::otlp::start(o, &agent.metrics).context("OTLP metrics push")?;
    }
    tracing::info!(
        "gpufeed-host {} started: metrics on http://{}/metrics; watchers on: {}; off: {}",
        env!("CARGO_PKG_VERSION"),
        listener.local_addr()?,
        running.enabled.join(", "),
        if running.disabled.is_empty() {
            "none".to_string()
        } else {
            running
                .disabled
                .iter()
                .map(|d| d.0)
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let server = tokio::spawn(gpufeed_host::metrics::serve(
        listener,
        agent.metrics.clone(),
    ));
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut wd_usec = 0u64;
    if sd_notify::watchdog_enabled(false, &mut wd_usec) && wd_usec > 0 {
        let period = std::time::Duration::from_micros(wd_usec / 2);
        let liveness = stream.as_ref().map(|s| s.liveness());
        let (agent, stopping) = (agent.clone(), stopping.clone());
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(period);
            let mut stuck = false;
            loop {
                iv.tick().await;
                if stopping.load(std::sync::atomic::Ordering::Relaxed) {
                    // The watchers are being stopped: their beats stop by design.
                    continue;
                }
                // The runtime runs this task; the stream and every periodic watcher loop must
                // be moving too, else no ping: systemd restarts a wedged agent after
                // WatchdogSec.
                let live = liveness
                    .as_ref()
                    .map_or(Ok(()), |l| l.check(period))
                    .and_then(|()| agent.heartbeats().check(period));
                match live {
                    Ok(()) => {
                        if std::mem::take(&mut stuck) {
                            tracing::info!("watchdog: the stream moves again; pinging");
                        }
                        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
                    }
                    Err(e) => {
                        if !std::mem::replace(&mut stuck, true) {
                            tracing::error!(
                                "watchdog: {e}; not pinging (systemd restarts the agent)"
                            );
                        }
                    }
                }
            }
        });
    }
    tokio::select! {
        _ = shutdown_signal() => tracing::info!("stopping"),
        r = server => { r??; anyhow::bail!("metrics server stopped") }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    stopping.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(running);
    if let Some(stream) = stream {
        // Writes the spools' state so that a restart resumes where this run stopped.
        stream.shutdown().await;
    }
    Ok(())
}

/// The doctor's checks at start and every [`gpufeed_host::doctor::PERIOD`]:
/// `gpufeed_check_ok{check}`, and a log line for each check that fails (or passes again).
fn spawn_doctor(cfg: &Config, registry: &prometheus::Registry) -> anyhow::Result<()> {
    use gpufeed_host::doctor;
    let gauge = doctor::CheckGauge::register(registry)?;
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("doctor".into())
        .spawn(move || loop {
            gauge.update(&doctor::checks(&cfg));
            std::thread::sleep(doctor::PERIOD);
        })?;
    Ok(())
}

async fn watch(cfg: Config, json: bool, serve: Option<SocketAddr>) -> anyhow::Result<()> {
    let listener = match serve {
        Some(addr) => Some(
            gpufeed_shared::http::bind(addr)
                .with_context(|| format!("cannot listen on {addr} (--metrics-listen)"))?,
        ),
        None => None,
    };
    let agent = Arc::new(Agent::new(cfg));
    let mut rx = agent.bus.subscribe();
    let running = agent.start().await;
    let server =
        listener.map(|l| tokio::spawn(gpufeed_host::metrics::serve(l, agent.metrics.clone())));
    if !json {
        eprintln!(
            "watching (on: {}; off: {}); Ctrl-C to stop",
            running.enabled.join(", "),
            running
                .disabled
                .iter()
                .map(|(w, r)| format!("{w} ({r})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            r = rx.recv() => match r {
                Ok(ev) => print_event(&ev, json),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => eprintln!("({n} events dropped: output too slow)"),
                Err(_) => break,
            }
        }
    }
    if let Some(s) = server {
        s.abort();
    }
    drop(running);
    Ok(())
}

fn print_event(ev: &Stamped, json: bool) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if json {
        if let Ok(s) = serde_json::to_string(ev) {
            let _ = writeln!(out, "{s}");
        }
        return;
    }
    let secs = ev.realtime_ns.div_euclid(1_000_000_000);
    let ms = ev.realtime_ns.rem_euclid(1_000_000_000) / 1_000_000;
    let _ = writeln!(
        out,
        "{}.{:03} {:<20} {}",
        secs,
        ms,
        ev.event.kind_name(),
        gpufeed_host::watch::describe(&ev.event)
    );
}
