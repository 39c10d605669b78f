# stripe-inbox — `make help` lists the targets.
#
# Without DATABASE_URL, targets that need PostgreSQL create and start a local cluster in ./.pg
# (as the postgres user when run as root) and use it; with DATABASE_URL set, that database is used.

SHELL := /bin/bash
CARGO ?= cargo
WITH_DB := scripts/with-db.sh
# The two product binaries and the example's; the tools (bench, chaos) are built only by their own
# targets.
PRODUCT := -p inbox-ingest -p inbox-worker
EXAMPLES := -p custom-worker
# What `make test` builds and runs: everything but the tools.
TOOLS := --exclude inbox-bench --exclude inbox-chaos

.DEFAULT_GOAL := help
.PHONY: help build build-release run test lint fmt db-start db-stop db-reset db-url psql clean

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

build: ## Build the binaries (debug, as the tests use them)
	$(CARGO) build --bins $(PRODUCT) $(EXAMPLES)

build-release: ## Build the two product binaries (release, as make run and the image use them)
	$(CARGO) build --bins --release -p inbox-ingest -p inbox-worker

run: build-release ## Local PostgreSQL, migrate, run inbox-ingest (+ worker); prints how to send an event
	@$(WITH_DB) scripts/run.sh

test: build ## Every test and doctest, against the local PostgreSQL (or DATABASE_URL)
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
	    $(WITH_DB) $(CARGO) nextest run --workspace $(TOOLS) $(if $(CI),--profile ci,); \
	else \
	    $(WITH_DB) $(CARGO) test --workspace $(TOOLS) --lib --bins --tests; \
	fi
	$(CARGO) test --doc --workspace $(TOOLS)
	$(CARGO) test -p inbox-bench --bins # the bench's own arithmetic (rounds, ratios), no server

CHAOS_DURATION ?= 5m
CHAOS_RATE ?= 100
CHAOS_FAULT_INTERVAL ?= 5s
CHAOS_ARGS ?=
.PHONY: chaos
chaos: ## Load + faults (kill -9, pg restarts, WAL disk full, max_connections, xmin pin, …) on a cluster of its own; then check nothing lost/doubled/parked; target/chaos/report.json
	$(CARGO) build --bins $(PRODUCT) -p inbox-chaos
	$(WITH_DB) target/debug/chaos --duration $(CHAOS_DURATION) --rate $(CHAOS_RATE) \
	    --fault-interval $(CHAOS_FAULT_INTERVAL) $(CHAOS_ARGS)

BENCH_ARGS ?=
.PHONY: bench
bench: ## Throughput/latency as ratios to pgbench on this PostgreSQL (~6 min); table + target/bench/report.json
	$(CARGO) build --release --bins $(PRODUCT) -p inbox-bench
	$(WITH_DB) target/release/bench $(BENCH_ARGS)

SOAK_ARGS ?=
.PHONY: soak
soak: ## Steady state, 30 min: ingest + worker + relay at half the ingest's rate, purge every 3 min, a 5-min snapshot mid-run; target/bench/soak/ and docs/performance/soak/ charts
	$(CARGO) build --release --bins $(PRODUCT) -p inbox-bench
	$(WITH_DB) target/release/bench --phases b,soak --connections 32 --soak-publish $(SOAK_ARGS)

.PHONY: console-screenshots
console-screenshots: build ## PNGs of every console page from a real run (headless Chromium; seeded data) into docs/console/
	$(WITH_DB) env CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(CARGO) test -p inbox-tests --test e2e \
	    console_browser::every_page_renders -- --nocapture

.PHONY: deps
deps: ## Install what lint and the tests need beyond the toolchain and PostgreSQL (cargo-deny, pgbouncer, nats-server, Chromium + chromedriver, Standard Webhooks reference library), if missing
	scripts/ci-deps.sh

lint: ## rustfmt check, clippy with warnings as errors, cargo deny (licenses, duplicate versions, banned crates, sources)
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@$(CARGO) deny --version >/dev/null 2>&1 || { echo "cargo-deny is not installed: run 'make deps'" >&2; exit 1; }
	$(CARGO) deny check licenses bans sources

.PHONY: audit
audit: ## cargo deny's advisories check: needs the RustSec database from GitHub (not reachable in CI)
	$(CARGO) deny check advisories

.PHONY: deploy-check
deploy-check: ## Validate deploy/ manifests, alert rules and dashboard
	scripts/check-deploy.sh

fmt: ## Format the code
	$(CARGO) fmt --all

db-start: ## Start the local PostgreSQL (created on first use)
	@scripts/pg.sh start && scripts/pg.sh url

db-stop: ## Stop the local PostgreSQL
	@scripts/pg.sh stop

db-reset: ## Delete the local PostgreSQL cluster (recreated by the next target that needs it)
	@scripts/pg.sh reset

db-url: ## Print the local DATABASE_URL
	@scripts/pg.sh url

psql: ## psql into the local inbox database
	@scripts/pg.sh psql

clean: ## Remove build output
	$(CARGO) clean
