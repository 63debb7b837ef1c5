//! Running the tools the lab builds with (apt-get, mmdebstrap, mke2fs, cpio): each call's
//! output is kept so that a failure says what the tool said.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::{Error, Result};

/// Runs `command`, returns its stdout; a non-zero exit is an error with its stderr.
pub fn run(command: &mut Command) -> Result<String> {
    let shown = format!("{command:?}");
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(crate::io_err(format!("cannot start {shown}")))?;
    if !out.status.success() {
        let mut output = String::from_utf8_lossy(&out.stderr).into_owned();
        if output.trim().is_empty() {
            output = String::from_utf8_lossy(&out.stdout).into_owned();
        }
        return Err(Error::Command {
            command: shown,
            status: out.status.to_string(),
            output: tail(&output, 40),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sh -c script` in `dir`.
pub fn sh(dir: &Path, script: &str) -> Result<String> {
    run(Command::new("sh").arg("-c").arg(script).current_dir(dir))
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether `program` is on PATH.
pub fn have(program: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// `program` from PATH, else from /sbin or /usr/sbin (a root shell's PATH may lack them).
pub fn sbin(program: &str) -> std::path::PathBuf {
    if have(program) {
        return program.into();
    }
    ["/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(program))
        .find(|p| p.exists())
        .unwrap_or_else(|| program.into())
}
