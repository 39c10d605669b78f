//! A pooled connection that goes back to the pool only when declared clean.

use deadpool_postgres::{Object, Pool};

/// A pooled connection that is discarded unless explicitly marked clean: a task cancelled or
/// panicking mid-transaction never hands a connection with an open or aborted transaction back
/// to the pool (tokio-postgres only queues a dropped transaction's ROLLBACK for the connection's
/// next use, so the next borrower would meet it).
pub struct Conn {
    object: Option<Object>,
    clean: bool,
}

impl Conn {
    /// A connection from `pool`, not yet clean.
    pub async fn get(pool: &Pool) -> Result<Conn, String> {
        pool.get()
            .await
            .map(|object| Conn { object: Some(object), clean: false })
            .map_err(|e| inbox_domain::db::describe_pool_error(&e))
    }

    pub fn client(&mut self) -> &mut Object {
        self.object.as_mut().expect("connection present until drop")
    }

    /// Declares the connection outside any transaction (or not): it goes back to the pool when
    /// dropped only if clean.
    pub fn set_clean(&mut self, clean: bool) {
        self.clean = clean;
    }

    /// Whether the connection will go back to the pool.
    pub fn is_clean(&self) -> bool {
        self.clean
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            if !self.clean {
                // The server rolls back whatever was open.
                inbox_domain::db::discard(object);
            }
        }
    }
}
