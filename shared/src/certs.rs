//! `certs init` (in both agents: the admin may be on a host or next to the cluster): creates
//! the deployment's certificates and configuration.
//!
//! ```text
//! certs init --out DIR --guest-addr HOST:PORT [--guest-addr HOST:PORT ...] --host NAME [--host NAME ...]
//! ```
//!
//! A site with several GPU VMs on its hosts (each VM a node with its own guest agent) gives
//! every node's address: one CA, one guest certificate naming them all (every node mounts the
//! same Secret), and each host's `host.toml` lists every guest. A host routes each guest its
//! own VM's events by the VM's SMBIOS UUID, so the list needs no `vmids`.
//!
//! writes
//!
//! | path | what |
//! |---|---|
//! | `DIR/ca/ca.pem`, `DIR/ca/ca-key.pem` | the deployment CA; its key goes nowhere else (keep it offline) |
//! | `DIR/guest/` | the guest's `--tls-dir`: `ca.pem`, `guest.pem`, `guest-key.pem`, `allowed-hosts` |
//! | `DIR/gpufeed-guest-tls.yaml` | the same four files as a Kubernetes Secret, to mount at the `--tls-dir` |
//! | `DIR/hosts/NAME/` | one host's bundle, laid out as its `/etc/gpufeed`: `host.toml`, `tls/ca.pem`, `tls/host.pem`, `tls/host-key.pem` |
//!
//! A bundle is installed with one copy (`cp -a DIR/hosts/NAME/. /etc/gpufeed/`): `host.toml`
//! is the file the packaged unit reads, and names its certificates by their `/etc/gpufeed`
//! paths (the agent's defaults). Keys are mode 0600, everything else 0644; the CA directory is
//! 0700. Each host has a directory of its own, so no two host names share a file.
//!
//! The server certificate names `HOST` (DNS name or IP address); a host certificate names the
//! host (SAN DNS name and CN), which is the identity the hub checks against `allowed-hosts`.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::tls::{self, Deployment, TlsError};

/// The CA's files, apart from everything that is copied anywhere.
pub const CA_DIR: &str = "ca";
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// The guest's `--tls-dir`.
pub const GUEST_DIR: &str = "guest";
pub const SECRET_FILE: &str = "gpufeed-guest-tls.yaml";
/// Host bundles: `hosts/NAME/`.
pub const HOSTS_DIR: &str = "hosts";
/// Inside a bundle (relative to `/etc/gpufeed`).
pub const BUNDLE_CONFIG: &str = "host.toml";
pub const BUNDLE_CA: &str = "tls/ca.pem";
pub const BUNDLE_CERT: &str = "tls/host.pem";
pub const BUNDLE_KEY: &str = "tls/host-key.pem";
/// Where a bundle is installed on its host.
pub const HOST_ETC: &str = "/etc/gpufeed";

#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("--guest-addr {0:?}: expected HOST:PORT")]
    GuestAddr(String),
    #[error("{0} already holds a CA; use --force to replace the whole deployment")]
    Exists(PathBuf),
    #[error("creating {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// `certs ...`
#[derive(Debug, clap::Subcommand)]
pub enum CertsCmd {
    /// Create the CA, the guest server certificate and its Kubernetes Secret manifest, and
    /// one bundle per host (configuration, certificate, key, CA) laid out for /etc/gpufeed.
    Init(CertsInitArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct CertsInitArgs {
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Address the hosts connect to (`HOST:PORT`, the guest's `--quic-listen` as seen from the
    /// hosts); HOST goes into the server certificate. Repeat for every node with a guest agent
    /// (one per GPU VM): the certificate names them all and every host's `host.toml` lists
    /// them.
    #[arg(long = "guest-addr", required = true)]
    pub guest_addr: Vec<String>,
    /// A host allowed to stream (its certificate identity); repeat for several.
    #[arg(long = "host", required = true)]
    pub hosts: Vec<String>,
    /// Namespace of the Secret manifest.
    #[arg(long, default_value = "gpufeed")]
    pub namespace: String,
    /// Name of the Secret.
    #[arg(long, default_value = "gpufeed-guest-tls")]
    pub secret_name: String,
    /// Replace existing files in DIR.
    #[arg(long)]
    pub force: bool,
}

/// Runs a `certs` subcommand; prints the files written.
pub fn run(cmd: CertsCmd) -> Result<(), CertsError> {
    match cmd {
        CertsCmd::Init(a) => {
            for p in init(&a)? {
                println!("{}", p.display());
            }
            Ok(())
        }
    }
}

/// Splits `HOST:PORT` (IPv6 as `[addr]:port`) into the host for the certificate and the port.
pub fn split_guest_addr(addr: &str) -> Result<(String, u16), CertsError> {
    let bad = || CertsError::GuestAddr(addr.to_owned());
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A bundle's `host.toml`: streams to every one of `guest_addrs` with the bundle's files at
/// their `/etc/gpufeed` paths.
pub fn host_toml(host: &str, guest_addrs: &[String]) -> String {
    let etc = |f: &str| toml_str(&format!("{HOST_ETC}/{f}"));
    let mut guests = String::new();
    for addr in guest_addrs {
        let name = split_guest_addr(addr).map(|(h, _)| h).unwrap_or_default();
        guests.push_str(&format!(
            "\n[[stream.guests]]\nname = {}\nendpoint = {}\n",
            toml_str(&name),
            toml_str(addr)
        ));
    }
    format!(
        r#"# gpufeed-host configuration of host {host}, written by `certs init` as part of this host's
# bundle: install the bundle with `cp -a hosts/{host}/. /etc/gpufeed/`; the packaged unit reads
# this file as /etc/gpufeed/host.toml. Every other setting has its default (see
# /usr/share/doc/gpufeed-host/host-agent.md); add keys here to change them.
host_id = {id}

[stream]
ca = {ca}
cert = {cert}
key = {key}
# Events wait here until the guest acknowledges them (memory-only when "").
spool_dir = "/var/lib/gpufeed/spool"

# Every guest of the site. On a Proxmox host each gets the events of its own VM (the one whose
# smbios1: uuid= is the guest's SMBIOS UUID); a guest that is no VM of this host is refused.
# To route a guest by hand instead, give it
# vmids = [100]
# devices = ["0000:01:00.0"]
{guests}"#,
        id = toml_str(host),
        ca = etc(BUNDLE_CA),
        cert = etc(BUNDLE_CERT),
        key = etc(BUNDLE_KEY),
    )
}

/// The Kubernetes Secret manifest holding the guest's `--tls-dir` files.
pub fn secret_yaml(name: &str, namespace: &str, files: &[(&str, &str)]) -> String {
    let mut y = format!(
        "# Mount at the guest's --tls-dir (e.g. /etc/gpufeed/tls). Generated by `certs init`.\n\
         apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\n  \
         labels:\n    app.kubernetes.io/name: gpufeed-guest\ntype: Opaque\nstringData:\n"
    );
    for (k, v) in files {
        y.push_str(&format!("  {k}: |\n"));
        for line in v.lines() {
            y.push_str("    ");
            y.push_str(line);
            y.push('\n');
        }
    }
    y
}

fn mkdir(path: &Path, mode: u32) -> Result<(), CertsError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| CertsError::Dir {
            path: path.to_owned(),
            source,
        })
}

/// Creates everything; returns the files written.
pub fn init(a: &CertsInitArgs) -> Result<Vec<PathBuf>, CertsError> {
    let mut guest_hosts = Vec::new();
    for addr in &a.guest_addr {
        let (h, _) = split_guest_addr(addr)?;
        if guest_hosts.contains(&h) {
            return Err(CertsError::GuestAddr(format!("{addr} (named twice)")));
        }
        guest_hosts.push(h);
    }
    let mut hosts = a.hosts.clone();
    hosts.sort();
    hosts.dedup();
    for h in &hosts {
        // A DNS name: also a safe directory name (no `/`, no `..`).
        tls::check_host_name(h)?;
    }
    let dir = &a.out;
    let ca_dir = dir.join(CA_DIR);
    if !a.force && ca_dir.join(tls::CA_FILE).exists() {
        return Err(CertsError::Exists(dir.clone()));
    }
    mkdir(&ca_dir, 0o700)?;
    let dep = Deployment::generate_for(&guest_hosts, &hosts)?;
    let mut written = Vec::new();
    let mut write = |path: PathBuf, data: &str, secret: bool| -> Result<(), CertsError> {
        tls::write_file(&path, data.as_bytes(), secret)?;
        written.push(path);
        Ok(())
    };
    let ca_pem = dep.ca.cert_pem();
    write(ca_dir.join(tls::CA_FILE), &ca_pem, false)?;
    write(ca_dir.join(CA_KEY_FILE), &dep.ca.key_pem(), true)?;

    let guest_dir = dir.join(GUEST_DIR);
    mkdir(&guest_dir, 0o755)?;
    let mut allowed = String::new();
    for h in &hosts {
        allowed.push_str(h);
        allowed.push('\n');
    }
    let guest_files = [
        (tls::CA_FILE, ca_pem.as_str(), false),
        (tls::GUEST_CERT_FILE, dep.guest.cert_pem.as_str(), false),
        (tls::GUEST_KEY_FILE, dep.guest.key_pem.as_str(), true),
        (tls::ALLOWED_HOSTS_FILE, allowed.as_str(), false),
    ];
    for (f, data, secret) in guest_files {
        write(guest_dir.join(f), data, secret)?;
    }
    let secret = secret_yaml(
        &a.secret_name,
        &a.namespace,
        &guest_files.map(|(f, data, _)| (f, data)),
    );
    write(dir.join(SECRET_FILE), &secret, true)?;

    for (h, issued) in &dep.hosts {
        let bundle = dir.join(HOSTS_DIR).join(h);
        mkdir(&bundle.join("tls"), 0o755)?;
        write(
            bundle.join(BUNDLE_CONFIG),
            &host_toml(h, &a.guest_addr),
            false,
        )?;
        write(bundle.join(BUNDLE_CA), &ca_pem, false)?;
        write(bundle.join(BUNDLE_CERT), &issued.cert_pem, false)?;
        write(bundle.join(BUNDLE_KEY), &issued.key_pem, true)?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_addr_and_toml_strings() {
        assert!(split_guest_addr("nohost").is_err());
        assert!(split_guest_addr(":80").is_err());
        assert!(split_guest_addr("h:99999").is_err());
        assert_eq!(
            split_guest_addr("[::1]:7845").unwrap(),
            ("::1".to_string(), 7845)
        );
        assert_eq!(toml_str("a\"b\\c\n"), r#""a\"b\\c\u000A""#);
    }

    #[test]
    fn a_host_lists_every_guest_of_the_site() {
        let t = host_toml(
            "pve1",
            &["10.0.0.11:7845".to_string(), "[fd00::12]:7845".to_string()],
        );
        #[derive(serde::Deserialize)]
        struct G {
            name: String,
            endpoint: String,
        }
        #[derive(serde::Deserialize)]
        struct S {
            guests: Vec<G>,
        }
        #[derive(serde::Deserialize)]
        struct H {
            host_id: String,
            stream: S,
        }
        let h: H = toml::from_str(&t).unwrap();
        assert_eq!(h.host_id, "pve1");
        let got: Vec<(&str, &str)> = h
            .stream
            .guests
            .iter()
            .map(|g| (g.name.as_str(), g.endpoint.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.11", "10.0.0.11:7845"),
                ("fd00::12", "[fd00::12]:7845")
            ]
        );
    }
}
