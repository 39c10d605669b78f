//! Connection settings as PostgreSQL users write them: a URL split where libpq splits it, the
//! libpq environment, password files, `gssencmode` — each driving the built binaries.

use std::time::Duration;

use inbox_test_support::app::post_signed_to;
use inbox_test_support::events::{invoice_paid, SECRET_A};
use inbox_test_support::process::{command, run_split, start_ingest, Proc};
use inbox_test_support::tls::{TlsCluster, PASSWORD};
use inbox_test_support::TestDb;

const TIMEOUT: Duration = Duration::from_secs(60);

/// `inbox-worker <args>` with `env`; returns (exit code, all output).
async fn worker(env: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let mut cmd = command("inbox-worker");
    cmd.envs(env.iter().copied()).args(args);
    let (code, _, output) = tokio::task::spawn_blocking(move || run_split(cmd, TIMEOUT)).await.unwrap();
    (code, output)
}

#[tokio::test]
async fn a_question_mark_in_the_password_never_hides_sslmode_require_from_the_connection() {
    // The shared cluster has no TLS and trusts 127.0.0.1: any password passes, so only TLS can
    // refuse. libpq: "server does not support SSL, but SSL was required".
    let db = TestDb::new().await;
    let migrated = db.url();
    let (scheme, rest) = migrated.split_once("://").unwrap();
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    let base = rest.split_once('?').map_or(rest, |(base, _)| base);
    let url = format!("{scheme}://postgres:pa?ss@{base}?sslmode=require");
    let (code, output) = worker(&[("DATABASE_URL", &url)], &["stats"]).await;
    assert_eq!(code, 1, "refused, not connected in clear: {output}");
    assert!(output.contains("server does not support TLS"), "{output}");
    assert!(!output.contains("pa?ss"), "the password is never printed: {output}");

    // The same URL without the mode connects, with the whole "pa?ss" as its password.
    let (code, output) = worker(&[("DATABASE_URL", &url.replace("?sslmode=require", ""))], &["stats"]).await;
    assert_eq!(code, 0, "{output}");

    // A string the driver would read otherwise is refused by name, not silently read one way.
    let bad = format!("{scheme}://{base}?application_name=a@b");
    let (code, output) = worker(&[("DATABASE_URL", &bad), ("USER", "postgres")], &["stats"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("read differently"), "{output}");
}

#[tokio::test]
async fn the_libpq_environment_pgpass_and_a_rotated_password_file_connect_as_libpq_would() {
    let cluster = tokio::task::spawn_blocking(TlsCluster::start).await.unwrap();
    let ca = cluster.ca.display().to_string();
    let port = cluster.port.to_string();
    // Everything from PG* variables: DATABASE_URL names nothing but the scheme.
    let pg_env = |extra: &[(&'static str, String)]| {
        let mut env: Vec<(&'static str, String)> = vec![
            ("DATABASE_URL", "postgres://".into()),
            ("PGHOST", "127.0.0.1".into()),
            ("PGPORT", port.clone()),
            ("PGUSER", "inbox_pw".into()),
            ("PGDATABASE", "inbox".into()),
            ("PGSSLMODE", "verify-ca".into()),
            ("PGSSLROOTCERT", ca.clone()),
            ("PGCONNECT_TIMEOUT", "5".into()),
        ];
        env.extend(extra.iter().cloned());
        env
    };
    let run = |env: Vec<(&'static str, String)>, args: &'static [&'static str]| async move {
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        worker(&pairs, args).await
    };

    let (code, output) = run(pg_env(&[("PGPASSWORD", PASSWORD.into())]), &["migrate"]).await;
    assert_eq!(code, 0, "PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT: {output}");
    let (code, output) = run(pg_env(&[]), &["stats"]).await;
    assert_eq!(code, 1, "no password: {output}");
    assert!(output.contains("password"), "{output}");

    // A pgpass file, as libpq reads it: found by host, port, database and user; ignored (with a
    // warning) when others may read it.
    let dir = std::env::temp_dir().join(format!("inbox-pgpass-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pgpass = dir.join("pgpass");
    let escaped = PASSWORD.replace('\\', "\\\\").replace(':', "\\:");
    std::fs::write(
        &pgpass,
        format!("127.0.0.1:{port}:other:inbox_pw:wrong\n*:{port}:inbox:inbox_pw:{escaped}\n"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();
    let with_pgpass = pg_env(&[("PGPASSFILE", pgpass.display().to_string())]);
    let (code, output) = run(with_pgpass.clone(), &["stats"]).await;
    assert_eq!(code, 0, "PGPASSFILE: {output}");
    std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, output) = run(with_pgpass.clone(), &["stats"]).await;
    assert_eq!(code, 1, "a world-readable pgpass is ignored: {output}");
    assert!(output.contains("group or world access"), "{output}");

    // gssencmode: disable and prefer connect (no GSSAPI here); require is refused by name.
    for mode in ["disable", "prefer"] {
        let env = pg_env(&[
            ("PGPASSWORD", PASSWORD.into()),
            ("DATABASE_URL", format!("postgres://?gssencmode={mode}")),
        ]);
        let (code, output) = run(env, &["stats"]).await;
        assert_eq!(code, 0, "gssencmode={mode}: {output}");
    }
    let env =
        pg_env(&[("PGPASSWORD", PASSWORD.into()), ("DATABASE_URL", "postgres://?gssencmode=require".into())]);
    let (code, output) = run(env, &["stats"]).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("gssencmode=require"), "{output}");

    // DATABASE_PASSWORD_FILE: read again for every new connection. The ingest keeps storing
    // across a password rotation once its old connections are gone.
    let password_file = dir.join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let mut ingest = command("inbox-ingest");
    for (k, v) in pg_env(&[
        ("DATABASE_PASSWORD_FILE", password_file.display().to_string()),
        ("PGAPPNAME", "billing-ingest".into()),
    ]) {
        ingest.env(k, v);
    }
    ingest.env("INBOX_ENDPOINTS", format!("billing={SECRET_A}")).env("INBOX_LISTEN", "127.0.0.1:0");
    let (ingest, base) = tokio::task::spawn_blocking(move || start_ingest(ingest)).await.unwrap();
    let post = |id: &'static str| post_signed_to(&base, invoice_paid(id, "in_rotate", 100));
    assert_eq!(post("evt_before_rotation").await, 200, "{}", ingest.output());
    assert_eq!(
        cluster.psql(
            "SELECT count(*) > 0 AND bool_and(application_name = 'billing-ingest') \
               FROM pg_stat_activity WHERE usename = 'inbox_pw'"
        ),
        "t",
        "PGAPPNAME names every connection, in place of the component's own name"
    );
    cluster.psql("ALTER ROLE inbox_pw PASSWORD 'second-Secret'");
    std::fs::write(&password_file, "second-Secret").unwrap();
    cluster.psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = 'inbox_pw'");
    let mut status = 0;
    for _ in 0..20 {
        status = post("evt_after_rotation").await;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(status, 200, "new connections use the rotated password:\n{}", ingest.output());
    assert_eq!(cluster.psql("SELECT count(*) FROM webhook_inbox"), "2");
    let logs = ingest.output();
    assert!(!logs.contains("second-Secret") && !logs.contains(PASSWORD), "no password in the logs");
    drop::<Proc>(ingest);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_malformed_database_url_is_named_never_echoed_by_either_binary() {
    for (url, says) in [
        ("postgress://inbox:Sup3rSecretPw@db.example.com/inbox", "another scheme"),
        ("host=db.example.com user=inbox password=Sup3r SecretPw dbname=inbox", "entry #4 has no =value"),
        ("host=db.example.com user=inbox password='Sup3rSecretPw dbname=inbox", "unterminated quoted value"),
        (
            "postgres://inbox:Sup3rSecretPw@db.example.com/inbox?sslmode=verify-fullest",
            "sslmode is not one of",
        ),
    ] {
        let (code, output) = worker(&[("DATABASE_URL", url)], &["stats"]).await;
        assert_eq!(code, 1, "{url}: {output}");
        assert!(output.contains(says), "{url}: {output}");
        let mut ingest = command("inbox-ingest");
        ingest
            .env("DATABASE_URL", url)
            .env("INBOX_ENDPOINTS", format!("billing={SECRET_A}"))
            .env("INBOX_LISTEN", "127.0.0.1:0");
        let (code, _, ingest_output) =
            tokio::task::spawn_blocking(move || run_split(ingest, TIMEOUT)).await.unwrap();
        assert_eq!(code, 1, "{url}: {ingest_output}");
        assert!(ingest_output.contains(says), "{url}: {ingest_output}");
        for output in [output, ingest_output] {
            assert!(!output.contains("Sup3r") && !output.contains("SecretPw"), "echoed: {output}");
        }
    }
}
