//! The Debian package, as `systemd/build-deb.sh` builds it: its contents (binary, unit where
//! Debian and Proxmox expect it, config, copyright, changelog), dependencies computed from the
//! binary, the unit passing `systemd-analyze verify`, the shipped config with every default
//! commented out (and those commented values being the binary's real defaults), and a real
//! `dpkg` install, conffile edit, upgrade to a newer package, remove and purge, in a private
//! mount namespace (overlays over /usr, /etc and /var, so this machine is not changed) with a
//! recording `systemctl`: the service is enabled and started on install, and after the
//! upgrade the binary restarted is the new one. And the certificates' path: the bundle that
//! `gpufeed-host certs init` writes for a host, installed as /etc/gpufeed with the documented
//! copy, is what the packaged unit's command line runs with.

use crate::common;

use std::path::Path;
use std::process::Command;

fn tools_or_skip(tools: &[&str]) -> bool {
    let missing: Vec<&&str> = tools.iter().filter(|t| !have(t)).collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("missing tools {missing:?} (apt-get install -y systemd dpkg-dev)");
    }
    eprintln!("SKIP: missing {missing:?}");
    false
}

use gpufeed_testkit::{repo, sh::have};

/// Shell lines (in a private mount namespace) that make /usr, /etc and /var overlays whose
/// writes stay below `t`: this machine is not changed.
fn overlay_root(t: &Path) -> String {
    format!(
        r#"mount --make-rprivate /
for d in usr etc var; do
  mkdir -p {t}/o/$d/u {t}/o/$d/w
  mount -t overlay overlay -o lowerdir=/$d,upperdir={t}/o/$d/u,workdir={t}/o/$d/w /$d
done"#,
        t = t.display()
    )
}

/// Builds the package from `binary` into `out`; returns the .deb's path.
fn build_deb(binary: &Path, out: &Path, version: Option<&str>) -> String {
    let mut c = Command::new(repo().join("systemd/build-deb.sh"));
    c.arg("--binary").arg(binary).arg("--out").arg(out);
    if let Some(v) = version {
        c.args(["--version", v]);
    }
    let r = c.env("DEB_COMPRESSOR", "none").output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8(r.stdout).unwrap().trim().to_string()
}

fn out(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn deb_contents_unit_verify_and_check_config() {
    if !tools_or_skip(&["dpkg-deb", "dpkg-shlibdeps", "systemd-analyze"]) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let deb = build_deb(
        Path::new(env!("CARGO_BIN_EXE_gpufeed-host")),
        tmp.path(),
        None,
    );
    assert!(
        deb.ends_with(&format!(
            "gpufeed-host_{}_amd64.deb",
            env!("CARGO_PKG_VERSION")
        )) || deb.ends_with(".deb"),
        "{deb}"
    );

    let list = out(Command::new("dpkg-deb").args(["-c", &deb]));
    let mut files: Vec<&str> = list
        .lines()
        .filter(|l| !l.starts_with('d'))
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    files.sort();
    let mut want = vec![
        "./etc/gpufeed/host.toml",
        "./usr/bin/gpufeed-host",
        "./usr/lib/systemd/system/gpufeed-host.service",
        "./usr/share/doc/gpufeed-host/changelog.Debian.gz",
        "./usr/share/doc/gpufeed-host/copyright",
    ];
    for d in ["host-agent.md", "install.md"] {
        if repo().join("docs").join(d).exists() {
            want.push(if d == "install.md" {
                "./usr/share/doc/gpufeed-host/install.md"
            } else {
                "./usr/share/doc/gpufeed-host/host-agent.md"
            });
        }
    }
    want.sort();
    assert_eq!(files, want, "{list}");
    assert!(
        list.lines()
            .any(|l| l.starts_with("-rwxr-xr-x root/root") && l.ends_with("./usr/bin/gpufeed-host")),
        "{list}"
    );
    assert!(
        !list.lines().any(|l| {
            let mode = l.split_whitespace().next().unwrap_or("");
            mode.as_bytes().get(8) == Some(&b'w')
        }),
        "nothing world-writable: {list}"
    );

    // Dependencies computed from the binary (dpkg-shlibdeps), then systemd.
    let info = out(Command::new("dpkg-deb").args(["-f", &deb, "Package", "Depends"]));
    let depends = info
        .lines()
        .find_map(|l| l.strip_prefix("Depends: "))
        .unwrap();
    assert!(info.starts_with("Package: gpufeed-host\n"), "{info}");
    assert!(
        depends.starts_with("libc6 (>= 2.") && depends.ends_with(", systemd"),
        "{depends}"
    );

    let x = tmp.path().join("x");
    out(Command::new("dpkg-deb").args(["-x", &deb]).arg(&x));
    let doc = x.join("usr/share/doc/gpufeed-host");
    let copyright = std::fs::read_to_string(doc.join("copyright")).unwrap();
    assert!(copyright
        .starts_with("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"));
    assert!(copyright.contains("License: Apache-2.0"));
    let changelog = out(Command::new("zcat").arg(doc.join("changelog.Debian.gz")));
    assert!(
        changelog.starts_with(&format!("gpufeed-host ({}) ", env!("CARGO_PKG_VERSION"))),
        "{changelog}"
    );
    assert!(
        changelog.contains("\n -- gpufeed maintainers <"),
        "{changelog}"
    );

    let bin = x.join("usr/bin/gpufeed-host");
    let cfg = x.join("etc/gpufeed/host.toml");
    let c = Command::new(&bin)
        .args(["run", "--check-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    assert_eq!(
        String::from_utf8_lossy(&c.stdout),
        format!("{}: configuration OK\n", cfg.display())
    );
    // A bad config names the key.
    std::fs::write(
        tmp.path().join("bad.toml"),
        "[bridge]\nsample_interval_ms = 5000\n",
    )
    .unwrap();
    let b = Command::new(&bin)
        .args(["run", "--check-config", "--config"])
        .arg(tmp.path().join("bad.toml"))
        .output()
        .unwrap();
    assert!(!b.status.success());
    assert!(String::from_utf8_lossy(&b.stderr)
        .contains("key `bridge.sample_interval_ms`: must be between 100 and 1000, got 5000"));

    // systemd-analyze verify on the packaged unit; ExecStart points at the packaged binary
    // because /usr/bin/gpufeed-host is not installed on the test machine.
    let unit =
        std::fs::read_to_string(x.join("usr/lib/systemd/system/gpufeed-host.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/gpufeed-host run --config /etc/gpufeed/host.toml"));
    // `[bridge] netns` calls setns(CLONE_NEWNET): the sandbox lets it, and nothing else.
    assert!(
        unit.lines().any(|l| l == "RestrictNamespaces=net"),
        "RestrictNamespaces allows exactly the network namespace"
    );
    let unit_path = tmp.path().join("gpufeed-host.service");
    std::fs::write(
        &unit_path,
        unit.replace("/usr/bin/gpufeed-host", bin.to_str().unwrap()),
    )
    .unwrap();
    let v = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit_path)
        .output()
        .unwrap();
    let msg = String::from_utf8_lossy(&v.stderr).to_string() + &String::from_utf8_lossy(&v.stdout);
    assert!(v.status.success(), "{msg}");
    assert!(
        !msg.contains("gpufeed-host.service"),
        "warnings about the unit: {msg}"
    );
}

/// Lines of the shipped config that show an example rather than a default: no default to
/// restore by uncommenting.
const EXAMPLES: [&str; 2] = ["host_id = ", "netns = "];

#[test]
fn shipped_config_has_every_default_commented_out() {
    let path = repo().join("systemd/host.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    // Nothing active: the binary's defaults apply, and follow a later version's.
    let active: toml::Table = text.parse().unwrap();
    assert!(active.is_empty(), "active keys in host.toml: {active:?}");

    // Uncommented, the defaults shown are the binary's own (up to the [stream] section, which
    // is off by default and shown as an example).
    let defaults_part = text.split("# Host → guest event stream").next().unwrap();
    let mut uncommented = String::new();
    let mut examples = Vec::new();
    for line in defaults_part.lines() {
        let Some(rest) = line.strip_prefix("# ") else {
            continue;
        };
        let is_section = rest.starts_with('[');
        let is_key = rest
            .split_once(" = ")
            .is_some_and(|(k, _)| k.trim().chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        if EXAMPLES.iter().any(|e| rest.starts_with(e)) {
            examples.push(rest.to_string());
        } else if is_section || is_key {
            uncommented.push_str(rest);
            uncommented.push('\n');
        }
    }
    assert_eq!(examples.len(), EXAMPLES.len(), "{examples:?}");
    assert!(uncommented.lines().count() > 20, "{uncommented}");
    let parsed = gpufeed_host::config::Config::parse(&uncommented, &path)
        .unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
    assert_eq!(
        format!("{parsed:?}"),
        format!("{:?}", gpufeed_host::config::Config::default()),
        "the commented values are the defaults"
    );
    // The comparison can fail: a changed value is noticed.
    let changed = uncommented.replace("event_capacity = 4096", "event_capacity = 4095");
    assert_ne!(changed, uncommented);
    let parsed = gpufeed_host::config::Config::parse(&changed, &path).unwrap();
    assert_ne!(
        format!("{parsed:?}"),
        format!("{:?}", gpufeed_host::config::Config::default())
    );
}

/// Install, edit, upgrade, remove and purge with the real dpkg, in a mount namespace where
/// /usr, /etc and /var are overlays (writes stay in the test's directory) and /run is empty
/// but for /run/systemd/system (a running systemd, as the maintainer scripts test it). A
/// `systemctl` first in PATH records its arguments, and for start/restart which binary it
/// would run (its sha256).
#[test]
fn dpkg_install_upgrade_purge_runs_the_new_binary() {
    if !common::require_root("dpkg_install_upgrade_purge_runs_the_new_binary")
        || !tools_or_skip(&["dpkg", "dpkg-shlibdeps", "unshare", "sha256sum"])
    {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let t = t.path();
    let old = build_deb(
        Path::new(env!("CARGO_BIN_EXE_gpufeed-host")),
        &t.join("old"),
        Some("0.1.0"),
    );
    // A newer version whose binary differs (an ELF runs with bytes appended).
    let newbin = t.join("gpufeed-host-new");
    std::fs::copy(env!("CARGO_BIN_EXE_gpufeed-host"), &newbin).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&newbin)
            .unwrap();
        f.write_all(b"gpufeed-host upgrade test").unwrap();
    }
    let new = build_deb(&newbin, &t.join("new"), Some("0.1.1"));
    let sha = |p: &Path| {
        out(Command::new("sha256sum").arg(p))
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    let (old_sha, new_sha) = (
        sha(Path::new(env!("CARGO_BIN_EXE_gpufeed-host"))),
        sha(&newbin),
    );
    assert_ne!(old_sha, new_sha);

    std::fs::create_dir_all(t.join("bin")).unwrap();
    let log = t.join("calls");
    std::fs::write(
        t.join("bin/systemctl"),
        format!(
            "#!/bin/sh\necho \"$*\" >> {log}\ncase \"$1\" in start|restart|try-restart) \
             echo \"$1 $(sha256sum /usr/bin/gpufeed-host | cut -d' ' -f1)\" >> {log} ;; esac\n",
            log = log.display()
        ),
    )
    .unwrap();
    out(Command::new("chmod")
        .arg("0755")
        .arg(t.join("bin/systemctl")));

    let script = format!(
        r#"set -eu
{overlay}
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/system
export PATH={t}/bin:$PATH
mark() {{ echo "== $1" >> {log}; }}
mark install
dpkg --force-depends -i {old} >/dev/null
# the admin sets a key in the conffile
sed -i 's/^# event_capacity = 4096/event_capacity = 8192/' /etc/gpufeed/host.toml
mark upgrade
dpkg --force-depends -i {new} >/dev/null
grep -c '^event_capacity = 8192' /etc/gpufeed/host.toml > {t}/conffile-kept
mark remove
dpkg -r gpufeed-host >/dev/null
mkdir -p /var/lib/gpufeed/spool && touch /var/lib/gpufeed/spool/seg
mark purge
dpkg --purge gpufeed-host >/dev/null
test -e /var/lib/gpufeed && echo kept > {t}/spool || echo gone > {t}/spool
mark install-keep
dpkg --force-depends -i {new} >/dev/null
mkdir -p /var/lib/gpufeed/spool && touch /var/lib/gpufeed/spool/seg
GPUFEED_KEEP_SPOOL=1 dpkg --purge gpufeed-host >/dev/null
test -e /var/lib/gpufeed/spool/seg && echo kept > {t}/spool-keep || echo gone > {t}/spool-keep
umount /run
mark install-without-systemd
dpkg --force-depends -i {old} >/dev/null
"#,
        t = t.display(),
        overlay = overlay_root(t),
        log = log.display(),
    );
    let o = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .unwrap();
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        o.status.success(),
        "{}{}\ncalls:\n{calls}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let phase = |name: &str| -> Vec<String> {
        calls
            .split(&format!("== {name}\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no phase {name}: {calls}"))
            .split("\n== ")
            .next()
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    };
    assert_eq!(
        phase("install"),
        [
            "enable gpufeed-host.service".to_string(),
            "daemon-reload".into(),
            "start gpufeed-host.service".into(),
            format!("start {old_sha}"),
        ],
        "{calls}"
    );
    // Upgrade: not stopped by the old prerm; restarted with the new binary in place.
    assert_eq!(
        phase("upgrade"),
        [
            "daemon-reload".to_string(),
            "try-restart gpufeed-host.service".into(),
            format!("try-restart {new_sha}"),
        ],
        "{calls}"
    );
    assert_eq!(
        std::fs::read_to_string(t.join("conffile-kept"))
            .unwrap()
            .trim(),
        "1",
        "the admin's edit survives the upgrade"
    );
    assert_eq!(
        phase("remove"),
        ["stop gpufeed-host.service", "daemon-reload"],
        "{calls}"
    );
    assert_eq!(
        phase("purge"),
        ["disable gpufeed-host.service", "daemon-reload"],
        "{calls}"
    );
    assert_eq!(
        std::fs::read_to_string(t.join("spool")).unwrap().trim(),
        "gone"
    );
    assert_eq!(
        std::fs::read_to_string(t.join("spool-keep"))
            .unwrap()
            .trim(),
        "kept"
    );
    // Without a running systemd (a chroot, an image build): enabled, nothing started.
    assert_eq!(
        phase("install-without-systemd"),
        ["enable gpufeed-host.service"],
        "{calls}"
    );
}

/// `gpufeed-host certs init` (on the host, where the admin is), the host's bundle installed
/// with the one documented step (`cp -a hosts/NAME/. /etc/gpufeed/`), then the packaged
/// unit's `ExecStart` command line as it stands, in a private mount namespace whose /etc, /usr
/// and /var are overlays (this machine is not changed): the agent reads the bundle as it is
/// and streams to the guest, authenticated as the host. Appended to the command line are only
/// `--root` (no watcher on this machine's devices) and `--metrics-listen` (no fixed port).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certs_bundle_in_etc_gpufeed_runs_with_the_unit_command_line() {
    use gpufeed_testkit::stream::{hub, hub_config, metric, wait_for};
    if !common::require_root("certs_bundle_in_etc_gpufeed_runs_with_the_unit_command_line")
        || !tools_or_skip(&["unshare", "cp", "stat"])
    {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let t = t.path();
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let certs = t.join("certs");
    out(Command::new(env!("CARGO_BIN_EXE_gpufeed-host"))
        .args(["certs", "init", "--out"])
        .arg(&certs)
        .args(["--guest-addr", &addr.to_string()])
        .args(["--host", "pve1", "--host", "a", "--host", "a-key"]));

    let reg = prometheus::Registry::new();
    let mut hc = hub_config(&certs.join("guest"));
    hc.listen = addr;
    let hub = hub::serve(hc, &reg).await.unwrap();

    let unit = std::fs::read_to_string(repo().join("systemd/gpufeed-host.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap();
    assert!(exec.starts_with("/usr/bin/gpufeed-host "), "{exec}");
    let root = t.join("root");
    std::fs::create_dir(&root).unwrap();
    let script = format!(
        r#"set -eu
{overlay}
cp {bin} /usr/bin/gpufeed-host
rm -rf /etc/gpufeed /var/lib/gpufeed
mkdir -p /etc/gpufeed
cp -a {certs}/hosts/pve1/. /etc/gpufeed/
(cd /etc/gpufeed && stat -c '%a %n' host.toml tls/ca.pem tls/host.pem tls/host-key.pem) > {t}/modes
exec {exec} --root {root} --metrics-listen 127.0.0.1:0
"#,
        t = t.display(),
        overlay = overlay_root(t),
        bin = env!("CARGO_BIN_EXE_gpufeed-host"),
        certs = certs.display(),
        root = root.display(),
    );
    let log = t.join("agent.log");
    let mut agent = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let connected = wait_for(std::time::Duration::from_secs(10), || {
        metric(&reg, "gpufeed_stream_connected", &[("host", "pve1")]) == 1.0
    })
    .await;
    let _ = agent.kill();
    let _ = agent.wait();
    hub.shutdown().await;
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(connected, "the agent did not connect as pve1:\n{log}");
    assert_eq!(
        std::fs::read_to_string(t.join("modes")).unwrap(),
        "644 host.toml\n644 tls/ca.pem\n644 tls/host.pem\n600 tls/host-key.pem\n"
    );
    assert!(!log.contains("unknown key"), "{log}");
}
