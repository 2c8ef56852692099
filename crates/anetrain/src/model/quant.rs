//! MLX's affine quantization, as `mlx.core.quantize` computes it on the
//! CPU and mlx-lm stores it (mlx 0.32 `mlx/backend/cpu/quantized.cpp`:
//! `quantize`, `extract_bits`, `_qmm_t`; mlx-lm 0.32 `mlx_lm/utils.py`:
//! `quantize_model`, `load_model`).
//!
//!   per group of `group_size` consecutive values of a row:
//!   w ≈ scale·q + bias,   q = rint((w − bias)/scale) clamped to 0..2^bits − 1
//!
//! A module `X` is stored as `X.weight` (`uint32` `[rows, cols·bits/32]`:
//! each row's q values as one little-endian bit stream, value k at bits
//! k·bits…, so 3-, 5- and 6-bit values cross byte and word boundaries as
//! mlx packs them), `X.scales` and `X.biases` (`[rows, cols/group_size]`
//! in the checkpoint's float dtype). `config.json`'s `quantization` holds
//! the default `group_size`, `bits` and `mode`, and per-module entries
//! keyed by module path: a spec of their own, or `false` (left as is).

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::dtype::{round_to, StoredDtype};

/// Bits per value and values per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The bit widths and group sizes mlx's affine mode supports.
pub const BITS: &[u32] = &[2, 3, 4, 5, 6, 8];
pub const GROUP_SIZES: &[usize] = &[32, 64, 128];

impl QuantSpec {
    pub fn new(bits: u32, group_size: usize) -> Result<QuantSpec> {
        if !BITS.contains(&bits) {
            bail!("{bits}-bit quantization is not one mlx has (2, 3, 4, 5, 6 or 8 bits)");
        }
        if !GROUP_SIZES.contains(&group_size) {
            bail!("a quantization group of {group_size} is not one mlx has (32, 64 or 128)");
        }
        Ok(QuantSpec { bits, group_size })
    }

    /// Packed `u32` words of a row of `cols` values (`cols` a multiple of
    /// the group size, so of 32).
    pub fn words(self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }

    /// Whether a row of `cols` values can be quantized (mlx-lm quantizes a
    /// module only when its input width is a multiple of the group size).
    pub fn fits(self, cols: usize) -> bool {
        cols.is_multiple_of(self.group_size)
    }

    fn levels(self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }
}

/// The quantization of a checkpoint: its default and its per-module
/// exceptions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    pub default: QuantSpec,
    /// Module paths (`model.layers.0.mlp.down_proj`) with a spec of their
    /// own, or `None` where mlx-lm left the module unquantized.
    #[serde(default)]
    pub modules: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The quantization a `config.json` declares: mlx-lm's `quantization`
    /// (or the same under `quantization_config`), `None` when it declares
    /// none. Methods we do not read are refused in one line.
    pub fn from_config(v: &Value) -> Result<Option<Quantization>> {
        let q = match (v.get("quantization"), v.get("quantization_config")) {
            (Some(q), _) | (None, Some(q)) if !q.is_null() => q,
            _ => return Ok(None),
        };
        if let Some(method) = q.get("quant_method").and_then(Value::as_str) {
            bail!(
                "the model is quantized with {method}, which anetrain does not read; it reads MLX's affine quantization (mlx-community models, `mlx_lm.convert -q`, `anetrain quantize`) and unquantized bf16/f16/f32 weights"
            );
        }
        let spec = |q: &Value, what: &str| -> Result<QuantSpec> {
            if let Some(mode) = q.get("mode").and_then(Value::as_str) {
                if mode != "affine" {
                    bail!("{what}: quantization mode '{mode}' is not read; anetrain reads MLX's affine mode");
                }
            }
            let int = |k: &str| q.get(k).and_then(Value::as_u64);
            match (int("bits"), int("group_size")) {
                (Some(b), Some(g)) => QuantSpec::new(b as u32, g as usize),
                _ => bail!("{what}: a quantization needs \"bits\" and \"group_size\""),
            }
        };
        let default = spec(q, "\"quantization\"")?;
        let mut modules = BTreeMap::new();
        if let Some(map) = q.as_object() {
            for (k, v) in map {
                match v {
                    Value::Object(_) => {
                        modules.insert(
                            k.clone(),
                            Some(spec(v, &format!("\"quantization\".\"{k}\""))?),
                        );
                    }
                    Value::Bool(false) => {
                        modules.insert(k.clone(), None);
                    }
                    _ => {}
                }
            }
        }
        Ok(Some(Quantization { default, modules }))
    }

    /// The `config.json` value mlx-lm writes for this quantization.
    pub fn to_config(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("group_size".into(), self.default.group_size.into());
        m.insert("bits".into(), self.default.bits.into());
        m.insert("mode".into(), "affine".into());
        for (k, s) in &self.modules {
            let v = match s {
                Some(s) => {
                    serde_json::json!({"group_size": s.group_size, "bits": s.bits, "mode": "affine"})
                }
                None => Value::Bool(false),
            };
            m.insert(k.clone(), v);
        }
        Value::Object(m)
    }

    /// The spec module `path` (a weight's name without `.weight`) is
    /// quantized with, when it is listed on its own, else the default.
    pub fn of(&self, path: &str) -> Option<QuantSpec> {
        match self.modules.get(path) {
            Some(s) => *s,
            None => Some(self.default),
        }
    }
}

/// A matrix quantized: `packed` `[rows, words(cols)]`, `scales` and
/// `biases` `[rows, cols/group_size]` (values of the checkpoint's dtype).
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub packed: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

/// Quantizes `w` (`[rows, cols]`, values of `dtype`) as mlx does: each
/// group's scale and bias computed in f32 (the edge of larger magnitude
/// made exactly representable), the q values from those f32 numbers, and
/// only then scale and bias rounded to `dtype` for storage.
pub fn quantize(w: &[f32], cols: usize, spec: QuantSpec, dtype: StoredDtype) -> Quantized {
    use rayon::prelude::*;
    assert!(
        spec.fits(cols) && w.len().is_multiple_of(cols),
        "quantize: {cols} columns"
    );
    let (gs, groups) = (spec.group_size, cols / spec.group_size);
    let words = spec.words(cols);
    let rows = w.len() / cols;
    let mut packed = vec![0u32; rows * words];
    let mut scales = vec![0f32; rows * groups];
    let mut biases = vec![0f32; rows * groups];
    let levels = spec.levels();
    packed
        .par_chunks_mut(words)
        .zip(scales.par_chunks_mut(groups))
        .zip(biases.par_chunks_mut(groups))
        .zip(w.par_chunks(cols))
        .for_each(|(((row_words, row_scales), row_biases), row)| {
            let mut bytes = vec![0u8; words * 4];
            for (g, group) in row.chunks(gs).enumerate() {
                let (lo, hi) = group
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                let low_edge = lo.abs() > hi.abs();
                let mut scale = ((hi - lo) / levels).max(1e-7);
                if !low_edge {
                    scale = -scale;
                }
                let edge = if low_edge { lo } else { hi };
                let q0 = (edge / scale).round_ties_even();
                let mut bias = 0.0;
                if q0 != 0.0 {
                    scale = edge / q0;
                    bias = edge;
                }
                for (k, &v) in group.iter().enumerate() {
                    let q = ((v - bias) / scale).round_ties_even().clamp(0.0, levels) as u64;
                    put(&mut bytes, g * gs + k, spec.bits, q);
                }
                row_scales[g] = round_to(scale, dtype);
                row_biases[g] = round_to(bias, dtype);
            }
            for (word, b) in row_words.iter_mut().zip(bytes.chunks_exact(4)) {
                *word = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        });
    Quantized {
        packed,
        scales,
        biases,
    }
}

/// Writes `q` as value `k` of a row's bit stream.
fn put(bytes: &mut [u8], k: usize, bits: u32, q: u64) {
    let at = k * bits as usize;
    let (byte, shift) = (at / 8, at % 8);
    let v = q << shift;
    for (i, b) in bytes[byte..]
        .iter_mut()
        .take((shift + bits as usize).div_ceil(8))
        .enumerate()
    {
        *b |= (v >> (8 * i)) as u8;
    }
}

/// Value `k` of a row's bit stream `bytes`.
pub fn get(bytes: &[u8], k: usize, bits: u32) -> u32 {
    let at = k * bits as usize;
    let (byte, shift) = (at / 8, at % 8);
    let mut v = 0u32;
    for (i, b) in bytes[byte..]
        .iter()
        .take((shift + bits as usize).div_ceil(8))
        .enumerate()
    {
        v |= (*b as u32) << (8 * i);
    }
    (v >> shift) & ((1u32 << bits) - 1)
}

/// One dequantized value, `scale·q + bias`, with each operation rounded
/// to the checkpoint's dtype as mlx's `dequantize` computes it in that
/// dtype.
pub fn dequantize_value(q: u32, scale: f32, bias: f32, dtype: StoredDtype) -> f32 {
    round_to(round_to(scale * q as f32, dtype) + bias, dtype)
}

/// `v` rounded to bf16, for a finite `v` (the bits trick of [`round_to`]
/// without its NaN branch, so a loop of it compiles to vector code).
#[inline(always)]
fn round_bf16_finite(v: f32) -> f32 {
    let b = v.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// `v` rounded to f16 (to nearest, ties to even) and back, for a finite
/// `v`, in operations that vectorize; `half`'s conversion is a call per
/// value. Normal results round the mantissa to 10 bits on the bits; below
/// f16's smallest normal 2⁻¹⁴ the grid is the fixed 2⁻²⁴, which adding and
/// taking away 0.5 (whose f32 ulp is 2⁻²⁴) rounds to; past 65504 is ∞.
#[inline(always)]
fn round_f16_finite(v: f32) -> f32 {
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2⁻¹⁴
    let a = v.abs();
    let b = a.to_bits();
    let normal = f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & 0xffff_e000);
    let subnormal = (a + 0.5) - 0.5;
    let r = if a < MIN_NORMAL { subnormal } else { normal };
    let r = if r > 65504.0 { f32::INFINITY } else { r };
    r.copysign(v)
}

/// Dequantizes whole groups of one row: `bytes` holds their packed values
/// from the first group's first bit (a group of 32·k values always starts
/// on a byte), `groups[g]` is group g's (scale, bias), all finite. The
/// same operations in the same order as [`dequantize_value`], so the same
/// bits; written per width over little-endian units of 3, 4 or 5 bytes
/// (whole 3- and 6-bit values fill 3 bytes, 5-bit ones 5) so the
/// unpacking and both roundings compile to vector code.
pub fn dequantize_groups(
    spec: QuantSpec,
    dtype: StoredDtype,
    bytes: &[u8],
    groups: &[(f32, f32)],
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        groups.len() * spec.group_size,
        "dequantize_groups: lengths"
    );
    assert!(
        bytes.len() * 8 >= out.len() * spec.bits as usize,
        "dequantize_groups: bytes"
    );
    groups_dispatch(spec.bits, spec.group_size, dtype, bytes, groups, out);
}

crate::util::simd::vectorized! {
    fn groups_dispatch(
        bits: u32,
        group_size: usize,
        dtype: StoredDtype,
        bytes: &[u8],
        groups: &[(f32, f32)],
        out: &mut [f32],
    ) {
        macro_rules! widths {
            ($round:expr) => {
                match bits {
                    2 => unpack::<2, 4, u32>(group_size, bytes, groups, out, $round),
                    3 => unpack::<3, 3, u32>(group_size, bytes, groups, out, $round),
                    4 => unpack::<4, 4, u32>(group_size, bytes, groups, out, $round),
                    5 => unpack::<5, 5, u64>(group_size, bytes, groups, out, $round),
                    6 => unpack::<6, 3, u32>(group_size, bytes, groups, out, $round),
                    8 => unpack::<8, 4, u32>(group_size, bytes, groups, out, $round),
                    _ => unreachable!("QuantSpec::new admits no {bits}-bit values"),
                }
            };
        }
        match dtype {
            StoredDtype::F32 => widths!(|v: f32| v),
            StoredDtype::BF16 => widths!(round_bf16_finite),
            StoredDtype::F16 => widths!(round_f16_finite),
        }
    }
}

/// The loop of [`dequantize_groups`] for `BITS`-bit values read `UNIT`
/// bytes (a whole number of values) at a time into a `W`.
#[inline(always)]
fn unpack<const BITS: usize, const UNIT: usize, W: Unit>(
    group_size: usize,
    bytes: &[u8],
    groups: &[(f32, f32)],
    out: &mut [f32],
    round: impl Fn(f32) -> f32 + Copy,
) {
    let per_unit = UNIT * 8 / BITS;
    let group_bytes = group_size * BITS / 8;
    for ((o, b), &(scale, bias)) in out
        .chunks_exact_mut(group_size)
        .zip(bytes.chunks_exact(group_bytes))
        .zip(groups)
    {
        for (o, u) in o.chunks_exact_mut(per_unit).zip(b.chunks_exact(UNIT)) {
            let w = W::little_endian(u);
            for (k, o) in o.iter_mut().enumerate() {
                let q = w.bits(k * BITS, BITS);
                *o = round(round(scale * q as f32) + bias);
            }
        }
    }
}

/// The integer a unit of packed bytes is read into: 32 bits where they
/// suffice (twice the vector lanes of 64), 64 for 5-bit values' 5 bytes.
trait Unit: Copy {
    fn little_endian(bytes: &[u8]) -> Self;
    /// `bits` bits from bit `at`.
    fn bits(self, at: usize, bits: usize) -> u32;
}

impl Unit for u32 {
    #[inline(always)]
    fn little_endian(bytes: &[u8]) -> u32 {
        bytes
            .iter()
            .enumerate()
            .fold(0, |w, (i, &b)| w | (b as u32) << (8 * i))
    }
    #[inline(always)]
    fn bits(self, at: usize, bits: usize) -> u32 {
        (self >> at) & ((1 << bits) - 1)
    }
}

impl Unit for u64 {
    #[inline(always)]
    fn little_endian(bytes: &[u8]) -> u64 {
        bytes
            .iter()
            .enumerate()
            .fold(0, |w, (i, &b)| w | (b as u64) << (8 * i))
    }
    #[inline(always)]
    fn bits(self, at: usize, bits: usize) -> u32 {
        ((self >> at) & ((1 << bits) - 1)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::quantized_stored;

    #[test]
    fn the_bit_stream_holds_every_width() {
        for &bits in BITS {
            let spec = QuantSpec::new(bits, 32).unwrap();
            let cols = 64;
            let mut bytes = vec![0u8; spec.words(cols) * 4];
            let max = (1u64 << bits) - 1;
            let vals: Vec<u64> = (0..cols as u64).map(|k| (k * 7 + 3) % (max + 1)).collect();
            for (k, &v) in vals.iter().enumerate() {
                put(&mut bytes, k, bits, v);
            }
            for (k, &v) in vals.iter().enumerate() {
                assert_eq!(get(&bytes, k, bits) as u64, v, "{bits} bits, value {k}");
            }
        }
    }

    /// Each group's edge of larger magnitude is exact, and every value is
    /// within one step: mlx anchors the grid at that edge, so the other
    /// end can fall up to a step outside it and be clamped.
    #[test]
    fn quantizing_keeps_the_edge_exact_and_each_value_within_a_step() {
        let w: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for &bits in BITS {
            let spec = QuantSpec::new(bits, 64).unwrap();
            let q = quantize(&w, 128, spec, StoredDtype::F32);
            for (i, &v) in w.iter().enumerate() {
                let (row, col) = (i / 128, i % 128);
                let g = row * 2 + col / 64;
                let bytes: Vec<u8> = q.packed[row * spec.words(128)..][..spec.words(128)]
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .collect();
                let d = dequantize_value(
                    get(&bytes, col, bits),
                    q.scales[g],
                    q.biases[g],
                    StoredDtype::F32,
                );
                assert!(
                    (d - v).abs() <= q.scales[g].abs() * 1.0001,
                    "{bits} bits: {v} -> {d}"
                );
                let group = &w[row * 128 + (col / 64) * 64..][..64];
                let lo = group.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let edge = if lo.abs() > hi.abs() { lo } else { hi };
                if v == edge {
                    assert!(
                        (d - v).abs() <= 1e-6 * v.abs(),
                        "{bits} bits: edge {v} -> {d}"
                    );
                }
            }
        }
    }

    /// Any range of a quantized matrix (a row's middle, across rows)
    /// dequantizes to the same values as the whole.
    #[test]
    fn every_range_reads_as_the_whole() {
        let (rows, cols) = (5, 128);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
            .collect();
        for &bits in BITS {
            for dtype in [StoredDtype::F32, StoredDtype::BF16] {
                let spec = QuantSpec::new(bits, 32).unwrap();
                let st = quantized_stored(&w, cols, spec, dtype).unwrap();
                let mut whole = vec![0f32; w.len()];
                st.convert(0..w.len(), &mut whole);
                for r in [3..4, 7..100, 127..129, 130..500, 33..640, 639..640] {
                    let mut part = vec![0f32; r.len()];
                    st.convert(r.clone(), &mut part);
                    assert_eq!(part, whole[r.clone()], "{bits} bits {dtype:?} {r:?}");
                }
            }
        }
    }

    /// The vectorized groups give what [`dequantize_value`] gives value by
    /// value, bit for bit, for every width, group size and dtype, with
    /// scales and biases that reach f16's subnormals and its overflow.
    #[test]
    fn whole_groups_dequantize_as_value_by_value() {
        let params = [
            (0.013, -0.1),
            (-2.5e-3, 0.04),
            (3.1e-7, 1.2e-6),
            (-6.0e-8, 0.0),
            (517.0, -3000.0),
            (4400.0, 1.0),
            (1.7e37, -1.0e38),
            (0.0, 0.5),
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for &bits in BITS {
            for &gs in GROUP_SIZES {
                let spec = QuantSpec::new(bits, gs).unwrap();
                let n = gs * params.len();
                let bytes: Vec<u8> = (0..n * bits as usize / 8)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (state >> 56) as u8
                    })
                    .collect();
                for dtype in [StoredDtype::F32, StoredDtype::F16, StoredDtype::BF16] {
                    let mut got = vec![0f32; n];
                    dequantize_groups(spec, dtype, &bytes, &params, &mut got);
                    for (k, g) in got.iter().enumerate() {
                        let (scale, bias) = params[k / gs];
                        let q = get(&bytes, k, bits);
                        let want = dequantize_value(q, scale, bias, dtype);
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "{bits} bits, groups of {gs}, {dtype:?}: value {k} (q {q}, scale {scale:e}, bias {bias:e})"
                        );
                    }
                }
            }
        }
    }

    /// The vectorized f16 rounding is `half`'s on every f16 value's
    /// neighbourhood: ties, carries into the exponent, subnormals, the
    /// largest finite value and past it.
    #[test]
    fn f16_rounding_is_halfs() {
        let mut checked = 0;
        for h in 0u16..=0xffff {
            let x = half::f16::from_bits(h);
            if !x.is_finite() {
                continue;
            }
            let v = x.to_f32();
            let next = half::f16::from_bits(h.wrapping_add(1)).to_f32();
            let mut probes = vec![v, v.next_up(), v.next_down()];
            if next.is_finite() {
                let mid = (v + next) / 2.0;
                probes.extend([mid, mid.next_up(), mid.next_down()]);
            }
            for p in probes {
                let want = half::f16::from_f32(p).to_f32();
                let got = round_f16_finite(p);
                assert_eq!(got.to_bits(), want.to_bits(), "{p:e}");
                checked += 1;
            }
        }
        for p in [
            65504.0f32,
            65519.99,
            65520.0,
            1e6,
            -1e30,
            f32::MAX,
            1e-10,
            -1e-30,
        ] {
            assert_eq!(
                round_f16_finite(p).to_bits(),
                half::f16::from_f32(p).to_f32().to_bits(),
                "{p:e}"
            );
        }
        assert!(checked > 300_000);
    }

    /// The inline bf16 rounding is `half`'s, on values around every
    /// rounding case (ties, carries into the exponent, the largest finite
    /// values, subnormals).
    #[test]
    fn bf16_rounding_is_halfs() {
        let mut checked = 0;
        for hi in (0u32..=0xffff).step_by(7) {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let v = f32::from_bits(hi << 16 | lo);
                if v.is_nan() {
                    continue;
                }
                let want = half::bf16::from_f32(v).to_f32();
                let got = round_to(v, StoredDtype::BF16);
                assert_eq!(got.to_bits(), want.to_bits(), "{v:e}");
                checked += 1;
            }
        }
        assert!(checked > 50_000);
    }

    #[test]
    fn configs_are_read_as_mlx_writes_them_and_others_refused() {
        let v = serde_json::json!({"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
            "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8}, "lm_head": false}});
        let q = Quantization::from_config(&v).unwrap().unwrap();
        assert_eq!(
            q.of("model.layers.1.mlp.up_proj"),
            Some(QuantSpec {
                bits: 4,
                group_size: 64
            })
        );
        assert_eq!(
            q.of("model.layers.0.mlp.down_proj"),
            Some(QuantSpec {
                bits: 8,
                group_size: 32
            })
        );
        assert_eq!(q.of("lm_head"), None);
        assert_eq!(
            Quantization::from_config(
                &q.to_config()
                    .as_object()
                    .map(|m| serde_json::json!({"quantization": m}))
                    .unwrap()
            )
            .unwrap()
            .unwrap(),
            q
        );
        for (method, name) in [
            ("bitsandbytes", "bitsandbytes"),
            ("gptq", "gptq"),
            ("awq", "awq"),
            ("compressed-tensors", "compressed-tensors"),
            ("fp8", "fp8"),
        ] {
            let v = serde_json::json!({"quantization_config": {"quant_method": method, "bits": 4}});
            let e = Quantization::from_config(&v).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains("MLX's affine"), "{e}");
        }
        let v = serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}});
        assert!(Quantization::from_config(&v)
            .unwrap_err()
            .to_string()
            .contains("mxfp4"));
        assert!(
            Quantization::from_config(&serde_json::json!({"hidden_size": 8}))
                .unwrap()
                .is_none()
        );
    }
}
