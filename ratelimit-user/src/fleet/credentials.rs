//! The files `[fleet]` names beyond the config: the store's passwords and the TLS material,
//! read and checked (at start, and by `ratelimit check-config`).

use std::path::Path;

use anyhow::{Context as _, bail};

use super::trust;
use crate::config;

/// The store's password from `path` (one line): refused if the file is missing, empty, or
/// readable by every user (mode `o+r`).
pub fn read_password(path: &Path) -> anyhow::Result<String> {
    read_password_of(path, "fleet.password_file")
}

/// A password from `path` (one line), the key `field` naming it: refused as
/// [`read_password`] refuses.
pub(super) fn read_password_of(path: &Path, field: &str) -> anyhow::Result<String> {
    let text = read_private(path, field)?;
    let pw = text.trim_end_matches(['\n', '\r']).to_string();
    if pw.is_empty() {
        bail!("{field} {} is empty", path.display());
    }
    Ok(pw)
}

/// The text of a file holding a secret (the key `field` names it): refused if missing or
/// readable by every user (mode `o+r`).
fn read_private(path: &Path, field: &str) -> anyhow::Result<String> {
    let bytes = crate::durable::read_secret(path, field, 0o004)?;
    String::from_utf8(bytes).with_context(|| format!("{field} {} is not UTF-8", path.display()))
}

/// The TLS material of `[fleet]` (`tls_ca_file`, `tls_cert_file`, `tls_key_file`), read and
/// checked: each file must hold what its key names (PEM), and the private key must not be
/// readable by every user. `None` without any of them.
pub fn read_tls(f: &config::Fleet) -> anyhow::Result<Option<redis::TlsCertificates>> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    if f.tls_ca_file.is_none() && f.tls_cert_file.is_none() && f.tls_key_file.is_none() {
        return Ok(None);
    }
    let certs = |path: &Path, field: &str| -> anyhow::Result<Vec<u8>> {
        let pem =
            std::fs::read(path).with_context(|| format!("reading {field} {}", path.display()))?;
        let n = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("{field} {}: not PEM certificates: {e}", path.display()))?
            .len();
        if n == 0 {
            bail!(
                "{field} {} holds no certificate (expected PEM, -----BEGIN CERTIFICATE-----)",
                path.display()
            );
        }
        Ok(pem)
    };
    let root_cert = match f.tls_ca_file.as_deref() {
        Some(path) => {
            let pem = certs(path, "fleet.tls_ca_file")?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.expect("parsed above");
                roots.add(cert).map_err(|e| {
                    anyhow::anyhow!(
                        "fleet.tls_ca_file {}: not a usable CA certificate: {e}",
                        path.display()
                    )
                })?;
            }
            Some(pem)
        }
        None => None,
    };
    let client_tls = match (&f.tls_cert_file, &f.tls_key_file) {
        (Some(cert), Some(key)) => {
            let client_cert = certs(cert, "fleet.tls_cert_file")?;
            let client_key = read_private(key, "fleet.tls_key_file")?.into_bytes();
            PrivateKeyDer::from_pem_slice(&client_key).map_err(|e| {
                anyhow::anyhow!(
                    "fleet.tls_key_file {}: no private key (expected PEM, e.g. -----BEGIN \
                     PRIVATE KEY-----): {e}",
                    key.display()
                )
            })?;
            Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            })
        }
        (None, None) => None,
        _ => bail!("fleet.tls_cert_file and fleet.tls_key_file go together"),
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// What `ratelimit check-config` checks of `[fleet]` beyond the file itself: the password
/// file and the TLS material can be read and hold what they should.
pub fn check_files(f: &config::Fleet) -> anyhow::Result<()> {
    f.password_file.as_deref().map(read_password).transpose()?;
    f.sentinel_password_file
        .as_deref()
        .map(|p| read_password_of(p, "fleet.sentinel_password_file"))
        .transpose()?;
    read_tls(f)?;
    f.key_file.as_deref().map(trust::read_key).transpose()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_readable_password_file_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-fleet-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("pass");
        std::fs::write(&p, "s3cret\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_password(&p).unwrap_err().to_string();
        assert!(e.contains("readable by every user (mode 0644)"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password(&p).unwrap(), "s3cret");
        let e = format!("{:#}", read_password(&dir.join("missing")).unwrap_err());
        assert!(e.contains("missing") && e.contains("No such file"), "{e}");
        std::fs::write(&p, "\n").unwrap();
        assert!(read_password(&p).unwrap_err().to_string().contains("empty"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
