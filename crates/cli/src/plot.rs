//! `anetrain plot`: train/val loss and learning rate from `metrics.jsonl`
//! (for a preference run, its reward margin, train and val, in place of
//! the learning rate), drawn into a small raster with a 3×5 font and
//! written as PNG by the `png` crate.

use std::path::Path;

use anyhow::{bail, Context, Result};

const W: usize = 900;
const H: usize = 520;
const LEFT: usize = 70;
const RIGHT: usize = 70;
const TOP: usize = 40;
const BOTTOM: usize = 50;

type Rgb = [u8; 3];
const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [40, 40, 40];
const GRID: Rgb = [225, 225, 225];
const BLUE: Rgb = [31, 119, 180];
const ORANGE: Rgb = [255, 127, 14];
const GREEN: Rgb = [44, 160, 44];

struct Canvas {
    px: Vec<Rgb>,
}

impl Canvas {
    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            self.px[y as usize * W + x as usize] = c;
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: Rgb, thick: i64) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()) as usize).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (
                (x0 + (x1 - x0) * t).round() as i64,
                (y0 + (y1 - y0) * t).round() as i64,
            );
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(x + dx - thick / 2, y + dy - thick / 2, c);
                }
            }
        }
    }

    fn text(&mut self, x: usize, y: usize, s: &str, c: Rgb, scale: usize) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits >> (2 - col) & 1 == 1 {
                        for sx in 0..scale {
                            for sy in 0..scale {
                                self.set(
                                    (x + i * 4 * scale + col * scale + sx) as i64,
                                    (y + row * scale + sy) as i64,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// 3×5 glyphs, one row per entry, bit 2 = left column.
fn glyph(c: char) -> [u8; 5] {
    match c.to_ascii_lowercase() {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        '/' => [1, 1, 2, 4, 4],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        ',' => [0, 0, 0, 2, 4],
        'c' => [7, 4, 4, 4, 7],
        // not 9's shape: "log" must not read "lo9"
        'g' => [7, 4, 5, 5, 7],
        'b' => [4, 4, 7, 5, 7],
        'd' => [1, 1, 7, 5, 7],
        'f' => [3, 4, 6, 4, 4],
        'h' => [4, 4, 7, 5, 5],
        'j' => [1, 1, 1, 5, 7],
        'k' => [5, 5, 6, 5, 5],
        'm' => [5, 7, 7, 5, 5],
        'q' => [7, 5, 5, 7, 1],
        'u' => [5, 5, 5, 5, 7],
        'w' => [5, 5, 7, 7, 5],
        'x' => [5, 5, 2, 5, 5],
        'y' => [5, 5, 7, 2, 2],
        'z' => [7, 1, 2, 4, 7],
        '_' => [0, 0, 0, 0, 7],
        ':' => [0, 2, 0, 2, 0],
        '=' => [0, 7, 0, 7, 0],
        'a' => [2, 5, 7, 5, 5],
        'e' => [7, 4, 6, 4, 7],
        'i' => [7, 2, 2, 2, 7],
        'l' => [4, 4, 4, 4, 7],
        'n' => [6, 5, 5, 5, 5],
        'o' => [7, 5, 5, 5, 7],
        'p' => [7, 5, 7, 4, 4],
        'r' => [6, 5, 6, 5, 5],
        's' => [7, 4, 7, 1, 7],
        't' => [7, 2, 2, 2, 2],
        'v' => [5, 5, 5, 5, 2],
        _ => [0; 5],
    }
}

fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 0.01 && v.abs() < 1e4 {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.1e}")
    }
}

/// A "nice" spacing for about `n` ticks over `span`: 1, 2 or 5 times a
/// power of ten.
fn nice_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&v| v >= raw)
        .unwrap_or(10.0 * p)
}

/// Linear ticks at multiples of a 1-2-5 spacing within `[lo, hi]`.
fn linear_ticks(lo: f64, hi: f64, n: f64) -> Vec<f64> {
    let step = nice_step(hi - lo, n);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Ticks for a log axis over `[lo, hi]` (both > 0): 1, 2, 5 × 10^e, or
/// every integer multiple of the decade when the range is narrow.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let within = |mults: &[f64]| -> Vec<f64> {
        let mut v = vec![];
        for e in (lo.log10().floor() as i32)..=(hi.log10().ceil() as i32) {
            for &m in mults {
                // m / 10^-e is the closest double to the decimal value.
                let t = if e < 0 {
                    m / 10f64.powi(-e)
                } else {
                    m * 10f64.powi(e)
                };
                if t >= lo * (1.0 - 1e-9) && t <= hi * (1.0 + 1e-9) {
                    v.push(t);
                }
            }
        }
        v
    };
    let coarse = within(&[1.0, 2.0, 5.0]);
    let fine = within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    if coarse.len() >= 4 || (coarse.len() >= 3 && fine.len() > 12) {
        coarse
    } else if fine.len() >= 3 {
        fine
    } else {
        linear_ticks(lo, hi, 8.0)
    }
}

/// Reads `metrics.jsonl` and writes the chart to `out`.
pub fn plot(run: &Path, out: &Path) -> Result<()> {
    let path = run.join("metrics.jsonl");
    if !run.is_dir() {
        anyhow::bail!("'{}' is not a run directory", run.display());
    }
    if !path.is_file() {
        anyhow::bail!(
            "'{}' has no metrics.jsonl: plot a directory `anetrain train` wrote",
            run.display()
        );
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read '{}'", path.display()))?;
    let (mut train, mut val, mut lr) = (vec![], vec![], vec![]);
    // A preference run's `rewards/margins` (TRL's name), train and val.
    let (mut margin, mut val_margin) = (vec![], vec![]);
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("'{}' line {}: not JSON", path.display(), i + 1))?;
        let (Some(step), Some(loss)) = (v["step"].as_f64(), v["loss"].as_f64()) else {
            continue;
        };
        if !loss.is_finite() {
            continue;
        }
        let m = v["rewards/margins"].as_f64().filter(|m| m.is_finite());
        if v["split"] == "val" {
            val.push((step, loss));
            val_margin.extend(m.map(|m| (step, m)));
        } else {
            train.push((step, loss));
            if let Some(l) = v["lr"].as_f64() {
                lr.push((step, l));
            }
            margin.extend(m.map(|m| (step, m)));
        }
    }
    if train.is_empty() {
        bail!("'{}' has no training steps to plot", path.display());
    }
    let mut c = Canvas {
        px: vec![WHITE; W * H],
    };
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let xmax = train.iter().chain(&val).map(|p| p.0).fold(1.0, f64::max);
    let lmax = train
        .iter()
        .chain(&val)
        .map(|p| p.1)
        .fold(f64::MIN, f64::max);
    let lmin = train
        .iter()
        .chain(&val)
        .map(|p| p.1)
        .fold(f64::MAX, f64::min)
        .min(lmax - 1e-9);
    // Loss on a log axis (cross-entropy is positive): early and late
    // training both stay readable.
    let log = lmin > 0.0;
    let f = |l: f64| if log { l.ln() } else { l };
    let (flo, fhi) = (f(lmin), f(lmax).max(f(lmin) + 1e-9));
    let (lo, hi) = (flo - 0.05 * (fhi - flo), fhi + 0.05 * (fhi - flo));
    // The right axis: the reward margin of a preference run (from its
    // lowest, or 0, up), else the learning rate (from 0).
    let preference = !margin.is_empty();
    let right: Vec<(f64, f64)> = if preference {
        margin.clone()
    } else {
        lr.clone()
    };
    let all_right = || {
        right
            .iter()
            .chain(if preference { &val_margin[..] } else { &[] })
    };
    let rmax = all_right().map(|p| p.1).fold(0.0, f64::max).max(1e-30);
    let rmin = all_right().map(|p| p.1).fold(0.0, f64::min);
    let px = |s: f64| LEFT as f64 + s / xmax * pw;
    let py = |l: f64| TOP as f64 + (hi - f(l)) / (hi - lo) * ph;
    let pr = |r: f64| TOP as f64 + (rmax - r) / (rmax - rmin) * ph;
    let loss_ticks = if log {
        log_ticks(lo.exp(), hi.exp())
    } else {
        linear_ticks(lo, hi, 5.0)
    };
    for t in loss_ticks {
        let y = py(t);
        c.line((LEFT as f64, y), (LEFT as f64 + pw, y), GRID, 1);
        c.text(8, (y as usize).saturating_sub(5), &fmt_num(t), BLUE, 2);
    }
    for t in linear_ticks(rmin, rmax, 5.0) {
        let y = pr(t);
        c.text(
            W - RIGHT + 8,
            (y as usize).saturating_sub(5),
            &fmt_num(t),
            GREEN,
            2,
        );
    }
    for t in linear_ticks(0.0, xmax, 5.0) {
        let x = px(t);
        c.line((x, TOP as f64), (x, TOP as f64 + ph), GRID, 1);
        c.text(
            (x as usize).saturating_sub(8),
            H - BOTTOM + 10,
            &fmt_num(t),
            BLACK,
            2,
        );
    }
    c.line(
        (LEFT as f64, TOP as f64),
        (LEFT as f64, TOP as f64 + ph),
        BLACK,
        2,
    );
    c.line(
        (LEFT as f64, TOP as f64 + ph),
        (LEFT as f64 + pw, TOP as f64 + ph),
        BLACK,
        2,
    );
    c.line(
        (LEFT as f64 + pw, TOP as f64),
        (LEFT as f64 + pw, TOP as f64 + ph),
        BLACK,
        2,
    );
    for w in right.windows(2) {
        c.line((px(w[0].0), pr(w[0].1)), (px(w[1].0), pr(w[1].1)), GREEN, 1);
    }
    for w in val_margin.windows(2) {
        c.line((px(w[0].0), pr(w[0].1)), (px(w[1].0), pr(w[1].1)), GREEN, 3);
    }
    for &(s, m) in &val_margin {
        c.line((px(s) - 3.0, pr(m)), (px(s) + 3.0, pr(m)), GREEN, 5);
    }
    for w in train.windows(2) {
        c.line((px(w[0].0), py(w[0].1)), (px(w[1].0), py(w[1].1)), BLUE, 2);
    }
    for w in val.windows(2) {
        c.line(
            (px(w[0].0), py(w[0].1)),
            (px(w[1].0), py(w[1].1)),
            ORANGE,
            3,
        );
    }
    for &(s, l) in &val {
        c.line((px(s) - 3.0, py(l)), (px(s) + 3.0, py(l)), ORANGE, 5);
    }
    c.text(8, 12, if log { "loss (log)" } else { "loss" }, BLUE, 2);
    let right_name = if preference { "margin" } else { "lr" };
    c.text(W - RIGHT + 8, 12, right_name, GREEN, 2);
    c.text(LEFT + 100, 12, "train loss", BLUE, 3);
    c.text(LEFT + 250, 12, "val loss", ORANGE, 3);
    // A preference run's margin has two series: the thin line is the
    // train margin, the thick one with marks the validation's.
    let name_at = match preference {
        true => {
            c.text(LEFT + 380, 14, "margin: train (thin), val", GREEN, 2);
            LEFT + 600
        }
        false => {
            c.text(LEFT + 380, 12, right_name, GREEN, 3);
            LEFT + 470
        }
    };
    c.text(W / 2 - 20, H - 22, "step", BLACK, 3);
    // The run it shows, as a title (the end of a long name is kept).
    let name = run
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| run.display().to_string());
    let room = (W - RIGHT - name_at) / 8 - 5;
    let shown: String = match name.chars().count() > room {
        true => name.chars().skip(name.chars().count() - room).collect(),
        false => name,
    };
    c.text(name_at, 14, &format!("run: {shown}"), BLACK, 2);
    anetrain::util::fsutil::write_atomic(out, &encode_png(&c.px)?)
}

/// The raster as an 8-bit RGB PNG.
fn encode_png(px: &[Rgb]) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut enc = png::Encoder::new(&mut bytes, W as u32, H as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().context("encoding the PNG")?;
    w.write_image_data(px.as_flattened())
        .context("encoding the PNG")?;
    w.finish().context("encoding the PNG")?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What we write decodes (with the `png` crate's decoder) to the same
    /// size, colour type and pixels.
    #[test]
    fn png_decodes_to_the_raster() {
        let px: Vec<Rgb> = (0..W * H)
            .map(|i| [(i % 251) as u8, (i / W % 256) as u8, 7])
            .collect();
        let bytes = encode_png(&px).unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (W as u32, H as u32));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(&buf[..info.buffer_size()], px.as_flattened());
    }

    #[test]
    fn ticks_fall_on_1_2_5_values() {
        assert_eq!(log_ticks(0.3, 7.0), [0.5, 1.0, 2.0, 5.0]);
        assert_eq!(
            log_ticks(0.53, 6.3),
            [0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        assert_eq!(
            log_ticks(0.05, 70.0),
            [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
        );
        assert_eq!(log_ticks(4.2, 6.8), [4.5, 5.0, 5.5, 6.0, 6.5]);
        assert_eq!(
            linear_ticks(0.0, 1000.0, 5.0),
            [0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]
        );
        assert_eq!(linear_ticks(0.0, 0.003, 5.0).len(), 4);
        assert_eq!(nice_step(0.03, 5.0), 0.01);
    }

    #[test]
    fn plot_draws_a_run_and_refuses_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let lines: String = (1..=20)
            .map(|s| {
                format!(
                    "{{\"step\": {s}, \"split\": \"train\", \"loss\": {}, \"lr\": 0.001}}\n",
                    5.0 / s as f64
                )
            })
            .collect();
        std::fs::write(dir.path().join("metrics.jsonl"), lines).unwrap();
        let out = dir.path().join("loss.png");
        plot(dir.path(), &out).unwrap();
        let reader = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&out).unwrap()))
            .read_info()
            .unwrap();
        assert_eq!(reader.info().width, W as u32);
        // A preference run: the margin on the right axis, negative at
        // first; the learning rate's green line gives way to it.
        let lines: String = (1..=20)
            .map(|s| {
                format!(
                    "{{\"step\": {s}, \"split\": \"train\", \"loss\": {}, \"lr\": 0.001, \"rewards/margins\": {}}}\n",
                    0.7 / s as f64,
                    s as f64 * 0.1 - 0.5
                )
            })
            .collect();
        std::fs::write(dir.path().join("metrics.jsonl"), lines).unwrap();
        plot(dir.path(), &out).unwrap();
        let mut reader =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&out).unwrap()))
                .read_info()
                .unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        reader.next_frame(&mut buf).unwrap();
        // The green series runs from the bottom (margin −0.4 is the axis'
        // lowest value) to the top: green pixels near both edges.
        let green_rows: Vec<usize> = (0..H)
            .filter(|&y| (LEFT + 10..W - RIGHT).any(|x| buf[(y * W + x) * 3..][..3] == GREEN))
            .collect();
        let (top, bottom) = (green_rows[0], *green_rows.last().unwrap());
        assert!(
            top < TOP + 40 && bottom > H - BOTTOM - 40,
            "{top}..{bottom}"
        );
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert!(plot(dir.path(), &out).is_err());
    }
}
