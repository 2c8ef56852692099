//! The maths the CPU twins of the kernels (and the engine around them) are
//! written with: products of weights `[out, in]` and channel-first
//! activations `[C, S]`, per-head RMSNorm, SwiGLU, RoPE, causal softmax,
//! each forward beside its backward.

use linalg::{matmul, matmul_serial, MatMut, MatRef};
use rayon::prelude::*;

use super::io::LayerWeights;
use super::{KernelOptions, Product, Rope, Shape};
use crate::model::Projection;
use crate::util::simd::{exp, vectorized};

/// `W [m, k] · X [k, n]` → `[m, n]`.
pub fn w_x(w: &[f32], x: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    matmul(
        MatRef::row_major(w, 0, m, k),
        MatRef::row_major(x, 0, k, n),
        MatMut::row_major(&mut out, 0, m, n),
        false,
    );
    out
}

/// `Wᵀ · X` for `W [k, m]`, `X [k, n]` → `[m, n]`.
pub fn wt_x(w: &[f32], x: &[f32], k: usize, m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    matmul(
        MatRef::row_major(w, 0, k, m).t(),
        MatRef::row_major(x, 0, k, n),
        MatMut::row_major(&mut out, 0, m, n),
        false,
    );
    out
}

/// `x ⊙ mask`, or `x` itself without a mask.
pub fn masked<'a>(x: &'a [f32], mask: Option<&[f32]>) -> std::borrow::Cow<'a, [f32]> {
    match mask {
        Some(m) => x.iter().zip(m).map(|(a, b)| a * b).collect(),
        None => std::borrow::Cow::Borrowed(x),
    }
}

/// Adds projection `target`'s LoRA branch, when it has an adapter, to `y`:
///   forward   y [out, S] += s·B·(A·(m⊙x))
///   backward dx [in, S]  += m⊙(s·Aᵀ·(Bᵀ·dy))
/// with `A [r, in]`, `B [out, r]` and m the optional dropout mask
/// (host-only; the device kernels have no dropout).
pub fn add_adapter(
    y: &mut [f32],
    w: &LayerWeights,
    o: &KernelOptions,
    s: &Shape,
    target: Projection,
    x: &[f32],
    product: Product,
) {
    let Some((r, scale)) = o.adapter(target) else {
        return;
    };
    // A layer below an adapter's layer range (`--lora-layers`) has none:
    // its branch adds nothing.
    let Some((a, b)) = w.adapters[target.index()] else {
        return;
    };
    let mask = w.dropout[target.index()];
    let (out, inp) = s.projection(target);
    let seq = s.seq;
    let scale = o.constant(scale);
    match product {
        Product::Forward | Product::ForwardRows => {
            let x = masked(x, mask);
            let xa = w_x(a, &x, r, inp, seq);
            let low = w_x(b, &xa, out, r, seq);
            y.iter_mut().zip(&low).for_each(|(y, l)| *y += scale * l);
        }
        Product::Backward => {
            let tb = wt_x(b, x, out, r, seq);
            let low = wt_x(a, &tb, r, inp, seq);
            match mask {
                Some(m) => y
                    .iter_mut()
                    .zip(low.iter().zip(m))
                    .for_each(|(y, (l, m))| *y += scale * l * m),
                None => y.iter_mut().zip(&low).for_each(|(y, l)| *y += scale * l),
            }
        }
    }
}

/// The largest mean square over the channels of `x [C, S]` at any
/// position, in f64.
pub fn max_mean_square(x: &[f32], seq: usize) -> f64 {
    let c = x.len() / seq.max(1);
    let mut sums = vec![0f64; seq];
    for row in x.chunks(seq) {
        sums.iter_mut()
            .zip(row)
            .for_each(|(s, &v)| *s += (v as f64) * (v as f64));
    }
    sums.into_iter().fold(0f64, f64::max) / c.max(1) as f64
}

/// RMSNorm over groups of `hd` channels at every position of
/// `x [groups·hd, S]`: y = x · rsqrt(mean(x²) + eps) · w. One group is a
/// layer's norm (`hd` = D); one group a head is QK-norm.
/// Rows are walked contiguously (per-position sums over channels kept in a
/// vector), heads in parallel.
pub fn rms_norm(x: &[f32], w: &[f32], hd: usize, seq: usize, eps: f32) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(hd * seq)
        .zip(x.par_chunks(hd * seq))
        .for_each(|(yh, xh)| {
            let r = inv_rms(xh, hd, seq, eps);
            for d in 0..hd {
                let (xr, yr) = (&xh[d * seq..][..seq], &mut yh[d * seq..][..seq]);
                for ((y, &x), &r) in yr.iter_mut().zip(xr).zip(&r) {
                    *y = x * r as f32 * w[d];
                }
            }
        });
    y
}

/// rsqrt(mean over the `hd` rows of `x [hd, S]` squared + eps), per position
/// (f64).
fn inv_rms(x: &[f32], hd: usize, seq: usize, eps: f32) -> Vec<f64> {
    let mut ms = vec![0f64; seq];
    for d in 0..hd {
        for (m, &v) in ms.iter_mut().zip(&x[d * seq..][..seq]) {
            *m += (v as f64).powi(2);
        }
    }
    ms.iter()
        .map(|&m| 1.0 / (m / hd as f64 + eps as f64).sqrt())
        .collect()
}

/// Backward of [`rms_norm`]: with r = rsqrt(mean(x²) + eps) per group
/// and position,
///   dx_d = r·w_d·dy_d − x_d · r³/HD · Σ_e w_e·dy_e·x_e,   dw_d = Σ dy_d·x_d·r.
/// `dw` is accumulated (per-head partial sums added in head order).
pub fn rms_norm_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    hd: usize,
    seq: usize,
    eps: f32,
    dw: &mut [f32],
) -> Vec<f32> {
    let mut dx = vec![0f32; x.len()];
    let partial: Vec<Vec<f64>> = dx
        .par_chunks_mut(hd * seq)
        .zip(x.par_chunks(hd * seq))
        .zip(dy.par_chunks(hd * seq))
        .map(|((dxh, xh), dyh)| {
            let r = inv_rms(xh, hd, seq, eps);
            let mut dot = vec![0f64; seq];
            for d in 0..hd {
                let (xr, dyr) = (&xh[d * seq..][..seq], &dyh[d * seq..][..seq]);
                for ((t, &x), &g) in dot.iter_mut().zip(xr).zip(dyr) {
                    *t += (w[d] * g * x) as f64;
                }
            }
            let c: Vec<f64> = r
                .iter()
                .zip(&dot)
                .map(|(&r, &t)| r * r * r / hd as f64 * t)
                .collect();
            let mut dwh = vec![0f64; hd];
            for d in 0..hd {
                let (xr, dyr) = (&xh[d * seq..][..seq], &dyh[d * seq..][..seq]);
                let out = &mut dxh[d * seq..][..seq];
                for s in 0..seq {
                    out[s] = (r[s] * (w[d] * dyr[s]) as f64 - xr[s] as f64 * c[s]) as f32;
                    dwh[d] += dyr[s] as f64 * xr[s] as f64 * r[s];
                }
            }
            dwh
        })
        .collect();
    for dwh in &partial {
        for (a, &b) in dw.iter_mut().zip(dwh) {
            *a += b as f32;
        }
    }
    dx
}

/// Backward of gate = silu(h1)·h3:
///   dh1 = dgate·h3·σ(h1)·(1 + h1·(1 − σ(h1))),   dh3 = dgate·silu(h1).
pub fn swiglu_backward(h1: &[f32], h3: &[f32], dgate: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dh1 = vec![0f32; h1.len()];
    let mut dh3 = vec![0f32; h1.len()];
    swiglu_backward_into(h1, h3, dgate, &mut dh1, &mut dh3);
    (dh1, dh3)
}

vectorized! {
    /// [`swiglu_backward`] into given buffers.
    fn swiglu_backward_into(h1: &[f32], h3: &[f32], dgate: &[f32], dh1: &mut [f32], dh3: &mut [f32]) {
        let n = h1.len();
        let (h3, dgate, dh1, dh3) = (&h3[..n], &dgate[..n], &mut dh1[..n], &mut dh3[..n]);
        for i in 0..n {
            let sg = 1.0 / (1.0 + exp(-h1[i]));
            dh1[i] = dgate[i] * h3[i] * sg * (1.0 + h1[i] * (1.0 - sg));
            dh3[i] = dgate[i] * h1[i] * sg;
        }
    }
}

vectorized! {
    /// `gate = silu(h1)·h3 = h1·σ(h1)·h3`, σ(a) = 1/(1 + e⁻ᵃ).
    pub fn swiglu_forward(h1: &[f32], h3: &[f32], gate: &mut [f32]) {
        let n = h1.len();
        let (h3, gate) = (&h3[..n], &mut gate[..n]);
        for i in 0..n {
            gate[i] = h1[i] / (1.0 + exp(-h1[i])) * h3[i];
        }
    }
}

/// GELU's tanh form (PyTorch's `gelu(approximate="tanh")`, Gemma's
/// `gelu_pytorch_tanh`) as a sigmoid, which it is exactly:
///   gelu(x) = ½x(1 + tanh(u)) = x·σ(2u),  u = √(2/π)·(x + 0.044715·x³)
/// computed as ffn_forward's program does, z = 2u = x·(κx² + 1)·2β.
pub const GELU_2BETA: f32 =
    (2.0 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
pub const GELU_KAPPA: f32 = 0.044_715;

vectorized! {
    /// `gate = gelu(h1)·h3` (see [`GELU_2BETA`]), with the constants
    /// `(2β, κ)` given (a program's are fp16: `KernelOptions::constant`).
    pub fn geglu_forward(h1: &[f32], h3: &[f32], gate: &mut [f32], two_beta: f32, kappa: f32) {
        let n = h1.len();
        let (h3, gate) = (&h3[..n], &mut gate[..n]);
        for i in 0..n {
            let x = h1[i];
            let z = x * (x * x * kappa + 1.0) * two_beta;
            gate[i] = x * (1.0 / (1.0 + exp(-z))) * h3[i];
        }
    }
}

/// `dh1, dh3` of `gate = gelu(h1)·h3` from `dgate`:
///   dh3 = dgate·gelu(h1),  dh1 = dgate·h3·(s + x·s(1 − s)·2β(1 + 3κx²)),  s = σ(z)
pub fn geglu_backward(h1: &[f32], h3: &[f32], dgate: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dh1 = vec![0f32; h1.len()];
    let mut dh3 = vec![0f32; h1.len()];
    geglu_backward_into(h1, h3, dgate, &mut dh1, &mut dh3);
    (dh1, dh3)
}

vectorized! {
    /// [`geglu_backward`] into given buffers.
    fn geglu_backward_into(h1: &[f32], h3: &[f32], dgate: &[f32], dh1: &mut [f32], dh3: &mut [f32]) {
        let n = h1.len();
        let (h3, dgate, dh1, dh3) = (&h3[..n], &dgate[..n], &mut dh1[..n], &mut dh3[..n]);
        for i in 0..n {
            let x = h1[i];
            let z = x * (x * x * GELU_KAPPA + 1.0) * GELU_2BETA;
            let sg = 1.0 / (1.0 + exp(-z));
            let dz = GELU_2BETA * (1.0 + 3.0 * GELU_KAPPA * x * x);
            dh1[i] = dgate[i] * h3[i] * (sg + x * sg * (1.0 - sg) * dz);
            dh3[i] = dgate[i] * x * sg;
        }
    }
}

/// Applies RoPE to `x [heads·HD, S]` (sign −1 applies the inverse rotation,
/// which is RoPE's backward). `cos`, `sin` are `[S, HD]`.
pub fn apply_rope(
    x: &[f32],
    hd: usize,
    seq: usize,
    cos: &[f32],
    sin: &[f32],
    rope: Rope,
    sign: f32,
) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    // The tables transposed to [HD, S], so the loop below reads them
    // contiguously (and vectorises) instead of striding by HD.
    let transposed = |t: &[f32]| -> Vec<f32> {
        (0..hd)
            .flat_map(|d| (0..seq).map(move |s| t[s * hd + d]))
            .collect()
    };
    let (cos, sin) = (transposed(cos), transposed(sin));
    y.par_chunks_mut(hd * seq)
        .zip(x.par_chunks(hd * seq))
        .for_each(|(yh, xh)| {
            for d in 0..hd {
                // partner row and the sign of its term in rotate(x)
                let (p, rs) = rope.partner(d, hd);
                let (xr, xp) = (&xh[d * seq..][..seq], &xh[p * seq..][..seq]);
                let (c, sn) = (&cos[d * seq..][..seq], &sin[d * seq..][..seq]);
                let out = &mut yh[d * seq..][..seq];
                for s in 0..seq {
                    out[s] = xr[s] * c[s] + sign * rs * xp[s] * sn[s];
                }
            }
        });
    y
}

/// What the scores become before the mask: x·scale, and where the model
/// soft-caps them (Gemma 2), c·tanh(x·scale/c), whose slope is 1 − t²
/// (t = tanh(x·scale/c)). The constants as the program stores them: the
/// scale, 1/c and c ([`KernelOptions::constant`]).
#[derive(Clone, Copy)]
pub struct Scores {
    pub scale: f32,
    /// (1/c, c).
    cap: Option<(f32, f32)>,
}

impl Scores {
    pub fn of(o: &KernelOptions) -> Scores {
        Scores {
            scale: o.constant(o.score_scale),
            cap: o.score_cap.map(|c| (o.constant(1.0 / c), o.constant(c))),
        }
    }

    /// softmax(map(row) + mask) in place (`mask` 0 where none is given).
    fn softmax(&self, row: &mut [f32], mask: Option<&[f32]>) {
        match (self.cap, mask) {
            (None, None) => crate::util::simd::softmax_scaled(row, self.scale),
            (cap, mask) => {
                for (j, x) in row.iter_mut().enumerate() {
                    let y = *x * self.scale;
                    let y = match cap {
                        Some((inv, c)) => (y * inv).tanh() * c,
                        None => y,
                    };
                    *x = y + mask.map_or(0.0, |m| m[j]);
                }
                crate::util::simd::softmax_scaled(row, 1.0);
            }
        }
    }

    /// dS ← dS ⊙ (1 − t²) for one head's raw scores `x = qᵀk` (`[rows,
    /// S]`, as `ds`); nothing without a cap.
    pub fn through_cap(&self, x: &[f32], ds: &mut [f32]) {
        if let Some((inv, _)) = self.cap {
            for (d, &x) in ds.iter_mut().zip(x) {
                let t = (x * self.scale * inv).tanh();
                *d *= 1.0 - t * t;
            }
        }
    }

    pub fn capped(&self) -> bool {
        self.cap.is_some()
    }
}

/// Causal softmax(qᵀk·scale) for one query head, on the calling thread,
/// each query over the keys it sees ([`super::visible_keys`]: every
/// earlier one, or those of its window): `q_h, k_g` are `[HD, S]`; writes
/// `P [S, S]` into `p`.
pub fn head_probs(
    q_h: &[f32],
    k_g: &[f32],
    hd: usize,
    seq: usize,
    scores: Scores,
    window: Option<usize>,
    p: &mut [f32],
) {
    // Scores of queries lo..hi against keys 0..hi; the rest of each row is
    // masked and set to zero below.
    for (lo, hi) in causal_blocks(seq) {
        matmul_serial(
            MatRef::row_major(q_h, 0, hd, seq).t().rows_range(lo, hi),
            MatRef::row_major(k_g, 0, hd, seq).cols_range(0, hi),
            MatMut::strided(p, lo * seq, hi - lo, hi, seq),
            false,
        );
    }
    for i in 0..seq {
        let row = &mut p[i * seq..(i + 1) * seq];
        let keys = super::visible_keys(i, window);
        let (before, rest) = row.split_at_mut(*keys.start());
        let (live, after) = rest.split_at_mut(keys.count());
        scores.softmax(live, None);
        before.fill(0.0);
        after.fill(0.0);
    }
}

/// One head's probabilities for a block of `qb` queries against all `seq`
/// keys with an additive mask `[qb, seq]`, over whole rows:
///   P [qb, S] = softmax(q_hᵀ·k_g·scale + mask)   (soft-capped: [`Scores`])
/// (`q_h [HD, qb]`, `k_g [HD, S]`).
pub fn masked_head_probs(
    q_h: &[f32],
    k_g: &[f32],
    hd: usize,
    scores: Scores,
    mask: &[f32],
    p: &mut [f32],
) {
    let seq = k_g.len() / hd;
    let qb = q_h.len() / hd;
    matmul_serial(
        MatRef::row_major(q_h, 0, hd, qb).t(),
        MatRef::row_major(k_g, 0, hd, seq),
        MatMut::row_major(p, 0, qb, seq),
        false,
    );
    for (row, m) in p.chunks_mut(seq).zip(mask.chunks(seq)) {
        scores.softmax(row, Some(m));
    }
}

/// Causal attention in blocks of queries: block `lo..hi` sees keys `0..hi`
/// only. Products over probabilities a kernel computes itself skip the
/// blocks above the diagonal, where every entry is exactly zero (3/8 of
/// those products' FLOPs at 256 positions). Products over kernel *inputs*
/// (`sdpa_backward2`'s P and dP) and the full dP output stay whole, so
/// the twins match the MIL kernels for any input.
const CAUSAL_BLOCK: usize = 64;

pub fn causal_blocks(seq: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..seq)
        .step_by(CAUSAL_BLOCK)
        .map(move |lo| (lo, (lo + CAUSAL_BLOCK).min(seq)))
}

/// `y [out, S] += b` along every position, when the layer has a bias on
/// projection `p` (`LayerSpec::biased`).
pub fn add_bias(y: &mut [f32], w: &LayerWeights, o: &KernelOptions, p: Projection, seq: usize) {
    if !o.layer.biased().contains(&p) {
        return;
    }
    let b =
        w.biases[p.index()].unwrap_or_else(|| panic!("the layer has no bias on '{}'", p.module()));
    for (row, &bc) in y.chunks_mut(seq).zip(b) {
        row.iter_mut().for_each(|v| *v += bc);
    }
}

/// dx = Σᵢ Wᵢᵀ·dyᵢ (plus each projection's adapter) for a backward
/// kernel's `projections`, projection i applied to `dys[i]`.
pub fn projections_backward(
    s: &Shape,
    o: &KernelOptions,
    w: &LayerWeights,
    projections: &[(Projection, Product)],
    dys: &[&[f32]],
) -> Vec<f32> {
    let mut dx: Vec<f32> = vec![];
    for (&(p, product), &dy) in projections.iter().zip(dys) {
        let (rows, cols) = s.projection(p);
        let mut y = wt_x(w.projection(p), dy, rows, cols, s.seq);
        add_adapter(&mut y, w, o, s, p, dy, product);
        if dx.is_empty() {
            dx = y;
        } else {
            dx.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
    }
    dx
}
