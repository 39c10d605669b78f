//! The documents a new team reads first, held to the binaries they describe.

use std::time::Duration;

use inbox_test_support::process::{command, run};

fn read(path: &str) -> String {
    let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// The subcommands `inbox-worker --help` lists (every team binary built with `main_with` has the
/// same).
fn subcommands() -> Vec<String> {
    let mut cmd = command("inbox-worker");
    cmd.arg("--help");
    let (code, help) = run(cmd, Duration::from_secs(30));
    assert_eq!(code, 0, "{help}");
    let commands = help.split("Commands:").nth(1).expect("a Commands: section").split("\n\n").next().unwrap();
    let names: Vec<String> = commands
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect();
    assert!(names.len() >= 9, "{names:?}");
    names
}

#[test]
fn the_readme_the_handler_guide_and_the_examples_readme_name_every_subcommand() {
    let subcommands = subcommands();
    for doc in ["README.md", "docs/handlers.md", "examples/custom-worker/README.md"] {
        let text = read(doc);
        let named = |name: &String| {
            text.contains(&format!("`{name}`")) || text.contains(&format!("`inbox-worker {name}"))
        };
        let missing: Vec<&String> = subcommands.iter().filter(|name| !named(name)).collect();
        assert!(missing.is_empty(), "{doc} does not name {missing:?}");
    }
    // The README's overview lists the operator commands in one line (the services, `run` and
    // `relay`, have lines of their own in the diagram).
    let readme = read("README.md");
    let overview = readme.lines().find(|line| line.contains("operators ──")).expect("the overview's line");
    for service in ["inbox-worker run", "inbox-worker relay"] {
        assert!(readme.contains(service), "the README's overview lacks {service}");
    }
    for name in subcommands.iter().filter(|name| !["run", "relay"].contains(&name.as_str())) {
        assert!(overview.contains(name.as_str()), "the overview lacks {name}: {overview}");
    }
}

#[test]
fn the_readme_shows_how_to_walk_an_event_to_review_with_a_low_attempt_limit() {
    let readme = read("README.md");
    for needle in ["INBOX_MAX_ATTEMPTS=2 make run", "needs-review", "requeue --event-id"] {
        assert!(readme.contains(needle), "the README lacks {needle:?}");
    }
}
