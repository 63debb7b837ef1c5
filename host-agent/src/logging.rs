//! Logging: `tracing` everywhere (the `log` records of dependencies are turned into tracing
//! events), one [`EnvFilter`] built from `RUST_LOG` (per-module directives, every level), and
//! one of two outputs:
//!
//! * under systemd (stderr is the `JOURNAL_STREAM`), [`JournalLayer`]: each event becomes a
//!   `log::Record` whose key-values are the event's fields, sent by systemd-journal-logger,
//!   which writes them as journal fields (`watcher = "aer"` → `WATCHER=aer`, queryable with
//!   `journalctl WATCHER=aer`);
//! * elsewhere, text lines on stderr with the fields as `key=value`.

use std::fmt::Write as _;
use systemd_journal_logger::JournalLog;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_log::NormalizeEvent;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Dependencies whose log lines are kept only from `error` up unless `RUST_LOG` names them:
/// netlink-packet-route warns on every link dump about attributes newer than itself
/// (`IFLA_INET6_CONF` on current kernels), which is harmless.
const QUIET_DEPS: &[&str] = &["netlink_packet_route"];

/// The filter directives: `RUST_LOG` (or `default`), plus `<dep>=error` for the quiet dependencies
/// that it does not name.
pub fn log_filter(rust_log: Option<&str>, default: &str) -> String {
    let mut f = rust_log
        .filter(|s| !s.trim().is_empty())
        .unwrap_or(default)
        .to_string();
    for dep in QUIET_DEPS {
        if !f.contains(dep) {
            f.push_str(&format!(",{dep}=error"));
        }
    }
    f
}

/// The filter for `RUST_LOG` with `default` as the level when it is unset. Directives that do
/// not parse are skipped (with a note on stderr) rather than turning logging off.
pub fn env_filter(rust_log: Option<&str>, default: &str) -> EnvFilter {
    let directives = log_filter(rust_log, default);
    EnvFilter::builder().parse(&directives).unwrap_or_else(|e| {
        eprintln!("gpufeed-host: RUST_LOG {directives:?}: {e}; keeping the valid directives");
        EnvFilter::builder().parse_lossy(&directives)
    })
}

/// Install the global subscriber. `default` is the level when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter = env_filter(std::env::var("RUST_LOG").ok().as_deref(), default);
    if systemd_journal_logger::connected_to_journal() {
        if let Ok(j) = JournalLog::new() {
            let j = j.with_syslog_identifier("gpufeed-host".into());
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(JournalLayer(j))
                .try_init();
            return;
        }
    }
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Sends every event to the journal through systemd-journal-logger, fields as key-values.
pub struct JournalLayer(pub JournalLog);

impl<S: Subscriber> Layer<S> for JournalLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        with_record(event, |r| {
            let _ = self.0.journal_send(r);
        });
    }
}

/// An event's message and fields (a `log` record's `log.*` bookkeeping fields left out: they
/// are the record's target, module, file and line, which the journal gets as its own fields).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fields {
    pub message: String,
    pub pairs: Vec<(&'static str, String)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let mut s = String::new();
        let _ = write!(s, "{value:?}");
        self.put(field, s);
    }
}

impl Fields {
    fn put(&mut self, field: &Field, value: String) {
        match field.name() {
            "message" => self.message = value,
            n if n.starts_with("log.") => {}
            n => self.pairs.push((n, value)),
        }
    }
}

/// Build the `log::Record` for an event (fields as key-values) and hand it to `f`.
pub fn with_record(event: &Event<'_>, f: impl FnOnce(&log::Record)) {
    let mut fields = Fields::default();
    event.record(&mut fields);
    let normalized = event.normalized_metadata();
    let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
    let kvs: Vec<(&str, &str)> = fields.pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let level = match *meta.level() {
        Level::ERROR => log::Level::Error,
        Level::WARN => log::Level::Warn,
        Level::INFO => log::Level::Info,
        Level::DEBUG => log::Level::Debug,
        Level::TRACE => log::Level::Trace,
    };
    f(&log::Record::builder()
        .args(format_args!("{}", fields.message))
        .level(level)
        .target(meta.target())
        .module_path(meta.module_path())
        .file(meta.file())
        .line(meta.line())
        .key_values(&kvs)
        .build());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn default_filter_quiets_netlink_packet_route() {
        assert_eq!(log_filter(None, "info"), "info,netlink_packet_route=error");
        assert_eq!(
            log_filter(Some(""), "warn"),
            "warn,netlink_packet_route=error"
        );
        assert_eq!(
            log_filter(Some("debug"), "info"),
            "debug,netlink_packet_route=error"
        );
        // An explicit directive for it wins.
        assert_eq!(
            log_filter(Some("info,netlink_packet_route=warn"), "info"),
            "info,netlink_packet_route=warn"
        );
    }

    /// What a layer saw of a record: level, target, message, key-values.
    type Seen1 = (log::Level, String, String, Vec<(String, String)>);
    type Seen = Arc<Mutex<Vec<Seen1>>>;

    struct Capture(Seen);

    impl<S: Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            with_record(event, |r| {
                struct Kv<'a>(&'a mut Vec<(String, String)>);
                impl<'k> log::kv::VisitSource<'k> for Kv<'_> {
                    fn visit_pair(
                        &mut self,
                        k: log::kv::Key<'k>,
                        v: log::kv::Value<'k>,
                    ) -> Result<(), log::kv::Error> {
                        self.0.push((k.to_string(), v.to_string()));
                        Ok(())
                    }
                }
                let mut kvs = Vec::new();
                let _ = r.key_values().visit(&mut Kv(&mut kvs));
                self.0.lock().unwrap().push((
                    r.level(),
                    r.target().to_string(),
                    r.args().to_string(),
                    kvs,
                ));
            });
        }
    }

    fn capture(rust_log: Option<&str>, f: impl FnOnce()) -> Vec<Seen1> {
        let seen = Seen::default();
        let sub = tracing_subscriber::registry()
            .with(env_filter(rust_log, "info"))
            .with(Capture(seen.clone()));
        tracing::subscriber::with_default(sub, f);
        let v = seen.lock().unwrap().clone();
        v
    }

    #[test]
    fn filter_drops_netlink_packet_route_warnings() {
        let seen = capture(None, || {
            tracing::warn!(target: "netlink_packet_route::link::buffer_tool", "unknown NLA");
            tracing::error!(target: "netlink_packet_route::link", "bad");
            tracing::warn!(target: "gpufeed_host::watch::bridge", "slow");
        });
        let targets: Vec<&str> = seen.iter().map(|s| s.1.as_str()).collect();
        assert_eq!(
            targets,
            ["netlink_packet_route::link", "gpufeed_host::watch::bridge"]
        );
    }

    /// Tracing fields become the record's key-values (journal fields); the message stays the
    /// message; a per-module directive opens that module's trace level only.
    #[test]
    fn fields_become_key_values_and_directives_are_per_module() {
        let seen = capture(Some("info,gpufeed_host::agent=trace"), || {
            tracing::warn!(target: "gpufeed_host::agent", watcher = "aer", code = 3, "aer watcher off");
            tracing::trace!(target: "gpufeed_host::agent", "fine detail");
            tracing::debug!(target: "gpufeed_host::events", kind = "kmsg", "event");
        });
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!(seen[0].0, log::Level::Warn);
        assert_eq!(seen[0].2, "aer watcher off");
        assert_eq!(
            seen[0].3,
            [
                ("watcher".to_string(), "aer".to_string()),
                ("code".to_string(), "3".to_string())
            ]
        );
        assert_eq!(
            (seen[1].0, seen[1].2.as_str()),
            (log::Level::Trace, "fine detail")
        );
    }
}
