//! `reconcile`: agrees with Stripe. Pages Stripe's `GET /v1/events` (newest first, `created[gte]`
//! the start of the window, 100 per page, `starting_after` the last id seen; Stripe keeps 30 days)
//! and stores every event the inbox lacks for the endpoint — by the ingest's own insert, so the
//! key and the deduplication are the ingest's and a webhook arriving at the same moment is stored
//! once — with provenance `api`. The workers then apply those events like any other.
//!
//! Push delivery is at least once only while the endpoint is up: events of an outage longer than
//! Stripe's retries (three days), of an endpoint Stripe disabled, of a deploy that answered 2xx
//! without storing, or acknowledged and then lost by a database failover to an asynchronous
//! replica are gone unless somebody asks Stripe. `docs/operations.md` ("Recovering what Stripe did
//! not deliver") says when to run it; a CronJob and a systemd timer run it every few hours.
//!
//! Which events: with `--types`, those types (sent to Stripe as `types[]`, at most 20). Without,
//! every event of a type this binary handles or ignores (as `run` claims them, `INBOX_IGNORE`
//! included): Stripe lists every type of the account, and a type the endpoint is not subscribed to
//! would wait for ever as `no_handler`. Those are counted as skipped.
//!
//! A walk is a *run* (`reconcile_runs`): each page's inserts and the run's cursor commit together,
//! so a run interrupted (killed, a network failure past the retries) resumes at its cursor when
//! `reconcile` is started again for the endpoint with the same types and a window no wider; a run
//! of another filter replaces it. One run per endpoint walks at a time (a lease renewed with every
//! page). `--dry-run` counts what would be inserted and writes nothing.
//!
//! Thin events (API v2, `/v2/core/events`) are not in this list; Stripe's
//! `v2.core.health.event_generation_failure.resolved` names the events Stripe failed to create,
//! and becomes a reconciliation item for a person.

use std::io::IsTerminal as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args as ClapArgs;
use inbox_domain::config::{parse_duration, EndpointMode};
use inbox_domain::handler::{ClaimFilter, EventTypePattern, Registry};
use inbox_domain::inbox::event::EventHead;
use inbox_domain::inbox::store::reconcile::{self as store, ApiEvent, NewRun, Totals};
use inbox_domain::inbox::store::{admin, set_limits};
use inbox_domain::PROVIDER_STRIPE;
use serde::Serialize;

use super::output::{emit, emit_json, OutputArgs};
use super::{db_error, ActorArgs, LIMITS};
use crate::cli::StripeArgs;

/// Stripe keeps events this long; `--since` further back finds nothing more.
const STRIPE_KEEPS_EVENTS: Duration = Duration::from_secs(30 * 24 * 3600);

/// Stripe's limit on `types[]`.
const MAX_TYPES: usize = 20;

/// Flags of `reconcile`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The endpoint whose inbox rows to complete (the `{endpoint}` of the ingest's URL).
    #[arg(long)]
    pub endpoint: String,

    /// How far back to look (Stripe keeps 30 days of events).
    #[arg(long, default_value = "72h", value_parser = parse_duration)]
    pub since: Duration,

    /// Only these event types, comma-separated (at most 20, Stripe's limit) [default: every type this
    /// binary handles or ignores].
    #[arg(long, value_delimiter = ',', value_name = "TYPE[,TYPE…]")]
    pub types: Vec<String>,

    /// A connected account's events (`Stripe-Account`), for a Connect endpoint.
    #[arg(long, value_name = "acct_…")]
    pub account: Option<String>,

    /// The endpoint's declared mode (as the ingest's --endpoint-mode): an event of the other mode
    /// is stored held, never applied; a key of the other mode is refused.
    #[arg(long, env = "INBOX_RECONCILE_MODE", value_name = "live|test")]
    pub mode: Option<String>,

    /// Types the workers ignore (as `run --ignore`): taken by the default filter too.
    #[arg(long, env = "INBOX_IGNORE", value_delimiter = ',', value_name = "PATTERN[,PATTERN…]")]
    pub ignore: Vec<String>,

    /// Count what would be inserted; write nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// How long the run stays this process's without a sign of life (renewed every third of it):
    /// a run whose process died is resumed by the next `reconcile` after this.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub lease: Duration,

    #[command(flatten)]
    pub stripe: StripeArgs,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `reconcile` prints.
#[derive(Debug, Serialize)]
struct Report {
    endpoint: String,
    account: Option<String>,
    dry_run: bool,
    /// The run (absent with --dry-run), and whether it resumed an interrupted one.
    run: Option<i64>,
    resumed: bool,
    /// The start of the window, as sent to Stripe (`created[gte]`, Unix seconds).
    created_gte: i64,
    types: Vec<String>,
    pages: i32,
    found: i64,
    already_present: i64,
    /// With --dry-run: what would be inserted.
    inserted: i64,
    skipped_no_handler: i64,
}

/// Which listed events the run takes.
enum Filter {
    /// `--types`: sent to Stripe; everything listed is taken.
    Types(Vec<String>),
    /// The binary's handled and ignored types, and the `--ignore` patterns.
    Claims(ClaimFilter, Vec<EventTypePattern>),
}

impl Filter {
    fn takes(&self, event_type: &str) -> bool {
        match self {
            Filter::Types(_) => true,
            Filter::Claims(filter, ignored) => {
                filter.claims(event_type) || ignored.iter().any(|p| p.matches(event_type))
            }
        }
    }
}

/// `reconcile`.
pub async fn run(
    client: &mut deadpool_postgres::Object,
    registry: &Registry,
    args: &Args,
) -> anyhow::Result<()> {
    let endpoint = args.endpoint.trim();
    anyhow::ensure!(!endpoint.is_empty(), "--endpoint must name the endpoint to reconcile");
    anyhow::ensure!(!args.since.is_zero(), "--since must be longer than 0");
    if args.since > STRIPE_KEEPS_EVENTS {
        eprintln!("note: Stripe keeps 30 days of events: nothing older than that can be listed");
    }
    let mode = match args.mode.as_deref().map(str::trim) {
        None | Some("") => None,
        Some("live") => Some(EndpointMode::Live),
        Some("test") => Some(EndpointMode::Test),
        Some(_) => anyhow::bail!("--mode / INBOX_RECONCILE_MODE must be live or test"),
    };
    let mut types: Vec<String> =
        args.types.iter().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect();
    types.sort();
    types.dedup();
    anyhow::ensure!(
        types.len() <= MAX_TYPES,
        "--types names {} types; Stripe's List Events takes at most {MAX_TYPES}: run reconcile once per group",
        types.len()
    );
    let ignored = args
        .ignore
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.parse::<EventTypePattern>().map_err(|e| anyhow::anyhow!("--ignore / INBOX_IGNORE: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let filter = if types.is_empty() {
        Filter::Claims(registry.claim_filter(), ignored)
    } else {
        for t in &types {
            if !registry.claim_filter().claims(t) && !ignored.iter().any(|p| p.matches(t)) {
                eprintln!("note: this binary has no handler for {t}: its events will wait for a worker that has one");
            }
        }
        Filter::Types(types.clone())
    };
    let api = args.stripe.client()?;
    if let (Some(mode), Some(key_live)) = (mode, api.livemode()) {
        anyhow::ensure!(
            key_live == (mode == EndpointMode::Live),
            "the API key is a {} key ({}) and endpoint {endpoint} is declared {}: it would list the other \
             mode's events",
            if key_live { "live-mode" } else { "test-mode" },
            api.key_shown(),
            mode.as_str()
        );
    }
    let account = args.account.as_deref().map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let requested_gte = now - args.since.as_secs() as i64;

    // The run: a new one, or the interrupted one this resumes.
    let owner = owner_token();
    let mut resumed = false;
    let (run, created_gte, starting_after, totals) = if args.dry_run {
        (None, requested_gte, None, Totals::default())
    } else {
        let account_key = account.as_deref().unwrap_or("");
        let existing = store::unfinished_run(&***client, PROVIDER_STRIPE, endpoint, account_key, args.lease)
            .await
            .map_err(db_error("reading the endpoint's unfinished run"))?;
        match existing {
            Some(run) if run.live => anyhow::bail!(
                "another reconcile of endpoint {endpoint} is running (run {}, started by {}, last sign of life \
                 {:.0} s ago); if its process died, the next reconcile resumes it once it has been quiet for \
                 {:.0} s",
                run.id,
                run.actor,
                run.quiet_for,
                args.lease.as_secs_f64()
            ),
            Some(run) if run.types == types && run.created_gte <= requested_gte => {
                anyhow::ensure!(
                    store::take_over(&***client, run.id, &owner, args.lease).await.map_err(db_error("taking the run over"))?,
                    "run {} of endpoint {endpoint} was taken over by another reconcile just now",
                    run.id
                );
                eprintln!(
                    "resuming run {} (started by {}, {} pages done, {} inserted), after {}",
                    run.id,
                    run.actor,
                    run.totals.pages,
                    run.totals.inserted,
                    run.starting_after.as_deref().unwrap_or("the first page")
                );
                resumed = true;
                (Some(run.id), run.created_gte, run.starting_after, run.totals)
            }
            existing => {
                if let Some(old) = existing {
                    store::abandon(&***client, old.id, "replaced", args.lease).await.map_err(db_error("closing the old run"))?;
                    eprintln!(
                        "note: run {} (other types or a narrower window) was interrupted; a new run replaces it",
                        old.id
                    );
                }
                let new = NewRun {
                    provider: PROVIDER_STRIPE,
                    endpoint,
                    account: account_key,
                    types: &types,
                    created_gte: requested_gte,
                    actor: args.actor.name(),
                    owner: &owner,
                };
                let id = store::start_run(&***client, &new).await.map_err(db_error("starting the run"))?;
                let id = id.ok_or_else(|| {
                    anyhow::anyhow!("another reconcile of endpoint {endpoint} started just now")
                })?;
                (Some(id), requested_gte, None, Totals::default())
            }
        }
    };

    let walk = Walk {
        endpoint,
        account: account.as_deref(),
        mode,
        filter: &filter,
        types: &types,
        owner: &owner,
        created_gte,
    };
    let walked = walk.run(client, &api, run, starting_after, totals, args).await;
    let totals = match (walked, run) {
        (Ok(totals), _) => totals,
        (Err(e), Some(id)) => {
            // Resumable at once by the next reconcile: the lease ends now.
            if let Err(release) = store::release(&***client, id, &owner).await {
                tracing::warn!(error = %inbox_domain::db::describe_db_error(&release), "could not release the run (it is resumable after its lease)");
            }
            return Err(e.context(format!("run {id} stopped; run the same command again to resume it")));
        }
        (Err(e), None) => return Err(e),
    };

    let report = Report {
        endpoint: endpoint.to_owned(),
        account,
        dry_run: args.dry_run,
        run,
        resumed,
        created_gte,
        types,
        pages: totals.pages,
        found: totals.found,
        already_present: totals.present,
        inserted: totals.inserted,
        skipped_no_handler: totals.skipped,
    };
    if args.output.json {
        return emit_json(&report);
    }
    let inserted = if args.dry_run { "would insert" } else { "inserted" };
    emit(&format!(
        "reconciled endpoint {endpoint}{} since {} ({}){}\n  found            {}\n  already present  {}\n  {inserted:<16} {}\n  skipped          {} (types without a handler here)\n",
        report.account.as_deref().map(|a| format!(" (account {a})")).unwrap_or_default(),
        humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(created_gte.max(0) as u64)),
        if report.types.is_empty() { "types this binary handles".to_owned() } else { report.types.join(", ") },
        match run {
            Some(id) if resumed => format!(", run {id} resumed"),
            Some(id) => format!(", run {id}"),
            None => ", dry run: nothing written".to_owned(),
        },
        totals.found,
        totals.present,
        totals.inserted,
        totals.skipped,
    ))
}

/// One walk through Stripe's list: what [`run`] decided, for the page loop.
struct Walk<'a> {
    endpoint: &'a str,
    account: Option<&'a str>,
    mode: Option<EndpointMode>,
    filter: &'a Filter,
    types: &'a [String],
    owner: &'a str,
    created_gte: i64,
}

impl Walk<'_> {
    /// Pages the list from `starting_after`, storing each page (or, without a run, counting what
    /// would be stored), renewing the run's lease while it waits for Stripe; then finishes the run
    /// with its audit record. Returns the totals. Stops at SIGINT/SIGTERM between pages.
    async fn run(
        &self,
        client: &mut deadpool_postgres::Object,
        api: &crate::stripe::Client,
        run: Option<i64>,
        starting_after: Option<String>,
        mut totals: Totals,
        args: &Args,
    ) -> anyhow::Result<Totals> {
        let endpoint = self.endpoint;
        let mut query: Vec<(&'static str, String)> = vec![("created[gte]", self.created_gte.to_string())];
        if let Filter::Types(types) = self.filter {
            query.extend(types.iter().map(|t| ("types[]", t.clone())));
        }
        let mut list = api
            .list("/v1/events", query, 100)
            .starting_after(starting_after)
            .on_account(self.account.map(str::to_owned));
        let progress = Progress::new(endpoint);
        let stop = crate::runner::os_signals();
        let mut beat = tokio::time::interval(args.lease / 3);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beat.tick().await;
        loop {
            // The next page; meanwhile the lease is renewed (the connection is idle: no
            // transaction is open while Stripe is asked).
            let page = {
                let next = list.next_page();
                tokio::pin!(next);
                loop {
                    tokio::select! {
                        page = &mut next => break page,
                        _ = stop.cancelled() => anyhow::bail!("stopped by a signal between pages"),
                        _ = beat.tick(), if run.is_some() => {
                            let id = run.unwrap_or_default();
                            let ours = store::heartbeat(&***client, id, self.owner)
                                .await
                                .map_err(db_error("renewing the run's lease"))?;
                            anyhow::ensure!(ours, "run {id} of endpoint {endpoint} was taken over by another reconcile");
                        }
                    }
                }
            };
            let Some(page) = page.map_err(|e| anyhow::anyhow!("listing Stripe's events: {e}"))? else {
                break;
            };
            let heads = page
                .data
                .iter()
                .map(|raw| EventHead::parse(raw.get().as_bytes()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    anyhow::anyhow!("an event of the list (request {}) is not an event: {e}", page.request_id)
                })?;
            let holds: Vec<Option<String>> =
                heads.iter().map(|h| self.mode.and_then(|m| m.hold_reason(endpoint, h.livemode))).collect();
            let mut taken = Vec::with_capacity(page.data.len());
            let mut skipped = 0;
            for ((raw, head), hold) in page.data.iter().zip(&heads).zip(&holds) {
                if self.filter.takes(&head.event_type) {
                    taken.push(ApiEvent {
                        event_id: &head.id,
                        event_type: &head.event_type,
                        payload: raw.get().as_bytes(),
                        livemode_hold: hold.as_deref(),
                    });
                } else {
                    skipped += 1;
                }
            }
            let Some(cursor) = list.cursor().map(str::to_owned) else { break };
            match run {
                None => {
                    let ids: Vec<&str> = taken.iter().map(|e| e.event_id).collect();
                    let present = store::present(&***client, PROVIDER_STRIPE, endpoint, &ids)
                        .await
                        .map_err(db_error("looking the events up"))?;
                    totals.pages += 1;
                    totals.found += taken.len() as i64;
                    totals.present += present.len() as i64;
                    totals.inserted += (taken.len() - present.len()) as i64;
                    totals.skipped += skipped;
                }
                Some(id) => {
                    let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
                    set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
                    let stored = store::store_page(
                        &tx,
                        PROVIDER_STRIPE,
                        endpoint,
                        &taken,
                        id,
                        self.owner,
                        &cursor,
                        skipped,
                    )
                    .await
                    .map_err(db_error("storing a page of events"))?;
                    let Some(now_totals) = stored else {
                        anyhow::bail!("run {id} of endpoint {endpoint} was taken over by another reconcile");
                    };
                    tx.commit().await.map_err(db_error("committing a page of events"))?;
                    totals = now_totals;
                }
            }
            progress.page(&totals);
        }
        progress.finish();

        let Some(id) = run else { return Ok(totals) };
        let tx = client.transaction().await.map_err(db_error("starting a transaction"))?;
        set_limits(&tx, &LIMITS).await.map_err(db_error("setting the transaction's timeouts"))?;
        let finished =
            store::finish(&*tx, id, self.owner, "complete").await.map_err(db_error("finishing the run"))?;
        let Some(finished) = finished else {
            anyhow::bail!("run {id} of endpoint {endpoint} was taken over by another reconcile");
        };
        let target = serde_json::json!({
            "provider": PROVIDER_STRIPE,
            "endpoint": endpoint,
            "account": self.account,
            "run": id,
            "created_gte": self.created_gte,
            "types": self.types,
            "found": finished.found,
            "already_present": finished.present,
            "skipped_no_handler": finished.skipped,
        });
        admin::insert_audit(&*tx, args.actor.name(), "reconcile", &target, finished.inserted.max(0) as u64)
            .await
            .map_err(db_error("writing the audit record"))?;
        tx.commit().await.map_err(db_error("committing the end of the run"))?;
        Ok(finished)
    }
}

/// Who walks a run: unique per process and start.
fn owner_token() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}:{}", std::process::id(), nanos)
}

/// Progress on stderr: a spinner with the counts on a terminal, a plain line per page otherwise
/// (a CronJob's log). stdout keeps only the report.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    endpoint: String,
}

impl Progress {
    fn new(endpoint: &str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new_spinner();
            bar.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            bar.enable_steady_tick(Duration::from_millis(120));
            bar.set_message(format!("reconciling {endpoint}: listing Stripe's events"));
            bar
        });
        Progress { bar, endpoint: endpoint.to_owned() }
    }

    fn page(&self, totals: &Totals) {
        let line = format!(
            "reconciling {}: {} pages, found {}, already present {}, inserted {}, skipped {}",
            self.endpoint, totals.pages, totals.found, totals.present, totals.inserted, totals.skipped
        );
        match &self.bar {
            Some(bar) => bar.set_message(line),
            None => eprintln!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
