//! Where a training step's arithmetic runs on the Neural Engine path:
//!
//!   device  = Σ over kernels of tiles × one tile's matrix products (counted
//!             from its MIL), per layer, forward kernels twice when
//!             checkpointing
//!   host    = the LM head and its input gradient (critical path: the
//!             backward cannot start before them), and the weight gradients
//!             beside the device (on the host's worker thread)
//!
//! Elementwise work (norms, RoPE, softmax, the loss) and LoRA's rank-r
//! adapter products on the host are not counted: they are small beside
//! the products counted here.

use anyhow::Result;
use serde::Serialize;

use crate::config::ModelConfig;
use crate::kernels::{tiling, KernelOptions, Shape};

/// One training step's work by place (FLOPs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepWork {
    /// The device kernels' matrix products.
    pub device_flop: f64,
    /// Device evaluations (one per tile a kernel runs).
    pub device_evaluations: usize,
    /// Host products on the critical path: the LM head's logits and its
    /// input gradient.
    pub host_flop: f64,
    /// Host weight gradients, overlapped with the device: every
    /// projection's and the LM head's when they train (full fine-tuning).
    pub host_weight_gradient_flop: f64,
    /// The sequence length the kernels are compiled for (padded).
    pub compiled_seq: usize,
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
        let compiled = crate::runner::compiled_length(seq);
        let plan = tiling::plan(&Shape::new(cfg, compiled), opts).map_err(anyhow::Error::msg)?;
        let (flop, evaluations) = plan.work_per_layer(grad_checkpoint);
        let layers = cfg.num_hidden_layers;
        let (d, v) = (cfg.hidden_size as f64, cfg.vocab_size as f64);
        let tokens = (seq * batch) as f64;
        let head = 2.0 * v * d * tokens;
        let weight_gradients = match full {
            true => crate::bench::projection_flops(cfg, seq * batch) / 3.0,
            false => 0.0,
        };
        Ok(StepWork {
            device_flop: flop * (layers * batch) as f64,
            device_evaluations: evaluations * layers * batch,
            host_flop: 2.0 * head,
            host_weight_gradient_flop: weight_gradients,
            compiled_seq: compiled,
        })
    }

    /// One line for `kernels plan`.
    pub fn describe(&self) -> String {
        let g = |f: f64| format!("{:.1} GFLOP", f / 1e9);
        format!(
            "per training step: device {} in {} evaluations; host {} on the critical path (LM head), {} of weight gradients beside the device; host/device {:.1}%",
            g(self.device_flop),
            self.device_evaluations,
            g(self.host_flop),
            g(self.host_weight_gradient_flop),
            100.0 * self.host_flop / self.device_flop.max(1.0)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Untiled and tiled, the device does the same products: tiles split
    /// them, sequence blocks of per-position kernels too; a checkpointed
    /// step adds exactly the forward kernels' work once more.
    #[test]
    fn device_work_is_the_products_whatever_the_tiling() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let o = KernelOptions::hf(&cfg);
        let plain = StepWork::plan(&cfg, 64, 1, &o, true, false).unwrap();
        let mut forced = o.clone();
        forced.min_tiles = 2;
        let tiled = StepWork::plan(&cfg, 64, 1, &forced, true, false).unwrap();
        assert!(tiled.device_evaluations > plain.device_evaluations);
        let rel = (tiled.device_flop - plain.device_flop).abs() / plain.device_flop;
        assert!(rel < 1e-9, "{} vs {}", tiled.device_flop, plain.device_flop);
        let ckpt = StepWork::plan(&cfg, 64, 1, &o, true, true).unwrap();
        assert!(ckpt.device_flop > plain.device_flop);
        // Weight gradients: one of the three passes over the projections.
        let head = 2.0 * (cfg.vocab_size * cfg.hidden_size * 64) as f64;
        assert_eq!(plain.host_flop, 2.0 * head);
        let wg = crate::bench::projection_flops(&cfg, 64) / 3.0;
        assert_eq!(plain.host_weight_gradient_flop, wg);
    }
}
