//! Tiling plans for models beyond Qwen3-0.6B (Hugging Face `config.json`
//! shapes under `testdata/configs/`): every program a plan asks for passes
//! every default ANE rule at the limit in force, within the compile budget,
//! and a model that cannot be tiled is refused with one line.

use ane::family::{Family, Limits};
use std::path::Path;

use anetrain::kernels::tiling::{self, Axis};
use anetrain::kernels::{build, KernelKind, KernelOptions, LoraKernel, Shape};
use anetrain::model::config::ModelConfig;
use anetrain::model::Projection;

fn config(name: &str) -> ModelConfig {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/configs")
        .join(format!("{name}.json"));
    ModelConfig::from_file(&p).unwrap()
}

/// Plans `cfg` at `seq` under both axis caps at `max_dim` (and every
/// other limit of the conservative row) and checks every tile program.
fn plan_and_check(
    what: &str,
    cfg: &ModelConfig,
    seq: usize,
    max_dim: usize,
    lora: bool,
) -> tiling::Plan {
    plan_for(
        what,
        cfg,
        seq,
        Limits::conservative().with_max_dim(max_dim),
        lora,
    )
}

/// Plans `cfg` at `seq` for `limits` and checks every tile program
/// against every rule those limits imply.
fn plan_for(what: &str, cfg: &ModelConfig, seq: usize, limits: Limits, lora: bool) -> tiling::Plan {
    let mut o = KernelOptions::hf(cfg);
    o.limits = limits;
    if lora {
        o.lora = Some(LoraKernel {
            rank: 16,
            scale: 2.0,
            targets: Projection::ALL.to_vec(),
            layers: None,
        });
    }
    let full = Shape::new(cfg, seq);
    let plan = tiling::plan(&full, &o).unwrap_or_else(|e| panic!("{what}: {e}"));
    let rules = ane::rules::RuleSet::for_limits(limits);
    for k in &plan.kernels {
        // Tiles cut their axes evenly.
        for sp in &k.splits {
            assert_eq!(sp.axis.count(&full) % sp.blocks, 0, "{what} {:?}", k.kind);
        }
        // Every program: one per kernel, one per causal key class.
        for program in k.programs() {
            let p = build(k.kind, &program.shape, &o).unwrap();
            let broken = ane::rules::check(&p.program, &rules);
            assert!(
                broken.is_empty(),
                "{what} {:?} ({} tiles, {} keys): {broken:?}",
                k.kind,
                k.tiles,
                program.shape.seq
            );
        }
        assert!(
            k.input[1] <= limits.max_spatial && k.output[1] <= limits.max_spatial,
            "{what} {k:?}"
        );
        assert!(
            k.input[0] <= limits.max_channel && k.output[0] <= limits.max_channel,
            "{what} {k:?}"
        );
    }
    assert!(plan.programs() <= ane::DEFAULT_COMPILE_BUDGET);
    plan
}

#[test]
fn larger_models_plan_within_the_limits() {
    for name in ["qwen3-1.7b", "qwen3-4b", "llama-3.2-3b"] {
        let cfg = config(name);
        let plan = plan_and_check(name, &cfg, 256, ane::rules::MAX_DIM, false);
        // Their FFN input passes 16384 untiled.
        assert!(
            plan.of(KernelKind::FfnForward).tiles >= 2,
            "{name}: {plan:?}"
        );
        assert_eq!(plan.of(KernelKind::FfnForward).splits[0].axis, Axis::Hidden);
        plan_and_check(name, &cfg, 256, 4096, false);
        plan_and_check(
            &format!("{name} LoRA"),
            &cfg,
            256,
            ane::rules::MAX_DIM,
            true,
        );
    }
    // Qwen3-0.6B fits the axis caps untiled at 16384: only the tile-size
    // cap cuts its largest kernels; and it tiles under a 4096 limit.
    let small = ModelConfig::preset("qwen3-0.6b").unwrap();
    let plan = plan_and_check("qwen3-0.6b", &small, 256, ane::rules::MAX_DIM, false);
    let cap = anetrain::kernels::MAX_TILE_BYTES;
    assert!(plan.kernels.iter().all(|k| k.surface_bytes().0 <= cap));
    let mut uncapped = KernelOptions::hf(&small);
    uncapped.limits = Limits::conservative();
    uncapped.max_tile_bytes = None;
    let plan = tiling::plan(&Shape::new(&small, 256), &uncapped).unwrap();
    assert!(plan.kernels.iter().all(|k| k.tiles == 1), "{plan:?}");
    let plan = plan_and_check("qwen3-0.6b at 4096", &small, 256, 4096, false);
    assert!(plan.of(KernelKind::FfnForward).tiles >= 2);
    assert!(plan.of(KernelKind::SdpaForward).tiles >= 2);
}

#[test]
fn an_untileable_model_is_refused_with_one_line_naming_kernel_and_limit() {
    // One attention head (128 wide with its positions and weights) cannot
    // be cut below the limit.
    let cfg = config("qwen3-1.7b");
    let mut o = KernelOptions::hf(&cfg);
    o.limits = o.limits.with_max_dim(128);
    let e = tiling::plan(&Shape::new(&cfg, 256), &o)
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n'), "{e}");
    assert!(e.starts_with("sdpa_forward: no tiling fits"), "{e}");
    assert!(
        e.contains("128") && e.contains("ANETRAIN_ANE_MAX_DIM"),
        "{e}"
    );
}

/// `eval` on rows of every length compiles one set per power of two up to
/// the longest (`NeuralKernels::padded`): for the largest shapes here, on
/// every family, every length from 32 to 8192 tokens compiles within the
/// process's budget, causal key classes included
/// (`tiling::MAX_KEY_CLASSES`).
#[test]
fn every_length_to_8192_compiles_within_the_budget() {
    for f in Family::ALL {
        for name in ["qwen3-4b", "llama-3.2-3b"] {
            let cfg = config(name);
            let mut o = KernelOptions::hf(&cfg);
            (o.limits, o.cost_family) = (f.limits(), f);
            let programs: usize = (5..=13)
                .map(|p| {
                    tiling::plan(&Shape::new(&cfg, 1 << p), &o)
                        .unwrap()
                        .programs()
                })
                .sum();
            assert!(
                programs <= ane::DEFAULT_COMPILE_BUDGET,
                "{name} on {f}: {programs} programs"
            );
        }
    }
}

#[test]
fn every_family_plans_the_qwen3_shapes_within_its_rules() {
    for f in Family::ALL {
        for name in ["qwen3-1.7b", "qwen3-4b"] {
            plan_for(
                &format!("{name} on {f}"),
                &config(name),
                256,
                f.limits(),
                false,
            );
        }
        let small = ModelConfig::preset("qwen3-0.6b").unwrap();
        plan_for(
            &format!("qwen3-0.6b on {f}"),
            &small,
            256,
            f.limits(),
            false,
        );
    }
}

#[test]
fn per_axis_caps_plan_4096_tokens_on_a16() {
    // sdpa_backward1's output has 16512 channels at 4096 tokens: over one
    // cap of 16384 for every axis, within the channel cap every family has.
    let small = ModelConfig::preset("qwen3-0.6b").unwrap();
    for f in [Family::M4, Family::M5] {
        plan_for(
            &format!("qwen3-0.6b at 4096 on {f}"),
            &small,
            4096,
            f.limits(),
            false,
        );
        plan_for(
            &format!("qwen3-1.7b at 4096 on {f}"),
            &config("qwen3-1.7b"),
            4096,
            f.limits(),
            false,
        );
    }
}

/// Sequence tiles take the Qwen3 shapes to long sequences: blocks of
/// positions keep the packed FFN inputs under the spatial cap and blocks
/// of queries the attention's scores, every tile program passing every
/// rule. Attention reads every key in every tile, so the spatial cap
/// bounds the sequence: 16384 tokens are refused in one line that says so.
#[test]
fn sequence_tiles_plan_long_sequences() {
    let small = ModelConfig::preset("qwen3-0.6b").unwrap();
    for (name, cfg) in [
        ("qwen3-0.6b", small),
        ("qwen3-1.7b", config("qwen3-1.7b")),
        ("qwen3-4b", config("qwen3-4b")),
    ] {
        for seq in [4096, 8192] {
            let plan = plan_and_check(name, &cfg, seq, ane::rules::MAX_DIM, seq == 8192);
            // Qwen3-4B's four query heads per KV head, folded along 8192
            // queries, need sdpa_forward in query blocks too.
            let forward = (name == "qwen3-4b" && seq == 8192).then_some(KernelKind::SdpaForward);
            for kind in [KernelKind::FfnForward, KernelKind::SdpaBackward2]
                .into_iter()
                .chain(forward)
            {
                assert!(
                    plan.of(kind).splits.iter().any(|s| s.axis == Axis::Seq),
                    "{name} at {seq}: {kind:?} {:?}",
                    plan.of(kind)
                );
            }
        }
        let e = tiling::plan(&Shape::new(&cfg, 16384), &KernelOptions::hf(&cfg))
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "{e}");
        assert!(e.starts_with("sdpa_forward: no tiling fits"), "{e}");
        assert!(e.contains("reads all 16384 keys in every tile"), "{e}");
    }
}
