//! How operator commands present results: aligned text tables, or one JSON document with
//! `--json`, on stdout; and the small formatting helpers the tables use.

use std::io::Write as _;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

/// Output flags of the operator commands.
#[derive(Debug, Args, Clone)]
pub struct OutputArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Prints `text` on stdout.
pub fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))
}

/// Prints `value` as a pretty JSON document.
pub fn emit_json(value: &impl Serialize) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    emit(&text)
}

/// A text table: a header row and rows, each column as wide as its widest cell; columns marked
/// numeric are right-aligned.
pub struct Table {
    headers: Vec<&'static str>,
    numeric: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with `columns` (header, numeric).
    pub fn new(columns: &[(&'static str, bool)]) -> Self {
        Table {
            headers: columns.iter().map(|c| c.0).collect(),
            numeric: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let headers: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i].saturating_sub(cell.chars().count());
                if self.numeric[i] {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `text` on one line, cut to `max` characters (with `…`): for table cells only.
pub fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// An age in seconds as `2h 3m 4s (7384.0 s)`.
pub fn format_age(seconds: f64) -> String {
    let whole = Duration::from_secs(seconds.max(0.0) as u64);
    format!("{} ({seconds:.1} s)", humantime::format_duration(whole))
}

/// `s` unless `n` is 1.
pub fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_flattens_and_cuts_on_characters() {
        assert_eq!(one_line("a\nb", 10), "a b");
        let long = "é".repeat(100);
        let cut = one_line(&long, 80);
        assert_eq!(cut.chars().count(), 80);
        assert!(cut.ends_with('…'));
    }

    #[test]
    fn tables_align_columns() {
        let mut t = Table::new(&[("name", false), ("n", true)]);
        t.push(vec!["a".into(), "10".into()]);
        t.push(vec!["longer".into(), "2".into()]);
        assert_eq!(t.render(), "name     n\na       10\nlonger   2\n");
    }
}

/// The error of a command that printed its report first (an interrupted batch run, a signature
/// that does not verify): the report is the one document on stdout, so the binary adds no JSON
/// error after it (it still prints the error on stderr and exits 1).
#[derive(Debug)]
pub struct AfterReport(pub String);

impl std::fmt::Display for AfterReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AfterReport {}
