//! The test binary's log output, captured for assertions on what was logged.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// Log output of the whole test binary (a global subscriber: scoped ones miss events through
/// tracing's per-callsite interest cache when tests run in parallel).
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

/// Installs the capturing subscriber (DEBUG and up, no colours) once per test binary.
pub fn captured() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let l = logs.clone();
        tracing_subscriber::fmt()
            .with_writer(move || l.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .init();
        logs
    })
}

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Lines that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_string)
            .collect()
    }

    /// Lines logged at `level` by `module` (e.g. `gpufeed_guest::pods::watch`).
    pub fn lines(&self, level: &str, module: &str) -> Vec<String> {
        self.lines_with(&format!(" {level} {module}"))
    }

    /// Lines logged inside the span `span`.
    pub fn lines_in(&self, span: &str) -> Vec<String> {
        self.lines_with(&format!(" {span}:"))
    }

    /// WARN lines logged inside the span `span`.
    pub fn warn_lines(&self, span: &str) -> Vec<String> {
        self.lines_in(span)
            .into_iter()
            .filter(|l| l.contains(" WARN "))
            .collect()
    }
}
