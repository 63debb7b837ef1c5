//! The binary's logging: `RUST_LOG` directives per module, and structured fields in the
//! journal. There is no journald on the test machines, so the journal test binds a datagram
//! socket of its own where systemd-journal-logger sends (`/run/systemd/journal/socket`, inside
//! a private mount namespace of the agent) and reads the native-protocol payloads.

use crate::common;

use common::{require_root, Tree};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_gpufeed-host");

/// An empty recorded tree (no Proxmox, no Thunderbolt, no kmsg: those watchers log that they
/// are off) and a config for it.
fn setup() -> (Tree, std::path::PathBuf) {
    let t = Tree::new();
    std::fs::remove_file(t.p("dev/kmsg")).unwrap();
    let cfg = t.p("host.toml");
    std::fs::write(&cfg, "host_id = \"logtest\"\n[bridge]\nenabled = false\n").unwrap();
    (t, cfg)
}

/// Run `gpufeed-host watch` on the tree with `RUST_LOG` until a stderr line contains `until`
/// (at most 20 s), stop it, and return its stderr.
fn stderr_with(rust_log: &str, until: &str) -> String {
    use std::io::BufRead;
    let (t, cfg) = setup();
    let mut child = Command::new(BIN)
        .args(["watch", "--json", "--root"])
        .arg(t.root())
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", rust_log)
        .env_remove("JOURNAL_STREAM")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut out = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while let Ok(line) =
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        out.push_str(&line);
        out.push('\n');
        if line.contains(until) {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    out
}

#[test]
fn rust_log_directives_are_per_module_and_per_level() {
    // The last unit to start is `host`: by then every start-up event has been emitted.
    let s = stderr_with("gpufeed_host::agent=trace", "watcher=\"host\"");
    assert!(
        s.lines().any(|l| l.contains("TRACE")
            && l.contains("gpufeed_host::agent")
            && l.contains("starting watcher")),
        "no agent trace line:\n{s}"
    );
    // Every event is logged at debug by gpufeed_host::events: not opened by the directive.
    assert!(!s.contains("DEBUG"), "debug of another module:\n{s}");
    // ...but it is there when asked for (the negative check above can fail).
    let s = stderr_with("gpufeed_host::events=debug", "WatcherDisabled");
    assert!(
        s.lines().any(|l| l.contains("DEBUG")
            && l.contains("gpufeed_host::events")
            && l.contains("WatcherDisabled")),
        "no events debug line:\n{s}"
    );
    assert!(!s.contains("TRACE"), "trace without a directive:\n{s}");
}

/// Parse journald's native protocol: `KEY=value\n`, or `KEY\n` + u64 LE length + bytes + `\n`.
fn journal_fields(mut p: &[u8]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    while !p.is_empty() {
        let nl = p.iter().position(|b| *b == b'\n').unwrap_or(p.len());
        let line = &p[..nl];
        if let Some(eq) = line.iter().position(|b| *b == b'=') {
            out.insert(
                String::from_utf8_lossy(&line[..eq]).into_owned(),
                String::from_utf8_lossy(&line[eq + 1..]).into_owned(),
            );
            p = &p[(nl + 1).min(p.len())..];
        } else {
            let key = String::from_utf8_lossy(line).into_owned();
            let rest = &p[nl + 1..];
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            out.insert(key, String::from_utf8_lossy(&rest[8..8 + len]).into_owned());
            p = &rest[(8 + len + 1).min(rest.len())..];
        }
    }
    out
}

#[test]
fn journal_gets_structured_fields() {
    if !require_root("journal_gets_structured_fields") {
        return;
    }
    let (t, cfg) = setup();
    // The agent's /run (a bind mount in its own mount namespace) holds our journal socket.
    let run = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(run.path().join("systemd/journal")).unwrap();
    let sock = UnixDatagram::bind(run.path().join("systemd/journal/socket")).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // Under systemd, stderr is the stream JOURNAL_STREAM names (device:inode).
    let err_path = run.path().join("stderr");
    let err = std::fs::File::create(&err_path).unwrap();
    let md = err.metadata().unwrap();
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind \"$0\" /run && exec \"$1\" watch --json --root \"$2\" --config \"$3\"")
        .arg(run.path())
        .arg(BIN)
        .arg(t.root())
        .arg(&cfg)
        .env("JOURNAL_STREAM", format!("{}:{}", md.dev(), md.ino()))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap();
    let mut records = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut buf = vec![0u8; 65536];
    while std::time::Instant::now() < deadline {
        if let Ok(n) = sock.recv(&mut buf) {
            records.push(journal_fields(&buf[..n]));
            if records
                .iter()
                .any(|r| r.get("WATCHER").map(String::as_str) == Some("thunderbolt"))
            {
                break;
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let tb = records
        .iter()
        .find(|r| r.get("WATCHER").map(String::as_str) == Some("thunderbolt"))
        .unwrap_or_else(|| {
            panic!("no record with WATCHER=thunderbolt: {records:#?}\nstderr: {stderr}")
        });
    assert_eq!(tb["PRIORITY"], "4");
    assert_eq!(tb["SYSLOG_IDENTIFIER"], "gpufeed-host");
    assert_eq!(tb["TARGET"], "gpufeed_host::agent");
    assert!(
        tb["REASON"].contains("sys/bus/thunderbolt/devices not found"),
        "{tb:?}"
    );
    assert!(tb["MESSAGE"].ends_with("thunderbolt watcher off"), "{tb:?}");
    // Nothing went to stderr: the journal got it all.
    assert!(!stderr.contains("watcher off"), "{stderr}");
}
