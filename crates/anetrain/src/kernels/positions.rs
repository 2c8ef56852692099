//! What a program reads about positions: the additive causal mask and
//! RoPE's tables (the rotation matrix, and cos/sin per position), built on
//! the host and passed as constants or inputs.

use super::Rope;
use crate::model::config::RopeScaling;

/// What an additive mask adds to a score a query must not see: fp16's
/// lowest finite value (−inf would turn fully masked rows into NaN).
pub(crate) const MASKED: f32 = -65504.0;

/// Additive causal mask for `ratio` query heads folded along the sequence:
/// `[ratio·S, S]`, row `r·S + i` masks keys `j > i` — and with an
/// attention window `W`, keys `j ≤ i − W` — with −65504 (fp16's lowest
/// finite value; −inf would turn fully masked rows into NaN).
pub fn causal_mask(seq: usize, ratio: usize, window: Option<usize>) -> Vec<f32> {
    let mut m = vec![0f32; ratio * seq * seq];
    for (row, mrow) in m.chunks_mut(seq).enumerate() {
        mask_row(mrow, row % seq, window);
    }
    m
}

/// The keys query `i` sees: `first..=i`, `first` the window's start.
pub fn visible_keys(i: usize, window: Option<usize>) -> std::ops::RangeInclusive<usize> {
    let first = window.map_or(0, |w| (i + 1).saturating_sub(w));
    first..=i
}

/// Masks, in one row of an additive mask over keys `0..row.len()`, the
/// keys query `i` does not see ([`visible_keys`]).
pub fn mask_row(row: &mut [f32], i: usize, window: Option<usize>) {
    let keys = visible_keys(i, window);
    let n = row.len();
    row[..(*keys.start()).min(n)].fill(MASKED);
    row[(i + 1).min(n)..].fill(MASKED);
}

/// RoPE's rotation as `heads` copies of a signed permutation `R [HD, HD]`
/// with `x·R = rotate(x)` for a row `x [HD]` (see [`Rope::partner`]); a
/// dimension RoPE passes through has an empty column (its sine is 0).
pub fn rope_rotation(heads: usize, hd: usize, rope: Rope) -> Vec<f32> {
    let mut r = vec![0f32; hd * hd];
    for j in 0..hd {
        // output column j takes sign · x[i]
        let (i, sign) = rope.partner(j, hd);
        r[i * hd + j] = sign;
    }
    r.repeat(heads)
}

/// RoPE's `dim/2` inverse frequencies for half-split (Hugging Face) RoPE
/// over `dim` rotated dimensions, in f32 step by step as `transformers`'
/// `modeling_rope_utils` computes them: `1 / θ^(2i/dim)`, then the
/// checkpoint's scaling. `positions` is the length of the forward they
/// serve (its last position + 1): LongRoPE's factors depend on it.
pub fn inv_freqs(hd: usize, theta: f64, scaling: &RopeScaling, positions: usize) -> Vec<f32> {
    let plain = (0..hd / 2).map(|i| 1.0f32 / (theta as f32).powf((2 * i) as f32 / hd as f32));
    match *scaling {
        RopeScaling::Default => plain.collect(),
        RopeScaling::Linear { factor } => plain.map(|f| f / factor as f32).collect(),
        // _compute_llama3_parameters: wavelengths past low_freq_wavelen
        // divided by the factor, between the two a smooth blend.
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let old = original_max_position_embeddings as f32;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            plain
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        return scaled;
                    }
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                })
                .collect()
        }
        // _compute_yarn_parameters: θ's frequencies and θ's over `factor`,
        // blended along a ramp between the correction dimensions.
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            let dim = hd as f64;
            let correction = |rotations: f64| {
                let n = original_max_position_embeddings as f64;
                dim * (n / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001; // transformers' guard against a zero-width ramp
            }
            (0..hd / 2)
                .map(|i| {
                    let pos = (theta as f32).powf((2 * i) as f32 / hd as f32);
                    let (extrapolation, interpolation) = (1.0 / pos, 1.0 / (factor as f32 * pos));
                    let ramp =
                        ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let keep = 1.0 - ramp;
                    interpolation * (1.0 - keep) + extrapolation * keep
                })
                .collect()
        }
        // _compute_longrope_parameters: 1 / (factor_i · θ^(2i/dim)), the
        // long factors once the forward passes the original context.
        RopeScaling::Longrope {
            ref short_factor,
            ref long_factor,
            original_max_position_embeddings,
            ..
        } => {
            let factors = match positions > original_max_position_embeddings {
                true => long_factor,
                false => short_factor,
            };
            (0..hd / 2)
                .map(|i| {
                    let shape = (2 * i) as f32 / hd as f32;
                    1.0 / (factors[i] as f32 * (theta as f32).powf(shape))
                })
                .collect()
        }
    }
}

/// RoPE tables `cos, sin [S, HD]` for positions 0..S.
///
/// Half-split (Hugging Face): column c < rotary uses frequency index
/// `c mod rotary/2`, a column past the rotated ones cos 1 and sin 0;
/// inverse frequencies ([`inv_freqs`]) and angles are computed in f32
/// exactly as `transformers` does. Interleaved (seed): columns 2i and 2i+1
/// share index i.
pub fn rope_tables(
    seq: usize,
    hd: usize,
    theta: f64,
    scaling: &RopeScaling,
    rope: Rope,
) -> (Vec<f32>, Vec<f32>) {
    let freqs = inv_freqs(rope.rotated(hd), theta, scaling, seq);
    let mut cos = Vec::with_capacity(seq * hd);
    let mut sin = Vec::with_capacity(seq * hd);
    for p in 0..seq {
        let (c, s) = row(p, hd, theta, &freqs, scaling.attention_factor(), rope);
        cos.extend(c);
        sin.extend(s);
    }
    (cos, sin)
}

/// One position's RoPE row (`cos, sin [HD]`), see [`rope_tables`], in a
/// sequence of `len` positions (LongRoPE's factors depend on it).
pub fn rope_row(
    pos: usize,
    len: usize,
    hd: usize,
    theta: f64,
    scaling: &RopeScaling,
    rope: Rope,
) -> (Vec<f32>, Vec<f32>) {
    let freqs = inv_freqs(rope.rotated(hd), theta, scaling, len);
    row(pos, hd, theta, &freqs, scaling.attention_factor(), rope)
}

/// One row; `factor` multiplies the rotated columns' cos and sin (YaRN's
/// and LongRoPE's attention factor).
fn row(
    pos: usize,
    hd: usize,
    theta: f64,
    freqs: &[f32],
    factor: f64,
    rope: Rope,
) -> (Vec<f32>, Vec<f32>) {
    let rotated = rope.rotated(hd);
    let mut cos = vec![1f32; hd];
    let mut sin = vec![0f32; hd];
    for c in 0..rotated {
        let angle = match rope {
            // transformers: angle = p·inv_freq in f32
            Rope::HalfSplit { .. } => pos as f32 * freqs[c % (rotated / 2)],
            // the seed: angle = p / powf(θ, 2i/HD) in f32
            Rope::Interleaved => pos as f32 / (theta as f32).powf((2 * (c / 2)) as f32 / hd as f32),
        };
        cos[c] = (angle as f64).cos() as f32;
        sin[c] = (angle as f64).sin() as f32;
        if factor != 1.0 {
            cos[c] *= factor as f32;
            sin[c] *= factor as f32;
        }
    }
    (cos, sin)
}
