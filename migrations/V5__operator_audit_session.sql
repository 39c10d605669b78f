-- stripe-inbox schema, version 5: who an operator's change came from, as the database saw it.
--
-- `actor` is what the operator typed (`--actor`, or $USER): useful, but self-declared. These two
-- columns are filled by the database, from the session that wrote the row: the role it logged in
-- as and the address it connected from (NULL over a unix socket). With deploy/roles.sql the
-- operators' role may insert only actor, action, target and affected, so it cannot set these.
-- Rows written before this version keep NULL: nobody recorded it then.
ALTER TABLE operator_audit ADD COLUMN db_user text, ADD COLUMN client_addr inet;
ALTER TABLE operator_audit ALTER COLUMN db_user SET DEFAULT session_user,
                           ALTER COLUMN client_addr SET DEFAULT inet_client_addr();
