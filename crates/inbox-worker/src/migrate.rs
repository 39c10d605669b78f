//! `inbox-worker migrate`.

use anyhow::Context as _;

/// Applies pending migrations and says what it did.
pub async fn run(database: tokio_postgres::Config) -> anyhow::Result<()> {
    let (mut client, connection) =
        database.connect(tokio_postgres::NoTls).await.context("cannot connect to the database")?;
    let connection = tokio::spawn(connection);
    let report = inbox_domain::schema::migrate(&mut client).await?;
    if report.applied.is_empty() {
        println!("schema is up to date at version {}", report.version);
    } else {
        for (version, name) in &report.applied {
            println!("applied V{version} {name}");
        }
        println!("schema is at version {}", report.version);
    }
    drop(client);
    let _ = connection.await;
    Ok(())
}
