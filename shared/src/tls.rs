//! Mutual TLS for the host → guest stream: a deployment CA (rcgen), the guest's server
//! certificate, one client certificate per host, and the rustls configurations of both ends.
//!
//! * The guest ([`server_config`]) requires a client certificate that chains to the deployment
//!   CA **and** names an allowed host ([`AllowedHostsVerifier`], wrapping rustls'
//!   `WebPkiClientVerifier`). A host's identity is the DNS name in its certificate's SAN (also its
//!   CN); [`identity_of`] recovers it after the handshake.
//! * The host ([`client_config`]) trusts only the deployment CA.
//! * Both offer only ALPN [`ALPN`] and TLS 1.3 (QUIC).
//! * [`FileStamps`] tells when the PEM files on disk changed, so both agents can reload them.
//!
//! Files written by [`Deployment::write_guest_dir`]: `ca.pem`, `guest.pem`, `guest-key.pem`,
//! `allowed-hosts` (one host name per line); for each host `host-NAME.pem`,
//! `host-NAME.key` (see [`Deployment::write_host_files`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, RootCertStore,
    SignatureScheme,
};

pub use crate::proto::ALPN;

/// File names inside the guest's `--tls-dir`.
pub const CA_FILE: &str = "ca.pem";
pub const GUEST_CERT_FILE: &str = "guest.pem";
pub const GUEST_KEY_FILE: &str = "guest-key.pem";
pub const ALLOWED_HOSTS_FILE: &str = "allowed-hosts";

/// `host-NAME.pem` / `host-NAME.key`. Distinct suffixes: with `host-NAME-key.pem`, host
/// `a-key`'s certificate would be host `a`'s key file.
pub fn host_cert_file(name: &str) -> String {
    format!("host-{name}.pem")
}
pub fn host_key_file(name: &str) -> String {
    format!("host-{name}.key")
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: no PEM {kind} found")]
    NoPem { what: String, kind: &'static str },
    #[error("{what}: bad PEM: {detail}")]
    BadPem { what: String, detail: String },
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid host name {0:?}: must be a DNS name (letters, digits, '-', '.')")]
    BadHostName(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Parses all certificates of a PEM blob.
pub fn parse_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadPem {
            what: what.into(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what: what.into(),
            kind: "certificate",
        });
    }
    Ok(certs)
}

/// Parses the first private key of a PEM blob.
pub fn parse_key(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoPem {
            what: what.into(),
            kind: "private key",
        },
        e => TlsError::BadPem {
            what: what.into(),
            detail: e.to_string(),
        },
    })
}

fn roots(ca_pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in parse_certs(ca_pem, "CA")? {
        roots.add(c)?;
    }
    Ok(roots)
}

/// Reads a file, naming it in the error.
pub fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Io {
        path: path.to_owned(),
        source,
    })
}

/// A host name usable as certificate identity (a DNS name).
pub fn check_host_name(name: &str) -> Result<(), TlsError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && !name.starts_with(['-', '.'])
        && ServerName::try_from(name).is_ok_and(|n| matches!(n, ServerName::DnsName(_)));
    if ok {
        Ok(())
    } else {
        Err(TlsError::BadHostName(name.into()))
    }
}

/// The first of `allowed` that the certificate is valid for (SAN match), if any.
pub fn identity_of<'a>(cert: &CertificateDer<'_>, allowed: &'a [String]) -> Option<&'a str> {
    let parsed = ParsedCertificate::try_from(cert).ok()?;
    allowed.iter().map(String::as_str).find(|name| {
        ServerName::try_from(*name)
            .is_ok_and(|sn| rustls::client::verify_server_name(&parsed, &sn).is_ok())
    })
}

/// Error text used when a verified certificate names no allowed host (matched by
/// [`classify_handshake_error`]).
pub const UNLISTED_HOST: &str = "client certificate names no allowed host";

struct Unlisted;
// rustls prints certificate errors with `Debug`: make that the clear text as well.
impl std::fmt::Debug for Unlisted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(UNLISTED_HOST)
    }
}
impl std::fmt::Display for Unlisted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(UNLISTED_HOST)
    }
}
impl std::error::Error for Unlisted {}

/// Client certificate verifier of the guest: chain to the deployment CA (delegated to
/// `WebPkiClientVerifier`), then the certificate must name one of `allowed`.
#[derive(Debug)]
pub struct AllowedHostsVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    allowed: Vec<String>,
}

impl AllowedHostsVerifier {
    pub fn new(ca_pem: &[u8], allowed: Vec<String>) -> Result<Self, TlsError> {
        let inner =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca_pem)?), provider())
                .build()?;
        Ok(AllowedHostsVerifier { inner, allowed })
    }

    pub fn allowed(&self) -> &[String] {
        &self.allowed
    }
}

impl ClientCertVerifier for AllowedHostsVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        true
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        match identity_of(end_entity, &self.allowed) {
            Some(_) => Ok(ClientCertVerified::assertion()),
            None => Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(Unlisted)),
            ))),
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The guest's TLS configuration: TLS 1.3, ALPN `gpufeed/1`, client certificates required and
/// checked by [`AllowedHostsVerifier`].
pub fn server_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
    allowed_hosts: Vec<String>,
) -> Result<rustls::ServerConfig, TlsError> {
    let verifier = Arc::new(AllowedHostsVerifier::new(ca_pem, allowed_hosts)?);
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            parse_certs(cert_pem, "server certificate")?,
            parse_key(key_pem, "server key")?,
        )?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// The host's TLS configuration: the deployment CA as the only root, the host's client
/// certificate, ALPN `gpufeed/1`.
pub fn client_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<rustls::ClientConfig, TlsError> {
    client_config_with(ca_pem, Some((cert_pem, key_pem)), vec![ALPN.to_vec()])
}

/// [`client_config`] with an optional identity and explicit ALPN list (tests use this to
/// present no certificate or a wrong ALPN).
pub fn client_config_with(
    ca_pem: &[u8],
    identity: Option<(&[u8], &[u8])>,
    alpn: Vec<Vec<u8>>,
) -> Result<rustls::ClientConfig, TlsError> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca_pem)?);
    let mut cfg = match identity {
        Some((c, k)) => b.with_client_auth_cert(
            parse_certs(c, "client certificate")?,
            parse_key(k, "client key")?,
        )?,
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn;
    Ok(cfg)
}

/// Maps the text of a failed server-side handshake to a
/// `gpufeed_stream_frames_rejected_total{reason}` value: `unknown_ca`, `expired`,
/// `unlisted_host`, `no_cert`, `alpn`, `bad_cert` or `tls`.
pub fn classify_handshake_error(text: &str) -> &'static str {
    let t = text.to_ascii_lowercase();
    if t.contains(&UNLISTED_HOST.to_ascii_lowercase()) {
        "unlisted_host"
    } else if t.contains("unknownissuer") || t.contains("unknown issuer") || t.contains("unknownca")
    {
        "unknown_ca"
    } else if t.contains("expired") || t.contains("notvalidyet") {
        "expired"
    } else if t.contains("no certificates") || t.contains("certificaterequired") {
        "no_cert"
    } else if t.contains("application protocol")
        || t.contains("noapplicationprotocol")
        || t.contains("known protocol")
    {
        "alpn"
    } else if t.contains("certificate") {
        "bad_cert"
    } else {
        "tls"
    }
}

/// Modification stamps of a set of files; [`changed`](Self::changed) says whether any of them
/// changed (mtime, size, inode, appearance) since the last call. Follows symlinks, so a
/// Kubernetes Secret volume's `..data` swap is seen.
#[derive(Debug)]
pub struct FileStamps {
    paths: Vec<PathBuf>,
    stamps: Vec<Option<(SystemTime, u64, u64)>>,
}

impl FileStamps {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let stamps = paths.iter().map(|p| stamp(p)).collect();
        FileStamps { paths, stamps }
    }

    pub fn changed(&mut self) -> bool {
        let now: Vec<_> = self.paths.iter().map(|p| stamp(p)).collect();
        let changed = now != self.stamps;
        self.stamps = now;
        changed
    }
}

fn stamp(p: &Path) -> Option<(SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// The files of the guest's `--tls-dir`.
#[derive(Debug, Clone)]
pub struct GuestTlsDir {
    pub dir: PathBuf,
}

impl GuestTlsDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        GuestTlsDir { dir: dir.into() }
    }

    pub fn paths(&self) -> Vec<PathBuf> {
        [CA_FILE, GUEST_CERT_FILE, GUEST_KEY_FILE, ALLOWED_HOSTS_FILE]
            .iter()
            .map(|f| self.dir.join(f))
            .collect()
    }

    /// Allowed host names: non-empty lines of `allowed-hosts`, `#` starts a comment.
    pub fn allowed_hosts(&self) -> Result<Vec<String>, TlsError> {
        let text = read(&self.dir.join(ALLOWED_HOSTS_FILE))?;
        let mut out = Vec::new();
        for line in String::from_utf8_lossy(&text).lines() {
            let name = line.split('#').next().unwrap_or("").trim();
            if name.is_empty() {
                continue;
            }
            check_host_name(name)?;
            out.push(name.to_owned());
        }
        Ok(out)
    }

    /// Loads the server configuration and the allowed host list.
    pub fn load(&self) -> Result<(rustls::ServerConfig, Vec<String>), TlsError> {
        let allowed = self.allowed_hosts()?;
        let cfg = server_config(
            &read(&self.dir.join(CA_FILE))?,
            &read(&self.dir.join(GUEST_CERT_FILE))?,
            &read(&self.dir.join(GUEST_KEY_FILE))?,
            allowed.clone(),
        )?;
        Ok((cfg, allowed))
    }
}

/// Current year (UTC), for certificate validity.
fn this_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    1970 + (secs / 31_556_952) as i32
}

/// A deployment CA held in memory.
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

/// A certificate and its key, PEM encoded.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Validity of an issued certificate: `(not_before, not_after)` as (year, month, day), UTC.
pub type Validity = ((i32, u8, u8), (i32, u8, u8));

impl Ca {
    /// A fresh CA (ECDSA P-256), valid from last year for 20 years.
    pub fn new(common_name: &str) -> Result<Self, TlsError> {
        Self::with_key(common_name, rcgen::KeyPair::generate()?)
    }

    /// The CA whose key is `key_pem` (a `ca-key.pem` that `certs init` wrote): what it issues
    /// verifies against that deployment's `ca.pem`, which names the same subject and key.
    pub fn from_key_pem(common_name: &str, key_pem: &str) -> Result<Self, TlsError> {
        Self::with_key(common_name, rcgen::KeyPair::from_pem(key_pem)?)
    }

    fn with_key(common_name: &str, key: rcgen::KeyPair) -> Result<Self, TlsError> {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        p.distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + 20, 1, 1);
        let cert = p.self_signed(&key)?;
        Ok(Ca { cert, key })
    }

    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Issues a leaf certificate for `names` (DNS names or IP addresses; the first is also the
    /// CN). `client`: client-auth usage, else server-auth. `validity`: default from last year
    /// for 10 years.
    pub fn issue(
        &self,
        names: &[String],
        client: bool,
        validity: Option<Validity>,
    ) -> Result<Issued, TlsError> {
        let key = rcgen::KeyPair::generate()?;
        let mut p = rcgen::CertificateParams::new(names.to_vec())?;
        if let Some(first) = names.first() {
            p.distinguished_name.push(rcgen::DnType::CommonName, first);
        }
        p.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        let y = this_year();
        let ((y0, m0, d0), (y1, m1, d1)) = validity.unwrap_or(((y - 1, 1, 1), (y + 10, 1, 1)));
        p.not_before = rcgen::date_time_ymd(y0, m0, d0);
        p.not_after = rcgen::date_time_ymd(y1, m1, d1);
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A client certificate for host `name`.
    pub fn issue_host(&self, name: &str) -> Result<Issued, TlsError> {
        check_host_name(name)?;
        self.issue(&[name.to_owned()], true, None)
    }
}

/// The subject of a deployment's CA.
pub const CA_NAME: &str = "gpufeed deployment CA";

/// Everything `gpufeed-guest certs init` creates.
pub struct Deployment {
    pub ca: Ca,
    /// Host part of the guest address, as the certificate's SAN and the hosts' server name.
    pub guest_name: String,
    pub guest: Issued,
    pub hosts: Vec<(String, Issued)>,
}

impl Deployment {
    /// Creates the CA, the guest server certificate for `guest_name` (DNS name or IP) and one
    /// client certificate per host.
    pub fn generate(guest_name: &str, hosts: &[String]) -> Result<Self, TlsError> {
        Self::generate_for(&[guest_name.to_owned()], hosts)
    }

    /// [`generate`](Self::generate) for a site with several guests (one per GPU VM): one
    /// server certificate names them all (`guest_names`, the first is `guest_name` and the
    /// CN), so that every guest's `--tls-dir` is the same Secret.
    pub fn generate_for(guest_names: &[String], hosts: &[String]) -> Result<Self, TlsError> {
        let ca = Ca::new(CA_NAME)?;
        let guest = ca.issue(guest_names, false, None)?;
        let guest_name = guest_names.first().cloned().unwrap_or_default();
        let hosts = hosts
            .iter()
            .map(|h| Ok((h.clone(), ca.issue_host(h)?)))
            .collect::<Result<Vec<_>, TlsError>>()?;
        Ok(Deployment {
            ca,
            guest_name,
            guest,
            hosts,
        })
    }

    /// Writes the guest's `--tls-dir` content into `dir` (keys mode 0600).
    pub fn write_guest_dir(&self, dir: &Path) -> Result<(), TlsError> {
        write_file(&dir.join(CA_FILE), self.ca.cert_pem().as_bytes(), false)?;
        write_file(
            &dir.join(GUEST_CERT_FILE),
            self.guest.cert_pem.as_bytes(),
            false,
        )?;
        write_file(
            &dir.join(GUEST_KEY_FILE),
            self.guest.key_pem.as_bytes(),
            true,
        )?;
        let mut allowed = String::new();
        for (h, _) in &self.hosts {
            allowed.push_str(h);
            allowed.push('\n');
        }
        write_file(&dir.join(ALLOWED_HOSTS_FILE), allowed.as_bytes(), false)
    }

    /// Writes `host-NAME.pem` and `host-NAME.key` for every host into `dir`.
    pub fn write_host_files(&self, dir: &Path) -> Result<(), TlsError> {
        for (h, i) in &self.hosts {
            write_file(&dir.join(host_cert_file(h)), i.cert_pem.as_bytes(), false)?;
            write_file(&dir.join(host_key_file(h)), i.key_pem.as_bytes(), true)?;
        }
        Ok(())
    }
}

/// Writes a file atomically (temp file + rename); `secret` files get mode 0600. The temporary
/// file is new (`O_EXCL`, never a link or file planted at its name: it is not followed nor
/// reused) and named after the whole file name, so two files never share one.
pub fn write_file(path: &Path, data: &[u8], secret: bool) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| TlsError::Io {
        path: path.to_owned(),
        source,
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut attempt = 0u32;
    let (tmp, mut f) = loop {
        let tmp = path.with_file_name(format!(".{name}.{}.{attempt}.tmp", std::process::id()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(if secret { 0o600 } else { 0o644 })
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => {
                attempt += 1;
            }
            Err(e) => return Err(io(e)),
        }
    };
    let written = f.write_all(data).and_then(|()| f.sync_all());
    drop(f);
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_and_verifier() {
        let d = Deployment::generate("127.0.0.1", &["pve1".into(), "pve2".into()]).unwrap();
        let allowed = vec!["pve1".to_string()];
        let v = AllowedHostsVerifier::new(d.ca.cert_pem().as_bytes(), allowed.clone()).unwrap();
        let now = UnixTime::now();
        let c1 = parse_certs(d.hosts[0].1.cert_pem.as_bytes(), "c").unwrap();
        let c2 = parse_certs(d.hosts[1].1.cert_pem.as_bytes(), "c").unwrap();
        assert_eq!(identity_of(&c1[0], &allowed), Some("pve1"));
        assert_eq!(identity_of(&c2[0], &allowed), None);
        v.verify_client_cert(&c1[0], &[], now).unwrap();
        let e = v.verify_client_cert(&c2[0], &[], now).unwrap_err();
        assert_eq!(classify_handshake_error(&e.to_string()), "unlisted_host");

        let other = Ca::new("other").unwrap().issue_host("pve1").unwrap();
        let c3 = parse_certs(other.cert_pem.as_bytes(), "c").unwrap();
        let e = v.verify_client_cert(&c3[0], &[], now).unwrap_err();
        assert_eq!(
            classify_handshake_error(&e.to_string()),
            "unknown_ca",
            "{e}"
        );

        let y = this_year();
        let old =
            d.ca.issue(&["pve1".into()], true, Some(((y - 3, 1, 1), (y - 2, 1, 1))))
                .unwrap();
        let c4 = parse_certs(old.cert_pem.as_bytes(), "c").unwrap();
        let e = v.verify_client_cert(&c4[0], &[], now).unwrap_err();
        assert_eq!(classify_handshake_error(&e.to_string()), "expired", "{e}");
    }

    #[test]
    fn configs_build_and_files_roundtrip() {
        let dir = std::env::temp_dir().join(format!("gpufeed-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = Deployment::generate("guest.example", &["pve1".into()]).unwrap();
        d.write_guest_dir(&dir).unwrap();
        d.write_host_files(&dir).unwrap();
        let g = GuestTlsDir::new(&dir);
        let (cfg, allowed) = g.load().unwrap();
        assert_eq!(allowed, vec!["pve1".to_string()]);
        assert_eq!(cfg.alpn_protocols, vec![b"gpufeed/1".to_vec()]);
        let c = client_config(
            &read(&dir.join(CA_FILE)).unwrap(),
            &read(&dir.join(host_cert_file("pve1"))).unwrap(),
            &read(&dir.join(host_key_file("pve1"))).unwrap(),
        )
        .unwrap();
        assert_eq!(c.alpn_protocols, vec![b"gpufeed/1".to_vec()]);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(GUEST_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        let mut stamps = FileStamps::new(g.paths());
        assert!(!stamps.changed());
        std::fs::write(dir.join(ALLOWED_HOSTS_FILE), "pve1\n# comment\npve9 # x\n").unwrap();
        assert!(stamps.changed());
        assert!(!stamps.changed());
        assert_eq!(g.allowed_hosts().unwrap(), vec!["pve1", "pve9"]);
        std::fs::write(dir.join(ALLOWED_HOSTS_FILE), "bad name\n").unwrap();
        assert!(matches!(g.allowed_hosts(), Err(TlsError::BadHostName(_))));
        std::fs::write(dir.join(GUEST_KEY_FILE), "junk").unwrap();
        std::fs::write(dir.join(ALLOWED_HOSTS_FILE), "pve1\n").unwrap();
        assert!(matches!(g.load(), Err(TlsError::NoPem { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn classify_texts_seen_from_quinn() {
        for (text, reason) in [
            ("the cryptographic handshake failed: error 48: invalid peer certificate: UnknownIssuer", "unknown_ca"),
            ("the cryptographic handshake failed: error 116: peer sent no certificates", "no_cert"),
            ("error 45: invalid peer certificate: certificate expired: verification time 1 (UNIX), but certificate is not valid after 0", "expired"),
            ("error 120: peer doesn't support any known protocol", "alpn"),
            ("timed out", "tls"),
        ] {
            assert_eq!(classify_handshake_error(text), reason, "{text}");
        }
    }

    #[test]
    fn host_file_names_never_collide() {
        for (a, b) in [("a", "a-key"), ("a", "a.key"), ("a.pem", "a")] {
            let files = [
                host_cert_file(a),
                host_key_file(a),
                host_cert_file(b),
                host_key_file(b),
            ];
            for (i, f) in files.iter().enumerate() {
                assert!(!files[..i].contains(f), "{a} and {b} share {f}");
            }
        }
    }

    #[test]
    fn write_file_does_not_follow_a_planted_link() {
        let dir = std::env::temp_dir().join(format!("gpufeed-tls-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        // Links at the names a temporary file could have had.
        std::os::unix::fs::symlink(&victim, dir.join("k.tmp")).unwrap();
        std::os::unix::fs::symlink(
            &victim,
            dir.join(format!(".k.pem.{}.0.tmp", std::process::id())),
        )
        .unwrap();
        write_file(&dir.join("k.pem"), b"secret", true).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(
            std::fs::read_to_string(dir.join("k.pem")).unwrap(),
            "secret"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn host_names() {
        check_host_name("pve1").unwrap();
        check_host_name("pve-1.lab.example").unwrap();
        for bad in ["", "a b", "-x", "a/b", "127.0.0.1"] {
            assert!(check_host_name(bad).is_err(), "{bad}");
        }
    }
}
