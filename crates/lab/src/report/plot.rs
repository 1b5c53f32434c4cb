//! Time plots as SVG, drawn with `plotters` (its SVG backend needs no font files: text is written as SVG `<text>`
//! and laid out by the viewer).
//!
//! [`time_plot`] draws one [`TimePlot`] — named series over the lab's time axis, the lab's events as labelled
//! vertical lines, a legend to the right of the chart — and returns the SVG text. The same plot always gives the
//! same text.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One line of a plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Its legend entry.
    pub name: String,
    /// `(time since lab start in s, value)`, in time order.
    pub points: Vec<(f64, f64)>,
}

/// A vertical line at an event.
#[derive(Clone, Debug, PartialEq)]
pub struct Marker {
    /// When, in seconds since lab start.
    pub time_s: f64,
    /// Its label.
    pub label: String,
}

/// Everything one plot shows.
#[derive(Clone, Debug, PartialEq)]
pub struct TimePlot {
    /// Caption above the chart.
    pub title: String,
    /// The y axis' description (with its unit).
    pub y_label: String,
    /// The lines, in legend order.
    pub series: Vec<Series>,
    /// Events drawn as vertical lines.
    pub markers: Vec<Marker>,
    /// The time axis runs from 0 to at least this (the lab's duration).
    pub min_time_s: f64,
}

/// Width of a plot, in pixels.
pub const WIDTH: u32 = 1100;
/// Height of a plot, in pixels.
pub const HEIGHT: u32 = 520;
/// Width of the legend panel right of the chart.
const LEGEND_WIDTH: u32 = 300;
/// Longest legend entry or event label, in characters (longer ones are cut with `…`).
const MAX_LABEL: usize = 42;
const FONT: &str = "sans-serif";
const LABEL_SIZE: u32 = 12;

/// Cuts `text` to at most `max` characters, ending with `…` when it was cut.
pub fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

/// A number with an SI prefix and up to 3 significant digits (`12.5M`, `950`, `1.2k`, `0.25`).
pub fn si(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let digits = if scaled.abs() >= 100.0 || scaled == scaled.trunc() {
        0
    } else if scaled.abs() >= 10.0 {
        1
    } else {
        2
    };
    let mut s = format!("{scaled:.digits$}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    if s == "-0" {
        s = "0".into();
    }
    format!("{s}{suffix}")
}

/// Markers grouped by where their labels go: markers at the same time share one label (joined with `; `).
fn merged_markers(markers: &[Marker]) -> Vec<Marker> {
    let mut sorted = markers.to_vec();
    sorted.sort_by(|a, b| a.time_s.total_cmp(&b.time_s).then_with(|| a.label.cmp(&b.label)));
    let mut out: Vec<Marker> = Vec::new();
    for m in sorted {
        match out.last_mut() {
            Some(last) if (last.time_s - m.time_s).abs() < 1e-9 => {
                last.label = format!("{}; {}", last.label, m.label);
            }
            _ => out.push(m),
        }
    }
    out
}

/// Draws `plot` as an SVG document.
pub fn time_plot(plot: &TimePlot) -> Result<String, String> {
    let mut svg = String::new();
    draw(plot, &mut svg).map_err(|e| format!("drawing {:?}: {e}", plot.title))?;
    Ok(svg)
}

fn draw(plot: &TimePlot, svg: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let points = plot.series.iter().flat_map(|s| s.points.iter());
    let (mut t_max, mut y_min, mut y_max) = (plot.min_time_s.max(1e-3), 0.0f64, 0.0f64);
    for &(t, y) in points {
        t_max = t_max.max(t);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    for m in &plot.markers {
        t_max = t_max.max(m.time_s);
    }
    if y_max - y_min < 1e-12 {
        y_max = y_min + 1.0;
    }
    // Room above the highest point for the event labels' first characters.
    let y_top = y_max + (y_max - y_min) * 0.08;

    let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let (chart_area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(&plot.title, (FONT, 18))
        .margin(12)
        .margin_right(28)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..t_max, y_min..y_top)?;
    chart
        .configure_mesh()
        .light_line_style(BLACK.mix(0.04))
        .bold_line_style(BLACK.mix(0.12))
        .x_desc("time since lab start (s)")
        .y_desc(plot.y_label.as_str())
        .x_label_formatter(&|x| si(*x))
        .y_label_formatter(&|y| si(*y))
        .label_style((FONT, LABEL_SIZE))
        .axis_desc_style((FONT, 13))
        .draw()?;

    let colors: Vec<RGBColor> = (0..plot.series.len()).map(series_color).collect();
    for (s, color) in plot.series.iter().zip(&colors) {
        chart.draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))?;
        if s.points.len() == 1 {
            chart.draw_series(s.points.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
        }
    }

    // Events: a dashed-looking grey line each, the label written downwards next to it from the top.
    let label_style = TextStyle::from((FONT, 11).into_font())
        .color(&RGBColor(90, 90, 90))
        .transform(FontTransform::Rotate90)
        .pos(Pos::new(HPos::Left, VPos::Top));
    let mut last_label_x: Option<i32> = None;
    for m in merged_markers(&plot.markers) {
        const DASHES: usize = 32;
        let span = y_top - y_min;
        chart.draw_series((0..DASHES).map(|k| {
            let a = y_min + span * k as f64 / DASHES as f64;
            let b = a + span * 0.6 / DASHES as f64;
            PathElement::new(vec![(m.time_s, a), (m.time_s, b)], RGBColor(110, 110, 110).stroke_width(1))
        }))?;
        // Labels closer than a line of text would overlap: move this one right of the last one.
        let (px, py) = chart.backend_coord(&(m.time_s, y_top));
        let mut x = px + 14;
        if let Some(last) = last_label_x {
            x = x.max(last + 13);
        }
        last_label_x = Some(x);
        let (ox, oy) = chart_area.get_base_pixel();
        let text = clip(&format!("{} {}", short_time(m.time_s), m.label), 60);
        // A translucent white band under the label keeps it readable where it crosses a line. The rotated text
        // lies left of `x` (its height) and below the top (its length, about 5 px a character at this size).
        let (left, top) = (x - ox - 12, py - oy + 3);
        let length = 5 * text.chars().count() as i32 + 4;
        chart_area.draw(&Rectangle::new([(left, top), (left + 13, top + length)], WHITE.mix(0.7).filled()))?;
        chart_area.draw(&Text::new(text, (x - ox, py - oy + 4), label_style.clone()))?;
    }

    // The legend, in its own panel so it never hides a line.
    legend_area.draw(&Text::new("legend", (8, 40), (FONT, 13).into_font().color(&BLACK)))?;
    for (i, (s, color)) in plot.series.iter().zip(&colors).enumerate() {
        let y = 64 + 20 * i as i32;
        legend_area.draw(&PathElement::new(vec![(8, y), (36, y)], color.stroke_width(3)))?;
        legend_area.draw(&Text::new(
            clip(&s.name, MAX_LABEL),
            (44, y),
            TextStyle::from((FONT, LABEL_SIZE).into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    if plot.series.is_empty() {
        legend_area.draw(&Text::new("(no data)", (8, 64), (FONT, LABEL_SIZE).into_font()))?;
    }
    root.present()?;
    Ok(())
}

/// `6s`, `13.5s`, `6.003s`.
fn short_time(t: f64) -> String {
    let s = format!("{t:.3}");
    format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
}

/// The `i`-th series colour: a fixed palette of distinct, readable colours (Tableau 10), then darker variants.
fn series_color(i: usize) -> RGBColor {
    const TABLEAU: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = TABLEAU[i % TABLEAU.len()];
    let shade = |c: u8| (c as usize * 2 / (2 + i / TABLEAU.len())) as u8;
    RGBColor(shade(r), shade(g), shade(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plot() -> TimePlot {
        TimePlot {
            title: "throughput".into(),
            y_label: "Mbit/s".into(),
            series: vec![
                Series { name: "h1-1 iperf3".into(), points: vec![(1.0, 10.0), (2.0, 19.5), (3.0, 18.0)] },
                Series { name: "h1-2 one point".into(), points: vec![(2.5, 4.0)] },
            ],
            markers: vec![
                Marker { time_s: 6.0, label: "link h1-srv set delay_ms=50".into() },
                Marker { time_s: 0.0, label: "start on srv".into() },
                Marker { time_s: 0.0, label: "start on h1".into() },
            ],
            min_time_s: 20.0,
        }
    }

    #[test]
    fn svg_has_series_events_and_axes_and_is_deterministic() {
        let svg = time_plot(&plot()).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..80]);
        for text in ["h1-1 iperf3", "h1-2 one point", "6s link h1-srv set delay_ms=50", "0s start on h1; start on srv"]
        {
            assert!(svg.contains(text), "missing {text:?}");
        }
        assert!(svg.contains("time since lab start (s)") && svg.contains("Mbit/s"));
        assert!(svg.contains("rotate(90"), "event labels are vertical");
        assert_eq!(svg, time_plot(&plot()).unwrap());
    }

    #[test]
    fn empty_plot_still_draws() {
        let svg = time_plot(&TimePlot { series: vec![], markers: vec![], ..plot() }).unwrap();
        assert!(svg.contains("(no data)"));
    }

    #[test]
    fn si_and_clip() {
        assert_eq!(si(12_500_000.0), "12.5M");
        assert_eq!(si(950.0), "950");
        assert_eq!(si(1234.0), "1.23k");
        assert_eq!(si(0.25), "0.25");
        assert_eq!(si(-2e9), "-2G");
        assert_eq!(si(0.0), "0");
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("abc", 4), "abc");
        assert_eq!(short_time(13.5), "13.5s");
        assert_eq!(short_time(6.0), "6s");
        assert_eq!(short_time(6.0031), "6.003s");
    }

    #[test]
    fn colours_differ() {
        let c: Vec<RGBColor> = (0..20).map(series_color).collect();
        for i in 0..c.len() {
            for j in 0..i {
                assert_ne!(c[i], c[j], "{i} and {j}");
            }
        }
    }
}
