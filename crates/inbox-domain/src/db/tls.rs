//! TLS to PostgreSQL with rustls: libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`,
//! turned into the connector every connection of every binary uses.
//!
//! | sslmode | TLS | the server's certificate | what it proves |
//! |---|---|---|---|
//! | `disable` | never | – | nothing: in clear |
//! | `allow`, `prefer` | when the server offers it | not checked | nothing against an active attacker |
//! | `require` | always | not checked; with a CA file, as `verify-ca` (as libpq) | encrypted, to whoever answers |
//! | `verify-ca` | always | chains to a CA of the `sslrootcert` file | the server holds a certificate of *your* CA |
//! | `verify-full` | always | chains to a trusted CA and names the host connected to | it is the host you named |
//!
//! The system's CA store (`sslrootcert=system`, or `verify-full` without a CA file) is trusted
//! only by `verify-full`: a public CA signs certificates for anybody's names, so a chain check
//! without the name would let any of them through ([`super::conninfo`] refuses the rest).

use std::sync::Arc;

use anyhow::Context as _;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::conninfo::{RootCerts, SslMode, TlsSettings};

/// The connector for `settings`: reads the CA and client certificate files now, so that a
/// missing or unreadable file is a start-up refusal naming it.
pub fn connector(settings: &TlsSettings) -> anyhow::Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match (settings.mode, &settings.root_certs) {
        (SslMode::VerifyFull, Some(roots)) => {
            WebPkiServerVerifier::builder_with_provider(Arc::new(root_store(roots)?), provider.clone())
                .build()
                .context("building the certificate verifier")?
        }
        (SslMode::VerifyCa | SslMode::Require, Some(RootCerts::File(file))) => {
            let roots = root_store(&RootCerts::File(file.clone()))?;
            Arc::new(ChainOnly { roots: Arc::new(roots), provider: provider.clone() })
        }
        (SslMode::VerifyCa | SslMode::Require, Some(RootCerts::System))
        | (SslMode::VerifyFull | SslMode::VerifyCa, None) => {
            anyhow::bail!(
                "sslmode={} with the system's CA store would trust any public certificate: only \
                 sslmode=verify-full may use it",
                settings.mode.as_str()
            )
        }
        _ => Arc::new(Unchecked(provider.clone())),
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
                     store, for verify-full without sslrootcert)"
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

/// `verify-ca`: the certificate chains to a CA of the `sslrootcert` file, whatever host it names.
/// The chain is checked by rustls' trust-anchor check itself, the name never looked at — not by
/// the full check with its name error forgiven, which would lean on the order of its checks.
#[derive(Debug)]
struct ChainOnly {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let certificate = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &certificate,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
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
