//! The systemd watchdog proves liveness: `gpufeed-host run` under a watchdog (`NOTIFY_SOCKET`,
//! `WATCHDOG_USEC`, `WATCHDOG_PID` as systemd sets them, the notifications read from the
//! socket) pings while its watchers run, and stops pinging once a watcher is wedged: here the
//! VM watcher, whose poll opens a QEMU pid file that is a FIFO nobody writes (the open never
//! returns), while the process, its runtime and /metrics stay up.

use crate::common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Notifications received within `d`.
fn notifications(sock: &UnixDatagram, d: Duration) -> Vec<String> {
    let mut out = Vec::new();
    let end = Instant::now() + d;
    let mut buf = [0u8; 4096];
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            out.extend(
                String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .map(str::to_owned),
            );
        }
    }
    out
}

/// Kills the agent when the test ends, passed or failed.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pings(n: &[String]) -> usize {
    n.iter().filter(|l| *l == "WATCHDOG=1").count()
}

#[test]
fn a_wedged_watcher_stops_the_watchdog_pings() {
    let t = common::Tree::new();
    std::fs::create_dir_all(t.p("run/qemu-server")).unwrap();
    let cfg = t.p("host.toml");
    std::fs::write(
        &cfg,
        format!(
            "host_id = \"testnode\"\nroot = \"{}\"\nmetrics_listen = \"127.0.0.1:0\"\n\
             [vm]\npoll_interval_ms = 100\nqmp = false\n[bridge]\nenabled = false\n\
             [host]\nenabled = false\n[thunderbolt]\nuevents = false\n",
            t.root().display()
        ),
    )
    .unwrap();
    let sock_path = t.p("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let log = t.p("agent.log");
    // WatchdogSec=2s: a ping every second; a loop is wedged after 1 s (4 × its 100 ms, at
    // least the ping period). systemd names the main pid in WATCHDOG_PID.
    let mut agent = KillOnDrop(
        Command::new("sh")
            .args(["-c", "export WATCHDOG_PID=$$; exec \"$0\" \"$@\""])
            .arg(env!("CARGO_BIN_EXE_gpufeed-host"))
            .args(["run", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock_path)
            .env("WATCHDOG_USEC", "2000000")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let first = notifications(&sock, Duration::from_secs(4));
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        first.iter().any(|l| l == "READY=1"),
        "{first:?}\n{}",
        read_log()
    );
    // The watchers come round: pings, one a second.
    let before = notifications(&sock, Duration::from_secs(3));
    assert!(pings(&before) >= 2, "{before:?}\n{}", read_log());

    // The VM watcher's next poll opens this and waits for a writer forever.
    nix::unistd::mkfifo(
        &t.p("run/qemu-server/100.pid"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    // A ping may still be on its way while the watcher's last beat ages past 1 s.
    let _ = notifications(&sock, Duration::from_millis(2500));
    let after = notifications(&sock, Duration::from_secs(3));
    assert_eq!(pings(&after), 0, "{after:?}\n{}", read_log());
    let text = read_log();
    assert!(
        text.contains("watchdog: the vm watcher made no progress"),
        "{text}"
    );
    // The process itself is up: only the watchdog tells systemd it is stuck.
    assert!(agent.0.try_wait().unwrap().is_none());
}
