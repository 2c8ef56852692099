//! The Neural Engine path: the kernel contract on a [`Device`]. Each kernel
//! is compiled once per sequence length; every layer has its own input
//! buffer per kernel whose weight regions are staged once per optimizer step
//! (when `Model::version` changes) while only the activation regions are
//! rewritten per call; outputs are unpacked by the layout.
//!
//! Sequences shorter than the compiled length are zero-padded on the right:
//! attention is causal and every other op is per position, so real
//! positions never see the padding, and zero upstream gradients keep the
//! padding out of every backward result. Lengths are padded to a multiple of
//! 16 (the `spatial-multiple-16` ANE rule).

use std::collections::BTreeMap;

use ane::Device;
use anyhow::{anyhow, bail, Result};

use crate::engine::{kernel_weights, KernelRunner};
use crate::kernels::cpu::{Inputs, Tensors};
use crate::kernels::layout::{Encoding, KernelLayout};
use crate::kernels::{build, Kernel, KernelKind, KernelOptions, Shape};
use crate::model::Model;

/// Padding granularity of the sequence axis.
pub const SEQ_MULTIPLE: usize = 16;

/// Score tensors are `[heads·S, S]`: padded per head, not just per column.
fn is_scores(name: &str) -> bool {
    matches!(name, "probs" | "dp")
}

/// Copies `[rows, seq]` (or `[heads·seq, seq]` for scores) into the padded
/// `[rows, sp]` (or `[heads·sp, sp]`) layout, zeros elsewhere.
fn pad(name: &str, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
    if seq == sp {
        return data.to_vec();
    }
    let rows = data.len() / seq;
    let (groups, per) = if is_scores(name) {
        (rows / seq, seq)
    } else {
        (1, rows)
    };
    let sp_rows = if is_scores(name) { sp } else { per };
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
fn crop(name: &str, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
    if seq == sp {
        return data.to_vec();
    }
    let rows = data.len() / sp;
    let (groups, per_in, per_out) = if is_scores(name) {
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

/// The compiled kernels and per-layer buffers for one padded length.
struct KernelSet<D: Device> {
    kernels: Vec<(Kernel, D::Program)>,
    /// `[layer][kernel]` input buffers.
    inputs: Vec<Vec<D::Buffer>>,
    /// One output buffer per kernel.
    outputs: Vec<D::Buffer>,
    /// `(Model::version, adapter version)` last staged.
    staged: Option<(u64, u64)>,
}

/// The kernel contract on a Neural Engine device.
pub struct NeuralKernels<D: Device> {
    pub device: D,
    opts: KernelOptions,
    sets: BTreeMap<usize, KernelSet<D>>,
    /// Always compile for this length (e.g. generation), if set.
    fixed_seq: Option<usize>,
}

fn kind_index(kind: KernelKind) -> usize {
    KernelKind::ALL.iter().position(|k| *k == kind).unwrap_or(0)
}

impl<D: Device> NeuralKernels<D> {
    pub fn new(device: D, opts: KernelOptions) -> NeuralKernels<D> {
        NeuralKernels {
            device,
            opts,
            sets: BTreeMap::new(),
            fixed_seq: None,
        }
    }

    /// Compile every kernel for `seq` (padded) regardless of call lengths.
    pub fn with_fixed_seq(mut self, seq: usize) -> NeuralKernels<D> {
        self.set_fixed_seq(seq);
        self
    }

    /// See [`NeuralKernels::with_fixed_seq`].
    pub fn set_fixed_seq(&mut self, seq: usize) {
        self.fixed_seq = Some(seq.div_ceil(SEQ_MULTIPLE) * SEQ_MULTIPLE);
    }

    fn padded(&self, seq: usize) -> Result<usize> {
        let sp = seq.div_ceil(SEQ_MULTIPLE) * SEQ_MULTIPLE;
        match self.fixed_seq {
            Some(f) if seq > f => bail!("sequence of {seq} tokens exceeds the compiled length {f}"),
            Some(f) => Ok(f),
            None => Ok(sp),
        }
    }

    fn build_set(&mut self, model: &Model, sp: usize) -> Result<()> {
        if self.sets.contains_key(&sp) {
            return Ok(());
        }
        let shape = Shape::new(&model.cfg, sp);
        let mut kernels = Vec::new();
        let mut outputs = Vec::new();
        for kind in KernelKind::ALL {
            let k = build(kind, &shape, &self.opts)
                .map_err(|e| anyhow!("generating {}: {e}", kind.name()))?;
            let p = self
                .device
                .compile(&k.text(), &k.blob_paths())
                .map_err(|e| anyhow!("{}: compiling {}: {e}", self.device.name(), kind.name()))?;
            outputs.push(
                self.device
                    .buffer(k.layout.output_elems())
                    .map_err(|e| anyhow!("{e}"))?,
            );
            kernels.push((k, p));
        }
        let mut inputs = Vec::new();
        for _ in 0..model.cfg.num_hidden_layers {
            let mut per = Vec::new();
            for (k, _) in &kernels {
                per.push(
                    self.device
                        .buffer(k.layout.input_elems())
                        .map_err(|e| anyhow!("{e}"))?,
                );
            }
            inputs.push(per);
        }
        self.sets.insert(
            sp,
            KernelSet {
                kernels,
                inputs,
                outputs,
                staged: None,
            },
        );
        Ok(())
    }

    /// Packs every layer's weights into its kernel input buffers: all of
    /// them when the base weights changed, only the LoRA adapter regions
    /// when only the adapters did.
    fn stage(&mut self, model: &Model, sp: usize) -> Result<()> {
        let set = self
            .sets
            .get_mut(&sp)
            .ok_or_else(|| anyhow!("no kernel set for {sp}"))?;
        let adapters = model.lora.as_ref().map_or(0, |l| l.version);
        let now = (model.version, adapters);
        match set.staged {
            Some(s) if s == now => return Ok(()),
            Some((base, _)) if base == model.version => {
                for layer in 0..model.cfg.num_hidden_layers {
                    for (ki, (k, _)) in set.kernels.iter().enumerate() {
                        for (name, data) in kernel_weights(model, layer, k.kind) {
                            if !name.contains("_lora_") {
                                continue;
                            }
                            let values = k.layout.region_values(name, data);
                            write_region(
                                &mut self.device,
                                &mut set.inputs[layer][ki],
                                &k.layout,
                                name,
                                &values,
                            )?;
                        }
                    }
                }
                set.staged = Some(now);
                return Ok(());
            }
            _ => {}
        }
        for layer in 0..model.cfg.num_hidden_layers {
            for (ki, (k, _)) in set.kernels.iter().enumerate() {
                let weights = kernel_weights(model, layer, k.kind);
                if weights.is_empty() {
                    continue;
                }
                let l = &k.layout;
                let mut host = vec![0f32; l.input_elems()];
                for (name, data) in &weights {
                    l.pack(name, data, &mut host);
                }
                self.device
                    .write(&mut set.inputs[layer][ki], 0, &host)
                    .map_err(|e| anyhow!("staging {}: {e}", k.kind.name()))?;
            }
        }
        set.staged = Some(now);
        Ok(())
    }
}

/// Writes a region's rows (`[channels, width]`) into a device input buffer.
fn write_region<D: Device>(
    device: &mut D,
    buf: &mut D::Buffer,
    l: &KernelLayout,
    name: &str,
    values: &[f32],
) -> Result<()> {
    let r = l.region(name);
    let width = r.spatial.len();
    if values.len() != r.channels.len() * width {
        bail!(
            "{}: '{name}' has {} values, the layout needs {}",
            l.kernel,
            values.len(),
            r.channels.len() * width
        );
    }
    for (ci, c) in r.channels.clone().enumerate() {
        device
            .write(
                buf,
                c * l.in_spatial + r.spatial.start,
                &values[ci * width..(ci + 1) * width],
            )
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

impl<D: Device> KernelRunner for NeuralKernels<D> {
    /// Device kernels leave the host free for weight gradients (on the
    /// simulator the "device" is the host too, which keeps the overlapped
    /// path exercised by every ane-sim test).
    fn overlaps_host(&self) -> bool {
        true
    }

    fn run(
        &mut self,
        model: &Model,
        layer: usize,
        kind: KernelKind,
        shape: &Shape,
        acts: &Inputs,
    ) -> Result<Tensors> {
        let sp = self.padded(shape.seq)?;
        self.build_set(model, sp)?;
        self.stage(model, sp)?;
        let seq = shape.seq;
        let set = self
            .sets
            .get_mut(&sp)
            .ok_or_else(|| anyhow!("no kernel set for {sp}"))?;
        let ki = kind_index(kind);
        let (k, prog) = &set.kernels[ki];
        let l = &k.layout;
        let buf = &mut set.inputs[layer][ki];
        if acts.keys().any(|k| k.ends_with("_lora_mask")) {
            bail!("LoRA dropout is not available on the Neural Engine path; use --lora-dropout 0");
        }
        for r in l
            .inputs
            .iter()
            .filter(|r| r.encoding == Encoding::Activation)
        {
            let Some(data) = acts.get(r.name.as_str()) else {
                if matches!(r.name.as_str(), "q_norm" | "k_norm") {
                    continue; // weights, staged
                }
                bail!("{}: activation '{}' not given", kind.name(), r.name);
            };
            let padded = pad(&r.name, data, seq, sp);
            write_region(&mut self.device, buf, l, &r.name, &padded)?;
        }
        let out = &mut set.outputs[ki];
        self.device
            .eval(prog, buf, out)
            .map_err(|e| anyhow!("{}: {e}", kind.name()))?;
        let mut result = Tensors::new();
        for b in &l.outputs {
            let mut v = vec![0f32; b.channels.len() * l.out_spatial];
            self.device
                .read(out, b.channels.start * l.out_spatial, &mut v)
                .map_err(|e| anyhow!("{e}"))?;
            result.insert(b.name.clone(), crop(&b.name, &v, seq, sp));
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pad_and_crop_roundtrip_for_activations_and_scores() {
        let act: Vec<f32> = (0..3 * 5).map(|v| v as f32).collect();
        let p = pad("x", &act, 5, 16);
        assert_eq!(p.len(), 3 * 16);
        assert_eq!(&p[16..21], &act[5..10]);
        assert_eq!(crop("x", &p, 5, 16), act);
        let scores: Vec<f32> = (0..2 * 5 * 5).map(|v| v as f32).collect();
        let p = pad("probs", &scores, 5, 16);
        assert_eq!(p.len(), 2 * 16 * 16);
        assert_eq!(&p[16 * 16..16 * 16 + 5], &scores[25..30]);
        assert_eq!(crop("probs", &p, 5, 16), scores);
    }
}
