//! Native f32 twins of the kernels: same named inputs (activations `[C, S]`,
//! weights Hugging Face `[out, in]`, norm weights `[HD]`), same named
//! outputs (`[C, S]`), computed with gemm and plain loops. The CPU engine
//! runs these; tests hold them equal to the MIL programs.

use std::collections::BTreeMap;

use linalg::{matmul, matmul_serial, MatMut, MatRef};
use rayon::prelude::*;

use super::{KernelKind, KernelOptions, Product, Rope, Shape};
use crate::lora::Target;
use crate::simd::{exp, vectorized};

/// Named tensors, row-major in their logical shapes.
pub type Tensors = BTreeMap<String, Vec<f32>>;

/// Borrowed kernel inputs (activations and weights), so the engine passes
/// weights without copying them.
pub type Inputs<'a> = BTreeMap<&'a str, &'a [f32]>;

/// Borrows every tensor of `t` as an input.
pub fn inputs(t: &Tensors) -> Inputs<'_> {
    t.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect()
}

fn get<'a>(t: &Inputs<'a>, name: &str) -> &'a [f32] {
    t.get(name)
        .copied()
        .unwrap_or_else(|| panic!("kernel input '{name}' missing"))
}

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
/// with `A [r, in]`, `B [out, r]` and m the optional dropout mask input
/// (host-only; the device kernels have no dropout).
fn add_adapter(
    y: &mut [f32],
    t: &Inputs,
    o: &KernelOptions,
    s: &Shape,
    target: Target,
    x: &[f32],
    product: Product,
) {
    let Some((r, scale)) = o.adapter(target) else {
        return;
    };
    let (an, bn) = target.adapter_regions();
    let (a, b) = (get(t, an), get(t, bn));
    let mask = t.get(target.mask_input()).copied();
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

/// Per-head RMSNorm over `HD` at every position of `x [heads·HD, S]`:
/// y = x · rsqrt(mean(x²) + eps) · w.
/// Rows are walked contiguously (per-position sums over channels kept in a
/// vector), heads in parallel.
pub fn head_rms_norm(x: &[f32], w: &[f32], hd: usize, seq: usize, eps: f32) -> Vec<f32> {
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

/// Backward of [`head_rms_norm`]: with r = rsqrt(mean(x²) + eps) per head
/// and position,
///   dx_d = r·w_d·dy_d − x_d · r³/HD · Σ_e w_e·dy_e·x_e,   dw_d = Σ dy_d·x_d·r.
/// `dw` is accumulated (per-head partial sums added in head order).
pub fn head_rms_norm_backward(
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
    fn swiglu_forward(h1: &[f32], h3: &[f32], gate: &mut [f32]) {
        let n = h1.len();
        let (h3, gate) = (&h3[..n], &mut gate[..n]);
        for i in 0..n {
            gate[i] = h1[i] / (1.0 + exp(-h1[i])) * h3[i];
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
    let half = hd / 2;
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
                let (p, rs) = match rope {
                    Rope::HalfSplit if d < half => (d + half, -1.0),
                    Rope::HalfSplit => (d - half, 1.0),
                    Rope::Interleaved if d % 2 == 0 => (d + 1, -1.0),
                    Rope::Interleaved => (d - 1, 1.0),
                };
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

/// Causal softmax(qᵀk/√HD) for one query head, on the calling thread:
/// `q_h, k_g` are `[HD, S]`; writes `P [S, S]` into `p`.
fn head_probs(q_h: &[f32], k_g: &[f32], hd: usize, seq: usize, scale: f32, p: &mut [f32]) {
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
        let (live, masked) = p[i * seq..(i + 1) * seq].split_at_mut(i + 1);
        crate::simd::softmax_scaled(live, scale);
        masked.fill(0.0);
    }
}

/// Causal attention in blocks of queries: block `lo..hi` sees keys `0..hi`
/// only. Products over probabilities a kernel computes itself skip the
/// blocks above the diagonal, where every entry is exactly zero (3/8 of
/// those products' FLOPs at 256 positions). Products over kernel *inputs*
/// (`sdpa_backward2`'s P and dP) and the full dP output stay whole, so
/// the twins match the MIL kernels for any input.
const CAUSAL_BLOCK: usize = 64;

fn causal_blocks(seq: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..seq)
        .step_by(CAUSAL_BLOCK)
        .map(move |lo| (lo, (lo + CAUSAL_BLOCK).min(seq)))
}

/// Runs kernel `kind` natively.
pub fn run(kind: KernelKind, s: &Shape, o: &KernelOptions, t: &Inputs) -> Tensors {
    let (d, hid, q, kv, seq, hd) = (s.dim, s.hidden, s.q_dim(), s.kv_dim(), s.seq, s.head_dim);
    let r = s.ratio();
    let scale = o.constant(1.0 / (hd as f64).sqrt());
    let eps = o.constant(o.eps);
    let mut out = Tensors::new();
    let mut put = |name: &str, v: Vec<f32>| {
        out.insert(name.to_string(), v);
    };
    match kind {
        KernelKind::SdpaForward => {
            let x = get(t, "xnorm");
            let mut q_raw = w_x(get(t, "wq"), x, q, d, seq);
            add_adapter(&mut q_raw, t, o, s, Target::Q, x, Product::Forward);
            let mut k_raw = w_x(get(t, "wk"), x, kv, d, seq);
            add_adapter(&mut k_raw, t, o, s, Target::K, x, Product::Forward);
            let mut v = w_x(get(t, "wv"), x, kv, d, seq);
            add_adapter(&mut v, t, o, s, Target::V, x, Product::Forward);
            let (qn, kn) = if o.qk_norm {
                (
                    head_rms_norm(&q_raw, get(t, "q_norm"), hd, seq, eps),
                    head_rms_norm(&k_raw, get(t, "k_norm"), hd, seq, eps),
                )
            } else {
                (q_raw.clone(), k_raw.clone())
            };
            let (cos, sin) = o.rope_tables(seq, hd);
            let q_rope = apply_rope(&qn, hd, seq, &cos, &sin, o.rope, 1.0);
            let k_rope = apply_rope(&kn, hd, seq, &cos, &sin, o.rope, 1.0);
            // The heads of one KV group share K and V; groups run in
            // parallel, each product on its own thread.
            let mut attn = vec![0f32; q * seq];
            attn.par_chunks_mut(r * hd * seq)
                .enumerate()
                .for_each(|(g, attn_g)| {
                    let mut p = vec![0f32; seq * seq];
                    for j in 0..r {
                        let h = g * r + j;
                        head_probs(
                            &q_rope[h * hd * seq..][..hd * seq],
                            &k_rope[g * hd * seq..][..hd * seq],
                            hd,
                            seq,
                            scale,
                            &mut p,
                        );
                        // attn_h [HD, S] = V_g [HD, S] · Pᵀ; query block
                        // lo..hi reads values 0..hi.
                        for (lo, hi) in causal_blocks(seq) {
                            matmul_serial(
                                MatRef::row_major(&v, g * hd * seq, hd, seq).cols_range(0, hi),
                                MatRef::row_major(&p, 0, seq, seq)
                                    .t()
                                    .rows_range(0, hi)
                                    .cols_range(lo, hi),
                                MatMut::strided(attn_g, j * hd * seq + lo, hd, hi - lo, seq),
                                false,
                            );
                        }
                    }
                });
            put("attn", attn);
            put("q_rope", q_rope);
            put("k_rope", k_rope);
            put("v", v);
            if o.seed_compat {
                put("xnorm", x.to_vec());
            }
            if o.qk_norm {
                put("q_raw", q_raw);
                put("k_raw", k_raw);
            }
        }
        KernelKind::WoForward => {
            let x = get(t, "attn");
            let mut y = w_x(get(t, "wo"), x, d, q, seq);
            add_adapter(&mut y, t, o, s, Target::O, x, Product::Forward);
            put("o", y);
        }
        KernelKind::FfnForward => {
            let x = get(t, "x2norm");
            let mut h1 = w_x(get(t, "w1"), x, hid, d, seq);
            add_adapter(&mut h1, t, o, s, Target::Gate, x, Product::Forward);
            let mut h3 = w_x(get(t, "w3"), x, hid, d, seq);
            add_adapter(&mut h3, t, o, s, Target::Up, x, Product::Forward);
            let mut gate = vec![0f32; h1.len()];
            swiglu_forward(&h1, &h3, &mut gate);
            let mut ffn = w_x(get(t, "w2"), &gate, d, hid, seq);
            add_adapter(&mut ffn, t, o, s, Target::Down, &gate, Product::ForwardRows);
            let alpha = o.constant(o.residual_scale);
            let x_next = get(t, "x2")
                .iter()
                .zip(&ffn)
                .map(|(&x2, &f)| x2 + alpha * f)
                .collect();
            put("x_next", x_next);
            put("h1", h1);
            put("h3", h3);
            put("gate", gate);
        }
        KernelKind::FfnBackwardW2
        | KernelKind::FfnBackwardW13
        | KernelKind::WoBackward
        | KernelKind::QBackward
        | KernelKind::KvBackward => {
            // dx = Σ over the kernel's projections of Wᵀ·dy (+ adapters)
            let (acts, out): (&[&str], &str) = match kind {
                KernelKind::FfnBackwardW2 => (&["dffn"], "dgate"),
                KernelKind::FfnBackwardW13 => (&["dh1", "dh3"], "dx"),
                KernelKind::WoBackward => (&["dy"], "da"),
                KernelKind::QBackward => (&["dq"], "dx"),
                _ => (&["dk", "dv"], "dx"),
            };
            let mut dx: Vec<f32> = vec![];
            for (&(w, product), act) in kind.projections().iter().zip(acts) {
                let (rows, cols) = s.projection(w);
                let dy = get(t, act);
                let mut y = wt_x(get(t, w.region()), dy, rows, cols, seq);
                add_adapter(&mut y, t, o, s, w, dy, product);
                if dx.is_empty() {
                    dx = y;
                } else {
                    dx.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
                }
            }
            put(out, dx);
        }
        KernelKind::SdpaBackward1 => {
            let (qr, kr, v, da) = (
                get(t, "q_rope"),
                get(t, "k_rope"),
                get(t, "v"),
                get(t, "da"),
            );
            let mut dv = vec![0f32; kv * seq];
            let mut probs = vec![0f32; s.heads * seq * seq];
            let mut dp = vec![0f32; s.heads * seq * seq];
            // One KV group per task, its heads in order (so dV sums in the
            // same order whatever the thread count).
            dv.par_chunks_mut(hd * seq)
                .zip(probs.par_chunks_mut(r * seq * seq))
                .zip(dp.par_chunks_mut(r * seq * seq))
                .enumerate()
                .for_each(|(g, ((dv_g, probs_g), dp_g))| {
                    for j in 0..r {
                        let h = g * r + j;
                        let p = &mut probs_g[j * seq * seq..(j + 1) * seq * seq];
                        head_probs(
                            &qr[h * hd * seq..][..hd * seq],
                            &kr[g * hd * seq..][..hd * seq],
                            hd,
                            seq,
                            scale,
                            p,
                        );
                        // dV_g [HD, S] += dA_h [HD, S] · P; key block
                        // lo..hi is seen by queries lo..S.
                        for (lo, hi) in causal_blocks(seq) {
                            matmul_serial(
                                MatRef::row_major(da, h * hd * seq, hd, seq).cols_range(lo, seq),
                                MatRef::row_major(p, 0, seq, seq)
                                    .rows_range(lo, seq)
                                    .cols_range(lo, hi),
                                MatMut::strided(dv_g, lo, hd, hi - lo, seq),
                                true,
                            );
                        }
                        // dP_h [S, S] = dA_hᵀ · V_g
                        matmul_serial(
                            MatRef::row_major(da, h * hd * seq, hd, seq).t(),
                            MatRef::row_major(v, g * hd * seq, hd, seq),
                            MatMut::row_major(dp_g, j * seq * seq, seq, seq),
                            false,
                        );
                    }
                });
            put("dv", dv);
            put("probs", probs);
            put("dp", dp);
        }
        KernelKind::SdpaBackward2 => {
            let (p, dp, qr, kr) = (
                get(t, "probs"),
                get(t, "dp"),
                get(t, "q_rope"),
                get(t, "k_rope"),
            );
            let mut dq = vec![0f32; q * seq];
            let mut dk = vec![0f32; kv * seq];
            dq.par_chunks_mut(r * hd * seq)
                .zip(dk.par_chunks_mut(hd * seq))
                .enumerate()
                .for_each(|(g, (dq_g, dk_g))| {
                    let mut ds = vec![0f32; seq * seq];
                    for j in 0..r {
                        let h = g * r + j;
                        let base = h * seq * seq;
                        // dS = P ∘ (dP − rowsum(P ∘ dP)) · scale (over whole
                        // rows, as the kernel does, whatever P holds).
                        for i in 0..seq {
                            let (p, dp) =
                                (&p[base + i * seq..][..seq], &dp[base + i * seq..][..seq]);
                            let dot: f32 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
                            let row = &mut ds[i * seq..(i + 1) * seq];
                            for ((d, &p), &dp) in row.iter_mut().zip(p).zip(dp) {
                                *d = p * (dp - dot) * scale;
                            }
                        }
                        // dQ_h [HD, S] = K_g [HD, S] · dSᵀ ; dK_g [HD, S] += Q_h · dS
                        matmul_serial(
                            MatRef::row_major(kr, g * hd * seq, hd, seq),
                            MatRef::row_major(&ds, 0, seq, seq).t(),
                            MatMut::row_major(dq_g, j * hd * seq, hd, seq),
                            false,
                        );
                        matmul_serial(
                            MatRef::row_major(qr, h * hd * seq, hd, seq),
                            MatRef::row_major(&ds, 0, seq, seq),
                            MatMut::row_major(dk_g, 0, hd, seq),
                            true,
                        );
                    }
                });
            put("dq", dq);
            put("dk", dk);
        }
    }
    out
}
