//! PNG plots from bench/results.json, drawn with `plotters` into `ctx.out_dir` (bench/):
//!
//! * `scale.png`: the pass path's cost against the number of tracked sources (log x axis),
//!   with the XDP_PASS reference program as a horizontal line;
//! * `flood.png`: absorbed Mpps per contender, grouped by flood scenario and address family
//!   (only when the results have `flood.scenarios`).
//!
//! Text goes through `ab_glyph` with a TTF read at run time (DejaVu Sans from Debian's
//! `fonts-dejavu-core`), so no fontconfig or freetype is needed. Without the font the plots
//! are skipped and the markdown says why.

use std::path::Path;

use plotters::{
    coord::Shift,
    prelude::*,
    style::{
        FontStyle, register_font,
        text_anchor::{HPos, Pos, VPos},
    },
};
use serde_json::Value;

use crate::part::Ctx;

const FONT: &str = "sans-serif";
/// Where the font is looked for, first found wins.
const FONT_FILES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];
const FONT_PACKAGE: &str = "fonts-dejavu-core";

const W: u32 = 1000;
const H: u32 = 560;

/// Bar colours, one per contender in order of first appearance.
const PALETTE: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Register the TTF once for the whole process; the path used, or why there is none.
fn font() -> Result<&'static str, String> {
    static FONT_REGISTERED: std::sync::OnceLock<Result<&'static str, String>> =
        std::sync::OnceLock::new();
    FONT_REGISTERED
        .get_or_init(|| {
            let path = FONT_FILES
                .iter()
                .find(|p| Path::new(p).is_file())
                .ok_or_else(|| {
                    format!(
                        "no TTF font found (looked for {}; install Debian's {FONT_PACKAGE})",
                        FONT_FILES.join(", ")
                    )
                })?;
            let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            for style in [FontStyle::Normal, FontStyle::Bold] {
                register_font(FONT, style, bytes)
                    .map_err(|_| format!("{path}: not a font ab_glyph can read"))?;
            }
            Ok(*path)
        })
        .clone()
}

/// Draw the plots from the results (the JSON that goes to bench/results.json); returns the
/// markdown that embeds them.
pub fn draw(ctx: &Ctx, results: &Value) -> String {
    let mut md = String::from("\n## Plots\n\n");
    if let Err(e) = font() {
        eprintln!("plots: skipped: {e}");
        md.push_str(&format!("Plots skipped: {e}.\n"));
        return md;
    }
    if let Err(e) = std::fs::create_dir_all(&ctx.out_dir) {
        md.push_str(&format!(
            "Plots skipped: creating {}: {e}.\n",
            ctx.out_dir.display()
        ));
        return md;
    }
    let mut drawn = 0;
    let mut each = |file: &str, alt: &str, what: Result<bool, String>| match what {
        Ok(true) => {
            drawn += 1;
            md.push_str(&format!("![{alt}](bench/{file})\n\n"));
        }
        Ok(false) => {}
        Err(e) => {
            eprintln!("plots: {file}: {e}");
            md.push_str(&format!("{file} could not be drawn: {e}\n\n"));
        }
    };
    let scale = ctx.out_dir.join("scale.png");
    each(
        "scale.png",
        "Pass-path cost against tracked sources",
        draw_scale(&scale, results),
    );
    let flood = ctx.out_dir.join("flood.png");
    each(
        "flood.png",
        "Absorbed Mpps per contender and flood",
        draw_flood(&flood, results),
    );
    if drawn == 0 && md.ends_with("## Plots\n\n") {
        md.push_str("No results to plot.\n");
    }
    md
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// One series of the scale plot: (tracked sources, ns).
fn scale_points(results: &Value, field: &str) -> Vec<(f64, f64)> {
    results["scale"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["tracked_sources"].as_f64()?, s[field].as_f64()?)))
        .filter(|(n, ns)| *n > 0.0 && ns.is_finite())
        .collect()
}

fn case_ns(results: &Value, name: &str) -> Option<f64> {
    results["cases"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == name)?["ns"]
        .as_f64()
}

/// `Ok(false)`: nothing to draw.
fn draw_scale(path: &Path, results: &Value) -> Result<bool, String> {
    let ours = scale_points(results, "ns");
    if ours.is_empty() {
        return Ok(false);
    }
    let one = scale_points(results, "ns_one_source");
    let reference = case_ns(results, "reference: XDP_PASS");
    let (x_lo, x_hi) = ours.iter().fold((f64::MAX, f64::MIN), |(lo, hi), (n, _)| {
        (lo.min(*n), hi.max(*n))
    });
    // A decade of margin on each side of a single point, half a decade otherwise.
    let (x_lo, x_hi) = if x_lo == x_hi {
        (x_lo / 10.0, x_hi * 10.0)
    } else {
        (x_lo / 2.0, x_hi * 2.0)
    };
    let y_hi = ours
        .iter()
        .chain(&one)
        .map(|p| p.1)
        .chain(reference)
        .fold(0.0, f64::max)
        * 1.5;
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Pass path: ns per packet against tracked sources",
            (FONT, 26),
        )
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(72)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..y_hi.max(1.0))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("tracked sources (log scale)")
        .y_desc("ns per packet (BPF_PROG_TEST_RUN)")
        .x_label_formatter(&|v| human(*v))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    let blue = PALETTE[0];
    chart
        .draw_series(LineSeries::new(ours.clone(), blue.stroke_width(3)))
        .map_err(err)?
        .label("ours: a different tracked source every run")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], blue.stroke_width(3)));
    chart
        .draw_series(ours.iter().map(|p| Circle::new(*p, 5, blue.filled())))
        .map_err(err)?;
    chart
        .draw_series(ours.iter().map(|&(n, ns)| {
            EmptyElement::at((n, ns))
                + Text::new(
                    format!("{ns:.0}"),
                    (0, -9),
                    (FONT, 15)
                        .into_font()
                        .color(&blue)
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
        }))
        .map_err(err)?;
    if !one.is_empty() {
        let green = PALETTE[2];
        chart
            .draw_series(LineSeries::new(one.clone(), green.stroke_width(2)))
            .map_err(err)?
            .label("ours: the same source every run")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], green.stroke_width(2))
            });
        chart
            .draw_series(one.iter().map(|p| Circle::new(*p, 4, green.filled())))
            .map_err(err)?;
    }
    // The floors over the same spread: the store's, and a directly indexed line per source.
    let floors = [
        (
            "floor_ns",
            "floor: one store lookup and atomic add",
            PALETTE[1],
        ),
        (
            "line64_ns",
            "floor: a 64-byte line per source, no hashing",
            PALETTE[3],
        ),
        (
            "line16_ns",
            "floor: a 16-byte line per source, no hashing",
            PALETTE[4],
        ),
    ];
    for (field, label, colour) in floors {
        let pts = scale_points(results, field);
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(DashedLineSeries::new(
                pts.clone(),
                6,
                4,
                colour.stroke_width(2),
            ))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, colour.filled())))
            .map_err(err)?;
    }
    if let Some(r) = reference {
        let grey = RGBColor(90, 90, 90);
        chart
            .draw_series(LineSeries::new(
                vec![(x_lo, r), (x_hi, r)],
                grey.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("reference: XDP_PASS ({r:.0} ns)"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], grey.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(true)
}

/// One group of bars: a scenario and family, and each contender's absorbed Mpps.
struct Group {
    label: String,
    family: String,
    bars: Vec<(String, f64)>,
}

fn scenario_title(name: &str) -> &str {
    match name {
        "F" => "F: flood",
        "R" => "R: random-source flood",
        "M" => "M: flood + legitimate",
        other => other,
    }
}

fn family_title(family: &str) -> String {
    match family {
        "ipv4" => "(IPv4)".into(),
        "ipv6" => "(IPv6)".into(),
        "" => String::new(),
        other => format!("({other})"),
    }
}

fn flood_groups(results: &Value) -> Vec<Group> {
    results["flood"]["scenarios"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            let name = s["name"].as_str()?;
            let family = s["family"].as_str().unwrap_or("");
            let bars: Vec<(String, f64)> = s["contenders"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| {
                    let mpps = c["absorbed_mpps"].as_f64()?;
                    mpps.is_finite()
                        .then(|| (c["name"].as_str().unwrap_or("?").to_string(), mpps))
                })
                .collect();
            (!bars.is_empty()).then(|| Group {
                label: scenario_title(name).to_string(),
                family: family_title(family),
                bars,
            })
        })
        .collect()
}

/// `Ok(false)`: no flood results.
fn draw_flood(path: &Path, results: &Value) -> Result<bool, String> {
    let groups = flood_groups(results);
    if groups.is_empty() {
        return Ok(false);
    }
    // Contenders in order of first appearance, one colour each.
    let mut names: Vec<String> = Vec::new();
    for g in &groups {
        for (n, _) in &g.bars {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let colour = |name: &str| {
        let i = names.iter().position(|n| n == name).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    let y_hi = groups
        .iter()
        .flat_map(|g| g.bars.iter().map(|b| b.1))
        .fold(0.0, f64::max)
        .max(0.001)
        * 1.35;
    let n = groups.len() as f64;
    let root = BitMapBackend::new(path, (W.max(220 * groups.len() as u32), H)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Floods: absorbed Mpps per contender", (FONT, 26))
        .margin(16)
        .x_label_area_size(64)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..n, 0.0..y_hi)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc("absorbed Mpps")
        .y_label_formatter(&|v| format!("{v:.2}"))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    // Each group spans [i, i+1): bars share 80% of it.
    let bar_geometry = |g: &Group, j: usize, i: usize| {
        let w = 0.8 / g.bars.len() as f64;
        let x0 = i as f64 + 0.1 + j as f64 * w;
        (x0, x0 + w * 0.92)
    };
    for name in &names {
        let c = colour(name);
        let mut rects = Vec::new();
        let mut labels = Vec::new();
        for (i, g) in groups.iter().enumerate() {
            if let Some((j, (_, v))) = g.bars.iter().enumerate().find(|(_, b)| &b.0 == name) {
                let (x0, x1) = bar_geometry(g, j, i);
                rects.push(Rectangle::new([(x0, 0.0), (x1, *v)], c.filled()));
                labels.push(
                    EmptyElement::at(((x0 + x1) / 2.0, *v))
                        + Text::new(
                            format!("{v:.2}"),
                            (0, -4),
                            (FONT, 14)
                                .into_font()
                                .color(&BLACK)
                                .pos(Pos::new(HPos::Center, VPos::Bottom)),
                        ),
                );
            }
        }
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        chart.draw_series(labels).map_err(err)?;
    }
    // Group names under the axis, centred on their groups.
    let (_, bottom) = chart.backend_coord(&(0.0, 0.0));
    for (i, g) in groups.iter().enumerate() {
        let (x, _) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        draw_label(&root, &g.label, (x, bottom + 10))?;
        draw_label(&root, &g.family, (x, bottom + 32))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(true)
}

fn draw_label(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    text: &str,
    at: (i32, i32),
) -> Result<(), String> {
    root.draw(&Text::new(
        text.to_string(),
        at,
        (FONT, 17)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Top)),
    ))
    .map_err(err)
}

/// 1000 → "1k", 1e6 → "1M" (axis labels of the log scale).
fn human(v: f64) -> String {
    let (d, s) = if v >= 1e6 {
        (1e6, "M")
    } else if v >= 1e3 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    let x = v / d;
    if (x - x.round()).abs() < 1e-9 {
        format!("{}{s}", x.round())
    } else {
        format!("{x:.1}{s}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx(dir: &Path) -> Ctx {
        Ctx {
            quick: true,
            out_dir: dir.to_path_buf(),
        }
    }

    fn tmp(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rl-plots-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Fabricated results: test data only, never in a report.
    fn fabricated() -> Value {
        json!({
            "cases": [
                {"name": "reference: XDP_PASS", "ns": 30.0},
                {"name": "reference: XDP_DROP", "ns": 29.0},
            ],
            "scale": [
                {"tracked_sources": 1000, "ns": 120.0, "ns_one_source": 110.0, "over_ref_pass": 90.0},
                {"tracked_sources": 100000, "ns": 150.0, "ns_one_source": 112.0, "over_ref_pass": 120.0},
                {"tracked_sources": 1000000, "ns": 210.0, "ns_one_source": 115.0, "over_ref_pass": 180.0},
                {"tracked_sources": 10000000, "ns": 260.0, "ns_one_source": 118.0, "over_ref_pass": 230.0},
            ],
            "flood": {"scenarios": [
                {"name": "F", "family": "ipv4", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 2.4},
                    {"name": "nftables", "absorbed_mpps": 0.6},
                    {"name": "iptables hashlimit", "absorbed_mpps": 0.5}]},
                {"name": "F", "family": "ipv6", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 2.1},
                    {"name": "nftables", "absorbed_mpps": 0.55}]},
                {"name": "R", "family": "ipv4", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 1.9},
                    {"name": "nftables", "absorbed_mpps": 0.3},
                    {"name": "iptables hashlimit", "absorbed_mpps": 0.2}]},
                {"name": "R", "family": "ipv6", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 1.8},
                    {"name": "nftables", "absorbed_mpps": 0.25},
                    {"name": "iptables hashlimit", "absorbed_mpps": 0.15}]},
                {"name": "M", "family": "ipv4", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 1.7},
                    {"name": "nftables", "absorbed_mpps": 0.4}]},
                {"name": "M", "family": "ipv6", "contenders": [
                    {"name": "ratelimit", "absorbed_mpps": 1.6},
                    {"name": "nftables", "absorbed_mpps": 0.35},
                    {"name": "iptables hashlimit", "absorbed_mpps": 0.3},
                    {"name": "no limiter", "absorbed_mpps": 0.9}]},
            ]},
        })
    }

    fn is_png(p: &Path) -> bool {
        std::fs::read(p)
            .map(|b| b.len() > 5_000 && b.starts_with(b"\x89PNG\r\n\x1a\n"))
            .unwrap_or(false)
    }

    #[test]
    fn draws_both_plots_from_full_results() {
        if font().is_err() {
            println!("skipped: {}", font().unwrap_err());
            return;
        }
        let dir = tmp("full");
        let md = draw(&ctx(&dir), &fabricated());
        assert!(
            md.contains("![Pass-path cost against tracked sources](bench/scale.png)"),
            "{md}"
        );
        assert!(md.contains("(bench/flood.png)"), "{md}");
        assert!(is_png(&dir.join("scale.png")));
        assert!(is_png(&dir.join("flood.png")));
        if std::env::var_os("RL_KEEP_PLOTS").is_none() {
            let _ = std::fs::remove_dir_all(&dir);
        } else {
            println!("plots kept in {}", dir.display());
        }
    }

    #[test]
    fn missing_or_odd_flood_results_only_skip_that_plot() {
        if font().is_err() {
            return;
        }
        for (tag, flood) in [
            ("absent", Value::Null),
            ("no-scenarios", json!({"other": 1})),
            ("empty", json!({"scenarios": []})),
            (
                "odd",
                json!({"scenarios": [{"name": "F", "contenders": [{"name": "x"}]}, 3, "y"]}),
            ),
        ] {
            let dir = tmp(tag);
            let mut r = fabricated();
            if flood.is_null() {
                r.as_object_mut().unwrap().remove("flood");
            } else {
                r["flood"] = flood;
            }
            let md = draw(&ctx(&dir), &r);
            assert!(md.contains("bench/scale.png"), "{tag}: {md}");
            assert!(!md.contains("flood.png"), "{tag}: {md}");
            assert!(!dir.join("flood.png").exists(), "{tag}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn empty_results_draw_nothing_and_do_not_panic() {
        let dir = tmp("empty");
        let md = draw(&ctx(&dir), &json!({}));
        assert!(!md.contains(".png"), "{md}");
        let md = draw(&ctx(&dir), &json!({"scale": [], "cases": 5, "flood": null}));
        assert!(!md.contains(".png"), "{md}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn one_scale_point_and_no_reference_still_draw() {
        if font().is_err() {
            return;
        }
        let dir = tmp("one");
        let md = draw(
            &ctx(&dir),
            &json!({"scale": [{"tracked_sources": 1000, "ns": 100.0}]}),
        );
        assert!(md.contains("bench/scale.png"), "{md}");
        assert!(is_png(&dir.join("scale.png")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The committed `bench/results.json` (the last full run's) draws both plots: the report
    /// writer reads what the bench writes. To look at them, add `--nocapture` and open the
    /// directory it prints.
    #[test]
    fn the_committed_results_draw_both_plots() {
        if font().is_err() {
            return;
        }
        let path = ratelimit_tests::env::workspace_root().join("bench/results.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{} is committed: {e}", path.display()));
        let dir = tmp("real");
        let md = draw(&ctx(&dir), &serde_json::from_str(&text).unwrap());
        assert!(md.contains("(bench/scale.png)"), "{md}");
        assert!(md.contains("(bench/flood.png)"), "{md}");
        assert!(is_png(&dir.join("scale.png")));
        assert!(is_png(&dir.join("flood.png")));
        println!("{md}\nplots in {}", dir.display());
    }

    #[test]
    fn labels_read_like_the_tables() {
        assert_eq!(human(1000.0), "1k");
        assert_eq!(human(10_000_000.0), "10M");
        assert_eq!(human(500.0), "500");
        assert_eq!(human(2500.0), "2.5k");
    }
}
