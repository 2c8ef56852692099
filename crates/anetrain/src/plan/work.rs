//! Where a training step's arithmetic runs on the Neural Engine path:
//!
//!   device  = Σ over kernels of tiles × one tile's matrix products (counted
//!             from its MIL): per layer, forward kernels twice when
//!             checkpointing; and the LM head's chunks, per sequence
//!   host    = the softmax statistics and logits' gradient between the
//!             head's chunks (critical path: the backward cannot start
//!             before them), and the weight gradients beside the device
//!             (on the host's worker thread), the head's among them when
//!             it trains
//!
//! Other elementwise work (norms, RoPE, residuals) and LoRA's rank-r
//! adapter products on the host are not counted: they are small beside
//! the products counted here.

use anyhow::Result;
use serde::Serialize;

use crate::kernels::{tiling, KernelOptions, Shape};
use crate::model::config::ModelConfig;
use crate::model::layer::Mixer;

/// The host's arithmetic per logit in `Engine::head_loss` with a
/// gradient: the running maximum (1), exp(z − m) and its sum (3), both
/// again over several chunks for the gradient (3), and the scale by
/// 2ᵏ/Σ (1).
pub const HOST_FLOP_PER_LOGIT: f64 = 8.0;

/// The same for a frozen head over several chunks, its input gradient
/// gathered in the statistics pass: the maximum, exp and sum (4), and
/// the scale by 2ᵏ/Σ_c (1).
pub const FROZEN_HOST_FLOP_PER_LOGIT: f64 = 5.0;

/// One training step's work by place (FLOPs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepWork {
    /// The device kernels' matrix products.
    pub device_flop: f64,
    /// Device evaluations (one per tile a kernel runs).
    pub device_evaluations: usize,
    /// Host work on the critical path: the loss's softmax over the head's
    /// logits and their gradient ([`HOST_FLOP_PER_LOGIT`] a logit), and
    /// the sum of the chunks' input gradients. No products: the head's
    /// run on the device.
    pub host_flop: f64,
    /// Host weight gradients, overlapped with the device: every
    /// projection's and the LM head's when they train (full fine-tuning).
    pub host_weight_gradient_flop: f64,
    /// The sequence length the kernels are compiled for (padded).
    pub compiled_seq: usize,
    /// Of the device's work, forward-only passes (DPO's reference): FLOPs
    /// and evaluations, counted in the totals too.
    pub reference_flop: f64,
    pub reference_evaluations: usize,
}

impl StepWork {
    /// The work of one step of `batch` rows of `seq` tokens with the
    /// kernel options `opts` (LoRA in `opts.lora`; `full` when every
    /// weight trains), checkpointing activations or not.
    pub fn plan(
        cfg: &ModelConfig,
        seq: usize,
        batch: usize,
        opts: &KernelOptions,
        full: bool,
        grad_checkpoint: bool,
    ) -> Result<StepWork> {
        let compiled = crate::kernels::compiled_length(seq);
        let plan = tiling::plan(&Shape::new(cfg, compiled), opts)?;
        let (flop, evaluations) = plan.work_per_layer(grad_checkpoint);
        let (head_flop, head_evaluations) = plan.head_work(tiling::HeadPass::gradient(full));
        let layers = cfg.num_hidden_layers;
        // LoRA on the last layers only: the layers below run their forward
        // and no backward (`--lora-layers`).
        let (fwd_flop, fwd_evaluations) = plan.forward_work_per_layer();
        let below = layers
            - opts
                .lora
                .as_ref()
                .map_or(layers, |l| l.backward_layers(layers));
        let (below_flop, below_evaluations) = (
            (flop - fwd_flop) * below as f64,
            (evaluations - fwd_evaluations) * below,
        );
        let (d, v) = (cfg.hidden_size as f64, cfg.vocab_size as f64);
        let tokens = (seq * batch) as f64;
        // dE = dz·xfᵀ, one product over the head.
        let head_gradient = 2.0 * v * d * tokens;
        let weight_gradients = match full {
            true => projection_flops(cfg, seq * batch) / 3.0 + head_gradient,
            false => 0.0,
        };
        let per_logit = match full || plan.head.chunks == 1 {
            true => HOST_FLOP_PER_LOGIT,
            false => FROZEN_HOST_FLOP_PER_LOGIT,
        };
        let softmax = per_logit * v * tokens;
        let dxf_sums = 2.0 * (plan.head.chunks as f64) * d * tokens;
        Ok(StepWork {
            device_flop: (flop * layers as f64 - below_flop + head_flop) * batch as f64,
            device_evaluations: (evaluations * layers - below_evaluations + head_evaluations)
                * batch,
            host_flop: softmax + dxf_sums,
            host_weight_gradient_flop: weight_gradients,
            compiled_seq: compiled,
            reference_flop: 0.0,
            reference_evaluations: 0,
        })
    }

    /// The step with `sequences` forward-only passes more (DPO's
    /// reference: two a pair): each layer's forward kernels and the LM
    /// head's chunks once, its softmax statistics on the host.
    pub fn with_reference(
        mut self,
        cfg: &ModelConfig,
        opts: &KernelOptions,
        sequences: usize,
    ) -> Result<StepWork> {
        let plan = tiling::plan(&Shape::new(cfg, self.compiled_seq), opts)?;
        let (flop, evaluations) = plan.forward_work_per_layer();
        let (head_flop, head_evaluations) = plan.head_work(tiling::HeadPass::Statistics);
        let n = sequences as f64;
        self.reference_flop = (flop * cfg.num_hidden_layers as f64 + head_flop) * n;
        self.reference_evaluations =
            (evaluations * cfg.num_hidden_layers + head_evaluations) * sequences;
        self.device_flop += self.reference_flop;
        self.device_evaluations += self.reference_evaluations;
        // The running maximum and Σ exp: 4 of HOST_FLOP_PER_LOGIT's 8.
        self.host_flop += 4.0 * (cfg.vocab_size * self.compiled_seq) as f64 * n;
        Ok(self)
    }

    /// The step's matrix products on the chip's CPU instead (`--backend
    /// cpu`, Accelerate's fp32 `sgemm` at `rates`' published curve): the
    /// device's products at the mean evaluation's size, the weight
    /// gradients at their own. A floor of the CPU engine's step — its
    /// norms, softmax and AdamW come on top, and nothing overlaps.
    pub fn cpu_products_ms(&self, rates: &ane::cost::Rates) -> f64 {
        let evals = self.device_evaluations.max(1) as f64;
        evals * rates.host_gemm_ms(self.device_flop / evals)
            + rates.host_gemm_ms(self.host_weight_gradient_flop)
    }

    /// One line for `kernels plan`.
    pub fn describe(&self) -> String {
        let g = |f: f64| format!("{:.1} GFLOP", f / 1e9);
        let reference = match self.reference_evaluations {
            0 => String::new(),
            n => format!(
                " ({} in {n} of them: the reference's forwards)",
                g(self.reference_flop)
            ),
        };
        format!(
            "per training step: device {} in {} evaluations (the LM head's chunks among them){reference}; host {} on the critical path (the loss's softmax between the head's chunks), {} of weight gradients beside the device; host/device {:.2}%",
            g(self.device_flop),
            self.device_evaluations,
            g(self.host_flop),
            g(self.host_weight_gradient_flop),
            100.0 * self.host_flop / self.device_flop.max(1.0)
        )
    }
}

/// FLOPs of one training step (forward + backward = 3× forward), counting
/// every matmul including the LM head and full (unmasked) attention.
pub fn step_flops(c: &ModelConfig, seq: usize, batch: usize) -> f64 {
    // The mixer's products between positions, forward, per layer and sequence.
    let mixing = match c.layer().mixer {
        // scores Q·Kᵀ and the weighted values P·V: 2·2·S²·(heads·HD)
        Mixer::Attention { .. } => 4.0 * (seq * seq) as f64 * c.q_dim() as f64,
    };
    projection_flops(c, seq * batch) + 3.0 * batch as f64 * c.num_hidden_layers as f64 * mixing
}

/// FLOPs of a step's weight products alone (every projection of the
/// layer's description and the LM head; forward, input gradient, weight
/// gradient) at `tokens` positions.
pub fn projection_flops(c: &ModelConfig, tokens: usize) -> f64 {
    let (d, v) = (c.hidden_size as f64, c.vocab_size as f64);
    let per_layer: f64 = c
        .layer()
        .params(&c.layer_dims())
        .iter()
        .filter(|p| p.shape.len() == 2)
        .map(|p| (p.shape[0] * p.shape[1]) as f64)
        .sum();
    3.0 * 2.0 * tokens as f64 * (per_layer * c.num_hidden_layers as f64 + v * d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_step_flops_match_a_hand_count() {
        // Per layer: q 1024·2048 + k, v 2·1024·1024 + o 2048·1024 + FFN
        // 3·1024·3072 = 15 728 640 weights; 28 layers + LM head 151936·1024
        // = 595 984 384. Products: 3 passes · 2 · 256 tokens · that =
        // 915 432 013 824; attention 3 · 28 · 4 · 256² · 2048 = 45 097 156 608.
        let c = ModelConfig::preset("qwen3-0.6b").unwrap();
        assert_eq!(projection_flops(&c, 256), 915_432_013_824.0);
        assert_eq!(step_flops(&c, 256, 1), 960_529_170_432.0);
    }

    /// Untiled and tiled, the device does the same products: tiles split
    /// them, sequence blocks of per-position kernels too, but for the
    /// head's forward run again over several chunks; a checkpointed step
    /// adds exactly the forward kernels' work once more.
    #[test]
    fn device_work_is_the_products_whatever_the_tiling() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let (v, d) = (cfg.vocab_size as f64, cfg.hidden_size as f64);
        let head = 2.0 * v * d * 64.0;
        let o = KernelOptions::hf(&cfg);
        let plain = StepWork::plan(&cfg, 64, 1, &o, true, false).unwrap();
        let mut forced = o.clone();
        forced.min_tiles = 2;
        let tiled = StepWork::plan(&cfg, 64, 1, &forced, true, false).unwrap();
        assert!(tiled.device_evaluations > plain.device_evaluations);
        let rel = (tiled.device_flop - plain.device_flop - head).abs() / plain.device_flop;
        assert!(rel < 1e-9, "{} vs {}", tiled.device_flop, plain.device_flop);
        let ckpt = StepWork::plan(&cfg, 64, 1, &o, true, true).unwrap();
        assert!(ckpt.device_flop > plain.device_flop);
        // The head on the device: its one chunk's forward and backward.
        let o_cpu = KernelOptions {
            max_tile_bytes: None,
            ..o.clone()
        };
        let layers_only = tiling::plan(&Shape::new(&cfg, 64), &o_cpu).unwrap();
        let layer_flop = layers_only.work_per_layer(false).0 * cfg.num_hidden_layers as f64;
        let rel = (plain.device_flop - layer_flop - 2.0 * head).abs() / plain.device_flop;
        assert!(
            rel < 1e-9,
            "{} vs {}",
            plain.device_flop,
            layer_flop + 2.0 * head
        );
        // The host: the softmax and one chunk's dxf, no products.
        assert_eq!(plain.host_flop, 8.0 * v * 64.0 + 2.0 * d * 64.0);
        // Weight gradients: one of the three passes over the projections,
        // and the head's.
        let wg = projection_flops(&cfg, 64) / 3.0 + head;
        assert_eq!(plain.host_weight_gradient_flop, wg);
    }

    /// Over several chunks a head that trains runs each chunk's forward
    /// twice; a frozen one (LoRA) once: one head forward's products and
    /// evaluations fewer, and 3 of the 8 host operations a logit.
    #[test]
    fn a_frozen_head_runs_each_chunk_forward_once() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let (v, d, seq) = (cfg.vocab_size as f64, cfg.hidden_size as f64, 64);
        let lora = crate::model::lora::LoraConfig::every_projection(4);
        let mut o = KernelOptions::hf(&cfg).with_lora(Some(&lora));
        o.min_tiles = 2;
        let plan = tiling::plan(&Shape::new(&cfg, seq), &o).unwrap();
        let chunks = plan.head.chunks;
        assert!(chunks >= 2, "{chunks}");
        let (forward_flop, forward_evaluations) = plan.head_work(tiling::HeadPass::Statistics);
        let trained = plan.head_work(tiling::HeadPass::Gradient);
        let frozen = plan.head_work(tiling::HeadPass::FrozenGradient);
        assert_eq!(trained.1 - frozen.1, forward_evaluations);
        assert!((trained.0 - frozen.0 - forward_flop).abs() < 1e-6 * forward_flop);
        let lora_step = StepWork::plan(&cfg, seq, 1, &o, false, false).unwrap();
        let full_step = StepWork::plan(&cfg, seq, 1, &o, true, false).unwrap();
        assert_eq!(
            full_step.device_evaluations - lora_step.device_evaluations,
            forward_evaluations
        );
        let dxf_sums = 2.0 * chunks as f64 * d * seq as f64;
        assert_eq!(lora_step.host_flop, 5.0 * v * seq as f64 + dxf_sums);
    }
}
