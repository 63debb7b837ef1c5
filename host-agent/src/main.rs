//! `gpufeed-host`: the host agent binary.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gpufeed_host::agent::Agent;
use gpufeed_host::config::{Config, DEFAULT_PATH};
use gpufeed_shared::event::{HostEvent, Stamped};
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
    },
    /// Print events live for a person (or as JSON lines with --json).
    Watch {
        #[command(flatten)]
        common: Common,
        /// One JSON object per line (`{"realtime_ns":..,"monotonic_ns":..,"event":{..}}`).
        #[arg(long)]
        json: bool,
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
    /// Address of the host-local /metrics (overrides `metrics_listen`).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

impl Common {
    fn load(&self) -> anyhow::Result<Config> {
        let mut cfg = Config::load(&self.config)?;
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

/// Dependencies whose log lines are kept only from `error` up unless `RUST_LOG` names them:
/// netlink-packet-route warns on every link dump about attributes newer than itself
/// (`IFLA_INET6_CONF` on current kernels), which is harmless.
const QUIET_DEPS: &[&str] = &["netlink_packet_route"];

/// The tracing filter: `RUST_LOG` (or `default`), plus `<dep>=error` for [`QUIET_DEPS`].
fn log_filter(rust_log: Option<&str>, default: &str) -> String {
    let mut f = rust_log
        .filter(|s| !s.trim().is_empty())
        .unwrap_or(default)
        .to_string();
    for dep in QUIET_DEPS {
        if !f.contains(dep) {
            f.push_str(&format!(",{dep}=error"));
        }
    }
    f
}

/// The journal logger with [`QUIET_DEPS`] held to `error`.
struct QuietDeps<L>(L);

impl<L: log::Log> log::Log for QuietDeps<L> {
    fn enabled(&self, m: &log::Metadata) -> bool {
        (m.level() <= log::Level::Error || !QUIET_DEPS.iter().any(|d| m.target().starts_with(d)))
            && self.0.enabled(m)
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            self.0.log(r)
        }
    }
    fn flush(&self) {
        self.0.flush()
    }
}

fn init_logging(quiet: bool) {
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        if let Ok(j) = systemd_journal_logger::JournalLog::new() {
            let j = j.with_syslog_identifier("gpufeed-host".into());
            if log::set_boxed_logger(Box::new(QuietDeps(j))).is_ok() {
                log::set_max_level(match std::env::var("RUST_LOG").as_deref() {
                    Ok("debug") => log::LevelFilter::Debug,
                    Ok("trace") => log::LevelFilter::Trace,
                    Ok("warn") => log::LevelFilter::Warn,
                    _ => log::LevelFilter::Info,
                });
                return; // tracing's `log` feature forwards events to the journal
            }
        }
    }
    let default = if quiet { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::new(log_filter(
        std::env::var("RUST_LOG").ok().as_deref(),
        default,
    ));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let quiet = matches!(cli.cmd, Cmd::Watch { .. });
    init_logging(quiet);
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
        } => {
            let cfg = common.load()?;
            if check_config {
                println!("{}: configuration OK", common.config.display());
                return Ok(());
            }
            run(cfg).await
        }
        Cmd::Watch { common, json } => {
            let mut cfg = common.load()?;
            if common.metrics_listen.is_none() {
                cfg.metrics_listen = "127.0.0.1:0".parse()?;
            }
            watch(cfg, json).await
        }
    }
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.metrics_listen)
        .await
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
            )
            .context("starting the host → guest stream")?,
        ),
        _ => None,
    };
    let running = agent.start().await;
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
    let mut wd_usec = 0u64;
    if sd_notify::watchdog_enabled(false, &mut wd_usec) && wd_usec > 0 {
        let period = std::time::Duration::from_micros(wd_usec / 2);
        let bus = agent.bus.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(period);
            loop {
                iv.tick().await;
                // The runtime is alive and the bus accepts events: the agent is healthy.
                let _ = bus.emitted();
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            }
        });
    }
    tokio::select! {
        _ = shutdown_signal() => tracing::info!("stopping"),
        r = server => { r??; anyhow::bail!("metrics server stopped") }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    drop(running);
    if let Some(stream) = stream {
        // Writes the spools' state so that a restart resumes where this run stopped.
        stream.shutdown().await;
    }
    Ok(())
}

async fn watch(cfg: Config, json: bool) -> anyhow::Result<()> {
    let agent = Arc::new(Agent::new(cfg));
    let mut rx = agent.bus.subscribe();
    let running = agent.start().await;
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
        describe(&ev.event)
    );
}

fn vm(v: Option<u32>) -> String {
    v.map(|v| format!(" vm {v}")).unwrap_or_default()
}

/// One line for a person.
fn describe(e: &HostEvent) -> String {
    use gpufeed_host::sysfs::fmt_speed;
    match e {
        HostEvent::PcieLinkChange(l) => format!(
            "{}{}: {} x{} -> {} x{} ({}{}, max {} x{})",
            l.bdf,
            vm(l.vmid),
            fmt_speed(l.old_speed_mts),
            l.old_width,
            fmt_speed(l.new_speed_mts),
            l.new_width,
            l.class.as_str(),
            if l.degraded { ", degraded" } else { "" },
            fmt_speed(l.max_speed_mts),
            l.max_width
        ),
        HostEvent::AerCounter(a) => format!(
            "{}{}: {} {} +{} (total {}){}",
            a.bdf,
            vm(a.vmid),
            a.severity.as_str(),
            a.error,
            a.delta,
            a.total,
            if a.kmsg_context.is_empty() {
                String::new()
            } else {
                format!(" [{}]", a.kmsg_context.join(" | "))
            }
        ),
        HostEvent::AerRootPortTotal(a) => format!(
            "{}: root port {} +{} (total {})",
            a.bdf,
            a.severity.as_str(),
            a.delta,
            a.total
        ),
        HostEvent::AerTrace(d) => format!(
            "{}: {} status {:#010x}",
            d.dev_name,
            d.severity.as_str(),
            d.status
        ),
        HostEvent::PciErrorRecovery(r) => format!(
            "{}{}: {} online={:?}",
            r.bdf,
            vm(r.vmid),
            r.event,
            r.device_online
        ),
        HostEvent::PciHotplug(h) => format!("{} slot {}: {}", h.port, h.slot, h.event),
        HostEvent::ThunderboltDevice(t) => {
            let i = t.new.as_ref().or(t.old.as_ref());
            format!(
                "{} {} {} {}{}",
                t.device,
                t.action.as_str(),
                i.and_then(|i| i.vendor_name.clone()).unwrap_or_default(),
                i.and_then(|i| i.device_name.clone()).unwrap_or_default(),
                match (&t.old, &t.new) {
                    (Some(o), Some(n)) => format!(
                        " rx {}x{:?} -> {}x{:?}, tx {}x{:?} -> {}x{:?}",
                        o.rx_lanes.unwrap_or(0),
                        o.rx_speed_gbps_x10.map(|v| v as f64 / 10.0),
                        n.rx_lanes.unwrap_or(0),
                        n.rx_speed_gbps_x10.map(|v| v as f64 / 10.0),
                        o.tx_lanes.unwrap_or(0),
                        o.tx_speed_gbps_x10.map(|v| v as f64 / 10.0),
                        n.tx_lanes.unwrap_or(0),
                        n.tx_speed_gbps_x10.map(|v| v as f64 / 10.0)
                    ),
                    _ => String::new(),
                }
            )
        }
        HostEvent::ThunderboltTunnel(t) => format!(
            "{}: tunnel {} {}",
            t.device,
            t.event,
            t.details.clone().unwrap_or_default()
        ),
        HostEvent::Kmsg(k) => format!("[{}]{} {}", k.class.as_str(), vm(k.vmid), k.text),
        HostEvent::KmsgLost { count } => format!("{count} kernel log records lost"),
        HostEvent::VmState(v) => format!(
            "vm {}: {} -> {}{}{}",
            v.vmid,
            v.old.as_str(),
            v.new.as_str(),
            v.detail
                .as_ref()
                .map(|d| format!(" ({d})"))
                .unwrap_or_default(),
            if v.cause.is_empty() {
                String::new()
            } else {
                format!(" cause: {}", v.cause.join(" | "))
            }
        ),
        HostEvent::BridgePort(b) => format!(
            "{} port {}{} {}",
            b.bridge,
            b.port,
            vm(b.vmid),
            b.action.as_str()
        ),
        HostEvent::DeviceMapped(d) => format!(
            "{}{} ({}): path {}{}",
            d.bdf,
            vm(d.vmid),
            d.origin,
            d.path.join(" <- "),
            d.thunderbolt_router
                .as_ref()
                .map(|t| format!(", thunderbolt router {t}"))
                .unwrap_or_default()
        ),
        HostEvent::WatcherDisabled { watcher, reason } => format!("{watcher} off: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_filter_quiets_netlink_packet_route() {
        assert_eq!(log_filter(None, "info"), "info,netlink_packet_route=error");
        assert_eq!(
            log_filter(Some(""), "warn"),
            "warn,netlink_packet_route=error"
        );
        assert_eq!(
            log_filter(Some("debug"), "info"),
            "debug,netlink_packet_route=error"
        );
        // An explicit directive for it wins.
        assert_eq!(
            log_filter(Some("info,netlink_packet_route=warn"), "info"),
            "info,netlink_packet_route=warn"
        );
    }

    #[test]
    fn journal_logger_drops_netlink_packet_route_warnings() {
        use log::Log;
        struct All;
        impl Log for All {
            fn enabled(&self, _: &log::Metadata) -> bool {
                true
            }
            fn log(&self, _: &log::Record) {}
            fn flush(&self) {}
        }
        let q = QuietDeps(All);
        let md = |target: &'static str, level| {
            log::MetadataBuilder::new()
                .target(target)
                .level(level)
                .build()
        };
        assert!(!q.enabled(&md(
            "netlink_packet_route::link::buffer_tool",
            log::Level::Warn
        )));
        assert!(q.enabled(&md("netlink_packet_route::link", log::Level::Error)));
        assert!(q.enabled(&md("gpufeed_host::watch::bridge", log::Level::Warn)));
    }
}
