//! Kernel runners: what runs a kernel for one layer. [`CpuKernels`] calls
//! the native f32 twins; [`NeuralKernels`] runs the generated MIL programs
//! on a Neural Engine [`Device`] (the real one, or the simulator).
//!
//! On a device each kernel is compiled once per sequence length; every
//! layer has its own input buffer per kernel whose weight regions are
//! staged once per optimizer step (when `Model::version` changes) while
//! only the activation regions are rewritten per call; outputs are unpacked
//! by the layout.
//!
//! Sequences shorter than the compiled length are zero-padded on the right:
//! attention is causal and every other op is per position, so real
//! positions never see the padding, and zero upstream gradients keep the
//! padding out of every backward result. Lengths are padded to a
//! power-of-two multiple of 32 ([`SEQ_MULTIPLE`], and a bounded number of
//! compiled sets: see `NeuralKernels::padded`).

use std::collections::BTreeMap;

use ane::Device;
use anyhow::{anyhow, bail, Result};

use crate::kernels::tiling::{self, Plan};
use crate::kernels::{
    build, Activations, Kernel, KernelKind, KernelLayout, KernelOptions, KernelProgram,
    LayerWeights, Outputs, Port, Shape,
};
use crate::model::{Model, Projection};

/// LoRA dropout masks of one layer, by [`Projection::index`] (scaled by
/// 1/(1−p); `None` where there is no dropout).
pub type Dropout = [Option<Vec<f32>>; 7];

/// Runs one kernel for one layer. Activations come in `acts`; the runner
/// supplies the layer's weights itself.
pub trait KernelRunner {
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out>;

    /// Whether kernels run off the host CPU, so the engine computes weight
    /// gradients on a worker thread while they run.
    fn overlaps_host(&self) -> bool {
        false
    }
}

/// Layer `layer`'s weights (and adapters) as the kernels read them.
pub fn layer_weights<'a>(model: &'a Model, layer: usize) -> LayerWeights<'a> {
    let l = &model.layers[layer];
    let p = |i: usize| model.params[i].data.as_slice();
    let mut w = LayerWeights {
        projections: Projection::ALL.map(|t| p(t.base(l))),
        q_norm: l.q_norm.map(p),
        k_norm: l.k_norm.map(p),
        ..LayerWeights::default()
    };
    if let Some(lora) = &model.lora {
        for t in Projection::ALL {
            w.adapters[t.index()] = lora.adapter(layer, t);
        }
    }
    w
}

/// The CPU engine's kernels: the native twins.
pub struct CpuKernels {
    pub opts: KernelOptions,
}

impl KernelRunner for CpuKernels {
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out> {
        let mut w = layer_weights(model, layer);
        for (m, d) in w.dropout.iter_mut().zip(dropout) {
            *m = d.as_deref();
        }
        Ok(K::cpu(shape, &self.opts, &w, acts))
    }
}

/// Padding granularity of the sequence axis: surfaces at least 32 wide
/// (apple-neural-engine-field-guide README.md, "The SP=32 Constraint"),
/// sequence strides multiples of 16 (Orion core/ane_runtime.m), and
/// products contracting over the sequence multiples of 32 (maderix/ANE
/// PR #47).
pub const SEQ_MULTIPLE: usize = 32;

/// Copies `[rows, seq]` (or `[heads·seq, seq]` for scores) into the padded
/// `[rows, sp]` (or `[heads·sp, sp]`) layout, zeros elsewhere.
fn pad(port: Port, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
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
fn crop(port: Port, data: &[f32], seq: usize, sp: usize) -> Vec<f32> {
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

/// The compiled kernels and per-layer buffers for one padded length.
struct KernelSet<D: Device> {
    /// How each kernel is tiled (see [`tiling`]).
    plan: Plan,
    /// One program per kernel, at its tile shape.
    kernels: Vec<(KernelProgram, D::Program)>,
    /// `[layer][kernel][tile]` input buffers.
    inputs: Vec<Vec<Vec<D::Buffer>>>,
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
    /// Kernels for `device`, built to its limits (its chip family's).
    pub fn new(device: D, mut opts: KernelOptions) -> NeuralKernels<D> {
        opts.limits = device.limits();
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

    /// The compiled length a sequence of `seq` tokens runs at: the fixed
    /// length when there is one; else the live set's length when the
    /// sequence fits in it; else the smallest power-of-two multiple of 32
    /// that fits. Compiled lengths only grow and a new set replaces the
    /// smaller one (its programs are unloaded), so `eval` on rows of any mix
    /// of lengths compiles at most one set per power of two — 10 programs
    /// each, 100 for every length up to 16384, within the ~119-compile
    /// budget — at the price of padding short rows to the longest seen.
    fn padded(&self, seq: usize) -> Result<usize> {
        match self.fixed_seq {
            Some(f) if seq > f => bail!("sequence of {seq} tokens exceeds the compiled length {f}"),
            Some(f) => Ok(f),
            None => Ok(match self.sets.keys().next_back() {
                Some(&sp) if sp >= seq => sp,
                _ => seq.div_ceil(SEQ_MULTIPLE).next_power_of_two() * SEQ_MULTIPLE,
            }),
        }
    }

    /// The tiling of the live kernel set, if one is compiled.
    pub fn plan(&self) -> Option<&Plan> {
        self.sets.values().next_back().map(|s| &s.plan)
    }

    /// The lengths with a compiled kernel set (for tests and reports).
    pub fn compiled_lengths(&self) -> Vec<usize> {
        self.sets.keys().copied().collect()
    }

    fn build_set(&mut self, model: &Model, sp: usize) -> Result<()> {
        if self.sets.contains_key(&sp) {
            return Ok(());
        }
        let shape = Shape::new(&model.cfg, sp);
        let plan = tiling::plan(&shape, &self.opts).map_err(|e| anyhow!(e))?;
        let mut kernels = Vec::new();
        let mut outputs = Vec::new();
        for kind in KernelKind::ALL {
            let k = build(kind, &plan.of(kind).shape, &self.opts)
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
                let mut tiles = Vec::new();
                for _ in 0..plan.of(k.kind).tiles {
                    tiles.push(
                        self.device
                            .buffer(k.layout.input_elems())
                            .map_err(|e| anyhow!("{e}"))?,
                    );
                }
                per.push(tiles);
            }
            inputs.push(per);
        }
        // The smaller sets are no longer used (see `padded`): unload them.
        self.sets.retain(|&len, _| len > sp);
        self.sets.insert(
            sp,
            KernelSet {
                plan,
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
        let adapters_only = matches!(set.staged, Some((base, _)) if base == model.version);
        if set.staged == Some(now) {
            return Ok(());
        }
        let full = set.plan.shape;
        for layer in 0..model.cfg.num_hidden_layers {
            let whole = layer_weights(model, layer);
            for (ki, (k, _)) in set.kernels.iter().enumerate() {
                let l = &k.layout;
                if !l.inputs.iter().any(|r| r.port.is_weight()) {
                    continue;
                }
                let tiles = set.plan.of(k.kind);
                for t in 0..tiles.tiles {
                    // A tile's weights are blocks of the layer's (copied).
                    let owned =
                        (tiles.tiles > 1).then(|| tiling::tile_weights(tiles, &full, &whole, t));
                    let w = owned.as_ref().map_or(whole, LayerWeights::from_tensors);
                    let buf = &mut set.inputs[layer][ki][t];
                    if adapters_only {
                        for r in l.inputs.iter().filter(|r| r.port.is_adapter()) {
                            let data = w.get(r.port).ok_or_else(|| {
                                anyhow!(
                                    "{}: the layer has no adapter '{}'",
                                    l.kernel,
                                    r.port.name()
                                )
                            })?;
                            let values = l.region_values(r.port, data);
                            write_region(&mut self.device, buf, l, r.port, &values)?;
                        }
                        continue;
                    }
                    let mut host = vec![0f32; l.input_elems()];
                    l.pack_weights(&w, &mut host).map_err(|e| anyhow!(e))?;
                    self.device
                        .write(buf, 0, &host)
                        .map_err(|e| anyhow!("staging {}: {e}", k.kind.name()))?;
                }
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

impl<D: Device> KernelRunner for NeuralKernels<D> {
    /// Device kernels leave the host free for weight gradients (on the
    /// simulator the "device" is the host too, which keeps the overlapped
    /// path exercised by every ane-sim test).
    fn overlaps_host(&self) -> bool {
        true
    }

    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> Result<K::Out> {
        if dropout.iter().any(Option::is_some) {
            bail!("LoRA dropout is not available on the Neural Engine path; use --lora-dropout 0");
        }
        let kind = K::KIND;
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
        let tiles = set.plan.of(kind);
        let mut results: BTreeMap<Port, Vec<f32>> = BTreeMap::new();
        for t in 0..tiles.tiles {
            let buf = &mut set.inputs[layer][ki][t];
            for (port, data) in acts.ports() {
                let padded = match tiles.tiles {
                    1 => pad(port, data, seq, sp),
                    _ => pad(
                        port,
                        &tiling::tile_activation(tiles, port, data, seq, t),
                        seq,
                        sp,
                    ),
                };
                write_region(&mut self.device, buf, l, port, &padded)?;
            }
            let out = &mut set.outputs[ki];
            self.device
                .eval(prog, buf, out)
                .map_err(|e| anyhow!("{}: {e}", kind.name()))?;
            for b in &l.outputs {
                let mut v = vec![0f32; b.channels.len() * l.out_spatial];
                self.device
                    .read(out, b.channels.start * l.out_spatial, &mut v)
                    .map_err(|e| anyhow!("{e}"))?;
                let part = crop(b.port, &v, seq, sp);
                let acc = results.entry(b.port).or_default();
                tiling::combine(tiles, b.port, acc, part, t);
            }
        }
        K::Out::from_lookup(&mut |port| results.remove(&port)).ok_or_else(|| {
            anyhow!(
                "{}: an output block is missing from its layout",
                kind.name()
            )
        })
    }
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
