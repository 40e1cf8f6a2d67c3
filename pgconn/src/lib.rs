//! How the relay reaches PostgreSQL: the URL (with libpq's `sslmode`,
//! `sslrootcert`, `sslcert`, `sslkey` and `passfile`, plus `password_file`
//! for a mounted secret), the password (URL, `PGPASSWORD`, `password_file`,
//! `.pgpass`), and TLS with rustls on both the SQL and the replication
//! connections. SCRAM-SHA-256 is negotiated by both drivers.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// libpq's sslmode values (`allow` is treated as `prefer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return Err(format!("sslmode {s:?} is not one of disable, prefer, require, verify-ca, verify-full")),
        })
    }
}

impl std::fmt::Display for SslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// A parsed database URL: everything both drivers need.
#[derive(Clone)]
pub struct Target {
    pub pg: tokio_postgres::Config,
    /// The first host: the one named in messages and in the `.pgpass` lookup.
    pub host: String,
    pub port: u16,
    /// Every host in the URL's order (`postgres://a:5432,b:5432/db`), each
    /// with its port: a connection tries them in turn.
    pub hosts: Vec<(String, u16)>,
    /// `target_session_attrs=read-write` (the default here, unlike libpq's
    /// `any`): only a server that accepts writes, i.e. the primary, is taken.
    pub read_write: bool,
    pub user: String,
    pub dbname: String,
    pub password: Option<String>,
    pub ssl: SslMode,
    pub root_cert: Option<PathBuf>,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// The URL with its password hidden, for messages.
    pub shown: String,
}

impl Target {
    /// `host:port` (every host, comma-separated), for messages that name the server.
    pub fn server(&self) -> String {
        self.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect::<Vec<_>>().join(",")
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("url", &self.shown).field("ssl", &self.ssl).finish_non_exhaustive()
    }
}

/// Query parameters that carry a secret: hidden wherever a URL is shown.
/// (`password_file` and `passfile` name files, not secrets.)
fn is_secret_parameter(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password") && k != "password_file"
}

/// A connection string with every secret hidden, for logs and errors:
/// the URL's password (`user:***@`), every secret-bearing query parameter
/// (`password=***`, `sslpassword=***`), and the same keys in a key=value
/// string (which [`parse`] refuses, but which may still be shown in its
/// refusal).
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return redact_key_value(url) };
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let base = match base.rsplit_once('@') {
        Some((auth, host)) => match auth.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{auth}@{host}"),
        },
        None => base.to_string(),
    };
    let Some(query) = query else { return format!("{scheme}://{base}") };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if is_secret_parameter(k) => format!("{k}=***"),
            _ => pair.to_string(),
        })
        .collect();
    format!("{scheme}://{base}?{}", query.join("&"))
}

/// `host=h password=secret` → `host=h password=***`, quoted values included.
fn redact_key_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let before = rest[..eq].trim_end();
        let key = &before[before.rfind(char::is_whitespace).map(|i| i + 1).unwrap_or(0)..];
        out.push_str(&rest[..=eq]);
        let after = rest[eq + 1..].trim_start();
        out.push_str(&rest[eq + 1..rest.len() - after.len()]);
        let end = if let Some(quoted) = after.strip_prefix('\'') {
            let mut i = 0;
            let b = quoted.as_bytes();
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            (i + 2).min(after.len())
        } else {
            after.find(char::is_whitespace).unwrap_or(after.len())
        };
        if is_secret_parameter(key) {
            out.push_str("***");
        } else {
            out.push_str(&after[..end]);
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Parse a `postgres://` URL with the parameters above. A key=value
/// connection string is refused (with its secrets hidden in the message).
pub fn parse(url: &str) -> Result<Target, String> {
    let shown = redact(url);
    let trimmed = url.trim_start();
    if !(trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://")) {
        return Err(format!(
            "database_url {shown:?} is not a postgres:// URL: key=value connection strings are not supported; \
             write postgres://USER[:PASSWORD]@HOST[:PORT]/DBNAME[?sslmode=...] (percent-encode special characters)"
        ));
    }
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let own = OwnParams::take(query, &shown)?;
    let plain = if own.rest.is_empty() { base.to_string() } else { format!("{base}?{}", own.rest.join("&")) };
    let mut pg = tokio_postgres::Config::from_str(&plain)
        .map_err(|e| format!("database_url {shown} is not a valid PostgreSQL URL: {e}"))?;
    let hosts = hosts_of(&pg);
    let (host, port) = hosts[0].clone();
    // The relay writes (settlement, the spool): take the primary unless the
    // URL says otherwise, so a list of servers follows a failover.
    if !query.contains("target_session_attrs=") {
        pg.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    }
    let read_write = pg.get_target_session_attrs() == tokio_postgres::config::TargetSessionAttrs::ReadWrite;
    let user = pg
        .get_user()
        .map(str::to_owned)
        .or_else(|| std::env::var("PGUSER").ok())
        .ok_or_else(|| format!("database_url {shown} has no user name"))?;
    let dbname = pg.get_dbname().map(str::to_owned).unwrap_or_else(|| user.clone());
    let password = match pg.get_password() {
        Some(p) => Some(String::from_utf8_lossy(p).into_owned()),
        None => own.password(&host, port, &dbname, &user)?,
    };
    pg.user(&user);
    pg.dbname(&dbname);
    if let Some(p) = &password {
        pg.password(p.as_bytes());
    }
    let ssl = own.ssl;
    pg.ssl_mode(match ssl {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    let (root_cert, client_cert) = (own.root_cert, own.client_cert);
    Ok(Target { pg, host, port, hosts, read_write, user, dbname, password, ssl, root_cert, client_cert, shown })
}

/// The URL parameters libpq knows and tokio-postgres does not (TLS files,
/// password files), with their environment defaults; `rest` are the others,
/// for tokio-postgres.
struct OwnParams<'q> {
    ssl: SslMode,
    root_cert: Option<PathBuf>,
    client_cert: Option<(PathBuf, PathBuf)>,
    passfile: Option<PathBuf>,
    password_file: Option<PathBuf>,
    rest: Vec<&'q str>,
}

impl<'q> OwnParams<'q> {
    fn take(query: &'q str, shown: &str) -> Result<Self, String> {
        let (mut ssl, mut root_cert, mut cert, mut key, mut passfile, mut password_file) =
            (None, None, None, None, None, None);
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v =
                urlencoding::decode(v).map_err(|e| format!("database_url {shown}: parameter {k}: {e}"))?.into_owned();
            match k {
                "sslmode" => ssl = Some(v.parse::<SslMode>().map_err(|e| format!("database_url {shown}: {e}"))?),
                "sslrootcert" => root_cert = Some(PathBuf::from(v)),
                "sslcert" => cert = Some(PathBuf::from(v)),
                "sslkey" => key = Some(PathBuf::from(v)),
                "passfile" => passfile = Some(PathBuf::from(v)),
                "password_file" => password_file = Some(PathBuf::from(v)),
                "sslpassword" => {
                    return Err(format!(
                        "database_url {shown}: sslpassword (a passphrase for an encrypted sslkey) is not supported: give sslkey as an unencrypted PEM file readable only by the relay"
                    ))
                }
                _ => rest.push(pair),
            }
        }
        let client_cert = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err(format!("database_url {shown}: sslcert and sslkey go together")),
        };
        Ok(OwnParams {
            ssl: ssl.or_else(|| std::env::var("PGSSLMODE").ok().and_then(|s| s.parse().ok())).unwrap_or_default(),
            root_cert: root_cert.or_else(|| std::env::var_os("PGSSLROOTCERT").map(PathBuf::from)),
            client_cert,
            passfile,
            password_file,
            rest,
        })
    }

    /// A password the URL does not give: `PGPASSWORD`, the `password_file`,
    /// or the entry of the pgpass file (`passfile`, `PGPASSFILE`,
    /// `~/.pgpass`) for the first host.
    fn password(&self, host: &str, port: u16, dbname: &str, user: &str) -> Result<Option<String>, String> {
        if let Ok(p) = std::env::var("PGPASSWORD") {
            return Ok(Some(p));
        }
        if let Some(f) = &self.password_file {
            let text = std::fs::read_to_string(f).map_err(|e| format!("password_file {}: {e}", f.display()))?;
            return Ok(Some(text.trim_end_matches(['\n', '\r']).to_string()));
        }
        let file = self
            .passfile
            .clone()
            .or_else(|| std::env::var_os("PGPASSFILE").map(PathBuf::from))
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pgpass")));
        Ok(file.and_then(|f| pgpass_lookup(&f, host, port, dbname, user)))
    }
}

/// Every host of the URL with its port (a single port applies to all;
/// none: 5432), `localhost` when it names none.
fn hosts_of(pg: &tokio_postgres::Config) -> Vec<(String, u16)> {
    let names: Vec<String> = pg
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    let names = if names.is_empty() { vec!["localhost".to_string()] } else { names };
    let ports = pg.get_ports();
    names.into_iter().enumerate().map(|(i, h)| (h, ports.get(i).or(ports.first()).copied().unwrap_or(5432))).collect()
}

/// The password for host/port/db/user in a `.pgpass` file (`*` matches any).
pub fn pgpass_lookup(file: &Path, host: &str, port: u16, db: &str, user: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    let port = port.to_string();
    for line in text.lines() {
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_pgpass(line);
        if fields.len() != 5 {
            continue;
        }
        let m = |f: &str, v: &str| f == "*" || f == v;
        if m(&fields[0], host) && m(&fields[1], &port) && m(&fields[2], db) && m(&fields[3], user) {
            return Some(fields[4].clone());
        }
    }
    None
}

/// `:` separates fields; `\:` and `\\` are literal.
fn split_pgpass(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    out.last_mut().unwrap().push(n);
                }
            }
            ':' if out.len() < 5 => out.push(String::new()),
            _ => out.last_mut().unwrap().push(c),
        }
    }
    out
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("sslrootcert/sslcert {}: {e}", path.display()))?
        .collect();
    let certs = certs.map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(certs)
}

/// The rustls client configuration for a target's sslmode.
pub fn tls_config(t: &Target) -> Result<ClientConfig, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let verify = matches!(t.ssl, SslMode::VerifyCa | SslMode::VerifyFull)
        || (t.ssl == SslMode::Require && t.root_cert.is_some());
    let builder = if verify {
        let mut roots = RootCertStore::empty();
        match &t.root_cert {
            Some(path) => {
                for c in read_certs(path)? {
                    roots.add(c).map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                for c in found.certs {
                    let _ = roots.add(c);
                }
                if roots.is_empty() {
                    return Err(format!("sslmode={} needs sslrootcert: no system CA certificates were found", t.ssl));
                }
            }
        }
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .build()
            .map_err(|e| e.to_string())?;
        let check_name = t.ssl == SslMode::VerifyFull;
        builder.dangerous().with_custom_certificate_verifier(Arc::new(Verifier {
            webpki: Some(webpki),
            check_name,
            provider,
        }))
    } else {
        // prefer / require without a CA: encrypted, not authenticated (libpq's behaviour).
        builder.dangerous().with_custom_certificate_verifier(Arc::new(Verifier {
            webpki: None,
            check_name: false,
            provider,
        }))
    };
    match &t.client_cert {
        Some((cert, key)) => {
            use rustls::pki_types::pem::PemObject;
            let chain = read_certs(cert)?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("sslkey {}: {e}", key.display()))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("sslcert/sslkey: {e}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// Certificate checks by sslmode: none (prefer/require), chain only
/// (verify-ca), chain and host name (verify-full).
#[derive(Debug)]
struct Verifier {
    webpki: Option<Arc<WebPkiServerVerifier>>,
    check_name: bool,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(webpki) = &self.webpki else { return Ok(ServerCertVerified::assertion()) };
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Ok(v) => Ok(v),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName | rustls::CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            Err(e) => Err(e),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

pub use tokio_postgres_rustls::MakeRustlsConnect;

/// The connector for tokio-postgres.
pub fn connector(t: &Target) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(t)?))
}

/// Say which check failed, in the words an operator needs.
pub fn explain(t: &Target, e: &tokio_postgres::Error) -> String {
    let mut text = e.to_string();
    let mut src: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(s) = src {
        text.push_str(": ");
        text.push_str(&s.to_string());
        src = s.source();
    }
    let lower = text.to_ascii_lowercase();
    let hint = if lower.contains("unknownissuer") || lower.contains("unknown issuer") || lower.contains("badsignature")
    {
        format!(
            " — TLS: the server's certificate is not signed by a CA in {} (sslmode={})",
            t.root_cert.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "the system store".into()),
            t.ssl
        )
    } else if lower.contains("notvalidforname") || lower.contains("not valid for name") {
        format!(" — TLS: the server's certificate does not name host {:?} (sslmode=verify-full checks the host name; use the name in the certificate, or verify-ca)", t.host)
    } else if lower.contains("expired") {
        " — TLS: the server's certificate has expired".to_string()
    } else if text.contains("server does not support TLS") {
        format!(
            " — TLS: sslmode={} but the server does not offer TLS (set ssl=on on the server, or lower sslmode)",
            t.ssl
        )
    } else if text.contains("password authentication failed") || text.contains("28P01") {
        format!(" — authentication: wrong password for user {:?}", t.user)
    } else if text.contains("does not allow writes") {
        format!(
            " — {} is a standby or read-only (target_session_attrs=read-write): the relay writes to the outbox and needs the primary; give the primary's address, or every server (postgres://USER@primary,standby/DB) and the writable one is taken",
            if t.hosts.len() > 1 { format!("every host of {}", t.server()) } else { t.server() }
        )
    } else if text.contains("password missing") {
        format!(" — authentication: the server asks user {:?} for a password; give it in the URL, PGPASSWORD, password_file or .pgpass", t.user)
    } else {
        String::new()
    };
    format!("{text}{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_and_sslmodes() {
        let t =
            parse("postgres://app:pw@db.example:6432/shop?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x")
                .unwrap();
        assert_eq!((t.host.as_str(), t.port, t.user.as_str(), t.dbname.as_str()), ("db.example", 6432, "app", "shop"));
        assert_eq!(t.ssl, SslMode::VerifyFull);
        assert_eq!(t.root_cert.as_deref(), Some(Path::new("/ca.pem")));
        assert_eq!(t.password.as_deref(), Some("pw"));
        assert!(!format!("{t:?}").contains("pw@"), "{t:?}");
        assert!(parse("postgres://a@h/d?sslmode=maybe").unwrap_err().contains("not one of"));
        assert!(parse("postgres://a@h/d?sslcert=/c.pem").unwrap_err().contains("go together"));
        assert!(parse("postgres://a:secret@h/d?bogus_option=1").unwrap_err().contains("***"));
        assert_eq!(parse("postgres://a@h/d?password=pw%21").unwrap().password.as_deref(), Some("pw!"));
        assert_eq!(parse("postgres://a@h/d?sslmode=allow").unwrap().ssl, SslMode::Prefer);
    }

    #[test]
    fn several_hosts_and_the_primary_by_default() {
        let t = parse("postgres://app@a.example:5433,b.example:5434/shop").unwrap();
        assert_eq!(t.hosts, vec![("a.example".to_string(), 5433), ("b.example".to_string(), 5434)]);
        assert_eq!(t.server(), "a.example:5433,b.example:5434");
        assert!(t.read_write);
        assert_eq!(t.pg.get_target_session_attrs(), tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        let t = parse("postgres://app@a,b/shop").unwrap();
        assert_eq!(t.hosts, vec![("a".to_string(), 5432), ("b".to_string(), 5432)]);
        // Said otherwise in the URL: kept.
        assert!(!parse("postgres://app@a/shop?target_session_attrs=any").unwrap().read_write);
        assert!(parse("postgres://app@a/shop?target_session_attrs=read-write").unwrap().read_write);
    }

    #[test]
    fn secrets_are_hidden_however_given() {
        let cases = [
            ("postgres://u:hunter2@h:5432/d", "postgres://u:***@h:5432/d"),
            ("postgres://u@h/d?password=hunter2", "postgres://u@h/d?password=***"),
            (
                "postgres://u@h/d?sslmode=require&sslpassword=hunter2&application_name=x",
                "postgres://u@h/d?sslmode=require&sslpassword=***&application_name=x",
            ),
            ("postgres://u@h/d?PASSWORD=hunter2", "postgres://u@h/d?PASSWORD=***"),
            ("postgres://u@h/d?password_file=/run/secret", "postgres://u@h/d?password_file=/run/secret"),
            ("host=h user=u password=hunter2 dbname=d", "host=h user=u password=*** dbname=d"),
            ("host=h password = 'hun ter2' dbname=d", "host=h password = *** dbname=d"),
        ];
        for (given, shown) in cases {
            assert_eq!(redact(given), shown, "{given}");
            assert!(!redact(given).contains("hunter2") && !redact(given).contains("ter2"));
        }
        let e = parse("host=127.0.0.1 user=app password=hunter2 dbname=app").unwrap_err();
        assert!(e.contains("key=value connection strings are not supported"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let t = parse("postgres://u@h/d?password=hunter2").unwrap();
        assert!(!t.shown.contains("hunter2") && !format!("{t:?}").contains("hunter2"));
        assert_eq!(t.password.as_deref(), Some("hunter2"));
    }

    #[test]
    fn pgpass_lines() {
        let dir = std::env::temp_dir().join(format!("pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("pgpass");
        std::fs::write(&f, "# c\nh:5432:d:u:first\n*:*:*:u:any\\:colon\nx:1:y:z\n").unwrap();
        assert_eq!(pgpass_lookup(&f, "h", 5432, "d", "u").as_deref(), Some("first"));
        assert_eq!(pgpass_lookup(&f, "other", 1, "d", "u").as_deref(), Some("any:colon"));
        assert_eq!(pgpass_lookup(&f, "h", 5432, "d", "nobody"), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tls_configs_build_for_every_mode() {
        for mode in ["disable", "prefer", "require"] {
            let t = parse(&format!("postgres://a@h/d?sslmode={mode}")).unwrap();
            tls_config(&t).unwrap();
        }
        let t = parse("postgres://a@h/d?sslmode=verify-full&sslrootcert=/nonexistent.pem").unwrap();
        assert!(tls_config(&t).unwrap_err().contains("/nonexistent.pem"));
    }
}
