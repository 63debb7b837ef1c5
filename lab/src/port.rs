//! The line channel between a test and its VM: a virtio-serial port (`lab.0`) that QEMU
//! connects to a unix socket. In the VM, `report KEY VALUE...` (lab/guest/lab.sh) writes one
//! line; a test waits for a key and reads its value. Lines the other way are commands a
//! scenario reads with `lab_command`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// One line from the VM: its key (the first word) and the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub key: String,
    pub value: String,
    /// when it arrived, since the port was connected
    pub at: Duration,
}

impl Line {
    pub fn parse(text: &str, at: Duration) -> Line {
        let text = text.trim_end_matches(['\r', '\n']);
        let (key, value) = text.split_once(' ').unwrap_or((text, ""));
        Line {
            key: key.to_string(),
            value: value.to_string(),
            at,
        }
    }
}

pub struct Port {
    rx: Receiver<Line>,
    tx: UnixStream,
    /// every line received so far, in order
    pub seen: Vec<Line>,
    /// lines received while waiting for another key, not yet taken
    pending: Vec<Line>,
}

/// Why a wait ended without its line.
#[derive(Debug)]
pub enum Missing {
    Timeout,
    /// the VM closed the port (it shut down or died)
    Closed,
    /// the scenario reported `error ...`
    Failed(String),
}

impl Port {
    /// Connects to QEMU's socket at `path`, waiting up to `within` for it to appear.
    pub fn connect(path: &Path, within: Duration) -> std::io::Result<Port> {
        let start = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if start.elapsed() > within => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel();
        let connected = Instant::now();
        // GPUFEED_LAB_TRACE=1: every line as it arrives, with its time, on stderr (where a
        // scenario spends its minutes under TCG)
        let trace = std::env::var("GPUFEED_LAB_TRACE").as_deref() == Ok("1");
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                let at = connected.elapsed();
                if trace {
                    eprintln!("lab: {:7.1} s  {line}", at.as_secs_f64());
                }
                if tx.send(Line::parse(&line, at)).is_err() {
                    break;
                }
            }
        });
        Ok(Port {
            rx,
            tx: stream,
            seen: Vec::new(),
            pending: Vec::new(),
        })
    }

    /// Waits for the next line with `key` (one already seen and not yet taken counts), up
    /// to `timeout`. An `error` line ends the wait at once.
    pub fn expect(&mut self, key: &str, timeout: Duration) -> Result<String, Missing> {
        if let Some(i) = self.pending.iter().position(|l| l.key == key) {
            return Ok(self.pending.remove(i).value);
        }
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.key == "error" {
                        return Err(Missing::Failed(line.value));
                    }
                    if line.key == key {
                        return Ok(line.value);
                    }
                    self.pending.push(line);
                }
                Err(RecvTimeoutError::Timeout) => return Err(Missing::Timeout),
                Err(RecvTimeoutError::Disconnected) => return Err(Missing::Closed),
            }
        }
    }

    /// The values of every line with `key` received so far.
    pub fn all(&self, key: &str) -> Vec<String> {
        self.seen
            .iter()
            .filter(|l| l.key == key)
            .map(|l| l.value.clone())
            .collect()
    }

    /// Sends one command line to the scenario.
    pub fn send(&mut self, line: &str) -> std::io::Result<()> {
        self.tx.write_all(line.as_bytes())?;
        self.tx.write_all(b"\n")?;
        self.tx.flush()
    }
}
