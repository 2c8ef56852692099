//! The LM head, forward and backward, in chunks of the vocabulary: the
//! logits of a chunk z_c = E_c·xf on the runner, the softmax statistics
//! (running maximum, Σ exp) and the cross-entropy's gradients on the host.
//! A frozen head (LoRA) gathers its input gradient in the statistics pass.

use anyhow::{bail, Result};

use super::queue::overlapped;
use super::{weight_grad, Engine, Grads};
use crate::device::KernelRunner;
use crate::kernels::{self, Shape};
use crate::model::Model;

/// Rows of a block [`column_max`] and [`exp_shifted`] hand to one thread.
const BLOCK_ROWS: usize = 512;

/// The softmax statistics of the LM head's logits per position: the
/// running maximum m_s, Σ_v exp(z_vs − m_s) and the target's logit.
struct SoftmaxStats {
    max: Vec<f32>,
    sum: Vec<f64>,
    target_logit: Vec<f32>,
}

impl SoftmaxStats {
    /// m_s + ln Σ_s − z_{t_s,s} of every position s.
    fn nll(&self) -> Vec<f64> {
        (0..self.max.len())
            .map(|s| self.max[s] as f64 + self.sum[s].ln() - self.target_logit[s] as f64)
            .collect()
    }
}

/// [`Engine::head_statistics`] of one sequence, kept for its
/// [`Engine::head_backward`].
pub struct HeadStatistics {
    /// −log p of each position's target.
    pub nll: Vec<f64>,
    stats: SoftmaxStats,
    ranges: Vec<std::ops::Range<usize>>,
    /// The last chunk's exp(z − m), which a one-chunk vocabulary reuses.
    last: Vec<f32>,
    /// A frozen head's input gradient gathered beside the statistics
    /// (see [`FrozenHeadGradient`]), when a gradient was asked for over
    /// several chunks.
    frozen: Option<FrozenHeadGradient>,
}

/// The input gradient of a frozen LM head (LoRA), gathered in the
/// statistics pass, so each chunk's logits are computed once, not twice:
///   u_s = Σ_v exp(z_vs − m_s)·g_vs·E_v  (rescaled by exp(m_old − m_new) as m_s grows)
///   dxf_s = w_s·(u_s/Σ_s − g_{t_s}·E_{t_s})  once the weights w_s are known
/// (g the logits' slope through a soft cap, 1 − (z/c)²; 1 without one).
/// A head that trains needs each chunk's normalised gradient for its own
/// weight gradient dE_c = dz_c·xfᵀ, so it keeps the second pass.
struct FrozenHeadGradient {
    /// u, `[D, S]`.
    u: Vec<f32>,
}

/// Whether the LM head's weights train (they are frozen under LoRA).
fn head_trains(model: &Model) -> bool {
    model.lora.is_none()
}

/// What the head's gradient pass reads.
struct GradientPass<'a> {
    xf: &'a [f32],
    targets: &'a [u32],
    /// The gradient's weight on each position's −log p.
    weights: &'a [f32],
    ranges: &'a [std::ops::Range<usize>],
    stats: &'a SoftmaxStats,
}

/// Gemma 2's final soft cap on logits `z` in place, where the model has
/// one (`final_logit_softcapping`), on the host in f32:
///   z ← c·tanh(z/c),  dz_raw = dz ⊙ (1 − (z/c)²)
pub(crate) fn cap_logits(cfg: &crate::model::config::ModelConfig, z: &mut [f32]) {
    use rayon::prelude::*;
    if let Some(c) = cfg.scales.logits_cap {
        let (c, inv) = (c as f32, (1.0 / c) as f32);
        z.par_chunks_mut(1 << 16)
            .for_each(|b| b.iter_mut().for_each(|v| *v = (*v * inv).tanh() * c));
    }
}

/// The slope 1 − (z/c)² of capped logits `z`, when capped.
fn cap_slope(cfg: &crate::model::config::ModelConfig, z: &[f32]) -> Option<Vec<f32>> {
    let inv = (1.0 / cfg.scales.logits_cap?) as f32;
    Some(
        z.iter()
            .map(|&v| {
                let t = v * inv;
                1.0 - t * t
            })
            .collect(),
    )
}

/// Column maxima of `lt [rows, S]`.
fn column_max(lt: &[f32], seq: usize) -> Vec<f32> {
    use rayon::prelude::*;
    lt.par_chunks(BLOCK_ROWS * seq)
        .map(|b| {
            let mut m = vec![f32::NEG_INFINITY; seq];
            for row in b.chunks(seq) {
                m.iter_mut().zip(row).for_each(|(m, &z)| *m = m.max(z));
            }
            m
        })
        .reduce(
            || vec![f32::NEG_INFINITY; seq],
            |a, b| a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect(),
        )
}

/// `lt [rows, S]` ← exp(lt − max) per column, in place; returns the column
/// sums (f64, per-block sums added in block order, so the result does not
/// depend on the thread count). One exp per logit.
fn exp_shifted(lt: &mut [f32], max: &[f32], seq: usize) -> Vec<f64> {
    use rayon::prelude::*;
    let partial: Vec<Vec<f64>> = lt
        .par_chunks_mut(BLOCK_ROWS * seq)
        .map(|b| {
            let mut sum = vec![0f64; seq];
            for row in b.chunks_mut(seq) {
                crate::util::simd::exp_shifted_accumulate(row, max, &mut sum);
            }
            sum
        })
        .collect();
    let mut sum = vec![0f64; seq];
    for p in &partial {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sum
}

/// `lt [rows, S]` ← lt·scale per column, in place.
fn scale_columns(lt: &mut [f32], scale: &[f32], seq: usize) {
    use rayon::prelude::*;
    lt.par_chunks_mut(BLOCK_ROWS * seq).for_each(|b| {
        for row in b.chunks_mut(seq) {
            row.iter_mut().zip(scale).for_each(|(z, c)| *z *= c);
        }
    });
}

/// dxf `[D, S]` of a frozen head from its gathered u (see
/// [`FrozenHeadGradient`]): w_s·(u_s/Σ_s − g_{t_s}·E_{t_s}), the target's row
/// in f32, g its logit's slope through the soft cap (1 without one).
fn frozen_head_input_gradient(
    model: &Model,
    f: &FrozenHeadGradient,
    stats: &SoftmaxStats,
    targets: &[u32],
    weights: &[f32],
) -> Vec<f32> {
    let (d, seq) = (model.cfg.hidden_size, targets.len());
    let head = model.lm_head_param();
    let mut dxf = vec![0f32; d * seq];
    let mut scratch = Vec::new();
    for (s, (&t, &w)) in targets.iter().zip(weights).enumerate() {
        if w == 0.0 {
            continue;
        }
        let row = head.rows(t as usize..t as usize + 1, &mut scratch);
        let inv = 1.0 / stats.sum[s];
        // The target's logit through the soft cap, where there is one.
        let slope = cap_slope(&model.cfg, &stats.target_logit[s..s + 1]).map_or(1.0, |v| v[0]);
        for (c, &e) in row.iter().enumerate() {
            let p = (f.u[c * seq + s] as f64 * inv) as f32;
            dxf[c * seq + s] = w * (p - slope * e);
        }
    }
    dxf
}

/// The power of two the logits' gradient is sent to the head's backward
/// kernel in, as `2ᵏ·(softmax − one-hot)` per counted position instead of
/// `grad_scale·(…)`: with `grad_scale = 1/targets` most probabilities
/// would be fp16 zeros (below 6e-8), the scaled ones keep 11 bits down to
/// 2⁻²⁴/2ᵏ. Every output of the product is bounded by
/// `max|E|·Σ_v|dz_v| ≤ 2ᵏ·2·max|E|`: 2ᵏ is the largest power of two (at
/// most 2¹⁴, so dz fits fp16) keeping that bound at 16384, half the
/// matmul output cliff of 32752 (ANEForge docs/numeric-cliffs.md, "Matmul
/// output saturation": "Scale activations or weights before the matmul
/// and undo the scale afterwards"). Powers of two scale exactly.
pub fn head_grad_scale(head_max_abs: f32) -> f32 {
    let mut k = 16384f32; // 2¹⁴
    while k > 1.0 && 2.0 * k * head_max_abs > 16384.0 {
        k /= 2.0;
    }
    k
}

/// The largest |value| of the LM head, read a block of rows at a time.
fn head_max_abs(model: &Model) -> f32 {
    let head = model.lm_head_param();
    let (rows, mut scratch) = (head.shape[0], Vec::new());
    (0..rows)
        .step_by(4096)
        .map(|r| {
            let block = head.rows(r..(r + 4096).min(rows), &mut scratch);
            block.iter().fold(0f32, |m, x| m.max(x.abs()))
        })
        .fold(0f32, f32::max)
}

impl<R: KernelRunner> Engine<R> {
    /// One vocabulary chunk's logits `z_c = E_c·xf`, `[rows, S]`.
    fn head_chunk(&mut self, model: &Model, xf: &[f32], c: usize, rows: usize) -> Result<Vec<f32>> {
        let seq = xf.len() / model.cfg.hidden_size;
        let shape = Shape::new(&model.cfg, seq).head_chunk(rows);
        let acts = kernels::head_forward::Acts { xf };
        let out = self.runner.run::<kernels::HeadForward>(
            model,
            c,
            &shape,
            &Default::default(),
            &acts,
        )?;
        let mut z = out.logits;
        cap_logits(&model.cfg, &mut z);
        Ok(z)
    }

    /// Logits `[S, V]` for a final-normed state `xf [D, S]`, chunk by chunk
    /// (tests and `anetrain logits`; training never holds them whole).
    pub fn logits(&mut self, model: &Model, xf: &[f32]) -> Result<Vec<f32>> {
        let (d, v) = (model.cfg.hidden_size, model.cfg.vocab_size);
        let seq = xf.len() / d;
        let chunks = self.runner.head_chunks(model, seq)?;
        let mut out = vec![0f32; seq * v];
        for c in 0..chunks.chunks {
            let r = chunks.range(c, v);
            let z = self.head_chunk(model, xf, c, r.len())?;
            for (i, row) in z.chunks(seq).enumerate() {
                for (s, &x) in row.iter().enumerate() {
                    out[s * v + r.start + i] = x;
                }
            }
        }
        Ok(out)
    }

    /// The logits `[V]` at the last position of `xf [D, S]` (generation):
    /// the head runs on that position alone.
    pub fn last_logits(&mut self, model: &Model, xf: &[f32]) -> Result<Vec<f32>> {
        let d = model.cfg.hidden_size;
        let seq = xf.len() / d;
        let last: Vec<f32> = (0..d).map(|c| xf[c * seq + seq - 1]).collect();
        self.logits(model, &last)
    }

    /// Cross-entropy summed over the targets `first..` of one sequence
    /// (the others, a masked prompt, add nothing and get zero gradient),
    /// and with `grads` the gradient of `grad_scale · loss` into the LM
    /// head (unless LoRA freezes it) and the returned `dxf`: the SFT loss,
    /// [`Engine::head_statistics`] then [`Engine::head_backward`] with one
    /// weight on the counted positions.
    pub fn head_loss(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        first: usize,
        grad_scale: f32,
        grads: Option<&mut Grads>,
    ) -> Result<(f64, Vec<f32>)> {
        let head = self.head_statistics(model, xf, targets, grads.is_some())?;
        let loss = head.nll[first..].iter().sum();
        let Some(grads) = grads else {
            return Ok((loss, vec![]));
        };
        let weights: Vec<f32> = (0..targets.len())
            .map(|s| if s < first { 0.0 } else { grad_scale })
            .collect();
        let dxf = self.head_backward(model, xf, targets, head, &weights, grads)?;
        Ok((loss, dxf))
    }

    /// The LM head over one sequence: −log p of each target, per position.
    /// The head runs in the runner's vocabulary chunks (on a device, its
    /// kernels), the statistics on the host in f32/f64; per position s,
    /// with z = E·xf (`[Vc, S]` a chunk):
    ///   nll_s = m_s + ln Σ_v exp(z_vs − m_s) − z_{t_s,s},   m_s, Σ kept running
    /// With `gradient` (an [`Engine::head_backward`] follows) and a frozen
    /// head over several chunks, the input gradient is gathered in the
    /// same pass ([`FrozenHeadGradient`]).
    pub fn head_statistics(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        gradient: bool,
    ) -> Result<HeadStatistics> {
        let v = model.cfg.vocab_size;
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
            bail!("target token id {t} is outside the vocabulary ({v} ids)");
        }
        let chunks = self.runner.head_chunks(model, targets.len())?;
        let ranges: Vec<_> = (0..chunks.chunks).map(|c| chunks.range(c, v)).collect();
        let gather = gradient && ranges.len() > 1 && !head_trains(model);
        let (stats, last, frozen) = self.softmax_statistics(model, xf, targets, &ranges, gather)?;
        Ok(HeadStatistics {
            nll: stats.nll(),
            stats,
            ranges,
            last,
            frozen,
        })
    }

    /// The gradient of Σ_s w_s·nll_s (`weights` per position, of one sign
    /// or zero) into the LM head (unless LoRA freezes it) and the returned
    /// `dxf`, from [`Engine::head_statistics`] of the same sequence:
    ///   dz_vs = w_s·(exp(z_vs − m_s)/Σ_s − [v = t_s]),  dxf = Σ_c E_cᵀ·dz_c,  dE_c = dz_c·xfᵀ
    /// Over several chunks, a head that trains computes each chunk's
    /// logits twice (once for the statistics, once for the gradient): one
    /// more head forward per sequence, where keeping them would hold the
    /// whole `[V, S]`; a frozen head's dxf was gathered with the
    /// statistics ([`FrozenHeadGradient`]) and is only finished here.
    pub fn head_backward(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        head: HeadStatistics,
        weights: &[f32],
        grads: &mut Grads,
    ) -> Result<Vec<f32>> {
        if let Some(f) = &head.frozen {
            return Ok(frozen_head_input_gradient(
                model,
                f,
                &head.stats,
                targets,
                weights,
            ));
        }
        let pass = GradientPass {
            xf,
            targets,
            weights,
            ranges: &head.ranges,
            stats: &head.stats,
        };
        self.head_gradient(model, &pass, head.last, grads)
    }

    /// Pass 1 of [`Engine::head_statistics`]: the softmax statistics, chunk by
    /// chunk; also the last chunk's exp(z − m), which a one-chunk
    /// vocabulary reuses in pass 2; with `gather`, a frozen head's input
    /// gradient u ([`FrozenHeadGradient`]): each chunk's exp(z_c − m) is
    /// sent to the head's backward kernel as 2ᵏ·exp(z_c − m)/Σ_c (its
    /// columns sum to 2ᵏ, the bound of [`head_grad_scale`]) and the
    /// product scaled back by Σ_c/2ᵏ on the host.
    fn softmax_statistics(
        &mut self,
        model: &Model,
        xf: &[f32],
        targets: &[u32],
        ranges: &[std::ops::Range<usize>],
        gather: bool,
    ) -> Result<(SoftmaxStats, Vec<f32>, Option<FrozenHeadGradient>)> {
        let seq = targets.len();
        let mut st = SoftmaxStats {
            max: vec![f32::NEG_INFINITY; seq],
            sum: vec![0f64; seq],
            target_logit: vec![0f32; seq],
        };
        let d = model.cfg.hidden_size;
        let k = match gather {
            true => head_grad_scale(self.head_max_abs(model)),
            false => 1.0,
        };
        let mut frozen = gather.then(|| FrozenHeadGradient {
            u: vec![0f32; d * seq],
        });
        let shape = Shape::new(&model.cfg, seq);
        let mut lt = Vec::new();
        for (c, r) in ranges.iter().enumerate() {
            lt = self.head_chunk(model, xf, c, r.len())?;
            for (s, &t) in targets.iter().enumerate() {
                if r.contains(&(t as usize)) {
                    st.target_logit[s] = lt[(t as usize - r.start) * seq + s];
                }
            }
            // Soft-capped logits: each one's slope, for the gathered
            // gradient (Σ_v exp(z_v − m)·g_v·E_v).
            let slope = frozen
                .is_some()
                .then(|| cap_slope(&model.cfg, &lt))
                .flatten();
            let chunk_max = column_max(&lt, seq);
            let mut rescale = vec![1f32; seq];
            for (s, &cm) in chunk_max.iter().enumerate() {
                if cm > st.max[s] {
                    let f = ((st.max[s] - cm) as f64).exp();
                    st.sum[s] *= f;
                    rescale[s] = f as f32;
                    st.max[s] = cm;
                }
            }
            let part = exp_shifted(&mut lt, &st.max, seq);
            st.sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            if let Some(f) = frozen.as_mut() {
                if let Some(slope) = &slope {
                    lt.iter_mut().zip(slope).for_each(|(e, g)| *e *= g);
                }
                let to_device: Vec<f32> = part
                    .iter()
                    .map(|&p| if p > 0.0 { (k as f64 / p) as f32 } else { 0.0 })
                    .collect();
                scale_columns(&mut lt, &to_device, seq);
                let acts = kernels::head_backward::Acts { dlogits: &lt };
                let shape = shape.head_chunk(r.len());
                let out = self.runner.run::<kernels::HeadBackward>(
                    model,
                    c,
                    &shape,
                    &Default::default(),
                    &acts,
                )?;
                // u_s ← u_s·exp(m_old − m_new) + (Σ_c/2ᵏ)·E_cᵀ·dz_c
                let back: Vec<f32> = part.iter().map(|&p| (p / k as f64) as f32).collect();
                for (u, o) in f.u.chunks_mut(seq).zip(out.dxf.chunks(seq)) {
                    for s in 0..seq {
                        u[s] = u[s] * rescale[s] + o[s] * back[s];
                    }
                }
            }
        }
        Ok((st, lt, frozen))
    }

    /// Pass 2, [`Engine::head_backward`]: the gradient, chunk by chunk (the
    /// one chunk of a small vocabulary still holds exp(z − m) from pass 1,
    /// given as `last`), sent as 2ᵏ·(p − one-hot) and scaled back by
    /// g/2ᵏ after the product (g the largest weight); the head's gradient on the host's
    /// worker beside the device. Returns dxf.
    fn head_gradient(
        &mut self,
        model: &Model,
        p: &GradientPass,
        mut lt: Vec<f32>,
        grads: &mut Grads,
    ) -> Result<Vec<f32>> {
        let (d, seq) = (model.cfg.hidden_size, p.targets.len());
        let k = head_grad_scale(self.head_max_abs(model));
        // The weights as g·r_s with g the largest |w_s| and |r_s| ≤ 1, so
        // the bound of `head_grad_scale` holds; one weight gives r_s = 1
        // exactly.
        let g = p.weights.iter().fold(0f32, |m, w| m.max(w.abs()));
        let relative: Vec<f32> = p
            .weights
            .iter()
            .map(|&w| if g > 0.0 { w / g } else { 0.0 })
            .collect();
        let undo = g / k;
        let scale: Vec<f32> = (0..seq)
            .map(|s| (k as f64 * relative[s] as f64 / p.stats.sum[s]) as f32)
            .collect();
        let xf_undone: Vec<f32> = p.xf.iter().map(|x| x * undo).collect();
        // The head's gradient buffer, written (or accumulated into, after
        // an earlier sequence) chunk by chunk; frozen with LoRA.
        let head_id = model.lm_head_id();
        let mut dhead = model.lora.is_none().then(|| grads.product_target(head_id));
        let overlap = self.runner.overlaps_host();
        let mut dxf = vec![0f32; d * seq];
        let shape = Shape::new(&model.cfg, seq);
        let capped = model.cfg.scales.logits_cap.is_some();
        for (c, r) in p.ranges.iter().enumerate() {
            let mut slope = None;
            if p.ranges.len() > 1 || capped {
                lt = self.head_chunk(model, p.xf, c, r.len())?;
                slope = cap_slope(&model.cfg, &lt);
                exp_shifted(&mut lt, &p.stats.max, seq);
            }
            scale_columns(&mut lt, &scale, seq);
            for (s, &t) in p.targets.iter().enumerate() {
                if r.contains(&(t as usize)) && relative[s] != 0.0 {
                    lt[(t as usize - r.start) * seq + s] -= k * relative[s];
                }
            }
            // Through the soft cap: dz_raw = dz ⊙ (1 − (z/c)²).
            if let Some(slope) = slope {
                lt.iter_mut().zip(&slope).for_each(|(d, s)| *d *= s);
            }
            let dz = &lt;
            // dE_c [Vc, D] (+)= dz_c [Vc, S] · (undo·xf)ᵀ [S, D], on the
            // host's worker beside the device.
            let x = &xf_undone;
            let dh = dhead
                .as_mut()
                .map(|(dh, accumulate)| (&mut dh[r.start * d..r.end * d], *accumulate));
            let job = move || {
                if let Some(target) = dh {
                    weight_grad(target, dz, x, r.len(), d, seq);
                }
            };
            let runner = &mut self.runner;
            let part = overlapped(overlap, job, || {
                let shape = shape.head_chunk(r.len());
                let acts = kernels::head_backward::Acts { dlogits: dz };
                runner.run::<kernels::HeadBackward>(model, c, &shape, &Default::default(), &acts)
            })?;
            // dxf [D, S] += undo · E_cᵀ·dz_c
            dxf.iter_mut()
                .zip(&part.dxf)
                .for_each(|(a, p)| *a += undo * p);
        }
        Ok(dxf)
    }

    /// The head's largest |value|, kept while the model's weights stay
    /// the same version.
    fn head_max_abs(&mut self, model: &Model) -> f32 {
        let key = (model.version, model.lm_head_id());
        match self.head_max {
            Some((k, m)) if k == key => m,
            _ => {
                let m = head_max_abs(model);
                self.head_max = Some((key, m));
                m
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CpuKernels, Dropout};
    use crate::engine::zero_grads;
    use crate::kernels::KernelOptions;
    use crate::util::rng::Rng;

    /// The chunked head gives the whole-vocabulary loss to 1e-6 relative
    /// (measured from scratch in f64), counts only targets `first..`, and
    /// its input and head gradients do not depend on the chunk size.
    #[test]
    fn chunked_head_loss_matches_the_whole_vocabulary() {
        let mut cfg = crate::model::config::ModelConfig::preset("tiny").unwrap();
        cfg.vocab_size = 700;
        cfg.tie_word_embeddings = false;
        let model = Model::init(&cfg, 3).unwrap();
        let (d, v, seq, first) = (cfg.hidden_size, cfg.vocab_size, 9, 4);
        let mut rng = Rng::new(5);
        let xf = rng.normals(d * seq, 3.0);
        let targets: Vec<u32> = (0..seq).map(|_| rng.below(v) as u32).collect();
        let head = model.lm_head();
        let mut expect = 0f64;
        for (s, &t) in targets.iter().enumerate().skip(first) {
            let z: Vec<f64> = (0..v)
                .map(|r| {
                    (0..d)
                        .map(|c| head[r * d + c] as f64 * xf[c * seq + s] as f64)
                        .sum()
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            expect += m + z.iter().map(|z| (z - m).exp()).sum::<f64>().ln() - z[t as usize];
        }
        let run = |chunk: usize| {
            let mut g = zero_grads(&model);
            g.reset();
            let mut eng = Engine::cpu(&model);
            eng.runner.head_rows = chunk;
            let (loss, dxf) = eng
                .head_loss(&model, &xf, &targets, first, 0.5, Some(&mut g))
                .unwrap();
            g.finish();
            let id = model.lm_head.unwrap();
            (loss, dxf, g[id].clone())
        };
        let (whole, dxf, dhead) = run(v);
        for chunk in [7, 256, 699] {
            let (loss, dx, dh) = run(chunk);
            assert!(
                (loss - expect).abs() < 1e-6 * expect,
                "{chunk}: {loss} vs {expect}"
            );
            let close = |a: &[f32], b: &[f32]| {
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale)
            };
            assert!(close(&dx, &dxf), "dxf differs at chunk {chunk}");
            assert!(close(&dh, &dhead), "dhead differs at chunk {chunk}");
        }
        assert!((whole - expect).abs() < 1e-6 * expect);
        // Uncounted positions get no gradient.
        for c in 0..d {
            for s in 0..first {
                assert_eq!(dxf[c * seq + s], 0.0);
            }
        }
    }

    /// The CPU engine's kernels, counting the LM head's forward runs.
    struct CountingHeads {
        inner: CpuKernels,
        head_forwards: usize,
    }

    impl KernelRunner for CountingHeads {
        fn run<K: kernels::Kernel>(
            &mut self,
            model: &Model,
            layer: usize,
            shape: &Shape,
            dropout: &Dropout,
            acts: &K::Acts<'_>,
        ) -> Result<K::Out> {
            self.head_forwards += (K::KIND == kernels::KernelKind::HeadForward) as usize;
            self.inner.run::<K>(model, layer, shape, dropout, acts)
        }

        fn head_chunks(
            &mut self,
            model: &Model,
            seq: usize,
        ) -> Result<kernels::tiling::HeadChunks> {
            self.inner.head_chunks(model, seq)
        }
    }

    /// A frozen head (LoRA) gathers its input gradient in the statistics
    /// pass: each chunk's logits are computed once, where a head that
    /// trains computes them twice, and dxf is the two-pass one (the
    /// trained head's, the same maths) to 1e-5 of its largest value, with
    /// per-position weights given after the statistics (as DPO does).
    #[test]
    fn a_frozen_head_computes_each_chunk_once_for_the_same_input_gradient() {
        // Without and with Gemma 2's soft cap on the logits (the gathered
        // gradient then weighs each logit by its slope).
        for cap in [None, Some(2.0)] {
            let mut cfg = crate::model::config::ModelConfig::preset("tiny").unwrap();
            cfg.vocab_size = 700;
            cfg.scales.logits_cap = cap;
            let mut model = Model::init(&cfg, 3).unwrap();
            let (d, v, seq) = (cfg.hidden_size, cfg.vocab_size, 9);
            let mut rng = Rng::new(5);
            let xf = rng.normals(d * seq, 3.0);
            let targets: Vec<u32> = (0..seq).map(|_| rng.below(v) as u32).collect();
            let weights: Vec<f32> = (0..seq).map(|s| [0.0, 0.5, -0.25][s % 3]).collect();
            let run = |model: &Model, chunk: usize| {
                let opts = KernelOptions::for_model(model);
                let mut inner = CpuKernels::new(opts.clone());
                inner.head_rows = chunk;
                let runner = CountingHeads {
                    inner,
                    head_forwards: 0,
                };
                let mut eng = Engine::with_runner(runner, opts);
                let mut g = zero_grads(model);
                g.reset();
                let head = eng.head_statistics(model, &xf, &targets, true).unwrap();
                let nll = head.nll.clone();
                let dxf = eng
                    .head_backward(model, &xf, &targets, head, &weights, &mut g)
                    .unwrap();
                (nll, dxf, eng.runner.head_forwards)
            };
            let (nll, trained, forwards) = run(&model, 256);
            assert_eq!(forwards, 6, "a head that trains: 3 chunks, twice");
            let lora = crate::model::lora::LoraConfig::every_projection(4);
            model.lora = Some(crate::model::lora::Lora::init(&cfg, lora, 1).unwrap());
            for chunk in [7, 256, 699] {
                let (nll_f, frozen, forwards) = run(&model, chunk);
                assert_eq!(forwards, v.div_ceil(chunk), "chunk {chunk}: once each");
                for (a, b) in nll_f.iter().zip(&nll) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs(),
                        "cap {cap:?}, chunk {chunk}: nll {a} vs {b}"
                    );
                }
                let scale = trained.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (i, (a, b)) in frozen.iter().zip(&trained).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * scale,
                        "cap {cap:?}, chunk {chunk}: dxf[{i}] {a} vs {b}"
                    );
                }
                // Unweighted positions get no gradient.
                assert!((0..d).all(|c| frozen[c * seq] == 0.0));
            }
        }
    }
}
