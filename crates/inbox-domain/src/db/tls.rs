//! TLS to PostgreSQL with rustls: libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`,
//! turned into the connector every connection of every binary uses.
//!
//! | sslmode | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | – |
//! | `allow`, `prefer` | when the server offers it | not checked |
//! | `require` | always | not checked; with `sslrootcert`, as `verify-ca` (as libpq) |
//! | `verify-ca` | always | signed by a CA of `sslrootcert` (default: the system's store) |
//! | `verify-full` | always | that, and issued for the host connected to |
//!
//! Decision: libpq reads `~/.postgresql/root.crt` when `sslrootcert` is absent and fails when it
//! is missing; here a `verify-*` mode without `sslrootcert` uses the system's CA store (libpq's
//! `sslrootcert=system`), which is what managed servers with public certificates need and what a
//! container has.

use std::sync::Arc;

use anyhow::Context as _;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::url::{RootCerts, SslMode, TlsSettings};

/// The connector for `settings`: reads the CA and client certificate files now, so that a
/// missing or unreadable file is a start-up refusal naming it.
pub fn connector(settings: &TlsSettings) -> anyhow::Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verify = match (settings.mode, &settings.root_certs) {
        (SslMode::VerifyFull, _) => Verify::Full,
        (SslMode::VerifyCa, _) | (SslMode::Require, Some(_)) => Verify::Chain,
        _ => Verify::Nothing,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        Verify::Nothing => Arc::new(Unchecked(provider.clone())),
        Verify::Chain | Verify::Full => {
            let roots = Arc::new(root_store(settings.root_certs.as_ref().unwrap_or(&RootCerts::System))?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .context("building the certificate verifier")?;
            if verify == Verify::Full {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        }
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match &settings.client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow::anyhow!("sslcert {}: {e}", cert.display()))?;
            anyhow::ensure!(!chain.is_empty(), "sslcert {}: no PEM certificate in it", cert.display());
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                anyhow::anyhow!("sslkey {}: {e} (an unencrypted PEM private key is needed)", key.display())
            })?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                anyhow::anyhow!("sslcert/sslkey {} and {}: {e}", cert.display(), key.display())
            })?
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

/// A hint for a TLS failure of a connection, from rustls' reason, or None.
pub fn hint(error: &tokio_postgres::Error) -> Option<&'static str> {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        // tokio-rustls wraps rustls' error in an io::Error, whose source() skips it.
        let inner = cause.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref());
        if let Some(rustls::Error::InvalidCertificate(reason)) =
            inner.and_then(|e| e.downcast_ref::<rustls::Error>())
        {
            return Some(match reason {
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    "the server's certificate is not signed by a CA of sslrootcert (or of the system's \
                     store when sslrootcert is not set)"
                }
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                    "the server's certificate is not issued for the host in DATABASE_URL (sslmode=verify-full \
                     checks the host name, verify-ca does not)"
                }
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    "the server's certificate has expired"
                }
                _ => "the server's certificate was refused",
            });
        }
        source = cause.source();
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    Nothing,
    Chain,
    Full,
}

fn root_store(roots: &RootCerts) -> anyhow::Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    match roots {
        RootCerts::File(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow::anyhow!("sslrootcert {}: {e}", path.display()))?;
            let (added, _) = store.add_parsable_certificates(certs);
            anyhow::ensure!(added > 0, "sslrootcert {}: no usable PEM certificate in it", path.display());
        }
        RootCerts::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            anyhow::ensure!(
                added > 0,
                "sslrootcert=system: no CA certificate in the system's store{}",
                found.errors.first().map(|e| format!(" ({e})")).unwrap_or_default()
            );
        }
    }
    Ok(store)
}

/// `verify-ca`: the chain to a trusted CA, whatever host the certificate names. rustls checks the
/// chain before the name, so a name error means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without `sslrootcert`: encrypted, the certificate not checked (the
/// handshake's signatures still are).
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
