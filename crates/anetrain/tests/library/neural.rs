//! The Neural Engine path through the simulated device: logits against the
//! `transformers` fixtures (fp16: within 3e-2 relative), gradients against
//! the CPU engine, weight staging, and padding of odd sequence lengths.

use crate::common;

use common::{fixture, rel};

use anetrain::device::{CpuKernels, Dropout, KernelRunner};
use anetrain::engine::{zero_grads, Engine};
use anetrain::kernels::{Kernel, KernelKind, Shape};
use anetrain::model::Model;

/// A fixture's model, token rows (flat), expected logits (flat) and row count.
fn fixture_logits(kind: &str) -> (Model, Vec<i64>, Vec<f32>, usize) {
    let dir = fixture(kind);
    let model = Model::load(&dir.join("model")).unwrap();
    let a = npy::read(&dir.join("tokens.npy")).unwrap();
    let rows = a.shape[0];
    let npy::NpyData::Int(t) = a.data else {
        panic!("tokens.npy holds integers")
    };
    let npy::NpyData::Float(want) = npy::read(&dir.join("logits.npy")).unwrap().data else {
        panic!("logits.npy holds floats")
    };
    (model, t, want, rows)
}

/// OLMo 2's norm over the whole q and k projections holds a mean square
/// up to 65504/k on the device (`KernelOptions::whole_norm_eps`); a model
/// whose projections pass it is refused by name, not trained on zeroed
/// queries, while the CPU engine runs it.
#[test]
fn a_projection_past_the_devices_whole_norm_range_is_refused() {
    let mut model = Model::load(&fixture("olmo2").join("model")).unwrap();
    // Embeddings 600× larger: the first layer's raw queries reach a mean
    // square of thousands.
    let embed = model.embed;
    model.params[embed]
        .data
        .iter_mut()
        .for_each(|v| *v *= 600.0);
    let row: Vec<u32> = (0..12).collect();
    let mut eng = Engine::neural(&model, ane::SimDevice::new());
    let Err(e) = eng.forward(&model, &row, None) else {
        panic!("the device ran past its norm's range");
    };
    let e = format!("{e:#}");
    assert!(
        e.contains("layer 0: the query projection's mean square"),
        "{e}"
    );
    assert!(e.contains("--backend cpu"), "{e}");
    assert!(Engine::cpu(&model).forward(&model, &row, None).is_ok());
}

#[test]
fn ane_sim_logits_match_transformers_in_fp16() {
    for kind in common::FAMILIES {
        let (model, t, want, rows) = fixture_logits(kind);
        let n = t.len() / rows - 1; // 12: padded to 32 on the device
        let v = model.cfg.vocab_size;
        let mut eng = Engine::neural(&model, ane::SimDevice::new());
        for b in 0..rows {
            let row: Vec<u32> = t[b * (n + 1)..b * (n + 1) + n]
                .iter()
                .map(|&x| x as u32)
                .collect();
            let fwd = eng.forward(&model, &row, None).unwrap();
            let got = eng.logits(&model, &fwd.xf).unwrap();
            let r = rel(&got, &want[b * n * v..(b + 1) * n * v]);
            eprintln!("{kind} row {b}: ane-sim logits rel err {r:.2e}");
            assert!(r <= 3e-2, "{kind}: {r}");
        }
        // 12 kernels (ten per layer, the head's two) compiled once for the
        // padded length 32; SmolLM3's layers without RoPE one more
        // sdpa_forward (its RoPE tables are the program's constants),
        // Ministral's layer without a window (Gemma's full layer, its
        // RoPE base too) one more sdpa_forward and sdpa_backward1 (the
        // mask is theirs; the multimodal Gemma 3's text model alike).
        let more = match kind {
            "smollm3" => 1,
            "ministral" | "gemma3" | "gemma3mm" | "gemma2" => 2,
            _ => 0,
        };
        assert_eq!(ane::Device::compiles(&eng.runner.device), 12 + more);
        let plan = eng.runner.plan().unwrap();
        assert_eq!(plan.programs_for(&model.cfg.layer_classes()), 12 + more);
    }
}

#[test]
fn ane_sim_gradients_track_the_cpu_engine_and_restage_after_updates() {
    let dir = fixture("qwen3");
    let mut model = Model::load(&dir.join("model")).unwrap();
    let row: Vec<u32> = (0..20).map(|i| (i * 37 % 128) as u32).collect();
    let rows = vec![row];
    let mut cpu = Engine::cpu(&model);
    let mut sim = Engine::neural(&model, ane::SimDevice::new());
    let mut gc = zero_grads(&model);
    let mut gs = zero_grads(&model);
    let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
    let (ls, _) = common::batch_loss(&mut sim, &model, &rows, Some(&mut gs)).unwrap();
    assert!((lc - ls).abs() < 2e-2, "loss {lc} vs {ls}");
    for (p, (a, b)) in model.params.iter().zip(gc.iter().zip(&gs)) {
        let r = rel(b, a);
        assert!(r < 5e-2, "{}: gradient rel err {r}", p.name);
    }
    // Change the weights: the device must restage and follow.
    for p in &mut model.params {
        p.data.iter_mut().for_each(|x| *x *= 0.9);
    }
    model.version += 1;
    let fc = cpu.forward(&model, &rows[0][..19], None).unwrap();
    let fs = sim.forward(&model, &rows[0][..19], None).unwrap();
    assert!(rel(&fs.xf, &fc.xf) < 3e-2);
}

/// The CPU twins behind a runner that claims to run off the host, so the
/// engine takes its overlapped path (weight gradients on a worker thread):
/// the threads its kernels ran on, and a kernel that fails, as a device
/// error would, if any.
struct OffHost {
    cpu: CpuKernels,
    threads: std::collections::HashSet<std::thread::ThreadId>,
    fails: Option<KernelKind>,
}

impl OffHost {
    fn new(opts: anetrain::kernels::KernelOptions, fails: Option<KernelKind>) -> OffHost {
        OffHost {
            cpu: CpuKernels::new(opts),
            threads: Default::default(),
            fails,
        }
    }
}

impl KernelRunner for OffHost {
    fn run<K: Kernel>(
        &mut self,
        model: &Model,
        layer: usize,
        shape: &Shape,
        dropout: &Dropout,
        acts: &K::Acts<'_>,
    ) -> anyhow::Result<K::Out> {
        if self.fails == Some(K::KIND) {
            anyhow::bail!("{}: the device failed", K::KIND.name());
        }
        self.threads.insert(std::thread::current().id());
        self.cpu.run::<K>(model, layer, shape, dropout, acts)
    }

    fn head_chunks(
        &mut self,
        model: &Model,
        seq: usize,
    ) -> anyhow::Result<anetrain::kernels::tiling::HeadChunks> {
        self.cpu.head_chunks(model, seq)
    }

    fn overlaps_host(&self) -> bool {
        true
    }
}

/// A kernel failing while the worker holds the layer's weight gradients
/// (after the FFN's were queued) returns the device's error, and the
/// gradients are all back, each its full size.
#[test]
fn a_device_error_mid_layer_returns_the_queued_gradients() {
    let model = Model::load(&fixture("qwen3").join("model")).unwrap();
    let rows = vec![(0..17).map(|i| (i * 29 % 90) as u32).collect::<Vec<u32>>()];
    let opts = Engine::cpu(&model).opts.clone();
    let runner = OffHost::new(opts.clone(), Some(KernelKind::WoBackward));
    let mut eng = Engine::with_runner(runner, opts);
    let mut g = zero_grads(&model);
    let e = common::batch_loss(&mut eng, &model, &rows, Some(&mut g)).unwrap_err();
    assert!(format!("{e:#}").contains("the device failed"), "{e:#}");
    g.finish();
    for (p, buf) in model.trainable().iter().zip(g.iter()) {
        assert_eq!(buf.len(), p.data.len(), "{}", p.name);
    }
}

/// A layer's weight gradients queued on the worker thread (full and
/// LoRA: the worker holds the projections' or the adapters' gradients
/// for the layer) are the inline ones, bit for bit.
#[test]
fn overlapped_weight_gradients_are_bit_identical() {
    for (kind, lora) in [("qwen3", false), ("llama", false), ("qwen3", true)] {
        let mut model = Model::load(&fixture(kind).join("model")).unwrap();
        if lora {
            let cfg = anetrain::model::lora::LoraConfig::every_projection(4);
            let adapters = anetrain::model::lora::Lora::init(&model.cfg, cfg, 1).unwrap();
            model.lora = Some(adapters);
        }
        let row: Vec<u32> = (0..17).map(|i| (i * 29 % 90) as u32).collect();
        let rows = vec![row];
        let mut plain = Engine::cpu(&model);
        let opts = plain.opts.clone();
        let mut off = Engine::with_runner(OffHost::new(opts.clone(), None), opts);
        let mut ga = zero_grads(&model);
        let mut gb = zero_grads(&model);
        common::batch_loss(&mut plain, &model, &rows, Some(&mut ga)).unwrap();
        common::batch_loss(&mut off, &model, &rows, Some(&mut gb)).unwrap();
        assert_eq!(ga, gb, "{kind}, LoRA {lora}");
        // Kernels stayed on the calling thread (a device is driven from one).
        assert_eq!(off.runner.threads.len(), 1);
    }
}

/// Every kernel, forward and backward, on a device that flushes fp16
/// subnormals, at a length the device pads (19 → 32): no NaN or ∞ from the
/// zero padding (QK-norm's eps stays an fp16 normal value), and the results
/// track the CPU engine as closely as without flushing.
#[test]
fn a_device_that_flushes_subnormals_gives_the_same_gradients_with_padding() {
    let model = Model::load(&fixture("qwen3").join("model")).unwrap();
    let rows = vec![(0..20).map(|i| (i * 53 % 128) as u32).collect::<Vec<u32>>()];
    let mut cpu = Engine::cpu(&model);
    let mut gc = zero_grads(&model);
    let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
    for flush in [false, true] {
        let device = ane::SimDevice::new().with_flush_subnormals(flush);
        let mut sim = Engine::neural(&model, device);
        let mut gs = zero_grads(&model);
        let (ls, _) = common::batch_loss(&mut sim, &model, &rows, Some(&mut gs)).unwrap();
        assert!((lc - ls).abs() < 2e-2, "flush {flush}: loss {lc} vs {ls}");
        for (p, (a, b)) in model.params.iter().zip(gc.iter().zip(&gs)) {
            assert!(
                b.iter().all(|v| v.is_finite()),
                "flush {flush}: {} not finite",
                p.name
            );
            let r = rel(b, a);
            assert!(r < 5e-2, "flush {flush}: {}: gradient rel err {r}", p.name);
        }
    }
}

/// Rows of many lengths (as `eval` sees them) compile one kernel set per
/// power-of-two bucket that grows, never one per length; the live set is
/// the largest, and short rows padded into it give the CPU engine's result.
#[test]
fn many_lengths_stay_within_the_compile_budget() {
    let model = Model::load(&fixture("qwen3").join("model")).unwrap();
    let mut cpu = Engine::cpu(&model);
    let mut sim = Engine::neural(&model, ane::SimDevice::new());
    for n in [5usize, 20, 40, 17, 100, 3, 64, 33] {
        let row: Vec<u32> = (0..n).map(|i| (i * 31 % 128) as u32).collect();
        let fs = sim.forward(&model, &row, None).unwrap();
        let fc = cpu.forward(&model, &row, None).unwrap();
        assert!(rel(&fs.xf, &fc.xf) < 3e-2, "length {n}");
    }
    // 32, 64, 128: twelve programs each; only the last set is loaded.
    assert_eq!(ane::Device::compiles(&sim.runner.device), 36);
    assert_eq!(sim.runner.compiled_lengths(), [128]);
}

/// An engine on the simulated device with every kernel tiled: at least two
/// blocks of every axis a kernel may split (`KernelOptions::min_tiles`, the
/// in-process form of `ANETRAIN_ANE_MIN_TILES`), so one-axis tiles and
/// two-axis grids, concatenated and summed results all run.
fn tiled(model: &Model) -> Engine<anetrain::device::NeuralKernels<ane::SimDevice>> {
    let mut opts = anetrain::kernels::KernelOptions::for_model(model);
    opts.min_tiles = 2;
    Engine::with_runner(
        anetrain::device::NeuralKernels::new(ane::SimDevice::new(), opts.clone()),
        opts,
    )
}

/// Tiled kernels hold the untiled tolerances: logits against the
/// `transformers` fixtures (fp16, 3e-2) and gradients against the CPU
/// engine (5e-2), for Qwen3 (GQA, QK-norm) and Llama; every kernel ran in
/// tiles, and tiles of a kernel share one compiled program.
#[test]
fn tiled_kernels_hold_the_fixture_and_gradient_tolerances() {
    for kind in common::FAMILIES {
        let (model, t, want, rows) = fixture_logits(kind);
        let n = t.len() / rows - 1;
        let v = model.cfg.vocab_size;
        let mut eng = tiled(&model);
        let row: Vec<u32> = t[..n].iter().map(|&x| x as u32).collect();
        let fwd = eng.forward(&model, &row, None).unwrap();
        let r = rel(&eng.logits(&model, &fwd.xf).unwrap(), &want[..n * v]);
        assert!(r <= 3e-2, "{kind}: tiled logits rel err {r}");
        let plan = eng.runner.plan().unwrap().clone();
        // Every layer kernel in tiles; the head in vocabulary chunks.
        // (OLMo 2's sdpa_forward normalises whole projections: it is cut
        // by positions only, `sequence_tiles_give_the_untiled_bits`.)
        let whole = |k: &anetrain::kernels::tiling::KernelTiles| {
            kind == "olmo2" && k.kind == anetrain::kernels::KernelKind::SdpaForward
        };
        assert!(
            plan.used()
                .all(|k| k.tiles >= 2 || k.kind.is_head() || whole(k)),
            "{kind}: {plan:?}"
        );
        assert!(plan.head.chunks >= 2, "{kind}: {:?}", plan.head);
        assert!(
            plan.kernels.iter().any(|k| k.splits.len() == 2),
            "{kind}: no grid"
        );
        // The tiled attention backward runs fused: eleven programs.
        assert_eq!(
            plan.attention_backward,
            anetrain::kernels::tiling::AttentionBackward::Fused
        );
        // (SmolLM3's layers without RoPE: one more sdpa_forward;
        // Ministral's without a window one more sdpa_forward and fused
        // backward, the kernels holding the mask.)
        let compiled = ane::Device::compiles(&eng.runner.device);
        assert_eq!(compiled, plan.programs_for(&model.cfg.layer_classes()));
        let more = match kind {
            "smollm3" => 1,
            "ministral" | "gemma3" | "gemma3mm" | "gemma2" => 2,
            _ => 0,
        };
        assert_eq!(compiled, 11 + more);

        let rows = vec![(0..20).map(|i| (i * 37 % 90) as u32).collect::<Vec<u32>>()];
        let mut cpu = Engine::cpu(&model);
        let (mut gc, mut gs) = (zero_grads(&model), zero_grads(&model));
        let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
        let (ls, _) = common::batch_loss(&mut eng, &model, &rows, Some(&mut gs)).unwrap();
        assert!((lc - ls).abs() < 2e-2, "{kind}: loss {lc} vs {ls}");
        for (p, (a, b)) in model.params.iter().zip(gc.iter().zip(&gs)) {
            let r = rel(b, a);
            assert!(r < 5e-2, "{kind}: {}: tiled gradient rel err {r}", p.name);
        }
    }
}

/// The LM head on the device, in vocabulary chunks (one, and several with
/// the last padded: 96 = 64 + 32 rows): the loss and the head's input
/// gradient within 1e-2 of the CPU engine's for the same final state, on
/// both fixtures; and on a 4000-token vocabulary in 4 chunks, where most
/// probabilities (≈ 1/4000, times 1/targets) would be fp16 zeros without
/// the gradient's power-of-two scale.
#[test]
fn the_head_on_the_device_gives_the_cpu_loss_and_input_gradient() {
    let check = |what: &str, model: &Model, row: &[u32], min_tiles: usize| {
        let n = row.len() - 1;
        let mut cpu = Engine::cpu(model);
        let xf = cpu.forward(model, &row[..n], None).unwrap().xf;
        let scale = 1.0 / n as f32;
        let mut gc = zero_grads(model);
        let (lc, dc) = cpu
            .head_loss(model, &xf, &row[1..], 2, scale, Some(&mut gc))
            .unwrap();
        let mut opts = anetrain::kernels::KernelOptions::for_model(model);
        opts.min_tiles = min_tiles;
        let runner = anetrain::device::NeuralKernels::new(ane::SimDevice::new(), opts.clone());
        let mut sim = Engine::with_runner(runner, opts);
        // Twice: a second step's gradient overwrites the first's, chunk by
        // chunk.
        let mut gs = zero_grads(model);
        for _ in 0..2 {
            gs.reset();
            sim.head_loss(model, &xf, &row[1..], 2, scale, Some(&mut gs))
                .unwrap();
            gs.finish();
        }
        gs.reset();
        let (ls, ds) = sim
            .head_loss(model, &xf, &row[1..], 2, scale, Some(&mut gs))
            .unwrap();
        let chunks = sim.runner.plan().unwrap().head.chunks;
        let r = rel(&ds, &dc);
        eprintln!("{what}: {chunks} chunks, loss {lc} vs {ls}, dxf rel err {r:.2e}");
        assert!((lc - ls).abs() <= 1e-2 * lc, "{what}: loss {lc} vs {ls}");
        assert!(r <= 1e-2, "{what}: dxf rel err {r}");
        // The head's weight gradient comes from the host beside the device.
        gc.finish();
        gs.finish();
        let id = model.lm_head.unwrap_or(model.embed);
        let r = rel(&gs[id], &gc[id]);
        assert!(r <= 1e-2, "{what}: head gradient rel err {r}");
        chunks
    };
    for kind in common::FAMILIES {
        let model = Model::load(&fixture(kind).join("model")).unwrap();
        let row: Vec<u32> = (0..25).map(|i| (i * 37 % 90) as u32).collect();
        assert_eq!(check(kind, &model, &row, 1), 1);
        assert_eq!(check(kind, &model, &row, 2), 2);
    }
    let mut cfg = anetrain::model::config::ModelConfig::preset("tiny").unwrap();
    cfg.vocab_size = 4000;
    cfg.num_hidden_layers = 1;
    cfg.tie_word_embeddings = false;
    let model = Model::init(&cfg, 7).unwrap();
    let row: Vec<u32> = (0..60).map(|i| (i * 613 % 4000) as u32).collect();
    assert_eq!(check("vocabulary 4000", &model, &row, 4), 4);
    // LoRA freezes the head: the device gathers dxf in the statistics
    // pass, each chunk's exp(z − m) scaled to 2ᵏ per column on its way to
    // fp16, and it matches the CPU's one-chunk gradient as closely.
    let mut model = model;
    let lora = anetrain::model::lora::LoraConfig::every_projection(4);
    model.lora = Some(anetrain::model::lora::Lora::init(&cfg, lora, 1).unwrap());
    let n = row.len() - 1;
    let xf = Engine::cpu(&model)
        .forward(&model, &row[..n], None)
        .unwrap()
        .xf;
    fn loss<R: anetrain::device::KernelRunner>(
        eng: &mut Engine<R>,
        model: &Model,
        xf: &[f32],
        row: &[u32],
    ) -> (f64, Vec<f32>) {
        let mut g = zero_grads(model);
        g.reset();
        let scale = 1.0 / (row.len() - 1) as f32;
        eng.head_loss(model, xf, &row[1..], 2, scale, Some(&mut g))
            .unwrap()
    }
    let (lc, dc) = loss(&mut Engine::cpu(&model), &model, &xf, &row);
    let mut opts = anetrain::kernels::KernelOptions::for_model(&model);
    opts.min_tiles = 4;
    let runner = anetrain::device::NeuralKernels::new(ane::SimDevice::new(), opts.clone());
    let mut sim = Engine::with_runner(runner, opts);
    let (ls, ds) = loss(&mut sim, &model, &xf, &row);
    assert_eq!(sim.runner.plan().unwrap().head.chunks, 4);
    let r = rel(&ds, &dc);
    eprintln!("frozen head, 4 chunks: loss {lc} vs {ls}, dxf rel err {r:.2e}");
    assert!(
        (lc - ls).abs() <= 1e-2 * lc,
        "frozen head: loss {lc} vs {ls}"
    );
    assert!(r <= 1e-2, "frozen head: dxf rel err {r}");
}

/// Sequence tiles (`KernelOptions::min_seq_tiles`, the in-process form of
/// `ANETRAIN_ANE_SEQ_TILES`): kernels that treat positions alone, cut into
/// blocks of 32 positions, compute each position as the whole does, so the
/// forward and its loss are the untiled run's bit for bit; the attention
/// backward in blocks of 32 queries moves the gradients by rounding only
/// (3e-3 of the untiled device run) and they hold the CPU tolerance.
#[test]
fn sequence_tiles_give_the_untiled_bits() {
    use anetrain::kernels::tiling::Axis;
    for kind in common::FAMILIES {
        let model = Model::load(&fixture(kind).join("model")).unwrap();
        let mut opts = anetrain::kernels::KernelOptions::for_model(&model);
        opts.min_seq_tiles = 2;
        let mut tiled = Engine::with_runner(
            anetrain::device::NeuralKernels::new(ane::SimDevice::new(), opts.clone()),
            opts,
        );
        let mut plain = Engine::neural(&model, ane::SimDevice::new());
        // 60 positions, padded to 64: two blocks of 32.
        let rows = vec![(0..60).map(|i| (i * 37 % 90) as u32).collect::<Vec<u32>>()];
        let (mut gt, mut gp) = (zero_grads(&model), zero_grads(&model));
        let (lt, _) = common::batch_loss(&mut tiled, &model, &rows, Some(&mut gt)).unwrap();
        let (lp, _) = common::batch_loss(&mut plain, &model, &rows, Some(&mut gp)).unwrap();
        let plan = tiled.runner.plan().unwrap().clone();
        for k in &plan.kernels {
            let seq_split = k
                .splits
                .iter()
                .any(|s| s.axis == Axis::Seq && s.blocks == 2);
            assert_eq!(
                seq_split,
                k.kind.tile_axes().contains(&Axis::Seq),
                "{kind}: {k:?}"
            );
        }
        // The blocks of queries read 32 and 64 keys (causal key classes),
        // in the forward and in the fused backward.
        for kernel in [KernelKind::SdpaForward, KernelKind::SdpaBackward] {
            let keys: Vec<usize> = plan.of(kernel).keys.iter().map(|c| c.shape.seq).collect();
            assert_eq!(keys, [32, 64], "{kind}: {}", kernel.name());
        }
        assert_eq!(lt.to_bits(), lp.to_bits(), "{kind}: loss {lt} vs {lp}");
        // Blocks of queries sum their partial dK, dV in f32 from fp16
        // results: the gradients move by rounding, not more.
        let mut cpu = Engine::cpu(&model);
        let mut gc = zero_grads(&model);
        common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
        for (p, ((a, b), c)) in model.params.iter().zip(gt.iter().zip(&gp).zip(&gc)) {
            let (r, rc) = (rel(a, b), rel(a, c));
            assert!(
                r < 3e-3,
                "{kind}: {}: query blocks moved the gradient by {r}",
                p.name
            );
            assert!(rc < 5e-2, "{kind}: {}: {rc} from the CPU engine", p.name);
        }
    }
}

/// The attention backward tile by tile (each tile's P and dP handed from
/// `sdpa_backward1`'s output straight to `sdpa_backward2`'s input) gives
/// the bits of the two kernels run over the whole layer, tiled by heads
/// and by blocks of queries or not at all; and so does the fused
/// `sdpa_backward` (P and dP kept inside, the same fp16 operations) where
/// the plan runs it, its blocks of queries in causal key classes (four
/// blocks of 32 of 128 positions read 32, 64, 128 and 128 keys: the keys
/// a class leaves out are masked for all its queries, exact zeros).
#[test]
fn attention_backward_tile_by_tile_gives_the_whole_layers_bits() {
    use anetrain::device::{attention_backward_in_full, NeuralKernels};
    use anetrain::kernels::sdpa_backward1::Acts;
    use anetrain::kernels::tiling::Axis;
    let mut rng = anetrain::util::rng::Rng::new(7);
    for (kind, tiles, seq) in [
        ("qwen3", 1, 60),
        ("qwen3", 2, 60),
        ("llama", 2, 60),
        ("qwen3", 4, 128),
    ] {
        let model = Model::load(&fixture(kind).join("model")).unwrap();
        let cfg = &model.cfg;
        let mut opts = anetrain::kernels::KernelOptions::for_model(&model);
        (opts.min_seq_tiles, opts.min_tiles) = (tiles, tiles);
        let mut fused = NeuralKernels::new(ane::SimDevice::new(), opts.clone());
        opts.fuse_attention_backward = false;
        let mut runner = NeuralKernels::new(ane::SimDevice::new(), opts);
        let shape = Shape::new(cfg, seq);
        let mut r = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let (q, k, v, da) = (
            r(cfg.q_dim() * seq),
            r(cfg.kv_dim() * seq),
            r(cfg.kv_dim() * seq),
            r(cfg.q_dim() * seq),
        );
        let acts = Acts {
            q_rope: &q,
            k_rope: &k,
            v: &v,
            da: &da,
            mask: None,
        };
        let dropout = Dropout::default();
        let a = runner
            .attention_backward(&model, 1, &shape, &dropout, &acts)
            .unwrap();
        let b =
            attention_backward_in_full(&mut runner, &model, 1, &shape, &dropout, &acts).unwrap();
        let f = fused
            .attention_backward(&model, 1, &shape, &dropout, &acts)
            .unwrap();
        let form = fused.plan().unwrap().attention_backward;
        assert_eq!(
            form == anetrain::kernels::tiling::AttentionBackward::Fused,
            tiles > 1,
            "{kind}, {tiles} tiles: {form:?}"
        );
        let keys: Vec<usize> = (fused.plan().unwrap())
            .of(anetrain::kernels::KernelKind::SdpaBackward)
            .keys
            .iter()
            .map(|c| c.shape.seq)
            .collect();
        match tiles {
            1 => assert!(keys.is_empty()),
            2 => assert_eq!(keys, [32, 64], "{kind}"),
            _ => assert_eq!(keys, [32, 64, 128], "{kind}"),
        }
        let plan = runner.plan().unwrap();
        let t1 = plan.of(anetrain::kernels::KernelKind::SdpaBackward1);
        assert_eq!(
            t1.splits,
            plan.of(anetrain::kernels::KernelKind::SdpaBackward2).splits
        );
        if tiles > 1 {
            assert!(
                t1.splits.iter().any(|s| s.axis == Axis::Seq),
                "{kind}: {t1:?}"
            );
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (name, x, y) in [
            ("dv", &a.dv, &b.dv),
            ("dq", &a.dq, &b.dq),
            ("dk", &a.dk, &b.dk),
            ("fused dv", &f.dv, &b.dv),
            ("fused dq", &f.dq, &b.dq),
            ("fused dk", &f.dk, &b.dk),
        ] {
            assert_eq!(x.len(), y.len(), "{kind} {name}");
            assert!(
                bits(x) == bits(y),
                "{kind}, {tiles} tiles: {name} differs (rel {})",
                rel(x, y)
            );
            assert!(x.iter().all(|v| v.is_finite()) && x.iter().any(|v| *v != 0.0));
        }
    }
}

/// LoRA adapters on all seven projections, tiled: each tile carries its
/// block of `B` (output split) or of `A` (input split) and the adapter
/// gradients track the CPU engine as untiled ones do.
#[test]
fn tiled_lora_adapters_track_the_cpu_engine() {
    use anetrain::model::lora::{Lora, LoraConfig};
    let mut model = Model::load(&fixture("qwen3").join("model")).unwrap();
    let cfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: anetrain::model::Projection::ALL.to_vec(),
        rslora: false,
        layers: None,
    };
    let mut lora = Lora::init(&model.cfg, cfg, 3).unwrap();
    // B starts at zero; give it values so the adapters act.
    let mut rng = anetrain::util::rng::Rng::new(9);
    for p in &mut lora.params {
        p.data = rng.normals(p.data.len(), 0.05);
    }
    model.lora = Some(lora);
    let rows = vec![(0..24).map(|i| (i * 41 % 128) as u32).collect::<Vec<u32>>()];
    let mut cpu = Engine::cpu(&model);
    let mut sim = tiled(&model);
    let (mut gc, mut gs) = (zero_grads(&model), zero_grads(&model));
    let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, Some(&mut gc)).unwrap();
    let (ls, _) = common::batch_loss(&mut sim, &model, &rows, Some(&mut gs)).unwrap();
    assert!((lc - ls).abs() < 2e-2, "loss {lc} vs {ls}");
    let names = &model.lora.as_ref().unwrap().params;
    for (p, (a, b)) in names.iter().zip(gc.iter().zip(&gs)) {
        let r = rel(b, a);
        assert!(r < 5e-2, "{}: tiled adapter gradient rel err {r}", p.name);
    }
}

/// A 4096-token sequence on the simulated device, its attention in blocks
/// of queries (forced: this model's are small enough whole), gives the CPU
/// engine's loss to 1e-2 (relative), as `eval` reports it.
#[test]
fn a_long_sequence_runs_in_query_blocks_and_matches_the_cpu_loss() {
    use anetrain::kernels::tiling::Axis;
    let model = Model::load(&fixture("qwen3").join("model")).unwrap();
    let rows = vec![(0..4097)
        .map(|i| (i * 37 % 90) as u32)
        .collect::<Vec<u32>>()];
    let mut opts = anetrain::kernels::KernelOptions::for_model(&model);
    opts.min_seq_tiles = 4;
    let mut sim = Engine::with_runner(
        anetrain::device::NeuralKernels::new(ane::SimDevice::new(), opts.clone()),
        opts,
    );
    let mut cpu = Engine::cpu(&model);
    let (ls, _) = common::batch_loss(&mut sim, &model, &rows, None).unwrap();
    let (lc, _) = common::batch_loss(&mut cpu, &model, &rows, None).unwrap();
    let plan = sim.runner.plan().unwrap().clone();
    let forward = plan.of(anetrain::kernels::KernelKind::SdpaForward);
    assert!(
        forward.splits.iter().any(|s| s.axis == Axis::Seq),
        "{forward:?}"
    );
    // A program per causal key class: the blocks read only the keys they see.
    assert!(forward.keys.len() >= 3, "{forward:?}");
    assert!(
        ((ls - lc) / lc).abs() < 1e-2,
        "4096 tokens: ane-sim loss {ls} vs cpu {lc}"
    );
}
