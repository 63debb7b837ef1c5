//! A guest that restarts (SIGKILL, then started again on the same port with the same TLS
//! files) while the host has events queued: the host must be connected again and the backlog
//! replayed within 3 s of the new guest listening, with the host's default timing (keep-alive,
//! idle timeout, reconnect backoff).
//!
//! The guest is this test binary re-executed (`run_guest_child`); the host runs in the test.

use std::path::Path;
use std::time::{Duration, Instant};

use gpufeed_shared::stream::client;
use gpufeed_testkit::stream::*;

/// Entry point of the child processes; does nothing in a normal test run.
#[test]
fn child_process_entry() {
    if std::env::var(CHILD).as_deref() == Ok("guest") {
        run_guest_child(&child_runtime());
    }
}

/// Waits until the host's spool has every event up to `last` acknowledged; the time it took.
async fn acked(h: &client::StreamHandle, last: u64, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if h.status()[0].acked == Some(last) {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

async fn restart_after(down: Duration, fx: &Fixture, work: &Path) -> Duration {
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let envs = vec![
        ("T_DEFAULT_IDLE", String::new()),
        ("T_TLS", fx.path().display().to_string()),
        ("T_ADDR", addr.to_string()),
        (
            "T_JOURNAL",
            work.join(format!("journal-{}.jsonl", down.as_millis()))
                .display()
                .to_string(),
        ),
    ];
    let mut guest = spawn_child("guest", work, 0, &envs);
    // Production timing: only the certificates and the guest differ from the defaults.
    let cfg = fx.production_stream_config("pve1", addr);
    let (h, _) = start_host(cfg);
    h.push_raw(0, kmsg_lost_raw(0, 100));
    assert!(acked(&h, 99, Duration::from_secs(10)).await.is_some());

    guest.child.kill().unwrap(); // SIGKILL: no close frame reaches the host
    guest.child.wait().unwrap();
    // Events keep coming while the guest is down: retransmissions back off meanwhile.
    let t_down = Instant::now();
    let mut next = 100;
    while t_down.elapsed() < down {
        h.push_raw(0, kmsg_lost_raw(next, next + 10));
        next += 10;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut guest = tokio::task::spawn_blocking({
        let (work, envs) = (work.to_owned(), envs.clone());
        move || spawn_child("guest", &work, 1, &envs)
    })
    .await
    .unwrap();
    let took = acked(&h, next - 1, Duration::from_secs(30)).await;
    let _ = guest.child.kill();
    let _ = guest.child.wait();
    h.shutdown().await;
    let took = took.unwrap_or_else(|| {
        panic!(
            "backlog not replayed within 30 s; guest log:\n{}",
            std::fs::read_to_string(&guest.log).unwrap_or_default()
        )
    });
    eprintln!(
        "guest down {down:?} ({} events queued): connected and replayed {took:?} after it listened again",
        next - 100
    );
    took
}

#[test]
fn host_reconnects_and_replays_within_3s_of_a_guest_restart() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let _logs = capture_logs();
    let fx = Fixture::new(&["pve1"]);
    let work = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A quick restart (the old connection still alive on the host) and a slow one (the host
    // already reconnecting with backoff).
    for down in [Duration::from_millis(1500), Duration::from_secs(10)] {
        let took = rt.block_on(restart_after(down, &fx, work.path()));
        assert!(
            took < Duration::from_secs(3),
            "down {down:?}: took {took:?}"
        );
    }
}
