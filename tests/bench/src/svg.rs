//! Line charts as hand-written SVG (800 × 300): axes with tick labels, one polyline per series, a
//! legend on the right, a shaded band (the held snapshot) and vertical dashed ticks (the purges).

use std::fmt::Write as _;

/// One line: (x, y) points; a `None` y breaks the line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, Option<f64>)>,
}

pub struct Chart {
    pub title: String,
    /// The y axis' label, with its unit.
    pub y_label: String,
    pub x_label: String,
    pub series: Vec<Series>,
    /// A shaded span of x and its legend text.
    pub band: Option<(f64, f64, String)>,
    /// Instants of x marked by a vertical dashed line, and their legend text.
    pub marks: (Vec<f64>, String),
    /// An instant of x marked by a solid vertical line, and its legend text.
    pub end: Option<(f64, String)>,
}

const W: f64 = 800.0;
const H: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 42.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
    "#bcbd22",
];

/// About five round ticks (1, 2 or 5 × 10ⁿ apart) from `lo` to at least `hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-9);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let first = (lo / step).floor() * step;
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        let v = first + step * i as f64;
        out.push(v);
        if v >= hi - step * 1e-9 || i > 50 {
            return out;
        }
        i += 1;
    }
}

fn label(v: f64, step: f64) -> String {
    if v.abs() >= 1e4 && step >= 1e3 {
        return format!("{}k", fmt_num(v / 1e3, step / 1e3));
    }
    fmt_num(v, step)
}

fn fmt_num(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 { 0 } else { (-step.log10()).ceil() as usize };
    format!("{v:.decimals$}")
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

pub fn render(c: &Chart) -> String {
    let values = || c.series.iter().flat_map(|s| s.points.iter());
    let xs: Vec<f64> = values()
        .map(|p| p.0)
        .chain(c.marks.0.iter().copied())
        .chain(c.band.iter().flat_map(|b| [b.0, b.1]))
        .chain(c.end.iter().map(|e| e.0))
        .collect();
    let x_hi = xs.iter().copied().fold(0.0, f64::max).max(1e-3);
    let ys: Vec<f64> = values().filter_map(|p| p.1).filter(|y| y.is_finite()).collect();
    let y_lo = ys.iter().copied().fold(0.0, f64::min);
    let y_hi = ys.iter().copied().fold(f64::MIN, f64::max);
    let y_hi = if y_hi <= y_lo { y_lo + 1.0 } else { y_hi };
    // The x axis ends at the last point (its ticks within it); the y axis at a round tick.
    let xt: Vec<f64> = ticks(0.0, x_hi).into_iter().filter(|x| *x <= x_hi * (1.0 + 1e-9)).collect();
    let yt = ticks(y_lo, y_hi);
    let (x1, y0, y1) = (x_hi, yt[0], *yt.last().unwrap());
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let px = |x: f64| LEFT + x / x1 * pw;
    let py = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">
<rect width="{W}" height="{H}" fill="white"/>
<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{}</text>
"#,
        esc(&c.title)
    );
    if let Some((b0, b1, _)) = &c.band {
        let _ = writeln!(
            s,
            r##"<rect x="{:.1}" y="{TOP}" width="{:.1}" height="{ph}" fill="#f5deb3" opacity="0.6"/>"##,
            px(*b0),
            (px(*b1) - px(*b0)).max(1.0)
        );
    }
    // Grid and tick labels.
    let step_x = xt.get(1).map_or(1.0, |v| v - xt[0]);
    for &x in &xt {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#e4e4e4"/><text x="{0:.1}" y="{2:.1}" text-anchor="middle">{3}</text>"##,
            px(x),
            TOP + ph,
            TOP + ph + 14.0,
            label(x, step_x)
        );
    }
    let step_y = yt.get(1).map_or(1.0, |v| v - yt[0]);
    for &y in &yt {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#e4e4e4"/><text x="{2:.1}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            py(y),
            LEFT + pw,
            LEFT - 5.0,
            py(y) + 4.0,
            label(y, step_y)
        );
    }
    for &m in &c.marks.0 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#555" stroke-dasharray="3,3"/>"##,
            px(m),
            TOP + ph
        );
    }
    if let Some((x, _)) = &c.end {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#555" stroke-width="1.5"/>"##,
            px(*x),
            TOP + ph
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>
<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>
<text transform="translate(14,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"##,
        LEFT + pw / 2.0,
        H - 8.0,
        esc(&c.x_label),
        TOP + ph / 2.0,
        esc(&c.y_label)
    );
    // The lines, split where a value is missing.
    for (i, series) in c.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        for run in series.points.split(|p| p.1.is_none_or(|y| !y.is_finite())) {
            let pts: Vec<String> =
                run.iter().map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(y.unwrap_or(0.0)))).collect();
            if pts.len() == 1 {
                let (x, y) = pts[0].split_once(',').unwrap();
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>"#);
            } else if pts.len() > 1 {
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="1.5"/>"#,
                    pts.join(" ")
                );
            }
        }
    }
    // Legend: the series, then the band and the marks.
    let lx = LEFT + pw + 12.0;
    let mut ly = TOP + 8.0;
    for (i, series) in c.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 18.0,
            lx + 23.0,
            ly + 4.0,
            esc(&series.name)
        );
        ly += 16.0;
    }
    if let Some((_, _, text)) = &c.band {
        let _ = writeln!(
            s,
            r##"<rect x="{lx}" y="{:.1}" width="18" height="10" fill="#f5deb3"/><text x="{:.1}" y="{:.1}">{}</text>"##,
            ly - 5.0,
            lx + 23.0,
            ly + 4.0,
            esc(text)
        );
        ly += 16.0;
    }
    if let Some((_, text)) = &c.end {
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="#555" stroke-width="1.5"/><text x="{:.1}" y="{:.1}">{}</text>"##,
            lx + 18.0,
            lx + 23.0,
            ly + 4.0,
            esc(text)
        );
        ly += 16.0;
    }
    if !c.marks.0.is_empty() {
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="#555" stroke-dasharray="3,3"/><text x="{:.1}" y="{:.1}">{}</text>"##,
            lx + 18.0,
            lx + 23.0,
            ly + 4.0,
            esc(&c.marks.1)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_reach_the_top() {
        assert_eq!(ticks(0.0, 4.03), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(ticks(0.0, 87.0), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(label(120_000.0, 20_000.0), "120k");
        assert_eq!(label(0.25, 0.05), "0.25");
    }

    #[test]
    fn a_missing_value_breaks_the_line() {
        let chart = Chart {
            title: "t <&>".into(),
            y_label: "ms".into(),
            x_label: "minutes".into(),
            series: vec![Series {
                name: "p99".into(),
                points: vec![(0.0, Some(1.0)), (1.0, None), (2.0, Some(2.0)), (3.0, Some(3.0))],
            }],
            band: Some((1.0, 2.0, "snapshot held".into())),
            marks: (vec![1.5], "purge".into()),
            end: Some((3.0, "end".into())),
        };
        let svg = render(&chart);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 1);
        assert!(svg.contains("t &lt;&amp;&gt;"));
        assert!(svg.contains("stroke-dasharray") && svg.contains("#f5deb3"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
