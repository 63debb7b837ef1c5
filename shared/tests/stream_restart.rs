//! Acceptance: 100,000 events streamed from a host process to a guest process over loopback
//! QUIC+mTLS while the guest is killed with SIGKILL and restarted three times and the host is
//! restarted once (SIGTERM, disk spool). Every sequence number must arrive exactly once, in
//! order, in the guest's event journal (which is what seeds the guest's de-duplication after a
//! restart), and every event's payload must be the one generated for it.
//!
//! The guest and host are this test binary re-executed with `GPUFEED_STREAM_TEST_CHILD` set:
//! the real hub and the real stream client, each in its own process.

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufeed_shared::event::{HostEvent, Stamped};
use gpufeed_testkit::stream::*;

const N: u64 = 100_000;

/// Entry point of the child processes; does nothing in a normal test run.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap();
    let rt = child_runtime();
    let tls_dir = PathBuf::from(env("T_TLS"));
    let addr: SocketAddr = env("T_ADDR").parse().unwrap();
    match role.as_str() {
        "guest" => run_guest_child(&rt),
        "host" => rt.block_on(async {
            let spool = PathBuf::from(env("T_SPOOL"));
            let mut cfg = stream_config_in(&tls_dir, "pve1", addr, Some(&spool));
            // Small memory cache: catching up after an outage reads the disk segments.
            cfg.memory_events = 2048;
            cfg.segment_bytes = 256 * 1024;
            let h = Arc::new(start_host(cfg).0);
            let stop = Arc::new(AtomicBool::new(false));
            let gen = {
                let (h, stop) = (h.clone(), stop.clone());
                tokio::spawn(async move {
                    // ~20,000 events/s in batches of 250; resumes where the spool left off.
                    let mut next = h.status()[0].next_seq;
                    while next < N && !stop.load(Ordering::SeqCst) {
                        let to = (next + 250).min(N);
                        let batch: Vec<Stamped> = (next..to)
                            .map(|i| Stamped {
                                realtime_ns: gpufeed_shared::clock::realtime_ns(),
                                monotonic_ns: i,
                                event: HostEvent::KmsgLost { count: i },
                            })
                            .collect();
                        h.push(&batch);
                        next = to;
                        tokio::time::sleep(Duration::from_millis(12)).await;
                    }
                })
            };
            println!("READY {}", h.status()[0].next_seq);
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
            term.recv().await;
            stop.store(true, Ordering::SeqCst);
            gen.await.unwrap();
            let h = Arc::try_unwrap(h).ok().expect("sole owner");
            eprintln!("host status at exit: {:?}", h.status());
            h.shutdown().await;
            std::process::exit(0);
        }),
        r => panic!("unknown child role {r}"),
    }
}

/// Event lines in the journal so far (counted incrementally).
struct Progress {
    path: PathBuf,
    pos: u64,
    lines: u64,
}

impl Progress {
    fn poll(&mut self) -> u64 {
        if let Ok(mut f) = std::fs::File::open(&self.path) {
            use std::io::Seek;
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len < self.pos {
                // The guest cut a torn tail at restart.
                self.pos = 0;
                self.lines = 0;
            }
            let _ = f.seek(std::io::SeekFrom::Start(self.pos));
            let mut buf = Vec::new();
            let _ = f.read_to_end(&mut buf);
            if let Some(last_nl) = buf.iter().rposition(|b| *b == b'\n') {
                self.lines += buf[..=last_nl].iter().filter(|b| **b == b'\n').count() as u64;
                self.pos += last_nl as u64 + 1;
            }
        }
        self.lines
    }

    fn wait(&mut self, at_least: u64, what: &str) {
        let t0 = Instant::now();
        while self.poll() < at_least {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "stalled before {what}: {} of {at_least} journal lines",
                self.lines
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn sigterm(p: &Proc) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

#[test]
fn hundred_thousand_events_survive_guest_kills_and_host_restart() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let t_start = Instant::now();
    let fx = Fixture::new(&["pve1"]);
    let work = tempfile::tempdir().unwrap();
    let journal = work.path().join("journal.jsonl");
    let spool = work.path().join("spool");
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let envs = vec![
        ("T_TLS", fx.path().display().to_string()),
        ("T_ADDR", addr.to_string()),
        ("T_JOURNAL", journal.display().to_string()),
        ("T_SPOOL", spool.display().to_string()),
    ];
    let mut progress = Progress {
        path: journal.clone(),
        pos: 0,
        lines: 0,
    };
    let mut guests = vec![spawn_child("guest", work.path(), 0, &envs)];
    let mut hosts = vec![spawn_child("host", work.path(), 0, &envs)];
    let kill_guest = |guests: &mut Vec<Proc>| {
        let g = guests.last_mut().unwrap();
        g.child.kill().unwrap(); // SIGKILL
        g.child.wait().unwrap();
        let n = guests.len();
        guests.push(spawn_child("guest", work.path(), n, &envs));
    };

    progress.wait(10_000, "guest kill 1");
    kill_guest(&mut guests);

    progress.wait(30_000, "host restart");
    {
        let h = hosts.last_mut().unwrap();
        sigterm(h);
        let st = h.child.wait().unwrap();
        assert!(st.success(), "host exit {st:?}");
    }
    hosts.push(spawn_child("host", work.path(), 1, &envs));

    progress.wait(50_000, "guest kill 2");
    kill_guest(&mut guests);
    progress.wait(75_000, "guest kill 3");
    kill_guest(&mut guests);

    let t0 = Instant::now();
    while progress.poll() < N && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in guests.iter_mut().chain(hosts.iter_mut()) {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }

    // Check the journal: every seq exactly once, in order, one sequence space, right payloads.
    let text = std::fs::read_to_string(&journal).unwrap();
    let mut next = 0u64;
    let mut boot = None;
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["host"], "pve1");
        assert!(
            v.get("loss_first").is_none(),
            "unexpected loss at line {i}: {line}"
        );
        let b = v["boot"].as_u64().unwrap();
        assert_eq!(
            *boot.get_or_insert(b),
            b,
            "sequence space changed at line {i}"
        );
        let seq = v["seq"].as_u64().unwrap();
        if seq != next {
            let logs: Vec<String> = guests
                .iter()
                .chain(hosts.iter())
                .map(|p| {
                    format!(
                        "== {}\n{}",
                        p.log.display(),
                        std::fs::read_to_string(&p.log).unwrap_or_default()
                    )
                })
                .collect();
            panic!("line {i}: seq {seq}, expected {next}\n{}", logs.join("\n"));
        }
        assert_eq!(
            v["event"]["KmsgLost"]["count"].as_u64(),
            Some(seq),
            "payload of {seq}"
        );
        next += 1;
    }
    assert_eq!(next, N, "journal ends at {next} of {N}");
    // The kills really interrupted the stream: every later guest resumed from its journal.
    for (i, g) in guests.iter().enumerate().skip(1) {
        let log = std::fs::read_to_string(&g.log).unwrap();
        assert!(log.contains("event journal opened"), "guest {i}");
        // ... and asked the host to resume after what its journal already had.
        let resumed = log
            .lines()
            .filter(|l| l.contains("hub: host connected"))
            .any(|l| l.contains("resume_from=Some(") && !l.contains("resume_from=Some(0)"));
        assert!(resumed, "guest {i} did not resume from its journal:\n{log}");
    }
    // The restarted host resumed its spool (same boot id, continued numbering).
    let h1 = std::fs::read_to_string(&hosts[1].log).unwrap();
    assert!(h1.contains("host stream: spool ready"), "{h1}");
    assert_eq!(guests.len(), 4);
    assert_eq!(hosts.len(), 2);
    eprintln!(
        "100k events, 3 guest kills, 1 host restart: {:?}",
        t_start.elapsed()
    );
}
