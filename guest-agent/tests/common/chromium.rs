//! Headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) rendering a page the
//! agent serves: its DOM after the page's scripts ran, and screenshots. Each run gets an empty
//! profile directory and nothing that would reach the network on its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct Chromium {
    bin: PathBuf,
}

/// Flags for a browser that only loads the page it is given.
const FLAGS: [&str; 9] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
];

impl Chromium {
    /// The browser; `None` (the caller skips) only outside CI: with `CI` set it must be there.
    pub fn find() -> Option<Chromium> {
        let found = ["chromium", "chromium-browser"].into_iter().find_map(|c| {
            let out = Command::new("sh")
                .args(["-c", &format!("command -v {c}")])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        });
        if found.is_none() {
            assert!(
                std::env::var("CI").is_err(),
                "chromium is not installed (scripts/setup.sh installs it)"
            );
            eprintln!("skipping the page check: no chromium");
        }
        found.map(|bin| Chromium { bin })
    }

    fn run(&self, url: &str, width: u32, height: u32, extra: &[String]) -> std::process::Output {
        let profile = tempfile::tempdir().unwrap();
        // the page fetches its data, then draws: 5 s of virtual time lets its scripts finish
        let out = Command::new("timeout")
            .arg("120")
            .arg(&self.bin)
            .args(FLAGS)
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("--virtual-time-budget=5000")
            .arg(format!("--window-size={width},{height}"))
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "chromium on {url}: {:?}", out.status);
        out
    }

    /// The page's DOM once its scripts ran, in a window `width` CSS pixels wide.
    pub fn dom(&self, url: &str, width: u32) -> String {
        let out = self.run(url, width, 1200, &["--dump-dom".into()]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A screenshot of the page at `width` × `height` into `out` (PNG).
    pub fn screenshot(&self, url: &str, width: u32, height: u32, out: &Path) {
        let _ = std::fs::remove_file(out);
        self.run(
            url,
            width,
            height,
            &[format!("--screenshot={}", out.display())],
        );
        let len = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
        assert!(len > 1000, "screenshot {} ({len} bytes)", out.display());
    }
}

/// The elements named `tag` in `html` whose class attribute contains `class`, as their
/// attributes (name, value), in document order. Enough for the page's own SVG, which the
/// browser serialises with double-quoted attributes.
pub fn elements(html: &str, tag: &str, class: &str) -> Vec<Vec<(String, String)>> {
    let open = format!("<{tag} ");
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find(&open) {
        let start = &rest[i + open.len()..];
        let end = start.find('>').unwrap_or(start.len());
        let attrs = parse_attrs(&start[..end]);
        let has = attrs
            .iter()
            .any(|(k, v)| k == "class" && v.split_whitespace().any(|c| c == class));
        if has {
            out.push(attrs);
        }
        rest = &start[end..];
    }
    out
}

fn parse_attrs(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let Some(close) = after.find('"') else { break };
        let value = after[..close]
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        out.push((name, value));
        rest = after[close + 1..].trim_start();
    }
    out
}

/// The value of attribute `name`.
pub fn attr<'a>(attrs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}
