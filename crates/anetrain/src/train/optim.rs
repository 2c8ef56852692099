//! AdamW with PyTorch semantics, global-norm gradient clipping, and the
//! learning-rate schedule (linear warmup, cosine decay to a floor).

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::engine::grads::Grads;
use crate::model::Model;
use crate::util::simd::vectorized;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Applied to parameters with `decay` set (matrices, embeddings).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// First and second moments per parameter, and the step count.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl AdamW {
    pub fn new(model: &Model, cfg: AdamWConfig) -> AdamW {
        AdamW {
            cfg,
            step: 0,
            m: model
                .trainable()
                .iter()
                .map(|p| crate::util::mem::zeroed_huge(p.data.len()))
                .collect(),
            v: model
                .trainable()
                .iter()
                .map(|p| crate::util::mem::zeroed_huge(p.data.len()))
                .collect(),
        }
    }

    /// One update, exactly as `torch.optim.AdamW` (non-fused, f32), with
    /// every gradient multiplied by `grad_scale` first (clipping and
    /// loss-scale removal fused into the one pass over the parameters;
    /// with a scale of 1 the result is the same bit for bit):
    ///   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
    ///   p ← p − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + eps)
    pub fn update(&mut self, model: &mut Model, grads: &Grads, lr: f64, grad_scale: f32) {
        self.step += 1;
        let t = self.step as i32;
        let c = &self.cfg;
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let step_size = (lr / bc1) as f32;
        let (eps, bc2_sqrt) = (c.eps as f32, bc2_sqrt as f32);
        for (i, p) in model.trainable_mut().iter_mut().enumerate() {
            let decay = if p.decay {
                (1.0 - lr * c.weight_decay) as f32
            } else {
                1.0
            };
            // Elementwise: splitting the work across threads changes nothing
            // in the result.
            const CHUNK: usize = 1 << 16;
            p.data
                .par_chunks_mut(CHUNK)
                .zip(self.m[i].par_chunks_mut(CHUNK))
                .zip(self.v[i].par_chunks_mut(CHUNK))
                .zip(grads[i].par_chunks(CHUNK))
                .for_each(|(((p, m), v), g)| {
                    let k = AdamWStep {
                        grad_scale,
                        decay,
                        b1,
                        b2,
                        bc2_sqrt,
                        eps,
                        step_size,
                    };
                    adamw_chunk(p, m, v, g, &k)
                });
        }
    }
}

/// The per-step constants of one parameter's AdamW update.
struct AdamWStep {
    grad_scale: f32,
    decay: f32,
    b1: f32,
    b2: f32,
    bc2_sqrt: f32,
    eps: f32,
    step_size: f32,
}

vectorized! {
    /// The AdamW update of one chunk (see [`AdamW::update`]), in
    /// the same operations and order as the formula there.
    fn adamw_chunk(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], k: &AdamWStep) {
        let n = p.len();
        let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
        for j in 0..n {
            let gj = g[j] * k.grad_scale;
            let pj = p[j] * k.decay;
            let mj = m[j] * k.b1 + gj * (1.0 - k.b1);
            let vj = v[j] * k.b2 + gj * gj * (1.0 - k.b2);
            let denom = vj.sqrt() / k.bc2_sqrt + k.eps;
            p[j] = pj - k.step_size * (mj / denom);
            m[j] = mj;
            v[j] = vj;
        }
    }
}

vectorized! {
    /// Σx² in f64 over eight interleaved accumulators (independent add
    /// chains, so the loop vectorises), then summed in order.
    fn sum_squares(c: &[f32]) -> f64 {
        let mut acc = [0f64; 8];
        let mut blocks = c.chunks_exact(8);
        for b in &mut blocks {
            for (a, &x) in acc.iter_mut().zip(b) {
                *a += (x as f64) * (x as f64);
            }
        }
        for (a, &x) in acc.iter_mut().zip(blocks.remainder()) {
            *a += (x as f64) * (x as f64);
        }
        acc.iter().sum::<f64>()
    }
}

/// The global L2 norm of all gradients (accumulated in f64).
pub fn grad_norm(grads: &Grads) -> f64 {
    // Partial sums per fixed-size chunk, added in order, each over eight
    // interleaved accumulators (independent add chains the compiler can
    // vectorise): the result does not depend on the number of threads.
    let partial: Vec<f64> = grads
        .iter()
        .flat_map(|g| g.chunks(1 << 16))
        .collect::<Vec<_>>()
        .par_iter()
        .map(|c| sum_squares(c))
        .collect();
    partial.iter().sum::<f64>().sqrt()
}

/// The factor PyTorch's `clip_grad_norm_` scales gradients of global norm
/// `norm` by to bring it to `max_norm`: max_norm / (norm + 1e-6) when that
/// is under 1, else 1 (as when `max_norm` is 0 or less: no clipping).
pub fn clip_coef(norm: f64, max_norm: f64) -> f32 {
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        coef as f32
    } else {
        1.0
    }
}

/// Linear warmup over `warmup` steps, then cosine decay from `peak` to
/// `peak·min_frac` at `total`. Steps count from 0; with `warmup = 0` the
/// first step uses the peak.
pub fn lr_at(step: u64, total: u64, warmup: u64, peak: f64, min_frac: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f64 / span as f64).min(1.0);
    let floor = peak * min_frac;
    floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_shape() {
        assert_eq!(lr_at(0, 100, 0, 1.0, 0.1), 1.0);
        assert!((lr_at(0, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(55, 100, 10, 1.0, 0.0) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn the_clip_factor_is_pytorchs() {
        assert_eq!(clip_coef(5.0, 1.0), (1.0 / (5.0 + 1e-6)) as f32);
        assert_eq!(clip_coef(0.5, 1.0), 1.0);
        assert_eq!(clip_coef(5.0, 0.0), 1.0);
    }

    /// The vectorised update (whichever instruction set runs it) equals the
    /// scalar formula bit for bit, over a length that leaves a remainder
    /// for every vector width.
    #[test]
    fn vectorised_update_is_the_scalar_formula_exactly() {
        let n = 1000 + 13;
        let val = |i: usize, s: f32| ((i as f32 * 0.37 + s).sin()) * 0.01;
        let (p0, m0, g): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| val(i, 0.1)).collect(),
            (0..n).map(|i| val(i, 0.5)).collect(),
            (0..n).map(|i| val(i, 0.9)).collect(),
        );
        let v0: Vec<f32> = (0..n).map(|i| val(i, 1.3).abs()).collect();
        let k = AdamWStep {
            grad_scale: 0.7,
            decay: 0.9999,
            b1: 0.9,
            b2: 0.95,
            bc2_sqrt: 0.31,
            eps: 1e-8,
            step_size: 3e-4,
        };
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw_chunk(&mut p, &mut m, &mut v, &g, &k);
        for j in 0..n {
            let gj = g[j] * k.grad_scale;
            let mut pj = p0[j];
            pj *= k.decay;
            let mj = m0[j] * k.b1 + gj * (1.0 - k.b1);
            let vj = v0[j] * k.b2 + gj * gj * (1.0 - k.b2);
            pj -= k.step_size * (mj / (vj.sqrt() / k.bc2_sqrt + k.eps));
            assert_eq!(
                (p[j].to_bits(), m[j].to_bits(), v[j].to_bits()),
                (pj.to_bits(), mj.to_bits(), vj.to_bits()),
                "{j}"
            );
        }
        let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
        assert!((sum_squares(&g) - want).abs() <= 1e-12 * want);
    }
}

/// Dynamic loss scaling for fp16 gradients: the loss gradient is multiplied
/// by `scale` before backward; a step whose gradients overflow is skipped
/// and the scale halved; after `growth_interval` clean steps it doubles.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub good_steps: u64,
    pub growth_interval: u64,
    pub dynamic: bool,
    /// The scale never grows past this.
    #[serde(default = "default_max_scale")]
    pub max_scale: f64,
}

fn default_max_scale() -> f64 {
    65536.0
}

/// Largest loss scale on the Neural Engine paths. A matmul output above
/// 32752 becomes ±inf on every measured chip (ANEForge
/// docs/numeric-cliffs.md, "Matmul output saturation"), and the backward
/// products run on the scaled gradient: the loss gradient per logit is at
/// most scale / targets (≤ 8192 / 32 = 256 at the shortest padded length),
/// which keeps `Wᵀ·dy` sums well below the cliff for weights of ordinary
/// size, while still lifting gradients of 2⁻²⁴ out of fp16's subnormals.
/// A step that overflows anyway is skipped and the scale halved.
pub const DEVICE_MAX_LOSS_SCALE: f64 = 8192.0;

impl LossScaler {
    /// No scaling (f32 engines).
    pub fn fixed() -> LossScaler {
        LossScaler {
            scale: 1.0,
            good_steps: 0,
            growth_interval: 0,
            dynamic: false,
            max_scale: 1.0,
        }
    }

    /// Starts at `initial` (2^10 unless given), grows every 100 clean
    /// steps up to [`DEVICE_MAX_LOSS_SCALE`] (or `initial`, if larger).
    pub fn dynamic(initial: Option<f64>) -> LossScaler {
        let scale = initial.unwrap_or(1024.0);
        LossScaler {
            scale,
            good_steps: 0,
            growth_interval: 100,
            dynamic: true,
            max_scale: DEVICE_MAX_LOSS_SCALE.max(scale),
        }
    }

    /// Records a step's outcome.
    pub fn update(&mut self, finite: bool) {
        if !self.dynamic {
            return;
        }
        if finite {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(self.max_scale);
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0 / 1024.0);
            self.good_steps = 0;
        }
    }
}
