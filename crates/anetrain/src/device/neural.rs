//! [`NeuralKernels`]: the generated MIL programs run on a Neural Engine
//! [`Device`] (the real one, or the simulator), each call staged,
//! evaluated and unpacked as below.
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
//! power-of-two multiple of 32 ([`COLUMN_GROUP`], and a bounded number of
//! compiled sets: see `NeuralKernels::padded`).

use std::collections::BTreeMap;

use ane::Device;
use anyhow::{anyhow, bail, Result};

use crate::kernels::tiling::{self, HeadChunks, Plan};
use crate::kernels::{
    build, compiled_length, sdpa_backward1, Activations, Kernel, KernelKind, KernelOptions,
    KernelProgram, Outputs, Port, SdpaBackward, Shape, COLUMN_GROUP,
};
use crate::model::Model;

use super::surface::{crop, gather, pad, write_region};
use super::{AttentionGrads, DeviceBuffers, Dropout, KernelRunner};

/// One run of a kernel's program: a tile of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unit {
    layer: usize,
    tile: usize,
}

/// What an input buffer holds: a unit's weights at `(Model::version,
/// adapter version)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    unit: Unit,
    base: u64,
    adapters: u64,
}

impl Held {
    fn of(model: &Model, unit: Unit) -> Held {
        Held {
            unit,
            base: model.version,
            adapters: model.lora.as_ref().map_or(0, |l| l.version),
        }
    }

    /// Whether a buffer holding `self` needs only `want`'s adapters.
    fn adapters_behind(self, want: Held) -> bool {
        self.unit == want.unit && self.base == want.base
    }
}

/// A unit's weight regions prepared on the host (fp16, as the device will
/// hold them) for the buffer that held `over` when they were prepared.
struct Prepared {
    held: Held,
    over: Option<Held>,
    regions: Vec<(Port, Vec<half::f16>)>,
}

/// The compiled kernels and input buffers for one padded length.
struct KernelSet<D: Device> {
    /// How each kernel is tiled (see [`tiling`]).
    plan: Plan,
    /// The programs a step runs: each kernel in use ([`Plan::in_use`]),
    /// and which of its programs ([`tiling::KernelTiles::programs`]), in
    /// the order of the vectors below.
    kinds: Vec<(KernelKind, usize)>,
    /// Each program's tiles (its shape, the kernel's splits).
    tiles: Vec<tiling::KernelTiles>,
    /// One program per kernel (per key class), at its tile shape, and
    /// its compiled variants: one per distinct program text among the
    /// model's layer classes ([`LayerClass`]: a NoPE or windowed class
    /// changes a program's constants — its RoPE tables, its mask — where
    /// the program holds them, and nothing where they are inputs).
    kernels: Vec<(KernelProgram, Vec<D::Program>)>,
    /// The variant each layer class runs, by kernel, by class index
    /// (`ModelConfig::layer_classes`).
    variant: Vec<Vec<usize>>,
    /// Input buffers by kernel (see [`NeuralKernels::buffer_index`]).
    inputs: Vec<Vec<D::Buffer>>,
    /// What each input buffer holds.
    held: Vec<Vec<Option<Held>>>,
    /// The next unit's weights, prepared while the device ran, by kernel.
    prepared: Vec<Option<Prepared>>,
    /// One output buffer per kernel.
    outputs: Vec<D::Buffer>,
}

/// The kernel contract on a Neural Engine device.
pub struct NeuralKernels<D: Device> {
    pub device: D,
    opts: KernelOptions,
    sets: BTreeMap<usize, KernelSet<D>>,
    /// Always compile for this length (e.g. generation), if set.
    fixed_seq: Option<usize>,
    buffers: DeviceBuffers,
    /// Forward kernels are recomputing a layer inside the backward.
    recomputing: bool,
}

impl<D: Device> KernelSet<D> {
    /// Where kernel `kind`'s (first) program and its buffers are.
    fn slot(&self, kind: KernelKind) -> Result<usize> {
        self.slot_of(kind, 0)
    }

    /// Where the program tile `t` of kernel `kind` runs is.
    fn slot_of(&self, kind: KernelKind, t: usize) -> Result<usize> {
        let program = self.plan.of(kind).program_of(t);
        let at = self.kinds.iter().position(|k| *k == (kind, program));
        at.ok_or_else(|| {
            anyhow!(
                "{}: not compiled, the plan runs the attention backward as {:?}",
                kind.name(),
                self.plan.attention_backward
            )
        })
    }
}

/// Kernel `k`'s weight regions for one unit (or only its adapter regions),
/// handed to `sink(port, values)` one region at a time in the region's
/// `[channels, width]` rows. A projection is read block by block from the
/// model (`Param::block_into`): a base kept in the file's dtype is
/// converted a tile's block at a time.
fn weight_regions(
    k: &KernelProgram,
    tiles: &tiling::KernelTiles,
    (full, head): (&Shape, HeadChunks),
    model: &Model,
    unit: Unit,
    adapters_only: bool,
    sink: &mut dyn FnMut(Port, Vec<f32>) -> Result<()>,
) -> Result<()> {
    let l = &k.layout;
    let (layer, t) = (unit.layer, unit.tile);
    let has = |port: Port| l.inputs.iter().any(|r| r.port == port);
    if k.kind.is_head() {
        if !adapters_only {
            // The chunk's rows, the last chunk's past the vocabulary zeros
            // (their logits are cropped, their gradients zero).
            let mut rows = Vec::new();
            let range = head.range(layer, model.cfg.vocab_size);
            model.lm_head_param().rows_into(range, &mut rows);
            rows.resize(head.rows * full.dim, 0.0);
            sink(Port::Head, l.region_values(Port::Head, &rows))?;
        }
        return Ok(());
    }
    for &(p, _) in k.kind.projections() {
        if !adapters_only && has(Port::Weight(p)) {
            let param = &model.params[p.base(&model.layers[layer])];
            let block = tiling::projection_block(tiles, full, t, p, param);
            sink(Port::Weight(p), l.region_values(Port::Weight(p), &block))?;
        }
        if !adapters_only && has(Port::Bias(p)) {
            let id = model.layers[layer].biases[p.index()].ok_or_else(|| {
                anyhow!("{}: the layer has no bias on '{}'", l.kernel, p.module())
            })?;
            let block = tiling::bias_block(tiles, full, t, p, &model.params[id].data);
            sink(Port::Bias(p), l.region_values(Port::Bias(p), &block))?;
        }
        if !has(Port::LoraA(p)) {
            continue;
        }
        let lora = model
            .lora
            .as_ref()
            .ok_or_else(|| anyhow!("{}: the model has no adapter on '{}'", l.kernel, p.module()))?;
        // A layer below the adapter's layer range (`--lora-layers`) runs the
        // same program with zero A and B: its branch adds nothing.
        let zeros;
        let ab = match lora.adapter(layer, p) {
            Some(ab) => ab,
            None => {
                let (out, inp) = p.shape(&model.cfg);
                let r = lora.cfg.rank;
                zeros = (vec![0f32; r * inp], vec![0f32; out * r]);
                (&zeros.0[..], &zeros.1[..])
            }
        };
        {
            let (a, b) = tiling::adapter_blocks(tiles, full, t, p, ab);
            sink(Port::LoraA(p), l.region_values(Port::LoraA(p), &a))?;
            sink(Port::LoraB(p), l.region_values(Port::LoraB(p), &b))?;
        }
    }
    let ids = &model.layers[layer];
    for (port, id) in [(Port::QNorm, ids.q_norm), (Port::KNorm, ids.k_norm)] {
        if has(port) && !adapters_only {
            let id = id.ok_or_else(|| {
                anyhow!("{}: the layer has no weight '{}'", l.kernel, port.name())
            })?;
            sink(port, l.region_values(port, &model.params[id].data))?;
        }
    }
    Ok(())
}

/// Where one tile of a call sits: its index, and the sequence's real and
/// compiled lengths.
#[derive(Clone, Copy)]
struct Tile {
    t: usize,
    seq: usize,
    sp: usize,
}

/// Stage weights: writes `unit`'s weight regions into input buffer `b` of
/// kernel `ki` unless it holds them already — the regions prepared while
/// the device ran the previous unit when they match, else read from the
/// model (only the adapters when the base is already there).
fn stage_weights<D: Device>(
    device: &mut D,
    set: &mut KernelSet<D>,
    ki: usize,
    model: &Model,
    unit: Unit,
    b: usize,
) -> Result<()> {
    let (full, head) = (set.plan.shape, set.plan.head);
    let (k, _) = &set.kernels[ki];
    let (l, tiles) = (&k.layout, &set.tiles[ki]);
    let (held, want) = (set.held[ki][b], Held::of(model, unit));
    if held == Some(want) {
        return Ok(());
    }
    let buf = &mut set.inputs[ki][b];
    match set.prepared[ki].take() {
        // Prepared while the device ran the previous unit.
        Some(p) if p.held == want && p.over == held => {
            for (port, values) in p.regions {
                let mut v = vec![0f32; values.len()];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&values[..], &mut v);
                write_region(device, buf, l, port, &v)?;
            }
        }
        _ => {
            let adapters_only = held.is_some_and(|h| h.adapters_behind(want));
            weight_regions(
                k,
                tiles,
                (&full, head),
                model,
                unit,
                adapters_only,
                &mut |port, v| write_region(device, buf, l, port, &v),
            )?;
        }
    }
    set.held[ki][b] = Some(want);
    Ok(())
}

/// Write activations: the call's activations (padded to the compiled
/// length, cut to the tile), and the causal mask and RoPE tables of the
/// tile where the program reads them, into input buffer `b`.
#[allow(clippy::too_many_arguments)]
fn write_activations<D: Device>(
    device: &mut D,
    set: &mut KernelSet<D>,
    ki: usize,
    b: usize,
    ports: &[(Port, &[f32])],
    opts: &KernelOptions,
    rope: &mut Option<(Vec<f32>, Vec<f32>)>,
    Tile { t, seq, sp }: Tile,
) -> Result<()> {
    let (full, head) = (set.plan.shape, set.plan.head);
    let (k, _) = &set.kernels[ki];
    let (l, tiles) = (&k.layout, &set.tiles[ki]);
    let buf = &mut set.inputs[ki][b];
    for &(port, data) in ports {
        if !l.inputs.iter().any(|r| r.port == port) {
            // An input only a block of queries reads (the layer input's
            // columns), given to a whole-sequence program.
            continue;
        }
        let mut padded = pad(port, data, seq, sp);
        if port == Port::Dlogits {
            // The last chunk's rows past the vocabulary: zeros.
            padded.resize(head.rows * sp, 0.0);
        }
        let part = match tiles.tiles {
            1 => padded,
            _ => tiling::tile_activation(tiles, port, &padded, sp, t),
        };
        write_region(device, buf, l, port, &part)?;
    }
    if l.inputs.iter().any(|r| r.port == Port::Mask) {
        let mask = tiling::tile_mask(tiles, t, opts.class.window);
        write_region(device, buf, l, Port::Mask, &mask)?;
    }
    if l.inputs.iter().any(|r| r.port == Port::RopeCos) {
        let (cos, sin) = rope.get_or_insert_with(|| opts.rope_tables(sp, full.head_dim));
        let (c, s) = tiling::tile_rope(tiles, (cos, sin), t);
        write_region(device, buf, l, Port::RopeCos, &c)?;
        write_region(device, buf, l, Port::RopeSin, &s)?;
    }
    Ok(())
}

/// Evaluate: runs kernel `ki` on input buffer `b` while a host thread
/// prepares `next`'s weight regions (unit, what it wants, what its buffer
/// will hold), kept for [`stage_weights`].
#[allow(clippy::too_many_arguments)]
fn evaluate<D: Device>(
    device: &mut D,
    set: &mut KernelSet<D>,
    ki: usize,
    class: usize,
    b: usize,
    model: &Model,
    next: Option<(Unit, Held, Option<Held>)>,
) -> Result<()> {
    let (full, head) = (set.plan.shape, set.plan.head);
    let (k, progs) = &set.kernels[ki];
    let prog = &progs[set.variant[ki][class]];
    let tiles = &set.tiles[ki];
    let (buf, out) = (&set.inputs[ki][b], &mut set.outputs[ki]);
    let prepared = std::thread::scope(|s| {
        let worker = next.map(|(n, nwant, over)| {
            s.spawn(move || {
                let adapters_only = over.is_some_and(|h| h.adapters_behind(nwant));
                let mut regions = Vec::new();
                let f = (&full, head);
                weight_regions(k, tiles, f, model, n, adapters_only, &mut |port, v| {
                    let mut h = vec![half::f16::ZERO; v.len()];
                    half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut h[..], &v);
                    regions.push((port, h));
                    Ok(())
                })
                .map(|()| Prepared {
                    held: nwant,
                    over,
                    regions,
                })
            })
        });
        let ran = device
            .eval(prog, buf, out)
            .map_err(|e| anyhow!("{}: {e}", k.kind.name()));
        let prepared = worker
            .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .transpose();
        ran.and(prepared)
    })?;
    if prepared.is_some() {
        set.prepared[ki] = prepared;
    }
    Ok(())
}

/// Read outputs: every output block of kernel `ki`'s last evaluation,
/// tile `t` combined into `results` (concatenated or summed by the plan).
fn read_outputs<D: Device>(
    device: &mut D,
    set: &KernelSet<D>,
    ki: usize,
    t: usize,
    results: &mut BTreeMap<Port, Vec<f32>>,
) -> Result<()> {
    let (k, _) = &set.kernels[ki];
    let (l, tiles) = (&k.layout, &set.tiles[ki]);
    for blk in &l.outputs {
        let mut v = vec![0f32; blk.channels.len() * l.out_spatial];
        device
            .read(&set.outputs[ki], blk.channels.start * l.out_spatial, &mut v)
            .map_err(|e| anyhow!("{e}"))?;
        gather(tiles, blk.port, results, v, (t, set.plan.shape.seq));
    }
    Ok(())
}

impl<D: Device> NeuralKernels<D> {
    /// Kernels for `device`, built to its limits (its chip family's), with
    /// persistent buffers (see [`NeuralKernels::with_buffers`]).
    pub fn new(device: D, mut opts: KernelOptions) -> NeuralKernels<D> {
        opts.limits = device.limits();
        NeuralKernels {
            device,
            opts,
            sets: BTreeMap::new(),
            fixed_seq: None,
            buffers: DeviceBuffers::Persistent,
            recomputing: false,
        }
    }

    /// Keeps input buffers as `mode` says (from the next compiled set on).
    pub fn with_buffers(mut self, mode: DeviceBuffers) -> NeuralKernels<D> {
        self.buffers = mode;
        self
    }

    /// How input buffers are kept.
    pub fn buffers(&self) -> DeviceBuffers {
        self.buffers
    }

    /// Compile every kernel for `seq` (padded) regardless of call lengths.
    pub fn with_fixed_seq(mut self, seq: usize) -> NeuralKernels<D> {
        self.set_fixed_seq(seq);
        self
    }

    /// See [`NeuralKernels::with_fixed_seq`].
    pub fn set_fixed_seq(&mut self, seq: usize) {
        self.fixed_seq = Some(seq.div_ceil(COLUMN_GROUP) * COLUMN_GROUP);
    }

    /// The compiled length a sequence of `seq` tokens runs at: the fixed
    /// length when there is one; else the live set's length when the
    /// sequence fits in it; else the smallest power-of-two multiple of 32
    /// that fits. Compiled lengths only grow and a new set replaces the
    /// smaller one (its programs are unloaded), so `eval` on rows of any mix
    /// of lengths compiles at most one set per power of two — 11 to 15
    /// programs each (a kernel in causal key classes has up to three), at
    /// most 114 for every length up to 8192 (the longest attention plans
    /// for on M1–M3) and every model shape in `testdata/configs`, within the
    /// ~119-compile budget — at the price of padding short rows to the
    /// longest seen. (A model with layers without RoPE compiles its
    /// sdpa_forward programs once more per set: `Plan::programs_for`.)
    fn padded(&self, seq: usize) -> Result<usize> {
        match self.fixed_seq {
            Some(f) if seq > f => bail!("sequence of {seq} tokens exceeds the compiled length {f}"),
            Some(f) => Ok(f),
            None => Ok(match self.sets.keys().next_back() {
                Some(&sp) if sp >= seq => sp,
                _ => compiled_length(seq),
            }),
        }
    }

    /// Every unit's input buffer (see [`NeuralKernels::buffer_index`]),
    /// layer-major, for a kernel of `ntiles` tiles over `layers` units.
    fn buffer_indices(&self, layers: usize, ntiles: usize) -> Vec<usize> {
        (0..layers * ntiles)
            .map(|i| {
                self.buffer_index(
                    Unit {
                        layer: i / ntiles,
                        tile: i % ntiles,
                    },
                    ntiles,
                )
            })
            .collect()
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
        // The smaller sets are no longer used (see `padded`): unload them
        // before the new one's buffers exist.
        self.sets.retain(|&len, _| len > sp);
        let shape = Shape::new(&model.cfg, sp);
        let plan = tiling::plan(&shape, &self.opts)?;
        let layers = model.cfg.num_hidden_layers;
        let (mut kernels, mut outputs, mut inputs) = (Vec::new(), Vec::new(), Vec::new());
        // Only what a step runs: of the attention backward's two forms,
        // one; a program per key class.
        let (mut kinds, mut tiles) = (Vec::new(), Vec::new());
        for kind in KernelKind::ALL.into_iter().filter(|&k| plan.in_use(k)) {
            for (c, t) in plan.of(kind).programs().into_iter().enumerate() {
                kinds.push((kind, c));
                tiles.push(t);
            }
        }
        let classes = model.cfg.layer_classes();
        let mut variant = Vec::new();
        for (&(kind, _), t) in kinds.iter().zip(&tiles) {
            let generate = |class| {
                let o = KernelOptions {
                    class,
                    ..self.opts.clone()
                };
                build(kind, &t.shape, &o).map_err(|e| anyhow!("generating {}: {e}", kind.name()))
            };
            // One program per distinct text among the layer classes (the
            // head's serve every class); a text names its constants by
            // their content (`kernels::build`), so equal texts are equal
            // programs. Every variant has the first's layout, so they
            // share its buffers.
            let mut texts: Vec<String> = vec![];
            let (mut progs, mut of_class) = (vec![], vec![]);
            let mut first = None;
            for &class in classes
                .iter()
                .take(if kind.is_head() { 1 } else { classes.len() })
            {
                let k = generate(class)?;
                let text = k.text();
                if let Some(at) = texts.iter().position(|t| *t == text) {
                    of_class.push(at);
                    continue;
                }
                if first
                    .as_ref()
                    .is_some_and(|f: &KernelProgram| f.layout != k.layout)
                {
                    bail!("{}: its layer classes' layouts differ", kind.name());
                }
                let p = self.device.compile(&text, &k.blob_paths()).map_err(|e| {
                    anyhow!("{}: compiling {}: {e}", self.device.name(), kind.name())
                })?;
                of_class.push(progs.len());
                progs.push(p);
                texts.push(text);
                first.get_or_insert(k);
            }
            let k = first.ok_or_else(|| anyhow!("{}: no layer class", kind.name()))?;
            of_class.resize(classes.len(), of_class[0]);
            variant.push(of_class);
            let new = |device: &mut D, elems| device.buffer(elems).map_err(|e| anyhow!("{e}"));
            outputs.push(new(&mut self.device, k.layout.output_elems())?);
            let (n, _) = self.buffers.buffers_of(t, plan.units(kind, layers));
            inputs.push(
                (0..n)
                    .map(|_| new(&mut self.device, k.layout.input_elems()))
                    .collect::<Result<Vec<_>>>()?,
            );
            kernels.push((k, progs));
        }
        let held = inputs.iter().map(|b| vec![None; b.len()]).collect();
        let prepared = kernels.iter().map(|_| None).collect();
        self.sets.insert(
            sp,
            KernelSet {
                plan,
                kinds,
                tiles,
                kernels,
                variant,
                inputs,
                held,
                prepared,
                outputs,
            },
        );
        Ok(())
    }

    /// The input buffer (of its kernel's) a unit runs in.
    fn buffer_index(&self, unit: Unit, tiles: usize) -> usize {
        match self.buffers {
            DeviceBuffers::Persistent => unit.layer * tiles + unit.tile,
            DeviceBuffers::Streamed => 0,
        }
    }
}

/// The unit kernel `kind` will run after `u` in a step: the next tile, else
/// the first tile of the next layer — up the layers in the forward, down in
/// the backward (and in a forward recomputed inside it); the head walks
/// its chunks upwards, and every pass over them starts again at the first.
fn next_unit(
    kind: KernelKind,
    u: Unit,
    tiles: usize,
    layers: usize,
    recomputing: bool,
) -> Option<Unit> {
    if u.tile + 1 < tiles {
        return Some(Unit {
            layer: u.layer,
            tile: u.tile + 1,
        });
    }
    if kind.is_head() {
        let layer = (u.layer + 1) % layers;
        return (layer != u.layer).then_some(Unit { layer, tile: 0 });
    }
    let layer = match kind.is_forward() && !recomputing {
        true => (u.layer + 1 < layers).then_some(u.layer + 1),
        false => u.layer.checked_sub(1),
    }?;
    Some(Unit { layer, tile: 0 })
}

impl<D: Device> KernelRunner for NeuralKernels<D> {
    /// Device kernels leave the host free for weight gradients (on the
    /// simulator the "device" is the host too, which keeps the overlapped
    /// path exercised by every ane-sim test).
    fn overlaps_host(&self) -> bool {
        true
    }

    fn computes_in_fp16(&self) -> bool {
        true
    }

    fn recomputing(&mut self, on: bool) {
        self.recomputing = on;
    }

    fn head_chunks(&mut self, model: &Model, seq: usize) -> Result<HeadChunks> {
        let sp = self.padded(seq)?;
        self.build_set(model, sp)?;
        Ok(self.sets[&sp].plan.head)
    }

    /// The fused `sdpa_backward` where the plan runs it (P and dP never
    /// leave the device); else tile by tile when the two kernels share
    /// their tiles: each tile's P and dP go from `sdpa_backward1`'s output
    /// surface straight into `sdpa_backward2`'s input, and only dV, dQ and
    /// dK are gathered.
    fn attention_backward(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &sdpa_backward1::Acts<'_>,
    ) -> Result<AttentionGrads> {
        let sp = self.padded(shape.seq)?;
        self.build_set(model, sp)?;
        let fused = self
            .sets
            .get(&sp)
            .is_some_and(|set| set.plan.attention_backward == tiling::AttentionBackward::Fused);
        if fused {
            let out = self.run::<SdpaBackward>(model, layer, shape, dropout, acts)?;
            return Ok(AttentionGrads {
                dv: out.dv,
                dq: out.dq,
                dk: out.dk,
            });
        }
        let shares_tiles = self.sets.get(&sp).is_some_and(|set| {
            let (t1, t2) = (
                set.plan.of(KernelKind::SdpaBackward1),
                set.plan.of(KernelKind::SdpaBackward2),
            );
            let (Ok(i1), Ok(i2)) = (
                set.slot(KernelKind::SdpaBackward1),
                set.slot(KernelKind::SdpaBackward2),
            ) else {
                return false;
            };
            let (l1, l2) = (&set.kernels[i1].0.layout, &set.kernels[i2].0.layout);
            t1.splits == t2.splits
                && [Port::Probs, Port::Dp].iter().all(|&p| {
                    l2.region(p).spatial.len() == l1.out_spatial
                        && l1
                            .outputs
                            .iter()
                            .any(|b| b.port == p && b.channels.len() == l2.region(p).channels.len())
                })
        });
        if !shares_tiles || dropout.iter().any(Option::is_some) {
            return super::attention_backward_in_full(self, model, layer, shape, dropout, acts);
        }
        let (k1, k2) = {
            let set = &self.sets[&sp];
            (
                set.slot(KernelKind::SdpaBackward1)?,
                set.slot(KernelKind::SdpaBackward2)?,
            )
        };
        let seq = shape.seq;
        let ntiles = self.sets[&sp].plan.of(KernelKind::SdpaBackward1).tiles;
        let set = self
            .sets
            .get_mut(&sp)
            .ok_or_else(|| anyhow!("no kernel set for {sp}"))?;
        let (l1, l2) = (
            set.kernels[k1].0.layout.clone(),
            set.kernels[k2].0.layout.clone(),
        );
        let ports1 = acts.ports();
        let ports2 = [(Port::QRope, acts.q_rope), (Port::KRope, acts.k_rope)];
        let mut results: BTreeMap<Port, Vec<f32>> = BTreeMap::new();
        let mut rope: Option<(Vec<f32>, Vec<f32>)> = None;
        let (class, opts) = (
            model.cfg.class_index(layer),
            self.opts.of_layer(&model.cfg, layer),
        );
        for t in 0..ntiles {
            let unit = Unit { layer, tile: t };
            // Neither kernel has weights: one input buffer each.
            let b = 0;
            let tile = Tile { t, seq, sp };
            stage_weights(&mut self.device, set, k1, model, unit, b)?;
            write_activations(
                &mut self.device,
                set,
                k1,
                b,
                &ports1,
                &opts,
                &mut rope,
                tile,
            )?;
            evaluate(&mut self.device, set, k1, class, b, model, None)?;
            stage_weights(&mut self.device, set, k2, model, unit, b)?;
            for blk in &l1.outputs {
                let mut v = vec![0f32; blk.channels.len() * l1.out_spatial];
                self.device
                    .read(
                        &set.outputs[k1],
                        blk.channels.start * l1.out_spatial,
                        &mut v,
                    )
                    .map_err(|e| anyhow!("{e}"))?;
                match blk.port {
                    // This tile's rows of P and dP: the next kernel's input.
                    Port::Probs | Port::Dp => {
                        write_region(&mut self.device, &mut set.inputs[k2][b], &l2, blk.port, &v)?
                    }
                    port => gather(&set.tiles[k1], port, &mut results, v, (t, sp)),
                }
            }
            write_activations(
                &mut self.device,
                set,
                k2,
                b,
                &ports2,
                &opts,
                &mut rope,
                tile,
            )?;
            evaluate(&mut self.device, set, k2, class, b, model, None)?;
            read_outputs(&mut self.device, set, k2, t, &mut results)?;
        }
        let mut take = |port: Port| {
            results
                .remove(&port)
                .map(|v| crop(port, &v, seq, sp))
                .ok_or_else(|| {
                    anyhow!(
                        "attention backward: '{}' is missing from the layouts",
                        port.name()
                    )
                })
        };
        Ok(AttentionGrads {
            dv: take(Port::Dv)?,
            dq: take(Port::Dq)?,
            dk: take(Port::Dk)?,
        })
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
        let (seq, recomputing) = (shape.seq, self.recomputing);
        let (ntiles, layers) = self
            .sets
            .get(&sp)
            .map(|s| {
                let layers = s.plan.units(kind, model.cfg.num_hidden_layers);
                (s.plan.of(kind).tiles, layers)
            })
            .ok_or_else(|| anyhow!("no kernel set for {sp}"))?;
        if layer >= layers {
            bail!("{}: no unit {layer} (there are {layers})", kind.name());
        }
        let indices = self.buffer_indices(layers, ntiles);
        let set = self
            .sets
            .get_mut(&sp)
            .ok_or_else(|| anyhow!("no kernel set for {sp}"))?;
        // A kernel without weights keeps nothing between evaluations: one
        // input buffer per program.
        let weightless = set.plan.of(kind).weight_bytes == 0;
        let at = |u: Unit| match weightless {
            true => 0,
            false => indices[u.layer * ntiles + u.tile],
        };
        let mut results: BTreeMap<Port, Vec<f32>> = BTreeMap::new();
        let mut rope: Option<(Vec<f32>, Vec<f32>)> = None;
        // The layer's class (a head kernel's `layer` is its chunk).
        let (class, opts) = match kind.is_head() {
            true => (0, std::borrow::Cow::Borrowed(&self.opts)),
            false => (
                model.cfg.class_index(layer),
                self.opts.of_layer(&model.cfg, layer),
            ),
        };
        for t in 0..ntiles {
            let unit = Unit { layer, tile: t };
            let b = at(unit);
            // The tile's program (its key class's, where it has several).
            let ki = set.slot_of(kind, t)?;
            stage_weights(&mut self.device, set, ki, model, unit, b)?;
            let tile = Tile { t, seq, sp };
            let ports = acts.ports();
            write_activations(&mut self.device, set, ki, b, &ports, &opts, &mut rope, tile)?;
            // The next unit's weights, if its buffer will not hold them,
            // are prepared on a host thread while the device runs this one.
            let want = Held::of(model, unit);
            let next = next_unit(kind, unit, ntiles, layers, recomputing).filter(|_| !weightless);
            let next = next.and_then(|n| {
                let nb = at(n);
                // What its buffer will hold when they are written.
                let over = if nb == b {
                    Some(want)
                } else {
                    set.held[ki][nb]
                };
                let nwant = Held::of(model, n);
                (over != Some(nwant)).then_some((n, nwant, over))
            });
            evaluate(&mut self.device, set, ki, class, b, model, next)?;
            read_outputs(&mut self.device, set, ki, t, &mut results)?;
        }
        // A head chunk's logits: its rows within the vocabulary.
        let rows = |port: Port, mut v: Vec<f32>| {
            if port == Port::Logits {
                v.truncate(shape.vocab * seq);
            }
            v
        };
        K::Out::from_lookup(&mut |port| {
            results
                .remove(&port)
                .map(|v| rows(port, crop(port, &v, seq, sp)))
        })
        .ok_or_else(|| {
            anyhow!(
                "{}: an output block is missing from its layout",
                kind.name()
            )
        })
    }
}
