//! A QMP client for the test's own monitor socket (a VM can have several; the host agent
//! watches another, laid out as Proxmox lays out `/run/qemu-server/<vmid>.qmp`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{Error, Result};

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// asynchronous events received so far (`STOP`, `RESUME`, `DEVICE_DELETED`, ...)
    pub events: Vec<Value>,
}

impl Qmp {
    /// Connects (waiting up to `within` for the socket) and leaves capabilities negotiation.
    pub fn connect(path: &Path, within: Duration) -> Result<Qmp> {
        let start = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if start.elapsed() > within => {
                    return Err(crate::io_err(format!("QMP {}", path.display()))(e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(crate::io_err("QMP timeout"))?;
        let writer = stream.try_clone().map_err(crate::io_err("QMP socket"))?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
            events: Vec::new(),
        };
        let greeting = q.read()?;
        if greeting.get("QMP").is_none() {
            return Err(Error::Lab(format!("not a QMP greeting: {greeting}")));
        }
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(crate::io_err("read QMP"))?;
        if n == 0 {
            return Err(Error::Lab("QMP closed".into()));
        }
        serde_json::from_str(&line).map_err(|e| Error::Lab(format!("QMP sent {line:?}: {e}")))
    }

    /// Runs `command` with `arguments`; returns its `return` value, keeps events that arrive
    /// meanwhile, and turns an `error` answer into an error.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        let msg = json!({"execute": command, "arguments": arguments});
        writeln!(self.writer, "{msg}").map_err(crate::io_err("write QMP"))?;
        loop {
            let v = self.read()?;
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            return Err(Error::Lab(format!("QMP {command}: {v}")));
        }
    }

    /// A human monitor command (`pcie_aer_inject_error ...`); returns what it printed.
    pub fn hmp(&mut self, command_line: &str) -> Result<String> {
        let r = self.execute(
            "human-monitor-command",
            json!({"command-line": command_line}),
        )?;
        Ok(r.as_str().unwrap_or_default().to_string())
    }
}
