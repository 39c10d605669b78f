-- stripe-inbox schema, version 22: the database asks for write-back of every write made in it,
-- autovacuum's included, where nobody chose a value for it.
--
-- backend_flush_after (PostgreSQL's default 0) has a process ask the kernel to start writing what
-- it wrote once that many bytes are pending. At 0 the pages a process evicts stay dirty in the
-- kernel's cache until its 30-second expiry or the checkpoint's fsync, and then go to the disk at
-- once, in front of the WAL flushes every commit waits for. The pipeline's sessions already ask
-- for 256kB where they find 0 (store::SESSION_WRITE_BACK_SQL); what they cannot reach is
-- autovacuum, whose vacuum of webhook_inbox visits a page per ~2 KB event and writes each page it
-- dirties through its own small ring of buffers. Autovacuum's workers read the database's
-- settings as any session does (ALTER DATABASE … SET), so the database's own value covers them:
-- over 150 s at a steady 3500/s it held receive→processed p99 at 18–21 ms in four runs of five,
-- against 28–79 ms without it (docs/performance.md, "Write-back of the pipeline's own writes").
--
-- Only where the migrating session's value is PostgreSQL's default, that is where no value was
-- set for the server, this database, the migrating role or the connection: a value anyone chose
-- is theirs. Set once, with this version: `ALTER DATABASE … RESET backend_flush_after` (or any
-- other value) afterwards is kept by every later migrate. Changing a database's settings takes
-- its owner or a superuser; a migrating role that is neither (a table owner such as
-- deploy/roles.sql's inbox_owner) leaves it unset, and is told the statement for the database's
-- owner. New sessions take the value; those already open keep theirs until they reconnect.
DO $write_back$
BEGIN
    IF (SELECT source FROM pg_catalog.pg_settings WHERE name = 'backend_flush_after') = 'default' THEN
        EXECUTE pg_catalog.format('ALTER DATABASE %I SET backend_flush_after = %L',
                                  pg_catalog.current_database(), '256kB');
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'backend_flush_after is left unset for database %: only its owner or a superuser may set it. As one of them: ALTER DATABASE % SET backend_flush_after = ''256kB''',
        pg_catalog.quote_ident(pg_catalog.current_database()), pg_catalog.quote_ident(pg_catalog.current_database());
END
$write_back$;
