//! The unit passes `systemd-analyze verify`; the .deb builds with the binary, the unit and the
//! default config; the packaged binary accepts the packaged config (`--check-config`).

use std::path::Path;
use std::process::Command;

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

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

#[test]
fn deb_contents_unit_verify_and_check_config() {
    if !tools_or_skip(&["dpkg-deb", "systemd-analyze"]) {
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = tempfile::tempdir().unwrap();
    let r = Command::new(repo.join("systemd/build-deb.sh"))
        .args(["--binary", env!("CARGO_BIN_EXE_gpufeed-host"), "--out"])
        .arg(out.path())
        .env("DEB_COMPRESSOR", "none")
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let deb = String::from_utf8(r.stdout).unwrap().trim().to_string();
    assert!(
        deb.ends_with("_amd64.deb") || deb.ends_with(".deb"),
        "{deb}"
    );

    let list = Command::new("dpkg-deb")
        .args(["-c", &deb])
        .output()
        .unwrap();
    let list = String::from_utf8(list.stdout).unwrap();
    let mut files: Vec<&str> = list
        .lines()
        .filter(|l| !l.starts_with('d'))
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    files.sort();
    let mut want = vec![
        "./etc/gpufeed/host.toml",
        "./lib/systemd/system/gpufeed-host.service",
        "./usr/bin/gpufeed-host",
    ];
    if repo.join("docs/host-agent.md").exists() {
        want.push("./usr/share/doc/gpufeed-host/host-agent.md");
    }
    want.sort();
    assert_eq!(files, want, "{list}");
    assert!(list.lines().any(|l| l.starts_with("-rwxr-xr-x root/root") && l.ends_with("./usr/bin/gpufeed-host")), "{list}");
    let info = Command::new("dpkg-deb")
        .args(["-f", &deb, "Package", "Depends"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&info.stdout),
        "Package: gpufeed-host\nDepends: libc6, systemd\n"
    );
    let conff = Command::new("dpkg-deb")
        .args(["--ctrl-tarfile", &deb])
        .output()
        .unwrap();
    assert!(conff.status.success());

    let x = out.path().join("x");
    assert!(Command::new("dpkg-deb")
        .args(["-x", &deb])
        .arg(&x)
        .status()
        .unwrap()
        .success());
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
        out.path().join("bad.toml"),
        "[bridge]\nsample_interval_ms = 5000\n",
    )
    .unwrap();
    let b = Command::new(&bin)
        .args(["run", "--check-config", "--config"])
        .arg(out.path().join("bad.toml"))
        .output()
        .unwrap();
    assert!(!b.status.success());
    assert!(String::from_utf8_lossy(&b.stderr)
        .contains("key `bridge.sample_interval_ms`: must be between 100 and 1000, got 5000"));

    // systemd-analyze verify on the packaged unit; ExecStart points at the packaged binary
    // because /usr/bin/gpufeed-host is not installed on the test machine.
    let unit = std::fs::read_to_string(x.join("lib/systemd/system/gpufeed-host.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/gpufeed-host run --config /etc/gpufeed/host.toml"));
    let unit_path = out.path().join("gpufeed-host.service");
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
