//! Shell commands a test runs: `sh` must succeed (its failure is the test's, with the
//! command's output), `sh_quiet` may fail (cleanup paths, which run after a failure too).

use std::process::{Command, Stdio};

/// Runs `cmd` with `sh -c` and returns its standard output; panics with both outputs when it
/// fails.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .expect("running sh");
    if !out.status.success() {
        panic!(
            "`{cmd}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd` with `sh -c`, ignoring its output and whether it failed.
pub fn sh_quiet(cmd: &str) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Whether `tool` is on the PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_returns_stdout() {
        assert_eq!(sh("echo one; echo two >&2"), "one\n");
    }

    #[test]
    #[should_panic(expected = "`exit 3` failed")]
    fn sh_fails_loudly() {
        sh("exit 3");
    }

    #[test]
    fn have_finds_sh_and_not_nonsense() {
        assert!(have("sh"));
        assert!(!have("no-such-tool-gpufeed"));
    }
}
