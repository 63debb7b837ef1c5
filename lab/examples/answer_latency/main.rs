//! How fast the answer arrives, from the kernel's own event (a benchmark, not a test): the
//! host agent (`gpufeed-host run`, the product's intervals) in the lab's q35 VM, whose kernel
//! owns AER and native PCIe hotplug, streams over QUIC with mutual TLS through QEMU's user
//! network to the guest agent on this machine (its loopback). Over QMP the benchmark injects
//! correctable errors (`pcie_aer_inject_error -c`, BadTLP) into a virtio-net function behind
//! a PCIe root port, then unplugs and replugs it (`device_del` / `device_add`, pciehp), and
//! times each leg on this machine's `CLOCK_REALTIME`:
//!
//! * QMP: the command sent → QEMU's answer;
//! * kernel: the kernel's own record (the `ras:aer_event` trace record's timestamp; for a
//!   replug pciehp's first log record), mapped from the VM's clocks (`clocks.rs`);
//! * agent: the host agent's event (its stamp, carried in the guest's journal);
//! * `/events`: the guest's `/events` lists it (polled every `ANSWER_POLL_MS`, 10 ms);
//! * `/metrics`: `gpufeed_host_events_total{event}` of the guest counts it, and the host's
//!   series in the guest's scrape (the AER counter, the link width gauge) show it.
//!
//! The VM runs under TCG on this kind of machine: the VM's share of each leg is emulated.
//!
//!   cargo build -p gpufeed-host -p gpufeed-guest --bins     # or --release, ANSWER_BIN_DIR
//!   cargo run -p gpufeed-lab --example answer_latency       # root; takes the kernel tests' lock
//!
//! `ANSWER_AER` injections (default 24), `ANSWER_HOTPLUG` unplug/replug cycles (default 6),
//! `ANSWER_KERNEL` (default `trixie`, 6.12; `newest` has the `pci:` tracepoints),
//! `ANSWER_BIN_DIR` (default this build's target directory).

#[path = "../../tests/common/mod.rs"]
mod common;

mod clocks;
mod guest;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clocks::{now_ns, Ping};
use gpufeed_lab::{KernelName, Payload, Variant, Vm, VmSpec};
use gpufeed_testkit::prom;
use guest::Guest;
use serde_json::{json, Value};

const HOST: &str = "answerlab";
const MAC: &str = "52:54:00:4e:11:01";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Aer,
    Unplug,
    Replug,
}

impl Kind {
    /// The guest's correlation kind for the event.
    fn event(self) -> &'static str {
        match self {
            Kind::Aer => "aer_correctable",
            Kind::Unplug => "link_down",
            Kind::Replug => "link_up",
        }
    }
}

/// One provoked kernel event and when each place showed it (this machine's realtime, ns).
struct Action {
    kind: Kind,
    sent: f64,
    answered: f64,
    events: Option<f64>,
    metrics: Option<f64>,
    state: Option<f64>,
    ping: Ping,
    /// from the journal, after the run
    kernel: Option<f64>,
    agent: Option<f64>,
    source: String,
    /// the kernel's log record of the function's enumeration (a replug's `add` uevent follows)
    enumerated: Option<f64>,
}

/// What the guest shows of `kind` now: the newest listed event's time, the counter of events,
/// whether the host's series says it happened.
fn views(g: &Guest, kind: Kind, dev: &str) -> (Option<i64>, f64, Option<f64>) {
    let s = g.scrape();
    let counted = prom::sum(
        &s,
        "gpufeed_host_events_total",
        &[("host", HOST), ("event", kind.event())],
    );
    let state = match kind {
        Kind::Aer => prom::value(
            &s,
            "gpufeed_host_aer_errors_total",
            &[("bdf", dev), ("error", "BadTLP"), ("host", HOST)],
        ),
        _ => prom::value(
            &s,
            "gpufeed_host_pcie_link_width",
            &[("bdf", dev), ("host", HOST)],
        ),
    };
    (g.newest_event(HOST, kind.event()), counted, state)
}

/// Runs `act` (the QMP command) and polls the guest until every view shows its effect or
/// `within` passes.
fn provoke(
    vm: &mut Vm,
    g: &Guest,
    dev: &str,
    kind: Kind,
    within: Duration,
    act: impl FnOnce(),
) -> Action {
    let poll = Duration::from_millis(env_or("ANSWER_POLL_MS", 10));
    let (e0, c0, s0) = views(g, kind, dev);
    let sent = now_ns();
    act();
    let answered = now_ns();
    let (mut events, mut metrics, mut state) = (None, None, None);
    let start = Instant::now();
    while (events.is_none() || metrics.is_none() || state.is_none()) && start.elapsed() < within {
        let (e, c, s) = views(g, kind, dev);
        let at = now_ns();
        if events.is_none() && e > e0 {
            events = Some(at);
        }
        if metrics.is_none() && c > c0 {
            metrics = Some(at);
        }
        let shown = match (kind, s) {
            (Kind::Aer, Some(v)) => v > s0.unwrap_or(0.0),
            (Kind::Unplug, Some(v)) => v == 0.0,
            (Kind::Replug, Some(v)) => v >= 1.0,
            (_, None) => false,
        };
        if state.is_none() && shown {
            state = Some(at);
        }
        std::thread::sleep(poll);
    }
    Action {
        kind,
        sent,
        answered,
        events,
        metrics,
        state,
        ping: clocks::best_of(vm, 3),
        kernel: None,
        agent: None,
        source: String::new(),
        enumerated: None,
    }
}

/// Fills in each action's kernel record and agent event from the guest's journal: the first
/// of its kind stamped after the action was sent and before the next one.
fn from_journal(actions: &mut [Action], journal: &[Value], dev: &str, port: &str) {
    let bounds: Vec<f64> = actions.iter().map(|a| a.sent).collect();
    for (i, a) in actions.iter_mut().enumerate() {
        let end = bounds.get(i + 1).copied().unwrap_or(f64::INFINITY);
        let within = |t: f64| t >= a.sent && t < end;
        for l in journal {
            let Some(real) = l["host_realtime_ns"].as_f64() else {
                continue;
            };
            let at = a.ping.real(real);
            if !within(at) {
                continue;
            }
            let ev = &l["event"];
            match a.kind {
                Kind::Aer => {
                    let c = &ev["AerCounter"];
                    if a.agent.is_none() && c["bdf"] == dev && c["error"] == "BadTLP" {
                        a.agent = Some(at);
                        a.kernel = c["detail"]["trace_ns"].as_f64().map(|t| a.ping.mono(t));
                        a.source = if c["detail"].is_object() {
                            "tracepoint record joined".into()
                        } else {
                            "no record".into()
                        };
                    }
                }
                Kind::Unplug | Kind::Replug => {
                    // the earliest event the guest lists as this link's `link_down`/`link_up`:
                    // the link's change, or on kernels with `pci:pci_hp_event` the slot's
                    // hotplug record (CARD_PRESENT comes before the link is read)
                    let unplug = a.kind == Kind::Unplug;
                    let c = &ev["PcieLinkChange"];
                    let link = c["bdf"] == dev
                        && c["new_width"].is_u64()
                        && (c["new_width"].as_u64() == Some(0)) == unplug;
                    let h = &ev["PciHotplug"];
                    let slot = h["port"] == port
                        && h["event"].as_str().is_some_and(|e| {
                            let down = matches!(e, "LINK_DOWN" | "CARD_NOT_PRESENT");
                            let up = matches!(e, "LINK_UP" | "CARD_PRESENT");
                            (down && unplug) || (up && !unplug)
                        });
                    if (link || slot) && a.agent.is_none_or(|t| at < t) {
                        a.agent = Some(at);
                        a.source = if link {
                            format!("link change, {}", c["source"].as_str().unwrap_or("?"))
                        } else {
                            format!("pci_hp_event {}", h["event"].as_str().unwrap_or("?"))
                        };
                    }
                    // pciehp's first log record about the slot after the command
                    let k = &ev["Kmsg"];
                    if a.kernel.is_none() && k["bdf"] == port {
                        a.kernel = k["usec"].as_f64().and_then(|us| a.ping.printk(us));
                    }
                }
            }
        }
    }
}

/// (p50, p99, max) in ms by nearest rank, and n.
fn summary(v: &[f64]) -> Option<(f64, f64, f64, usize)> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    Some((q(0.5), q(0.99), q(1.0), v.len()))
}

/// One leg's line; none where no action had both ends (the kernel logs nothing of a removal).
fn row(what: &str, v: Vec<f64>) {
    if let Some((p50, p99, max, n)) = summary(&v) {
        println!("| {what} | {p50:.0} / {p99:.0} / {max:.0} ms | {n} |")
    }
}

/// `to - from` in ms, per action where both are known.
fn leg(
    actions: &[&Action],
    from: impl Fn(&Action) -> Option<f64>,
    to: impl Fn(&Action) -> Option<f64>,
) -> Vec<f64> {
    actions
        .iter()
        .filter_map(|a| Some((to(a)? - from(a)?) / 1e6))
        .collect()
}

fn table(title: &str, actions: &[&Action], kernel: &str) {
    println!("\n{title}\n");
    println!("| leg | p50 / p99 / max | n |");
    println!("|---|---|---|");
    let sent = |a: &Action| Some(a.sent);
    row(
        "QMP command → QEMU's answer",
        leg(actions, sent, |a| Some(a.answered)),
    );
    row(
        &format!("QMP command → {kernel}"),
        leg(actions, sent, |a| a.kernel),
    );
    row(
        "QMP command → host agent's event",
        leg(actions, sent, |a| a.agent),
    );
    row(
        "QMP command → guest /events",
        leg(actions, sent, |a| a.events),
    );
    row(
        "QMP command → guest /metrics (`gpufeed_host_events_total`)",
        leg(actions, sent, |a| a.metrics),
    );
    row(
        "QMP command → the host's series in the guest's scrape",
        leg(actions, sent, |a| a.state),
    );
    row(
        &format!("{kernel} → host agent's event"),
        leg(actions, |a| a.kernel, |a| a.agent),
    );
    row(
        &format!("{kernel} → guest /events"),
        leg(actions, |a| a.kernel, |a| a.events),
    );
    if actions.iter().any(|a| a.enumerated.is_some()) {
        let en = "the kernel's record of the enumeration";
        row(
            &format!("QMP command → {en}"),
            leg(actions, sent, |a| a.enumerated),
        );
        row(
            &format!("{en} → host agent's event"),
            leg(actions, |a| a.enumerated, |a| a.agent),
        );
        row(
            &format!("{en} → guest /events"),
            leg(actions, |a| a.enumerated, |a| a.events),
        );
    }
    row(
        "host agent's event → guest /events",
        leg(actions, |a| a.agent, |a| a.events),
    );
    row(
        "host agent's event → guest /metrics",
        leg(actions, |a| a.agent, |a| a.metrics),
    );
    let missing = actions
        .iter()
        .filter(|a| a.events.is_none() || a.metrics.is_none() || a.agent.is_none())
        .count();
    let sources: std::collections::BTreeMap<&str, usize> =
        actions.iter().fold(Default::default(), |mut m, a| {
            *m.entry(a.source.as_str()).or_default() += 1;
            m
        });
    let err = actions
        .iter()
        .map(|a| a.ping.error / 1e6)
        .fold(0.0, f64::max);
    println!(
        "\n{} events; {missing} not seen in every place; agent's source: {sources:?}; clock \
         mapping error at most ±{err:.1} ms",
        actions.len()
    );
}

fn main() {
    let Some((cache, _lock)) = common::lab() else {
        return;
    };
    let aer_n: usize = env_or("ANSWER_AER", 24);
    let hotplug_n: usize = env_or("ANSWER_HOTPLUG", 6);
    let kernel: KernelName = std::env::var("ANSWER_KERNEL")
        .unwrap_or_else(|_| "trixie".into())
        .parse()
        .unwrap();
    let bins: PathBuf = std::env::var("ANSWER_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| common::target_dir());
    let bin = |name: &str| {
        let p = bins.join(name);
        assert!(p.exists(), "{} is missing: build it first", p.display());
        p
    };
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "answer_latency: binaries from {}, load {}",
        bins.display(),
        load()
    );

    let dir = tempfile::tempdir().unwrap();
    let quic = gpufeed_testkit::free_port();
    let certs = dir.path().join("certs");
    let out = Command::new(bin("gpufeed-guest"))
        .args(["certs", "init", "--out"])
        .arg(&certs)
        .args(["--guest-addr", &format!("127.0.0.1:{quic}"), "--host", HOST])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let guest = Guest::start(
        &bin("gpufeed-guest"),
        dir.path(),
        quic,
        &certs.join("guest"),
    );

    let script =
        std::fs::read_to_string(common::repo().join("lab/scenarios/host-answer.sh")).unwrap();
    let payload = Payload::new(&script).unwrap();
    payload.copy(&bin("gpufeed-host"), "gpufeed-host").unwrap();
    let bundle = certs.join("hosts").join(HOST).join("tls");
    for f in ["ca.pem", "host.pem", "host-key.pem"] {
        payload.copy(&bundle.join(f), &format!("tls/{f}")).unwrap();
    }
    payload
        .add("mac", format!("{MAC}\n").as_bytes(), 0o644)
        .unwrap();
    payload
        .add("host-id", format!("{HOST}\n").as_bytes(), 0o644)
        .unwrap();
    payload
        .add("guest-port", format!("{quic}\n").as_bytes(), 0o644)
        .unwrap();
    let mut spec = VmSpec::new(&cache, "answer", kernel, Variant::Minbase).unwrap();
    spec.q35 = true;
    // one vCPU, as the AER test has it (QEMU's multi-threaded TCG and hotplug's BAR moves)
    spec.cpus = 1;
    spec.deadline = Duration::from_secs(420 + 6 * aer_n as u64 + 45 * hotplug_n as u64);
    spec.args = [
        "-global",
        "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off",
        "-device",
        "pcie-root-port,id=rp1,bus=pcie.0,chassis=1,slot=1",
        "-netdev",
        "hubport,id=n1,hubid=0",
        "-device",
        "virtio-net-pci,netdev=n1,bus=rp1,id=nic1,aer=on",
        // the stream's way out: QEMU's user network, whose 10.0.2.2 is this machine's loopback
        "-netdev",
        "user,id=u0",
        "-device",
    ]
    .map(String::from)
    .to_vec();
    spec.args
        .push(format!("virtio-net-pci,netdev=u0,mac={MAC}"));
    let image = payload.image().unwrap();
    let t_boot = Instant::now();
    let mut vm = Vm::start(&cache, &spec, &image).unwrap();
    let device = vm.expect("device", Duration::from_secs(300)).unwrap();
    let (dev, port) = device.split_once(' ').unwrap();
    let (dev, port) = (dev.to_string(), port.to_string());
    let ready = vm.expect("ready", Duration::from_secs(180)).unwrap();
    eprintln!(
        "answer_latency: {} {dev} behind {port}, agent up {:.0} s after QEMU started: {ready}",
        spec.kernel.release,
        t_boot.elapsed().as_secs_f64()
    );
    gpufeed_testkit::wait::expect_within(
        "the stream connected and the host's link gauge in the guest's scrape",
        Duration::from_secs(120),
        || {
            let s = guest.scrape();
            (prom::value(&s, "gpufeed_stream_connected", &[("host", HOST)]) == Some(1.0)
                && prom::value(
                    &s,
                    "gpufeed_host_pcie_link_width",
                    &[("bdf", &dev), ("host", HOST)],
                )
                .is_some())
            .then_some(())
        },
    );
    let mut qmp = vm.qmp().unwrap();
    let first = clocks::best_of(&mut vm, 5);
    eprintln!(
        "answer_latency: stream up; clock offset {:.1} ms ± {:.1} ms",
        first.offset / 1e6,
        first.error / 1e6
    );
    std::thread::sleep(Duration::from_secs(3));

    let mut rng_state = 0x2545_f491_4f6c_dd1du64;
    let mut gap = || {
        // xorshift: spacing 1.0-2.0 s, so no event lands on a fixed phase of the pollers
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        Duration::from_millis(1000 + rng_state % 1000)
    };
    let mut actions = Vec::new();
    for i in 0..aer_n {
        std::thread::sleep(gap());
        let a = provoke(
            &mut vm,
            &guest,
            &dev,
            Kind::Aer,
            Duration::from_secs(10),
            || {
                let said = qmp.hmp("pcie_aer_inject_error -c nic1 0x40").unwrap();
                assert!(
                    said.trim().is_empty() || said.trim().starts_with("OK id: nic1"),
                    "QEMU: {said}"
                );
            },
        );
        eprintln!(
            "answer_latency: AER {}/{aer_n}: /events {:?} ms",
            i + 1,
            a.events.map(|t| ((t - a.sent) / 1e6).round())
        );
        actions.push(a);
    }
    for i in 0..hotplug_n {
        std::thread::sleep(gap());
        let a = provoke(
            &mut vm,
            &guest,
            &dev,
            Kind::Unplug,
            Duration::from_secs(30),
            || {
                qmp.execute("device_del", json!({"id": "nic1"})).unwrap();
            },
        );
        eprintln!(
            "answer_latency: unplug {}/{hotplug_n}: /events {:?} ms",
            i + 1,
            a.events.map(|t| ((t - a.sent) / 1e6).round())
        );
        actions.push(a);
        // QEMU unplugs once pciehp has powered the slot off (DEVICE_DELETED); a device_add
        // before that finds the id taken
        let end = Instant::now() + Duration::from_secs(20);
        while !qmp
            .events
            .iter()
            .any(|e| e["event"] == "DEVICE_DELETED" && e["data"]["device"] == "nic1")
            && Instant::now() < end
        {
            std::thread::sleep(Duration::from_millis(200));
            qmp.execute("query-status", json!({})).unwrap();
        }
        qmp.events.clear();
        std::thread::sleep(gap());
        let a = provoke(
            &mut vm,
            &guest,
            &dev,
            Kind::Replug,
            Duration::from_secs(20),
            || {
                qmp.execute(
                    "device_add",
                    json!({"driver": "virtio-net-pci", "netdev": "n1", "bus": "rp1", "id": "nic1",
                       "aer": true}),
                )
                .unwrap();
            },
        );
        eprintln!(
            "answer_latency: replug {}/{hotplug_n}: /events {:?} ms",
            i + 1,
            a.events.map(|t| ((t - a.sent) / 1e6).round())
        );
        actions.push(a);
    }
    let last = clocks::best_of(&mut vm, 5);
    // the journal is written in batches: give it a moment
    std::thread::sleep(Duration::from_secs(2));
    from_journal(&mut actions, &guest.journal(), &dev, &port);
    vm.send("enumerated").unwrap();
    vm.expect("enumerated_end", Duration::from_secs(60))
        .unwrap();
    let enumerated: Vec<f64> = vm
        .port
        .all("enumerated_at")
        .iter()
        .filter_map(|s| last.printk(s.parse::<f64>().ok()? * 1e6))
        .collect();
    let bounds: Vec<f64> = actions.iter().map(|a| a.sent).collect();
    for (i, a) in actions.iter_mut().enumerate() {
        let end = bounds.get(i + 1).copied().unwrap_or(f64::INFINITY);
        if a.kind == Kind::Replug {
            a.enumerated = enumerated
                .iter()
                .copied()
                .find(|t| *t >= a.sent && *t < end);
        }
    }
    vm.send("quit").unwrap();
    let _ = vm.expect("done", Duration::from_secs(60));

    println!(
        "\nanswer_latency: {} ({}), QEMU {}, binaries {}; load average at the end {}",
        spec.kernel.release,
        gpufeed_lab::vm::accelerator(),
        String::from_utf8_lossy(
            &Command::new("qemu-system-x86_64")
                .arg("--version")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default()
        )
        .lines()
        .next()
        .unwrap_or("?"),
        bins.display(),
        load().trim()
    );
    println!(
        "VM clock against this machine's: offset {:.3} ms ± {:.3} ms at the start, {:.3} ± {:.3} ms \
         at the end ({:.0} s later)",
        first.offset / 1e6,
        first.error / 1e6,
        last.offset / 1e6,
        last.error / 1e6,
        (last.at - first.at) / 1e9
    );
    let of = |k: Kind| actions.iter().filter(|a| a.kind == k).collect::<Vec<_>>();
    table(
        "Correctable AER (BadTLP), `pcie_aer_inject_error -c`",
        &of(Kind::Aer),
        "kernel's `ras:aer_event` record",
    );
    table(
        "Unplug (`device_del`: pciehp's 5 s attention-button delay, then the removal, which the \
         kernel announces by its `remove` uevent only)",
        &of(Kind::Unplug),
        "pciehp's first log record",
    );
    table(
        "Replug (`device_add`)",
        &of(Kind::Replug),
        "pciehp's first log record",
    );
}
