//! A scratch apt of the lab's own (sources, lists, status and archives under the cache), so
//! that Debian suites other than the machine's (trixie, trixie-backports) can be asked for
//! packages without touching the machine's own apt configuration.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::Cache;
use crate::{cmd, io_err, Error, Result};

const MIRROR: &str = "http://deb.debian.org/debian";

/// The suites the lab's kernels come from.
pub const SUITES: &[&str] = &["bookworm", "trixie", "trixie-backports"];

pub struct Apt {
    dir: PathBuf,
}

/// One version of a package and the suite that has it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub version: String,
    pub suite: String,
}

impl Apt {
    /// The scratch apt in `cache/apt`; its package lists are fetched when absent, or when
    /// `refresh` asks for it.
    pub fn open(cache: &Cache, refresh: bool) -> Result<Apt> {
        let dir = cache.path("apt");
        for d in ["lists/partial", "archives/partial", "etc"] {
            std::fs::create_dir_all(dir.join(d)).map_err(io_err("create the scratch apt"))?;
        }
        let sources: String = SUITES
            .iter()
            .map(|s| format!("deb {MIRROR} {s} main\n"))
            .collect();
        std::fs::write(dir.join("etc/sources.list"), sources).map_err(io_err("write sources"))?;
        let status = dir.join("etc/status");
        if !status.exists() {
            std::fs::write(&status, "").map_err(io_err("write the apt status"))?;
        }
        let apt = Apt { dir };
        let fetched = std::fs::read_dir(apt.dir.join("lists"))
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().contains("_Packages"))
            })
            .unwrap_or(false);
        if refresh || !fetched {
            eprintln!("lab: fetching the package lists of {}", SUITES.join(", "));
            cmd::run(apt.get().arg("update").arg("-q"))?;
        }
        Ok(apt)
    }

    fn options(&self, c: &mut Command) {
        let d = &self.dir;
        for (k, v) in [
            ("Dir::Etc::sourcelist", d.join("etc/sources.list")),
            ("Dir::Etc::sourceparts", PathBuf::from("-")),
            ("Dir::State::Lists", d.join("lists")),
            ("Dir::State::status", d.join("etc/status")),
            ("Dir::Cache", d.clone()),
        ] {
            c.arg("-o").arg(format!("{k}={}", v.display()));
        }
        // the lists are the lab's own: no lock shared with the machine's apt
        c.args(["-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root"]);
    }

    fn get(&self) -> Command {
        let mut c = Command::new("apt-get");
        self.options(&mut c);
        c
    }

    fn cache_cmd(&self) -> Command {
        let mut c = Command::new("apt-cache");
        self.options(&mut c);
        c
    }

    /// Every version of `package` in the lab's suites.
    pub fn candidates(&self, package: &str) -> Result<Vec<Candidate>> {
        let out = cmd::run(self.cache_cmd().args(["madison", package]))?;
        Ok(parse_madison(&out))
    }

    /// The `Depends` of `package` at `version`, as (name, exact version if pinned with `=`).
    pub fn depends(&self, package: &str, version: &str) -> Result<Vec<(String, Option<String>)>> {
        let out = cmd::run(
            self.cache_cmd()
                .args(["show", "--no-all-versions"])
                .arg(format!("{package}={version}")),
        )?;
        Ok(parse_depends(&out))
    }

    /// Downloads `name=version` of each package into `dir`.
    pub fn download(&self, packages: &[(String, String)], dir: &Path) -> Result<()> {
        let mut c = self.get();
        c.arg("download").arg("-q").current_dir(dir);
        for (n, v) in packages {
            c.arg(format!("{n}={v}"));
        }
        cmd::run(&mut c).map(|_| ())
    }
}

/// `apt-cache madison` lines: `pkg | version | mirror suite/main amd64 Packages`.
fn parse_madison(out: &str) -> Vec<Candidate> {
    out.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split('|').map(str::trim).collect();
            let source = cols.get(2)?;
            let suite = source.split_whitespace().nth(1)?.split('/').next()?;
            Some(Candidate {
                version: cols.get(1)?.to_string(),
                suite: suite.to_string(),
            })
        })
        .collect()
}

/// The `Depends:` field: alternatives are kept only as their first choice.
fn parse_depends(out: &str) -> Vec<(String, Option<String>)> {
    let Some(line) = out.lines().find_map(|l| l.strip_prefix("Depends:")) else {
        return Vec::new();
    };
    line.split(',')
        .filter_map(|dep| {
            let first = dep.split('|').next()?.trim();
            let (name, rest) = first.split_once(' ').unwrap_or((first, ""));
            let pinned = rest
                .trim()
                .strip_prefix("(=")
                .and_then(|v| v.strip_suffix(')'))
                .map(|v| v.trim().to_string());
            Some((name.to_string(), pinned))
        })
        .collect()
}

/// The candidate of `suite`, as `Error::Lab` when the suite has none.
pub fn in_suite(candidates: &[Candidate], package: &str, suite: &str) -> Result<String> {
    candidates
        .iter()
        .find(|c| c.suite == suite)
        .map(|c| c.version.clone())
        .ok_or_else(|| Error::Lab(format!("{suite} has no {package}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_apts_formats() {
        let m = "linux-image-cloud-amd64 | 7.3.4-1~bpo13+1 | http://deb.debian.org/debian trixie-backports/main amd64 Packages\n\
                 linux-image-cloud-amd64 |  6.1.176-1 | http://deb.debian.org/debian bookworm/main amd64 Packages\n";
        let c = parse_madison(m);
        assert_eq!(
            c,
            vec![
                Candidate {
                    version: "7.3.4-1~bpo13+1".into(),
                    suite: "trixie-backports".into()
                },
                Candidate {
                    version: "6.1.176-1".into(),
                    suite: "bookworm".into()
                }
            ]
        );
        assert_eq!(
            in_suite(&c, "linux-image-cloud-amd64", "bookworm").unwrap(),
            "6.1.176-1"
        );
        assert!(in_suite(&c, "x", "sid").is_err());
        let show = "Package: linux-image-7.3.4+deb13-cloud-amd64\nDepends: dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, linux-binary-7.3.4+deb13-cloud-amd64 (= 7.3.4-1~bpo13+1), kmod\n";
        assert_eq!(
            parse_depends(show),
            vec![
                ("dracut".into(), None),
                (
                    "linux-binary-7.3.4+deb13-cloud-amd64".into(),
                    Some("7.3.4-1~bpo13+1".into())
                ),
                ("kmod".into(), None)
            ]
        );
    }
}
