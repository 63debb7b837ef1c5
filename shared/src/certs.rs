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
//! ```text
//! certs add-guest --out DIR --guest-addr HOST:PORT    a new node: the guest certificate issued
//!                                                     again naming every guest, every host.toml
//!                                                     listing it
//! certs add-host --out DIR --host NAME                a new host: its bundle, and allowed-hosts
//! ```
//!
//! Both use the CA in `DIR/ca` (its key is needed: run them where it is kept), so the certificates
//! already installed stay valid: after `add-guest` apply the Secret again and copy each host's
//! `host.toml`; after `add-host` apply the Secret and install the new bundle. `DIR/guest-addrs`
//! lists the site's guests.
//!
//! writes
//!
//! | path | what |
//! |---|---|
//! | `DIR/ca/ca.pem`, `DIR/ca/ca-key.pem` | the deployment CA; its key goes nowhere else (keep it offline) |
//! | `DIR/guest/` | the guest's `--tls-dir`: `ca.pem`, `guest.pem`, `guest-key.pem`, `allowed-hosts` |
//! | `DIR/gpufeed-guest-tls.yaml` | the same four files as a Kubernetes Secret, to mount at the `--tls-dir` |
//! | `DIR/hosts/NAME/` | one host's bundle, laid out as its `/etc/gpufeed`: `host.toml`, `tls/ca.pem`, `tls/host.pem`, `tls/host-key.pem` |
//! | `DIR/guest-addrs` | the site's guest addresses, one a line (what `add-guest` and `add-host` start from) |
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
    #[error("{0}: {1} (is this a directory `certs init` wrote?)")]
    Site(PathBuf, &'static str),
}

/// `certs ...`
#[derive(Debug, clap::Subcommand)]
pub enum CertsCmd {
    /// Create the CA, the guest server certificate and its Kubernetes Secret manifest, and
    /// one bundle per host (configuration, certificate, key, CA) laid out for /etc/gpufeed.
    Init(CertsInitArgs),
    /// Add a guest (a node, one per GPU VM) to the site `init` made in DIR: the guest
    /// certificate is issued again naming every guest, and every host's host.toml lists it.
    AddGuest(CertsAddGuestArgs),
    /// Add a host to the site `init` made in DIR: its bundle (listing every guest), and the
    /// guests' allowed-hosts naming it.
    AddHost(CertsAddHostArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct CertsAddGuestArgs {
    /// The site's directory (what `certs init --out` wrote).
    #[arg(long)]
    pub out: PathBuf,
    /// The new guest's address (`HOST:PORT`, its `--quic-listen` as seen from the hosts).
    #[arg(long)]
    pub guest_addr: String,
    /// Namespace of the Secret manifest.
    #[arg(long, default_value = "gpufeed")]
    pub namespace: String,
    /// Name of the Secret.
    #[arg(long, default_value = "gpufeed-guest-tls")]
    pub secret_name: String,
}

#[derive(Debug, Clone, clap::Args)]
pub struct CertsAddHostArgs {
    /// The site's directory (what `certs init --out` wrote).
    #[arg(long)]
    pub out: PathBuf,
    /// The new host (its certificate identity).
    #[arg(long)]
    pub host: String,
    /// Namespace of the Secret manifest.
    #[arg(long, default_value = "gpufeed")]
    pub namespace: String,
    /// Name of the Secret.
    #[arg(long, default_value = "gpufeed-guest-tls")]
    pub secret_name: String,
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
        CertsCmd::Init(a) => print(init(&a)?),
        CertsCmd::AddGuest(a) => print(add_guest(&a)?),
        CertsCmd::AddHost(a) => print(add_host(&a)?),
    }
}

fn print(written: Vec<PathBuf>) -> Result<(), CertsError> {
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
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
    let guest_hosts = guest_names(&a.guest_addr)?;
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
    let mut w = Writer::default();
    let ca_pem = dep.ca.cert_pem();
    w.write(ca_dir.join(tls::CA_FILE), &ca_pem, false)?;
    w.write(ca_dir.join(CA_KEY_FILE), &dep.ca.key_pem(), true)?;
    let site = Site {
        dir: dir.clone(),
        ca_pem,
        guest_addrs: a.guest_addr.clone(),
        hosts: hosts.clone(),
        namespace: a.namespace.clone(),
        secret_name: a.secret_name.clone(),
    };
    site.write_guest(&mut w, &dep.guest)?;
    for (h, issued) in &dep.hosts {
        site.write_bundle(&mut w, h, Some(issued))?;
    }
    Ok(w.written)
}

/// The host part of every guest address, each once.
fn guest_names(addrs: &[String]) -> Result<Vec<String>, CertsError> {
    let mut names = Vec::new();
    for addr in addrs {
        let (h, _) = split_guest_addr(addr)?;
        if names.contains(&h) {
            return Err(CertsError::GuestAddr(format!("{addr} (named twice)")));
        }
        names.push(h);
    }
    Ok(names)
}

/// Writes files and remembers which.
#[derive(Default)]
struct Writer {
    written: Vec<PathBuf>,
}

impl Writer {
    fn write(&mut self, path: PathBuf, data: &str, secret: bool) -> Result<(), CertsError> {
        tls::write_file(&path, data.as_bytes(), secret)?;
        self.written.push(path);
        Ok(())
    }
}

/// What a site's directory says: its CA, its guests (`DIR/guest-addrs`, one address a line,
/// written by `init` and the `add-*` commands) and its hosts (`allowed-hosts`).
struct Site {
    dir: PathBuf,
    ca_pem: String,
    guest_addrs: Vec<String>,
    hosts: Vec<String>,
    namespace: String,
    secret_name: String,
}

/// The list of a site's guest addresses, beside the CA directory.
pub const GUEST_ADDRS_FILE: &str = "guest-addrs";

impl Site {
    /// Reads the site `certs init` wrote into `dir`.
    fn open(dir: &Path, namespace: &str, secret_name: &str) -> Result<(Site, tls::Ca), CertsError> {
        let read = |p: PathBuf| -> Result<String, CertsError> {
            String::from_utf8(tls::read(&p)?).map_err(|_| CertsError::Site(p, "not UTF-8"))
        };
        let ca_pem = read(dir.join(CA_DIR).join(tls::CA_FILE))?;
        let ca = tls::Ca::from_key_pem(tls::CA_NAME, &read(dir.join(CA_DIR).join(CA_KEY_FILE))?)?;
        let lines = |t: String| -> Vec<String> {
            t.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let guest_addrs = lines(read(dir.join(GUEST_ADDRS_FILE))?);
        let hosts = lines(read(dir.join(GUEST_DIR).join(tls::ALLOWED_HOSTS_FILE))?);
        Ok((
            Site {
                dir: dir.to_owned(),
                ca_pem,
                guest_addrs,
                hosts,
                namespace: namespace.to_owned(),
                secret_name: secret_name.to_owned(),
            },
            ca,
        ))
    }

    /// The guest's `--tls-dir`, its Secret and the list of guest addresses.
    fn write_guest(&self, w: &mut Writer, guest: &tls::Issued) -> Result<(), CertsError> {
        let guest_dir = self.dir.join(GUEST_DIR);
        mkdir(&guest_dir, 0o755)?;
        let mut allowed = String::new();
        for h in &self.hosts {
            allowed.push_str(h);
            allowed.push('\n');
        }
        let guest_files = [
            (tls::CA_FILE, self.ca_pem.as_str(), false),
            (tls::GUEST_CERT_FILE, guest.cert_pem.as_str(), false),
            (tls::GUEST_KEY_FILE, guest.key_pem.as_str(), true),
            (tls::ALLOWED_HOSTS_FILE, allowed.as_str(), false),
        ];
        for (f, data, secret) in guest_files {
            w.write(guest_dir.join(f), data, secret)?;
        }
        let secret = secret_yaml(
            &self.secret_name,
            &self.namespace,
            &guest_files.map(|(f, data, _)| (f, data)),
        );
        w.write(self.dir.join(SECRET_FILE), &secret, true)?;
        let mut addrs = self.guest_addrs.join("\n");
        addrs.push('\n');
        w.write(self.dir.join(GUEST_ADDRS_FILE), &addrs, false)
    }

    /// Host `h`'s bundle: its `host.toml` listing every guest, and, with `issued`, its
    /// certificate, key and the CA (without, those stay as they are).
    fn write_bundle(
        &self,
        w: &mut Writer,
        h: &str,
        issued: Option<&tls::Issued>,
    ) -> Result<(), CertsError> {
        let bundle = self.dir.join(HOSTS_DIR).join(h);
        mkdir(&bundle.join("tls"), 0o755)?;
        w.write(
            bundle.join(BUNDLE_CONFIG),
            &host_toml(h, &self.guest_addrs),
            false,
        )?;
        if let Some(issued) = issued {
            w.write(bundle.join(BUNDLE_CA), &self.ca_pem, false)?;
            w.write(bundle.join(BUNDLE_CERT), &issued.cert_pem, false)?;
            w.write(bundle.join(BUNDLE_KEY), &issued.key_pem, true)?;
        }
        Ok(())
    }
}

/// `certs add-guest`: a new node of the site. The guest certificate is issued again naming
/// every guest (same CA: the hosts' certificates and CA stay valid), the guest directory and
/// Secret are rewritten, and every host's `host.toml` lists the new guest.
pub fn add_guest(a: &CertsAddGuestArgs) -> Result<Vec<PathBuf>, CertsError> {
    let (mut site, ca) = Site::open(&a.out, &a.namespace, &a.secret_name)?;
    site.guest_addrs.push(a.guest_addr.clone());
    let names = guest_names(&site.guest_addrs)?;
    let guest = ca.issue(&names, false, None)?;
    let mut w = Writer::default();
    site.write_guest(&mut w, &guest)?;
    for h in &site.hosts {
        site.write_bundle(&mut w, h, None)?;
    }
    Ok(w.written)
}

/// `certs add-host`: a new host of the site, with a bundle listing every guest; the guests'
/// `allowed-hosts` (and Secret) name it. The guest certificate stays as it is.
pub fn add_host(a: &CertsAddHostArgs) -> Result<Vec<PathBuf>, CertsError> {
    tls::check_host_name(&a.host)?;
    let (mut site, ca) = Site::open(&a.out, &a.namespace, &a.secret_name)?;
    if site.hosts.contains(&a.host) {
        return Err(CertsError::Site(
            a.out.join(GUEST_DIR).join(tls::ALLOWED_HOSTS_FILE),
            "already names this host",
        ));
    }
    site.hosts.push(a.host.clone());
    site.hosts.sort();
    let issued = ca.issue_host(&a.host)?;
    let guest = tls::Issued {
        cert_pem: String::from_utf8(tls::read(
            &a.out.join(GUEST_DIR).join(tls::GUEST_CERT_FILE),
        )?)
        .unwrap_or_default(),
        key_pem: String::from_utf8(tls::read(&a.out.join(GUEST_DIR).join(tls::GUEST_KEY_FILE))?)
            .unwrap_or_default(),
    };
    let mut w = Writer::default();
    site.write_guest(&mut w, &guest)?;
    site.write_bundle(&mut w, &a.host, Some(&issued))?;
    Ok(w.written)
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
