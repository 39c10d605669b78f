//! The printed table (each figure, its ratio to the pgbench limit, its target) and the machine
//! lines.

use serde_json::{json, Value};

pub struct Row {
    figure: String,
    value: String,
    ratio: Option<(f64, String)>,
    target: String,
    ok: Option<bool>,
}

pub struct Table {
    rows: Vec<Row>,
}

fn mib(kib: f64) -> String {
    format!("{:.1} MiB", kib / 1024.0)
}

fn size(bytes: Option<i64>) -> String {
    match bytes {
        None => "?".into(),
        Some(b) if b >= 10 << 20 => format!("{:.0} MiB", b as f64 / (1 << 20) as f64),
        Some(b) if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
        Some(b) => format!("{:.0} KiB", b as f64 / 1024.0),
    }
}

fn f(v: &Value, digits: usize) -> String {
    match v.as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "–".into(),
    }
}

/// `256 / 64 / 32MiB`: the worker's defaults as its `--help` states them (`?` where it does not).
fn defaults_text(d: &Value) -> String {
    let v = |k: &str| d[k].as_str().unwrap_or("?").to_owned();
    format!("{} / {} / {}", v("concurrency"), v("batch_size"), v("max_bytes_in_flight"))
}

/// A row of what the services logged per request or event (`logs`, see `util::LogSample`), when
/// the phase counted it.
fn log_row(t: &mut Table, unit: &str, logs: &Value) {
    if logs.as_object().is_some_and(|m| !m.is_empty()) {
        t.add(format!("     log lines / bytes per {unit}"), crate::util::log_text(logs));
    }
}

/// The entries of a JSON object keyed by numbers ("32", "256"), in numeric order.
fn numeric(v: &Value) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = v.as_object().into_iter().flatten().collect();
    entries.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
    entries
}

fn explain(e: &Value) -> String {
    if let Some(err) = e["error"].as_str() {
        return format!("error: {}", err.chars().take(40).collect::<String>());
    }
    format!(
        "{} ms, {} buf",
        f(&e["execution_ms"], 2),
        e["shared_hit_blocks"].as_i64().unwrap_or(0) + e["shared_read_blocks"].as_i64().unwrap_or(0)
    )
}

impl Table {
    fn add(&mut self, figure: impl Into<String>, value: impl Into<String>) -> &mut Row {
        self.rows.push(Row {
            figure: figure.into(),
            value: value.into(),
            ratio: None,
            target: String::new(),
            ok: None,
        });
        self.rows.last_mut().unwrap()
    }

    pub fn build(r: &serde_json::Map<String, Value>) -> Table {
        let mut t = Table { rows: Vec::new() };
        let null = Value::Null;
        let get = |k: &str| r.get(k).unwrap_or(&null);
        let disk = get("disk");
        if disk.is_object() {
            let fl = &disk["flush"];
            t.add(
                format!(
                    "disk  8 KiB write + fdatasync for {} s: p50 / p99 / p99.9 / max",
                    f(&disk["seconds"], 0)
                ),
                format!(
                    "{} / {} / {} / {} ms",
                    f(&fl["p50_ms"], 2),
                    f(&fl["p99_ms"], 2),
                    f(&fl["p99_9_ms"], 2),
                    f(&fl["max_ms"], 1)
                ),
            );
            t.add(
                "     flushes over 20 ms; over 40 ms",
                format!(
                    "{} / min; {} / min",
                    f(&disk["stalls_over_20ms_per_min"], 1),
                    f(&disk["stalls_over_40ms_per_min"], 1)
                ),
            );
        }
        let pgbench = get("pgbench");
        let tps = |c: &str| pgbench[c]["tps"].as_f64();
        let ref32 = tps("32").map(|v| (v, "a32".to_owned())).or_else(|| {
            pgbench
                .as_object()
                .and_then(|m| m.iter().next())
                .and_then(|(k, v)| v["tps"].as_f64().map(|t| (t, format!("a{k}"))))
        });

        for (c, v) in numeric(pgbench) {
            let row = t.add(
                format!("a  pgbench -M prepared INSERT, {} clients", v["clients"]),
                format!("{} tps", f(&v["tps"], 0)),
            );
            row.ratio = Some((1.0, format!("a{c}")));
        }

        for (c, v) in numeric(get("ingest")) {
            let rate = v["req_per_s"].as_f64().unwrap_or(0.0);
            let row = t.add(format!("b  ingest, {c} connections"), format!("{rate:.0} req/s"));
            let l = &v["latency"];
            if let Some(base) = tps(c) {
                row.ratio = Some((rate / base, format!("a{c}")));
                // At 32 connections, the steady-state target: 1.2 × pgbench's commit rate with
                // p99 ≤ 25 ms; at 256, that group commit keeps up at all.
                if c == "32" {
                    let p99 = l["p99_ms"].as_f64().unwrap_or(f64::NAN);
                    row.target = "≥ 1.20, p99 ≤ 25".into();
                    row.ok = Some(rate / base >= 1.2 && p99 <= 25.0);
                } else {
                    row.target = "≥ 0.80".into();
                    row.ok = Some(rate / base >= 0.8);
                }
            }
            if let Some(ratios) = each_round(v, "rounds_req_per_s", &pgbench[c], "rounds_tps") {
                t.add("     each round: ingest / pgbench", ratios);
            }
            t.add(
                "     latency p50 / p99 / p99.9",
                format!("{} / {} / {} ms", f(&l["p50_ms"], 1), f(&l["p99_ms"], 1), f(&l["p99_9_ms"], 1)),
            );
            let (non2xx, unanswered) =
                (v["non_2xx"].as_u64().unwrap_or(0), v["unanswered"].as_u64().unwrap_or(0));
            let row = t.add("     non-2xx / unanswered", format!("{non2xx} / {unanswered}"));
            row.target = "0 / 0".into();
            row.ok = Some(non2xx == 0 && unanswered == 0);
            let row =
                t.add("     rows stored / 2xx answers", format!("{} / {}", v["rows_stored"], v["total_2xx"]));
            row.target = "equal".into();
            row.ok = v["rows_match_2xx"].as_bool();
            t.add(
                "     commits / request (XIDs assigned)",
                format!("{} ({})", f(&v["commits_per_request"], 2), f(&v["xids_per_request"], 2)),
            );
            t.add(
                "     CPU µs per request: ingest / postgres",
                format!(
                    "{} / {}",
                    f(&v["cpu"]["ingest_cpu_us_per_unit"], 0),
                    f(&v["cpu"]["postgres_cpu_us_per_unit"], 0)
                ),
            );
            log_row(&mut t, "request", &v["logs"]);
        }

        let drain_rows = |t: &mut Table, v: &Value| {
            let commits = v["commits_per_event"].as_f64().unwrap_or(f64::NAN);
            let row = t.add(
                "     commits / event (XIDs assigned, incl. savepoints)",
                format!("{commits:.2} ({})", f(&v["xids_per_event"], 2)),
            );
            row.target = "≤ 1.20".into();
            row.ok = Some(commits <= 1.2);
            t.add(
                "     WAL bytes / event (full-page images / event)",
                format!("{} ({})", f(&v["wal_bytes_per_event"], 0), f(&v["pg_stat_wal"]["fpi_per_event"], 2)),
            );
            let a = &v["table_after"];
            let autovacuums = a["autovacuum_count"].as_i64().unwrap_or(0)
                - v["table_before"]["autovacuum_count"].as_i64().unwrap_or(0);
            t.add(
                "     after drain: n_dead_tup / n_live_tup (autovacuums)",
                format!(
                    "{} / {} = {} ({autovacuums})",
                    a["n_dead_tup"],
                    a["n_live_tup"],
                    f(&a["dead_per_live"], 2)
                ),
            );
            let exact = &v["pgstattuple_after"];
            if exact["dead_tuples"].is_i64() {
                let density = |name: &str| {
                    exact["indexes"]
                        .as_array()
                        .and_then(|a| a.iter().find(|i| i["name"] == name))
                        .map_or("?".into(), |i| f(&i["avg_leaf_density"], 0))
                };
                t.add(
                    "     after drain, pgstattuple: dead / live; free; leaf density",
                    format!(
                        "{} / {}; {}; {}% / {}%",
                        exact["dead_tuples"],
                        exact["live_tuples"],
                        size(exact["free_bytes"].as_i64()),
                        density("webhook_inbox_queue_by_type"),
                        density("webhook_inbox_pkey")
                    ),
                );
            }
            t.add(
                "     after drain: heap / queue idx / pkey",
                format!(
                    "{} / {} / {}",
                    size(a["table_bytes"].as_i64()),
                    size(crate::pg::index_bytes(a, "webhook_inbox_queue_by_type")),
                    size(crate::pg::index_bytes(a, "webhook_inbox_pkey"))
                ),
            );
            t.add(
                "     HOT updates / updates",
                format!(
                    "{} / {} ({}%)",
                    v["hot_updates"],
                    v["updates"],
                    f(&json!(v["hot_update_ratio"].as_f64().map(|x| x * 100.0)), 0)
                ),
            );
            t.add(
                "     claim EXPLAIN (LIMIT 32) before / after drain",
                format!("{} / {}", explain(&v["explain_claim_before"]), explain(&v["explain_claim_after"])),
            );
            t.add(
                "     CPU µs per event: workers / postgres",
                format!(
                    "{} / {}",
                    f(&v["cpu"]["worker_cpu_us_per_unit"], 0),
                    f(&v["cpu"]["postgres_cpu_us_per_unit"], 0)
                ),
            );
            log_row(t, "event", &v["logs"]);
        };

        for (p, v) in numeric(get("drain")) {
            let eps = v["events_per_s"].as_f64().unwrap_or(0.0);
            let row = t.add(
                format!("c  drain {} rows, {p} worker proc × {}", v["queued_rows"], v["concurrency"]),
                format!("{eps:.0} events/s"),
            );
            if let Some((base, name)) = &ref32 {
                row.ratio = Some((eps / base, name.clone()));
                row.target = "≥ 0.40".into();
                row.ok = Some(eps / base >= 0.4);
            }
            drain_rows(&mut t, v);
        }

        let defaults = get("worker_defaults");
        let d = get("drain_default");
        if d.is_object() {
            let eps = d["events_per_s"].as_f64().unwrap_or(0.0);
            let row = t.add(
                format!("c  drain {} rows, 1 worker proc, default flags", d["queued_rows"]),
                format!("{eps:.0} events/s"),
            );
            // The best rate of one tuned process in this run.
            let best = numeric(get("drain"))
                .into_iter()
                .filter(|(_, v)| v["processes"] == 1)
                .filter_map(|(p, v)| v["events_per_s"].as_f64().map(|r| (r, format!("c{p}"))))
                .max_by(|a, b| a.0.total_cmp(&b.0));
            if let Some((base, name)) = best {
                row.ratio = Some((eps / base, name.clone()));
                row.target = "≥ 0.80".into();
                row.ok = Some(eps / base >= 0.8);
                let tuned = &get("drain")[name.trim_start_matches('c')];
                if let Some(ratios) = each_round(d, "rounds_events_per_s", tuned, "rounds_events_per_s") {
                    t.add(format!("     each round: default flags / {name}"), ratios);
                }
            }
            t.add(
                "     worker defaults: --concurrency / --batch-size / --max-bytes-in-flight",
                defaults_text(defaults),
            );
            t.add(
                "     commits / event; CPU µs per event: worker / postgres",
                format!(
                    "{}; {} / {}",
                    f(&d["commits_per_event"], 2),
                    f(&d["cpu"]["worker_cpu_us_per_unit"], 0),
                    f(&d["cpu"]["postgres_cpu_us_per_unit"], 0)
                ),
            );
        }

        // The relay at its defaults, beside the worker at its defaults in the same run.
        let worker_default = get("drain_default")["events_per_s"].as_f64();
        for (name, v) in get("relay").as_object().into_iter().flatten() {
            let per_s = v["deliveries_per_s"].as_f64().unwrap_or(0.0);
            let flags =
                if v["default_flags"] == true { "default flags".to_owned() } else { v["flags"].to_string() };
            let row = t.add(
                format!("relay  {} outbox rows → {name}, 1 relay proc, {flags}", v["rows"]),
                format!("{per_s:.0} deliveries/s"),
            );
            if let (Some(base), true) = (worker_default, v["default_flags"] == true) {
                row.ratio = Some((per_s / base, "c1-default".into()));
                row.target = "≥ 1.00".into();
                row.ok = Some(per_s / base >= 1.0);
                let worker = get("drain_default");
                if let Some(ratios) = each_round(v, "rounds_deliveries_per_s", worker, "rounds_events_per_s")
                {
                    t.add("     each round: relay / c1-default", ratios);
                }
            }
            t.add(
                "     commits / row; WAL bytes / row; CPU µs per row: relay / postgres",
                format!(
                    "{}; {}; {} / {}",
                    f(&v["commits_per_row"], 3),
                    f(&v["wal_bytes_per_row"], 0),
                    f(&v["cpu"]["relay_cpu_us_per_unit"], 0),
                    f(&v["cpu"]["postgres_cpu_us_per_unit"], 0)
                ),
            );
        }

        let e = get("e2e");
        if e.is_object() {
            let rp = &e["receive_to_processed"];
            let p99 = rp["p99_ms"].as_f64().unwrap_or(f64::NAN);
            let row = t.add(
                format!("d  end to end at {}/s: receive→processed p50 / p99", f(&e["target_rate"], 0)),
                format!("{} / {p99:.1} ms", f(&rp["p50_ms"], 1)),
            );
            row.target = "p99 ≤ 25".into();
            row.ok = Some(p99 <= 25.0);
            if let Some(runs) = e["autovacuum_in_window"].as_array() {
                // The tables and times are in report.json and the run's output; here only when.
                let from = runs.iter().filter_map(|r| r["from_s"].as_f64()).fold(f64::INFINITY, f64::min);
                let to = runs.iter().filter_map(|r| r["to_s"].as_f64()).fold(f64::NEG_INFINITY, f64::max);
                t.add(
                    "     autovacuum in the window (runs, from–to)",
                    if runs.is_empty() {
                        "none".to_owned()
                    } else {
                        format!("{} runs, {from:.1}–{to:.1} s", runs.len())
                    },
                );
            }
            let worst = &rp["worst_second"];
            if worst.is_object() {
                let m = &worst["machine"];
                let rounds = worst["autovacuum"].as_array().map_or(0, Vec::len);
                t.add(
                    "     worst second: p99; machine busy, every task on I/O; autovacuum",
                    format!(
                        "s {}: {} ms; {} %, {} ms; {}",
                        worst["second"],
                        f(&worst["p99_ms"], 0),
                        f(&m["busy_pct"], 0),
                        f(&m["io_stall_ms"], 0),
                        if rounds == 0 { "none".to_owned() } else { format!("{rounds} runs") }
                    ),
                );
            }
            let stages = &e["stages"];
            if stages.is_object() {
                let stage =
                    |k: &str| format!("{} / {}", f(&stages[k]["p50_ms"], 1), f(&stages[k]["p99_ms"], 1));
                t.add(
                    "     p50 / p99: receive→claim; claim→process",
                    format!("{}; {} ms", stage("receive_to_claim"), stage("claim_to_process")),
                );
            }
            log_row(&mut t, "request", &e["logs"]);
            t.add(
                "     HTTP latency p50 / p99 (from the scheduled send)",
                format!("{} / {} ms", f(&e["http_latency"]["p50_ms"], 1), f(&e["http_latency"]["p99_ms"], 1)),
            );
            let row = t.add(
                "     non-2xx / unanswered; rows stored / 2xx",
                format!("{} / {}; {} / {}", e["non_2xx"], e["unanswered"], e["rows_stored"], e["total_2xx"]),
            );
            row.target = "0 / 0; equal".into();
            row.ok = Some(e["non_2xx"] == 0 && e["unanswered"] == 0 && e["rows_match_2xx"] == true);
        }

        let phases = get("phases");
        let has_e = phases.as_array().is_some_and(|a| a.iter().any(|p| p == "e"));
        if has_e {
            for (bin, key) in [("inbox-ingest", "ingest"), ("inbox-worker", "worker")] {
                let rss = &get("rss")[key];
                if let Some(peak) = rss["peak_kib"].as_f64() {
                    let row = t.add(
                        format!("e  peak RSS {bin} (max of {})", rss["where"].as_str().unwrap_or("")),
                        mib(peak),
                    );
                    row.target = "≤ 64 MiB".into();
                    row.ok = Some(peak <= 64.0 * 1024.0);
                }
            }
        }

        let m = get("mem");
        if m.is_object() {
            let rows = m["rows"].as_f64().unwrap_or(0.0);
            let avg = m["payload_bytes"].as_f64().unwrap_or(0.0) / rows.max(1.0);
            t.add(
                format!(
                    "mem drain {} rows × {:.2} MiB, 1 worker proc, default flags",
                    m["rows"],
                    avg / f64::from(1 << 20)
                ),
                format!("{} events/s, {} MiB/s", f(&m["events_per_s"], 0), f(&m["payload_mib_per_s"], 1)),
            );
            let max_bytes = m["worker_defaults"]["max_bytes_in_flight"].as_str().unwrap_or("?");
            let limit = m["memory_limit_kib"].as_f64().unwrap_or(256.0 * 1024.0);
            let row = t.add(
                format!("     worker peak RSS, --max-bytes-in-flight {max_bytes} (default)"),
                m["worker_peak_rss_kib"].as_f64().map_or("?".into(), mib),
            );
            row.target = format!("≤ {:.0} MiB", limit / 1024.0);
            row.ok = Some(m["worker_peak_rss_kib"].as_f64().is_some_and(|p| p <= limit));
            t.add(
                "     worker defaults: --concurrency / --batch-size / --max-bytes-in-flight",
                defaults_text(&m["worker_defaults"]),
            );
            let row = t.add(
                "     ledger rows / rows; rows retried, with error",
                format!(
                    "{} / {}; {}, {}",
                    m["ledger_rows"], m["rows"], m["rows_retried"], m["rows_with_error"]
                ),
            );
            row.target = "equal; 0, 0".into();
            row.ok = Some(m["ledger_matches"] == true && m["rows_retried"] == 0 && m["rows_with_error"] == 0);
        }

        let s = get("scale");
        if s.is_object() {
            let eps = s["events_per_s"].as_f64().unwrap_or(0.0);
            let row = t.add(
                format!("3  scale: {} processed + {} queued, 1 proc", s["history_rows"], s["queued_rows"]),
                format!("{eps:.0} events/s"),
            );
            if let Some(ratio) = s["ratio_to_empty_table"].as_f64() {
                row.ratio = Some((ratio, "empty table".into()));
                row.target = "≥ 0.95".into();
                row.ok = Some(ratio >= 0.95);
            }
            if let Some(rounds) = s["rounds"].as_array() {
                let text = rounds
                    .iter()
                    .map(|r| {
                        let ratio = r["ratio"].as_f64().unwrap_or(f64::NAN);
                        let first = if r["history_first"] == true { "h" } else { "e" };
                        let av = |k: &str| r[k].as_u64().unwrap_or(0) > 0;
                        let marks = match (av("autovacuum_runs_history"), av("autovacuum_runs_empty_table")) {
                            (false, false) => "",
                            (true, false) => " (autovacuum: h)",
                            (false, true) => " (autovacuum: e)",
                            (true, true) => " (autovacuum: h, e)",
                        };
                        format!("{ratio:.2} {first}{marks}")
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                t.add("     each round: history / empty table (h, e: which drained first)", text);
            }
            drain_rows(&mut t, s);
        }

        let c = get("console");
        if c.is_object() {
            t.add(
                format!("console: {} parked rows, {} processed in 6 h", c["parked_rows"], c["history_rows"]),
                format!("{} GETs a page", c["requests_per_page"]),
            );
            for (key, label) in [
                ("needs_review", "     GET /needs-review (page 1) median / p95"),
                ("needs_review_filtered", "     GET /needs-review?type=…&error=… median / p95"),
                ("overview", "     GET / (overview) median / p95"),
            ] {
                let page = &c[key];
                let row = t.add(
                    label,
                    format!(
                        "{} / {} ms (first {})",
                        f(&page["median_ms"], 1),
                        f(&page["p95_ms"], 1),
                        f(&page["first_ms"], 1)
                    ),
                );
                row.target = format!("p95 < {} ms", f(&c["target_p95_ms"], 0));
                row.ok = page["ok"].as_bool();
            }
        }

        let s = get("soak");
        if s.is_object() {
            soak_rows(&mut t, s);
        }

        for (phase, err) in get("errors").as_object().into_iter().flatten() {
            let msg: String =
                err.as_str().unwrap_or("").lines().next().unwrap_or("").chars().take(60).collect();
            let row = t.add(format!("!  phase {phase} FAILED"), msg);
            row.ok = Some(false);
        }
        t
    }

    pub fn print(&self) {
        let w0 = self.rows.iter().map(|r| r.figure.chars().count()).max().unwrap_or(6).max(6);
        let w1 = self.rows.iter().map(|r| r.value.chars().count()).max().unwrap_or(5).max(5);
        let ratio = |r: &Row| {
            r.ratio
                .as_ref()
                .map_or(String::new(), |(x, vs)| format!("{} × {vs}", ratio_digits(*x, &r.target)))
        };
        let w2 = self.rows.iter().map(|r| ratio(r).chars().count()).max().unwrap_or(5).max(5);
        let w3 = self.rows.iter().map(|r| r.target.chars().count()).max().unwrap_or(6).max(6);
        let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
        let lpad = |s: &str, w: usize| format!("{}{s}", " ".repeat(w.saturating_sub(s.chars().count())));
        println!(
            "{}  {}  {}  {}  ok",
            pad("figure", w0),
            lpad("value", w1),
            pad("ratio", w2),
            pad("target", w3)
        );
        println!("{}", "-".repeat(w0 + w1 + w2 + w3 + 12));
        for r in &self.rows {
            let ok = match r.ok {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "",
            };
            println!(
                "{}  {}  {}  {}  {ok}",
                pad(&r.figure, w0),
                lpad(&r.value, w1),
                pad(&ratio(r), w2),
                pad(&r.target, w3)
            );
        }
    }

    pub fn json(&self) -> Value {
        json!(self
            .rows
            .iter()
            .map(|r| json!({
                "figure": r.figure.trim(),
                "value": r.value,
                "ratio": r.ratio.as_ref().map(|x| x.0),
                "ratio_to": r.ratio.as_ref().map(|x| x.1.clone()),
                "target": r.target,
                "ok": r.ok,
            }))
            .collect::<Vec<_>>())
    }

    pub fn any_missed(&self) -> bool {
        self.rows.iter().any(|r| r.ok == Some(false))
    }
}

/// The soak phase: steady state over a long run, with its targets.
fn soak_rows(t: &mut Table, s: &Value) {
    let ms = |v: &Value| f(v, 1);
    let minutes = |v: &Value| f(&json!(v.as_f64().map(|x| x / 60.0)), 0);
    t.add(
        format!(
            "soak  {} min at {}/s ({}), 1 ingest + 1 worker + 1 relay, default flags",
            minutes(&s["duration_s"]),
            f(&s["rate"], 0),
            s["rate_source"].as_str().unwrap_or("?")
        ),
        format!("{} req/s sent", f(&s["achieved_rate"], 0)),
    );
    let sent = &s["sent"];
    let row = t.add(
        "     2xx / processed; non-2xx / unanswered; relay duplicates",
        format!(
            "{} / {}; {} / {}; {}",
            sent["ok_2xx"], s["processed"], sent["non_2xx"], sent["errors"], s["relay_duplicates"]
        ),
    );
    row.target = "equal; 0 / 0; 0".into();
    row.ok = Some(
        s["processed_matches_2xx"] == true
            && sent["non_2xx"] == 0
            && sent["errors"] == 0
            && s["relay_duplicates"] == 0
            && s["relay_distinct"] == s["processed"],
    );
    let r = &s["receive_to_processed"];
    let window = match r["window_s"].as_f64() {
        Some(w) if w < 120.0 => format!("{w:.0} s"),
        _ => format!("{} min", minutes(&r["window_s"])),
    };
    t.add(
        format!("     receive→processed p50 / p99, first {window}"),
        format!("{} / {} ms", ms(&r["first"]["p50_ms"]), ms(&r["first"]["p99_ms"])),
    );
    let row = t.add(
        format!("     receive→processed p50 / p99, last {window}"),
        format!("{} / {} ms", ms(&r["last"]["p50_ms"]), ms(&r["last"]["p99_ms"])),
    );
    if let Some(ratio) = r["p99_last_over_first"].as_f64() {
        row.ratio = Some((ratio, "first".into()));
        row.target = "p99 ≤ 1.50 × first".into();
        row.ok = Some(ratio <= 1.5);
    }
    t.add(
        "     p99 overall; before / during / after the held snapshot",
        format!(
            "{}; {} / {} / {} ms",
            ms(&r["overall"]["p99_ms"]),
            ms(&r["before_snapshot_p99_ms"]),
            ms(&r["during_snapshot_p99_ms"]),
            ms(&r["after_snapshot_p99_ms"])
        ),
    );
    let c = &s["claim_interval_p99_ms_max"];
    t.add(
        "     claim mean / p99; worst 10 s p99 before / during / after",
        format!(
            "{} / {}; {} / {} / {} ms",
            f(&s["claims"]["mean_ms"], 2),
            f(&s["claims"]["p99_ms"], 2),
            f(&c["before_snapshot"], 1),
            f(&c["during_snapshot"], 1),
            f(&c["after_snapshot"], 1)
        ),
    );
    // The inbox, its queue's table (schema version 17 on), the outbox: those the run had.
    let tables = &s["tables"];
    let names: Vec<&str> = ["webhook_inbox", "webhook_inbox_queue", "outbox"]
        .into_iter()
        .filter(|n| tables[*n].is_object())
        .collect();
    for table in &names {
        let v = &s["sizes"][*table];
        let parts = if *table == "webhook_inbox" { "heap+TOAST+indexes" } else { "heap+indexes" };
        // The first purge leaves the table filling up to its steady state; flat is judged from
        // the second (see the soak's summary).
        for (nth, key, judged) in [("1st", "first", false), ("2nd", "second", true)] {
            let row = t.add(
                format!(
                    "     {table} {parts}: after {nth} purge → end{}",
                    if judged { "" } else { " (filling up)" }
                ),
                format!(
                    "{} → {}",
                    size(v[format!("after_{key}_purge_bytes")].as_i64()),
                    size(v["end_bytes"].as_i64())
                ),
            );
            let ratio = v[format!("end_over_after_{key}_purge")].as_f64();
            row.ratio = ratio.map(|r| (r, format!("{nth} purge")));
            if judged {
                row.target = "≤ 1.20 (flat)".into();
                row.ok = ratio.map(|r| r <= 1.2);
            }
        }
        let row = t.add(
            format!("     {table} {parts}: before the snapshot → end"),
            format!("{} → {}", size(v["before_snapshot_bytes"].as_i64()), size(v["end_bytes"].as_i64())),
        );
        row.ratio = v["end_over_before_snapshot"].as_f64().map(|r| (r, "before snapshot".to_owned()));
    }
    let short = |n: &str| match n {
        "webhook_inbox" => "inbox".to_owned(),
        "webhook_inbox_queue" => "queue".to_owned(),
        other => other.to_owned(),
    };
    let which = names.iter().map(|n| short(n)).collect::<Vec<_>>().join(" / ");
    let each = |key: &str, fmt: &dyn Fn(&Value) -> String| {
        names.iter().map(|n| fmt(&tables[*n][key])).collect::<Vec<_>>().join(" / ")
    };
    t.add(format!("     max n_dead_tup: {which}"), each("max_dead_tuples", &|v| v.to_string()));
    let hot = tables["webhook_inbox"]["hot_share"].as_f64();
    let row = t.add(
        format!("     HOT updates / updates over the run: {which}"),
        each("hot_share", &|v| format!("{}%", f(&json!(v.as_f64().map(|x| x * 100.0)), 0))),
    );
    row.target = "webhook_inbox ≥ 90%".into();
    row.ok = hot.map(|h| h >= 0.9);
    let wal = s["wal_bytes_per_event"].as_f64();
    let row = t.add("     WAL bytes / event (the whole cluster's WAL)", f(&s["wal_bytes_per_event"], 0));
    row.target = "≤ 2048".into();
    row.ok = wal.map(|w| w <= 2048.0);
    for (key, what) in [("wal_by_record_type", "record type"), ("wal_by_table", "table")] {
        let Some(parts) = s[key]["parts"].as_array() else { continue };
        // The five largest: record bytes + full-page images per event, for each.
        let top: Vec<String> = parts
            .iter()
            .take(5)
            .map(|k| {
                let (rec, fpi) = (&k["record_bytes_per_event"], &k["fpi_bytes_per_event"]);
                format!("{} {}+{}", k["name"].as_str().unwrap_or("?"), f(rec, 0), f(fpi, 0))
            })
            .collect();
        let images = s[key]["full_page_image_share"].as_f64().map(|x| x * 100.0);
        t.add(
            format!("     WAL by {what}, B / event (records + full-page images), largest 5"),
            format!("{}; images {}% of all", top.join(", "), f(&json!(images), 0)),
        );
    }
    t.add("     commits / event", f(&s["commits_per_event"], 2));
    let d = &s["dead_index_entries_per_event"];
    let row = t.add(
        "     dead index entries / event (upper est.): updates + deletes",
        format!("{} + {} = {}", f(&d["from_updates"], 2), f(&d["from_deletes"], 2), f(&d["total"], 2)),
    );
    row.target = "≤ 1".into();
    row.ok = d["total"].as_f64().map(|v| v <= 1.0);
    t.add(format!("     autovacuum runs: {which}"), each("autovacuum_runs", &|v| v.to_string()));
    let cpu = &s["cpu"];
    t.add(
        "     CPU µs / event: ingest / worker / relay / postgres",
        format!(
            "{} / {} / {} / {}",
            f(&cpu["ingest_cpu_us_per_unit"], 0),
            f(&cpu["worker_cpu_us_per_unit"], 0),
            f(&cpu["relay_cpu_us_per_unit"], 0),
            f(&cpu["postgres_cpu_us_per_unit"], 0)
        ),
    );
    log_row(t, "event", &s["logs"]);
    let rss = &s["peak_rss_kib"];
    let peak = |k: &str| rss[k].as_f64().map_or("?".into(), mib);
    t.add(
        "     peak RSS: ingest / worker / relay / bench; postgres RssAnon",
        format!(
            "{} / {} / {} / {}; {}",
            peak("ingest"),
            peak("worker"),
            peak("relay"),
            peak("bench"),
            peak("postgres_private_max_sampled")
        ),
    );
    let purges = s["purges"].as_array().cloned().unwrap_or_default();
    let durations: Vec<String> = purges.iter().map(|p| f(&p["seconds"], 1)).collect();
    let deleted: u64 = purges.iter().filter_map(|p| p["deleted"].as_u64()).sum();
    let outbox: u64 = purges.iter().filter_map(|p| p["outbox_deleted"].as_u64()).sum();
    let row = t.add(
        format!(
            "     purges (--older-than {}): s each; rows deleted",
            s["purge_older_than"].as_str().unwrap_or("?")
        ),
        format!("{} s; {deleted} + {outbox} outbox", durations.join(", ")),
    );
    row.target = "no failure".into();
    row.ok = Some(purges.iter().all(|p| p["error"].is_null()));
}

/// The peak RSS (VmHWM) of each binary over the phases that ran it.
pub fn rss_json(r: &serde_json::Map<String, Value>) -> Value {
    let mut ingest = serde_json::Map::new();
    let mut worker = serde_json::Map::new();
    for (c, v) in r.get("ingest").and_then(|v| v.as_object()).into_iter().flatten() {
        ingest.insert(format!("b{c}"), v["ingest_peak_rss_kib"].clone());
    }
    for (p, v) in r.get("drain").and_then(|v| v.as_object()).into_iter().flatten() {
        let max = v["worker_peak_rss_kib"].as_array().and_then(|a| a.iter().filter_map(|x| x.as_u64()).max());
        worker.insert(format!("c{p}"), json!(max));
    }
    if let Some(d) = r.get("drain_default") {
        let max = d["worker_peak_rss_kib"].as_array().and_then(|a| a.iter().filter_map(|x| x.as_u64()).max());
        worker.insert("c1-default".into(), json!(max));
    }
    if let Some(e) = r.get("e2e") {
        ingest.insert("d".into(), e["ingest_peak_rss_kib"].clone());
        worker.insert("d".into(), e["worker_peak_rss_kib"].clone());
    }
    if let Some(s) = r.get("scale") {
        let max = s["worker_peak_rss_kib"].as_array().and_then(|a| a.iter().filter_map(|x| x.as_u64()).max());
        worker.insert("scale".into(), json!(max));
    }
    let summary = |m: serde_json::Map<String, Value>| {
        let peak = m.values().filter_map(|v| v.as_u64()).max();
        let names: Vec<String> = m.keys().cloned().collect();
        json!({ "peak_kib": peak, "where": names.join(", "), "by_run_kib": m })
    };
    json!({ "ingest": summary(ingest), "worker": summary(worker) })
}

/// The machine and PostgreSQL settings, as printed above the table.
pub fn machine_lines(m: &Value) -> Vec<String> {
    let pg = &m["postgres"];
    let s = |k: &str| pg[k].as_str().unwrap_or("?").to_owned();
    vec![
        format!(
            "machine: {} cores ({}), {:.1} GiB RAM, kernel {}, load average at start {}",
            m["cores"],
            m["cpu_model"].as_str().unwrap_or("?"),
            m["memory_kib"].as_f64().unwrap_or(0.0) / 1024.0 / 1024.0,
            m["kernel"].as_str().unwrap_or("?"),
            m["load_average_start"].as_str().unwrap_or("?")
        ),
        format!(
            "postgres {}: fsync={} synchronous_commit={} full_page_writes={} wal_sync_method={} commit_delay={} \
             shared_buffers={} max_connections={}{}",
            s("server_version"),
            s("fsync"),
            s("synchronous_commit"),
            s("full_page_writes"),
            s("wal_sync_method"),
            s("commit_delay"),
            s("shared_buffers"),
            s("max_connections"),
            if m["postgres_local"] == true { "" } else { " (not on this machine: no CPU figures)" }
        ),
        format!(
            "build: git {}{}, binaries in {}, services logging at RUST_LOG={}",
            m["git_commit"].as_str().unwrap_or("?"),
            if m["git_dirty"] == true { " (uncommitted changes)" } else { "" },
            m["bin_dir"].as_str().unwrap_or("?"),
            m["service_log"].as_str().unwrap_or("?")
        ),
    ]
}

/// A ratio to two decimals, or three when two would print the bound of its target (the first
/// number in `target`): 0.9469 as "0.95" beside "≥ 0.95  NO" reads as a contradiction.
fn ratio_digits(x: f64, target: &str) -> String {
    let bound =
        target.split(|c: char| !(c.is_ascii_digit() || c == '.')).find_map(|word| word.parse::<f64>().ok());
    match bound {
        Some(bound) if format!("{x:.2}") == format!("{bound:.2}") => format!("{x:.3}"),
        _ => format!("{x:.2}"),
    }
}

/// Each round's ratio of one figure to another, as `1.02, 0.97`, when both ran in rounds (their
/// rates under `rounds_…`).
fn each_round(v: &Value, key: &str, base: &Value, base_key: &str) -> Option<String> {
    let rates = |v: &Value, key: &str| {
        v[key].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect::<Vec<_>>())
    };
    let (v, base) = (rates(v, key)?, rates(base, base_key)?);
    Some(v.iter().zip(&base).map(|(v, b)| format!("{:.2}", v / b)).collect::<Vec<_>>().join(", "))
}

#[cfg(test)]
mod tests {
    use super::ratio_digits;

    #[test]
    fn a_ratio_that_rounds_to_its_bound_shows_a_third_decimal() {
        assert_eq!(ratio_digits(0.9469, "≥ 0.95"), "0.947");
        assert_eq!(ratio_digits(1.2049, "≤ 1.20 (flat)"), "1.205");
        assert_eq!(ratio_digits(1.13, "≥ 1.20, p99 ≤ 25"), "1.13");
        assert_eq!(ratio_digits(0.93, ""), "0.93");
    }
}
