//! Activations on a device's surfaces: padded to the compiled length and
//! cropped back, a region's rows written into an input buffer, a tile's
//! output blocks combined into the kernel's results.

use std::collections::BTreeMap;

use ane::Device;
use anyhow::{anyhow, bail, Result};

use crate::kernels::tiling;
use crate::kernels::{KernelLayout, Port};

/// Copies `[rows, seq]` (or `[heads·seq, seq]` for scores) into the padded
/// `[rows, sp]` (or `[heads·sp, sp]`) layout, zeros elsewhere.
pub(super) fn pad(port: Port, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
    if seq == sp {
        return data.to_vec();
    }
    let rows = data.len() / seq;
    let (groups, per) = if port.is_scores() {
        (rows / seq, seq)
    } else {
        (1, rows)
    };
    let sp_rows = if port.is_scores() { sp } else { per };
    let mut out = vec![0f32; groups * sp_rows * sp];
    for g in 0..groups {
        for r in 0..per {
            let src = &data[(g * per + r) * seq..][..seq];
            out[(g * sp_rows + r) * sp..][..seq].copy_from_slice(src);
        }
    }
    out
}

/// Inverse of [`pad`].
pub(super) fn crop(port: Port, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
    if seq == sp {
        return data.to_vec();
    }
    let rows = data.len() / sp;
    let (groups, per_in, per_out) = if port.is_scores() {
        (rows / sp, sp, seq)
    } else {
        (1, rows, rows)
    };
    let mut out = Vec::with_capacity(groups * per_out * seq);
    for g in 0..groups {
        for r in 0..per_out {
            out.extend_from_slice(&data[(g * per_in + r) * sp..][..seq]);
        }
    }
    out
}

/// Tile `t`'s output block `part` of `port` combined into `results`
/// (concatenated or summed by the plan).
pub(super) fn gather(
    tiles: &tiling::KernelTiles,
    port: Port,
    results: &mut BTreeMap<Port, Vec<f32>>,
    part: Vec<f32>,
    (t, seq): (usize, usize),
) {
    let acc = results.entry(port).or_default();
    match tiles.tiles {
        1 => *acc = part,
        _ => tiling::combine(tiles, port, acc, part, t, seq),
    }
}

/// Writes a region's rows (`[channels, width]`) into a device input buffer.
pub(super) fn write_region<D: Device>(
    device: &mut D,
    buf: &mut D::Buffer,
    l: &KernelLayout,
    port: Port,
    values: &[f32],
) -> Result<()> {
    let r = l.region(port);
    let width = r.spatial.len();
    if values.len() != r.channels.len() * width {
        bail!(
            "{}: '{}' has {} values, the layout needs {}",
            l.kernel,
            port.name(),
            values.len(),
            r.channels.len() * width
        );
    }
    device
        .write_rows(
            buf,
            r.channels.start * l.in_spatial + r.spatial.start,
            l.in_spatial,
            width,
            values,
        )
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pad_and_crop_roundtrip_for_activations_and_scores() {
        let act: Vec<f32> = (0..3 * 5).map(|v| v as f32).collect();
        let p = pad(Port::Xnorm, &act, 5, 16);
        assert_eq!(p.len(), 3 * 16);
        assert_eq!(&p[16..21], &act[5..10]);
        assert_eq!(crop(Port::Xnorm, &p, 5, 16), act);
        let scores: Vec<f32> = (0..2 * 5 * 5).map(|v| v as f32).collect();
        let p = pad(Port::Probs, &scores, 5, 16);
        assert_eq!(p.len(), 2 * 16 * 16);
        assert_eq!(&p[16 * 16..16 * 16 + 5], &scores[25..30]);
        assert_eq!(crop(Port::Probs, &p, 5, 16), scores);
    }
}
