//! The scripts that need root (`scripts/lib/as-root.sh`, used by setup.sh, quickstart.sh,
//! test.sh and build-image.sh): as root they run as they are (a root shell on a fresh server or
//! in a container has no sudo); as another user they run again through sudo with the same
//! arguments; with neither they say how to run them and fail. Run for real: as root, and as
//! `nobody` (setpriv), with a `sudo` on PATH that records how it was called, and with none.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lib() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/lib/as-root.sh")
}

fn write_exec(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs `script ARGS` as `uid` (0: as root) with `PATH=path`.
fn run(script: &Path, uid: u32, path: &str, args: &[&str]) -> Output {
    let mut c = if uid == 0 {
        Command::new(script)
    } else {
        // by its path: PATH below is the script's, not this test's
        let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("setpriv (util-linux)");
        let mut c = Command::new(setpriv);
        c.args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
        ])
        .arg(script);
        c
    };
    c.args(args)
        .env_clear()
        .env("PATH", path)
        .env("GPUFEED_DEMO_SETTING", "kept")
        .current_dir("/")
        .output()
        .unwrap()
}

#[test]
fn scripts_run_as_root_through_sudo_or_say_how() {
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but not running as root"
        );
        eprintln!("skipping: needs root to run the script as another user");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // a script as the real ones are: it sources the library, then asks for root
    let script = dir.path().join("needs-root.sh");
    let lib_copy = dir.path().join("as-root.sh");
    std::fs::copy(lib(), &lib_copy).unwrap();
    write_exec(
        &script,
        &format!(
            "#!/usr/bin/env bash\nset -euo pipefail\n. {}\ncd /tmp\nas_root \"$@\"\necho \"ran as $(id -u) with $*\"\n",
            lib_copy.display()
        ),
    );
    // a sudo that says how it was called (and the setting it was asked to keep)
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    write_exec(&bin.join("sudo"), "#!/bin/sh\necho \"sudo $*\"\n");
    // the tools the scripts use and no sudo, whether or not this machine has one
    let tools = dir.path().join("tools");
    std::fs::create_dir(&tools).unwrap();
    for t in ["bash", "env", "id", "readlink", "basename", "sed", "paste"] {
        let found = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(t))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{t} on this machine"));
        std::os::unix::fs::symlink(found, tools.join(t)).unwrap();
    }
    let system = tools.to_str().unwrap().to_string();
    let system = system.as_str();

    // root: runs, no sudo asked
    let out = run(&script, 0, system, &["--demo", "a b"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ran as 0 with --demo a b\n"
    );

    // another user, sudo on PATH: the same script by its absolute path, same arguments
    let with_sudo = format!("{}:{system}", bin.display());
    let out = run(&script, 65534, &with_sudo, &["--demo", "a b"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        said,
        format!(
            "sudo --preserve-env=GPUFEED_DEMO_SETTING -- {} --demo a b\n",
            script.display()
        )
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("running it through sudo"));

    // another user, no sudo: says how, fails, runs nothing
    let out = run(&script, 65534, system, &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs root, and this machine has no sudo"),
        "{err}"
    );
}

#[test]
fn the_scripts_that_need_root_use_the_library() {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts");
    for s in ["setup.sh", "quickstart.sh", "test.sh", "build-image.sh"] {
        let text = std::fs::read_to_string(scripts.join(s)).unwrap();
        assert!(
            text.contains(". \"$(dirname \"$0\")/lib/as-root.sh\"") && text.contains("as_root "),
            "{s} asks for root through scripts/lib/as-root.sh"
        );
        assert!(!text.contains("id -u"), "{s} checks root itself");
    }
}
