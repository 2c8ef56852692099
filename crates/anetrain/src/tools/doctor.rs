//! `anetrain doctor`: what a first run on a Mac needs to tell us. For each
//! kernel of a model: does the device compile it, how long do compile and
//! evaluation take, and how far are its results from the simulator's on
//! the same random inputs; then a few training steps on the device beside
//! the same steps on the simulator. Every failure becomes a line of the
//! report naming the kernel or step and the device's error, never a crash.
//!
//! Where the Neural Engine does not open (Linux, or a macOS whose private
//! framework differs), the simulator stands in as the device, so the
//! command and its report are exercised everywhere; with
//! `ANETRAIN_ANE_RUNTIME` set, the device is `AneDevice` over that library.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use ane::{Device, SimDevice};
use serde::Serialize;

use crate::device::backend::Backend;
use crate::kernels::check::{pack_all, random_inputs};
use crate::kernels::{build, KernelKind, KernelOptions, Shape};
use crate::model::config::ModelConfig;
use crate::train::{self, Event, Sample, TrainRequest, TrainSettings};
use crate::util::rng::Rng;

/// Largest relative difference (against the largest entry of each output)
/// accepted between the device and the simulator for one kernel: both
/// compute in fp16, but may accumulate in different orders and widths;
/// the same bound the interpreter's fp16 mode meets against the f32 twins.
pub const KERNEL_TOL: f64 = crate::kernels::check::FP16_TOL as f64;
/// Largest relative difference accepted between device and simulator
/// losses at each of the first training steps.
pub const LOSS_TOL: f64 = 2e-2;

/// What to examine.
#[derive(Clone, Debug)]
pub struct DoctorRequest {
    /// A preset or model directory.
    pub model: String,
    pub seq: usize,
    /// Training steps on each of device and simulator (0: none).
    pub steps: u64,
    /// Timed evaluations per kernel (the median is reported).
    pub evals: usize,
}

/// The machine.
#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub os: String,
    pub os_version: String,
    pub arch: String,
    pub chip: String,
    pub cpu_threads: usize,
}

/// One kernel on the device.
#[derive(Clone, Debug, Serialize)]
pub struct KernelResult {
    pub kernel: String,
    /// Tiles the kernel runs in (checked: one tile's program).
    pub tiles: usize,
    pub input_bytes: usize,
    pub output_bytes: usize,
    pub compile_ms: Option<f64>,
    pub eval_ms_median: Option<f64>,
    /// max |device − simulator| / max |simulator| over the output.
    pub max_rel_error: Option<f64>,
    pub error: Option<String>,
}

/// Training steps on the device beside the simulator.
#[derive(Clone, Debug, Serialize)]
pub struct TrainingResult {
    pub steps: u64,
    pub device_losses: Vec<f64>,
    pub sim_losses: Vec<f64>,
    pub max_rel_diff: Option<f64>,
    pub error: Option<String>,
}

/// Everything `doctor` found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub anetrain_version: String,
    pub host: Host,
    /// `ane` (the Neural Engine, or the stand-in runtime) or `ane-sim`.
    pub device: String,
    /// Why the device is what it is (which runtime; why not the ANE).
    pub device_note: String,
    pub matmul: String,
    pub model: String,
    pub seq: usize,
    /// The chip family and where it came from.
    pub family: String,
    /// The limits kernels were built to.
    pub limits: ane::family::Limits,
    /// The family's facts measured on the device (see [`ane::probes`]).
    pub probes: Option<ane::probes::ProbeReport>,
    /// Probes whose result contradicts the family table, one line each.
    pub contradictions: Vec<String>,
    /// Where the measured profile was saved (later runs use it), or why not.
    pub profile: String,
    /// The cost model's timing constants: measured on the device beside
    /// the table's (see [`ane::timing`]).
    pub timing: Timing,
    pub kernels: Vec<KernelResult>,
    pub training: Option<TrainingResult>,
    /// One line per problem, naming the kernel or step.
    pub failures: Vec<String>,
    pub ok: bool,
    pub verdict: String,
}

/// The cost model's constants on this machine: the table's row for the
/// family, and what the timing probes measured on a Neural Engine (`None`
/// on the simulator, whose timings describe the host, not a chip).
#[derive(Clone, Debug, Serialize)]
pub struct Timing {
    pub family: Option<String>,
    pub table: TimingRow,
    pub measured: Option<TimingRow>,
    /// Why nothing was measured, or the error that stopped the probes.
    pub note: String,
}

/// One set of the constants the timeline is most sensitive to.
#[derive(Clone, Debug, Serialize)]
pub struct TimingRow {
    pub dispatch_ms: f64,
    /// η: a dynamic-weight product's rate over a compiled GEMM's.
    pub dynamic_efficiency: f64,
    pub write_gbs: f64,
    pub compile_ms: f64,
    /// The share of a program's intermediate matrices that slows it as
    /// surfaces would (the table assumes all; see `ane::cost::Rates`).
    pub scratch_share: f64,
}

impl TimingRow {
    fn of(r: &ane::cost::Rates) -> TimingRow {
        TimingRow {
            dispatch_ms: r.dispatch_ms,
            dynamic_efficiency: r.fitted.dynamic_efficiency,
            write_gbs: r.copy_gbs,
            compile_ms: r.compile_ms,
            scratch_share: r.scratch_share,
        }
    }
}

/// The timing probes on the Neural Engine (within their own four
/// compiles), beside the table's row for `family`; on any other device,
/// the table alone and a line saying nothing was measured.
fn measure_timing(
    device: &str,
    family: Option<ane::family::Family>,
    progress: &mut dyn FnMut(&str),
) -> (Timing, Option<ane::family::Measured>) {
    let table_family = family.unwrap_or(ane::family::Family::M1);
    let table = ane::cost::Rates::of(table_family);
    let mut t = Timing {
        family: family.map(|f| f.name().to_string()),
        table: TimingRow::of(&table),
        measured: None,
        note: String::new(),
    };
    if device != "ane" {
        t.note = "not measured: the simulator's timings describe this host, not a chip; the cost model uses the table".into();
        progress(&format!("timing {}", t.note));
        return (t, None);
    }
    let measured = ane::AneDevice::open()
        .map_err(|e| e.to_string())
        .and_then(|mut d| {
            ane::timing::measure(
                &mut d,
                50,
                &ane::timing::MATMUL_SHAPES,
                ane::timing::SCRATCH_SHAPE,
            )
        });
    match measured {
        Ok(m) => {
            let row = TimingRow::of(&table.clone().with_measured(&m));
            progress(&format!(
                "timing dispatch {:.3} ms (table {:.3}), η {:.2} (table {:.2}), writes {:.1} GB/s (table {:.1}), compile {:.0} ms (table {:.0}), scratch share {:.2} (table {:.2}, assumed)",
                row.dispatch_ms, t.table.dispatch_ms, row.dynamic_efficiency, t.table.dynamic_efficiency,
                row.write_gbs, t.table.write_gbs, row.compile_ms, t.table.compile_ms,
                row.scratch_share, t.table.scratch_share
            ));
            t.measured = Some(row);
            t.note =
                "measured on the device; saved with the profile, later predictions use it".into();
            (t, Some(m))
        }
        Err(e) => {
            t.note = format!("the timing probes failed: {e}");
            progress(&format!("timing: {}", t.note));
            (t, None)
        }
    }
}

/// Output of a command, trimmed, or `unknown`.
fn command(program: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
    (o.status.success() && !s.is_empty()).then_some(s)
}

/// Chip and OS: `sysctl` on macOS, `/proc/cpuinfo` and `/etc/os-release`
/// elsewhere.
pub fn host() -> Host {
    let unknown = || "unknown".to_string();
    let (chip, os_version) = if cfg!(target_os = "macos") {
        (
            command("sysctl", &["-n", "machdep.cpu.brand_string"]).unwrap_or_else(unknown),
            command("sysctl", &["-n", "kern.osproductversion"])
                .map(|v| format!("macOS {v}"))
                .unwrap_or_else(unknown),
        )
    } else {
        let field = |file: &str, key: &str| -> Option<String> {
            std::fs::read_to_string(file).ok()?.lines().find_map(|l| {
                let (k, v) = l.split_once(['=', ':'])?;
                (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        (
            field("/proc/cpuinfo", "model name").unwrap_or_else(unknown),
            field("/etc/os-release", "PRETTY_NAME").unwrap_or_else(unknown),
        )
    };
    Host {
        os: std::env::consts::OS.into(),
        os_version,
        arch: std::env::consts::ARCH.into(),
        chip,
        cpu_threads: linalg::threads(),
    }
}

/// A panic's message, for a report line.
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn max_rel(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12) as f64;
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| {
            if a.is_nan() != b.is_nan() {
                f64::INFINITY
            } else {
                (a - b).abs() as f64
            }
        })
        .fold(0f64, |m, d| if d.is_nan() { m } else { m.max(d) });
    worst / scale
}

/// Compiles, times and compares one kernel on `dev`.
fn kernel_on<D: Device>(
    dev: &mut D,
    sim: &mut SimDevice,
    kind: KernelKind,
    s: &Shape,
    o: &KernelOptions,
    evals: usize,
    rng: &mut Rng,
) -> KernelResult {
    let mut r = KernelResult {
        kernel: kind.name().into(),
        tiles: 1,
        input_bytes: 0,
        output_bytes: 0,
        compile_ms: None,
        eval_ms_median: None,
        max_rel_error: None,
        error: None,
    };
    let k = match build(kind, s, o) {
        Ok(k) => k,
        Err(e) => {
            r.error = Some(format!("generating the program: {e}"));
            return r;
        }
    };
    r.input_bytes = 2 * k.layout.input_elems();
    r.output_bytes = 2 * k.layout.output_elems();
    let input = pack_all(&k, &random_inputs(&k, rng));
    let (text, blobs) = (k.text(), k.blob_paths());
    let mut step = || -> Result<(), String> {
        let t0 = Instant::now();
        let p = dev
            .compile(&text, &blobs)
            .map_err(|e| format!("compile: {e}"))?;
        r.compile_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
        let (ni, no) = dev.io_elems(&p);
        let mut x = dev.buffer(ni).map_err(|e| format!("input buffer: {e}"))?;
        let mut y = dev.buffer(no).map_err(|e| format!("output buffer: {e}"))?;
        dev.write(&mut x, 0, &input)
            .map_err(|e| format!("write: {e}"))?;
        let mut times = vec![];
        for _ in 0..evals.max(1) {
            let t0 = Instant::now();
            dev.eval(&p, &x, &mut y).map_err(|e| format!("eval: {e}"))?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        r.eval_ms_median = Some(median(times));
        let mut got = vec![0f32; no];
        dev.read(&y, 0, &mut got)
            .map_err(|e| format!("read: {e}"))?;
        // The simulator on the same input.
        let ps = sim
            .compile(&text, &blobs)
            .map_err(|e| format!("simulator: {e}"))?;
        let xs_buf = {
            let mut b = sim.buffer(ni).map_err(|e| e.to_string())?;
            sim.write(&mut b, 0, &input).map_err(|e| e.to_string())?;
            b
        };
        let mut ys = sim.buffer(no).map_err(|e| e.to_string())?;
        sim.eval(&ps, &xs_buf, &mut ys)
            .map_err(|e| format!("simulator: {e}"))?;
        let mut want = vec![0f32; no];
        sim.read(&ys, 0, &mut want).map_err(|e| e.to_string())?;
        r.max_rel_error = Some(max_rel(&got, &want));
        Ok(())
    };
    if let Err(e) = catch_unwind(AssertUnwindSafe(&mut step))
        .unwrap_or_else(|p| Err(format!("internal error: {}", panic_text(p))))
    {
        r.error = Some(e);
    }
    r
}

/// Losses of `steps` training steps of `model` on `backend`.
fn losses(req: &DoctorRequest, backend: Backend, out: PathBuf) -> Result<Vec<f64>, String> {
    let settings = TrainSettings {
        backend,
        lr: 1e-3,
        warmup: Some(0),
        min_lr_frac: 1.0,
        clip: 1.0,
        seed: 1,
        sample: Sample::Sequential,
        val_frac: 0.05,
        eval_windows: 1,
        ..TrainSettings::neutral(&req.model, req.seq)
    };
    let request = TrainRequest {
        settings,
        adamw: Default::default(),
        steps: req.steps,
        out: out.clone(),
        out_is_default: false,
        resume: false,
        tokenizer: None,
        save_every: 0,
        memory: Default::default(),
    };
    let mut seen = vec![];
    let stop = AtomicBool::new(false);
    let result = catch_unwind(AssertUnwindSafe(|| {
        train::train(
            request,
            &mut |e: &Event| {
                if let Event::Step { loss, .. } = e {
                    seen.push(*loss);
                }
            },
            &stop,
        )
    }));
    let _ = std::fs::remove_dir_all(&out);
    match result {
        Ok(Ok(_)) => Ok(seen),
        Ok(Err(e)) => Err(format!("step {}: {e:#}", seen.len() + 1)),
        Err(p) => Err(format!(
            "step {}: internal error: {}",
            seen.len() + 1,
            panic_text(p)
        )),
    }
}

/// A scratch directory for one training run.
fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "anetrain-doctor-{}-{tag}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ))
}

/// Runs the checks; `progress` receives one line per finished item.
pub fn run(req: &DoctorRequest, progress: &mut dyn FnMut(&str)) -> anyhow::Result<Report> {
    let cfg = ModelConfig::resolve(&req.model)?;
    let profile = ane::family::Profile::in_force()?;
    let full = Shape::new(&cfg, req.seq);
    let mut o = KernelOptions::hf(&cfg);
    if let Some(f) = ane::family::sim_family_from_env()? {
        if !ane::AneDevice::available() {
            o.limits = SimDevice::for_family(f).limits();
        }
    }
    let mut failures = vec![];
    // Kernels too wide for the device are checked as their tiles run; a
    // model no tiling fits is a failure, and its kernels are tried whole.
    let plan = match crate::kernels::tiling::plan(&full, &o) {
        Ok(p) => Some(p),
        Err(e) => {
            failures.push(format!("tiling: {e}"));
            None
        }
    };
    let stand_in = std::env::var_os(ane::apple::RUNTIME_ENV).is_some_and(|p| !p.is_empty());
    let (device, device_note, ane) = open_device(stand_in);
    // The family's facts, measured by probe programs on a device of their
    // own (a real device checks only what it binds, so its compiler answers).
    let sim_family = ane::family::sim_family_from_env()?;
    let expected = match (device, sim_family) {
        ("ane-sim", Some(f)) => f.limits(),
        _ => profile.limits,
    };
    let family = sim_family.or(profile.family);
    let (timing, measured) = measure_timing(device, family, progress);
    let (probes, contradictions, profile_note) =
        probe_family(device, &expected, family, measured, &mut failures, progress);
    let kernels = check_kernels(req, plan.as_ref(), &full, &o, ane, &mut failures, progress)?;
    let training =
        (req.steps > 0).then(|| train_side_by_side(req, device, &mut failures, progress));
    let ok = failures.is_empty();
    let verdict = verdict(req, device, stand_in, training.is_some(), &failures);
    Ok(Report {
        anetrain_version: env!("CARGO_PKG_VERSION").into(),
        host: host(),
        device: device.into(),
        device_note,
        matmul: linalg::selected().describe().into(),
        model: req.model.clone(),
        seq: req.seq,
        family: match sim_family.filter(|_| device == "ane-sim") {
            Some(f) => format!(
                "{f}, played by the simulator ({})",
                ane::family::SIM_FAMILY_ENV
            ),
            None => profile.describe(),
        },
        limits: o.limits,
        probes,
        contradictions,
        profile: profile_note,
        timing,
        kernels,
        training,
        failures,
        ok,
        verdict,
    })
}

/// The device the kernels are checked on: the Neural Engine when one
/// opens (possibly the stand-in runtime), else the simulator; with a line
/// saying which.
fn open_device(stand_in: bool) -> (&'static str, String, Option<ane::AneDevice>) {
    match ane::AneDevice::open() {
        Ok(d) => {
            let note = match std::env::var_os(ane::apple::RUNTIME_ENV).filter(|_| stand_in) {
                Some(p) => format!(
                    "AneDevice over the stand-in runtime {} (a testing aid, not the Neural Engine)",
                    PathBuf::from(p).display()
                ),
                None => {
                    "AneDevice: the Apple Neural Engine through AppleNeuralEngine.framework".into()
                }
            };
            ("ane", note, Some(d))
        }
        Err(e) => (
            "ane-sim",
            format!("the simulator stands in as the device: {e}"),
            None,
        ),
    }
}

/// The family's limits probed on `device` against `expected`, the
/// contradictions, and the profile saved for later runs (with a line
/// saying where, or why not).
fn probe_family(
    device: &str,
    expected: &ane::family::Limits,
    family: Option<ane::family::Family>,
    timing: Option<ane::family::Measured>,
    failures: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> (Option<ane::probes::ProbeReport>, Vec<String>, String) {
    let probes = match device {
        "ane" => ane::AneDevice::open()
            .map(|d| ane::probes::run(&mut d.with_rules(ane::probes::probe_rules()), expected))
            .map_err(|e| e.to_string()),
        _ => SimDevice::from_env()
            .map(|mut d| ane::probes::run(&mut d, expected))
            .map_err(|e| e.to_string()),
    };
    match probes {
        Ok(p) => {
            // The simulator playing no family checks programs against every
            // family's limits at once but plays none of their numeric
            // faults: a difference there is the simulator's, not the table's.
            let unplayed = device != "ane" && family.is_none();
            let differs = match unplayed {
                true => " — the simulator plays no family's faults (--sim-family picks one)",
                false => " — contradicts the table",
            };
            for r in &p.results {
                progress(&format!(
                    "probe {:<15} {} (table: {}){}",
                    r.probe,
                    r.measured,
                    r.expected,
                    if r.agrees { "" } else { differs }
                ));
            }
            let contradictions: Vec<String> = p
                .results
                .iter()
                .filter(|r| !r.agrees && !unplayed)
                .map(|r| {
                    format!(
                        "{}: measured {}, the table says {}",
                        r.probe, r.measured, r.expected
                    )
                })
                .collect();
            let saved = ane::family::SavedProfile {
                format: ane::family::PROFILE_FORMAT,
                family,
                chip: ane::family::chip_key(),
                device: device.into(),
                limits: p.limits,
                measured_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                timing,
            };
            let note = match ane::family::profile_path() {
                // The simulator plays a family's table row back: saving it
                // would make later runs say the chip was measured.
                _ if device != "ane" => "not saved: measured on the simulator, which says nothing about a chip (ANETRAIN_ANE_FAMILY or --sim-family pick a family's limits)".to_string(),
                _ if std::env::var_os(ane::family::MAX_DIM_ENV).is_some() => format!(
                    "not saved: {} is set, so the axis caps measured are its",
                    ane::family::MAX_DIM_ENV
                ),
                Some(path) => match ane::family::save(&saved, &path) {
                    Ok(()) => format!(
                        "saved to {} (later runs build kernels to it)",
                        path.display()
                    ),
                    Err(e) => format!("not saved: {e}"),
                },
                None => "not saved: no configuration directory (set ANETRAIN_CONFIG_DIR)".into(),
            };
            progress(&format!("device profile {note}"));
            (Some(p), contradictions, note)
        }
        Err(e) => {
            failures.push(format!("probes: {e}"));
            (None, vec![], "not measured".into())
        }
    }
}

/// Every kernel (tile-sized where the plan tiles it) on the device against
/// the simulator: compile and evaluation times, relative error.
fn check_kernels(
    req: &DoctorRequest,
    plan: Option<&crate::kernels::tiling::Plan>,
    full: &Shape,
    o: &KernelOptions,
    ane: Option<ane::AneDevice>,
    failures: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<Vec<KernelResult>> {
    let mut rng = Rng::new(1);
    let mut sim = SimDevice::new();
    let mut kernels = vec![];
    // One device for all kernels, as a training run has; each program is
    // dropped (unloaded) after its check.
    let mut ane_dev = ane;
    let mut sim_dev = SimDevice::from_env()?;
    for kind in KernelKind::ALL {
        let s = plan.map_or(*full, |p| p.of(kind).shape);
        let mut r = match ane_dev.as_mut() {
            Some(d) => kernel_on(d, &mut sim, kind, &s, o, req.evals, &mut rng),
            None => kernel_on(&mut sim_dev, &mut sim, kind, &s, o, req.evals, &mut rng),
        };
        r.tiles = plan.map_or(1, |p| p.of(kind).tiles);
        if let Some(e) = &r.error {
            failures.push(format!("kernel {}: {e}", r.kernel));
        } else if let Some(err) = r.max_rel_error.filter(|x| x.is_nan() || *x > KERNEL_TOL) {
            failures.push(format!(
                "kernel {}: max relative error {err:.2e} against the simulator (tolerance {KERNEL_TOL:.0e})",
                r.kernel
            ));
        }
        progress(&format!(
            "kernel {:<17} {}",
            r.kernel,
            match (&r.error, r.compile_ms, r.eval_ms_median, r.max_rel_error) {
                (Some(e), ..) => format!("FAILED: {e}"),
                (None, Some(c), Some(t), Some(x)) =>
                    format!("compile {c:.0} ms, eval {t:.2} ms, rel. error {x:.1e}"),
                _ => "incomplete".into(),
            }
        ));
        kernels.push(r);
    }
    // The device is closed before training opens its own.
    drop(ane_dev);
    Ok(kernels)
}

/// A few training steps on the device and on the simulator, side by side.
fn train_side_by_side(
    req: &DoctorRequest,
    device: &str,
    failures: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> TrainingResult {
    let backend = if device == "ane" {
        Backend::Ane
    } else {
        Backend::AneSim
    };
    let dev = losses(req, backend, scratch("device"));
    let sim = losses(req, Backend::AneSim, scratch("sim"));
    let mut t = TrainingResult {
        steps: req.steps,
        device_losses: dev.clone().unwrap_or_default(),
        sim_losses: sim.clone().unwrap_or_default(),
        max_rel_diff: None,
        error: None,
    };
    match (dev, sim) {
        (Ok(d), Ok(s)) => {
            let diff = d
                .iter()
                .zip(&s)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
                .fold(
                    0f64,
                    |m, x| if x.is_nan() { f64::INFINITY } else { m.max(x) },
                );
            t.max_rel_diff = Some(diff);
            if diff.is_nan() || diff > LOSS_TOL || d.len() != s.len() {
                failures.push(format!(
                        "training: device losses differ from the simulator's by up to {diff:.2e} (tolerance {LOSS_TOL:.0e})"
                    ));
            }
        }
        (Err(e), _) => {
            failures.push(format!("training on {device}: {e}"));
            t.error = Some(e);
        }
        (_, Err(e)) => {
            failures.push(format!("training on ane-sim: {e}"));
            t.error = Some(e);
        }
    }
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    progress(&format!(
        "training {} steps: device {} | ane-sim {}",
        req.steps,
        show(&t.device_losses),
        show(&t.sim_losses)
    ));
    t
}

/// The report's last line.
fn verdict(
    req: &DoctorRequest,
    device: &str,
    stand_in: bool,
    trained: bool,
    failures: &[String],
) -> String {
    match (failures.is_empty(), device) {
        (true, "ane") if stand_in => format!(
            "PASS against the stand-in runtime: AneDevice drove every kernel of {} and training as on the simulator (this is not the Neural Engine)",
            req.model
        ),
        (true, "ane") => format!(
            "PASS: every kernel of {} ran on the device within {KERNEL_TOL:.0e} of the simulator{}",
            req.model,
            if trained { ", and training tracked it" } else { "" }
        ),
        (true, _) => "PASS on the simulator only: no Neural Engine here, so nothing about the device was shown".into(),
        (false, _) => format!("FAIL: {} problem(s); the first: {}", failures.len(), failures[0]),
    }
}

impl Report {
    /// A short markdown summary: host, a table of kernels, the losses, the
    /// verdict. (One template read top to bottom, as the report reads.)
    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        let mut m = String::new();
        let h = &self.host;
        let _ = writeln!(m, "## anetrain doctor {}\n", self.anetrain_version);
        let _ = writeln!(
            m,
            "* host: {} ({}, {}), {} CPU threads\n* device: **{}** — {}\n* matrix multiply: {}\n* model: {} at seq {}\n* chip family: {}\n* axis caps: spatial {}, channel {} ({} overrides); a tiled kernel's row checks one tile\n",
            h.chip, h.os_version, h.arch, h.cpu_threads, self.device, self.device_note, self.matmul, self.model, self.seq,
            self.family, self.limits.max_spatial, self.limits.max_channel, ane::family::MAX_DIM_ENV
        );
        if let Some(p) = &self.probes {
            let _ = writeln!(
                m,
                "Probes ({} of at most {} compiles; {}):\n\n| probe | question | measured | family table | |\n|---|---|---|---|---|",
                p.compiles,
                ane::probes::COMPILE_BUDGET,
                if self.device == "ane" { "on the device" } else { "on the simulator: nothing about hardware is shown" }
            );
            for r in &p.results {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} | {} |",
                    r.probe,
                    r.question,
                    r.measured.replace('|', "/"),
                    r.expected,
                    match (
                        r.agrees,
                        self.contradictions
                            .iter()
                            .any(|c| c.starts_with(&format!("{}:", r.probe)))
                    ) {
                        (true, _) => "agrees",
                        (false, true) => "**contradicts the table**",
                        (false, false) => "differs: the simulator plays no family's faults",
                    }
                );
            }
            let _ = writeln!(m, "\nDevice profile: {}\n", self.profile);
        }
        let t = &self.timing;
        let _ = writeln!(
            m,
            "Timing for the cost model (docs/benchmarks.md; table row: {}): {}\n\n| constant | table | measured |\n|---|---:|---:|",
            t.family.as_deref().unwrap_or("m1, no family known"),
            t.note
        );
        type Get = fn(&TimingRow) -> f64;
        let rows: [(&str, Get, usize); 5] = [
            ("dispatch per evaluation (ms)", |r| r.dispatch_ms, 3),
            (
                "η, dynamic-weight matmul / compiled GEMM",
                |r| r.dynamic_efficiency,
                2,
            ),
            ("surface writes (GB/s)", |r| r.write_gbs, 1),
            ("compile per program (ms)", |r| r.compile_ms, 0),
            (
                "scratch share (intermediates counted as surfaces; table: assumed)",
                |r| r.scratch_share,
                2,
            ),
        ];
        for (name, get, p) in rows {
            let _ = writeln!(
                m,
                "| {name} | {:.p$} | {} |",
                get(&t.table),
                t.measured
                    .as_ref()
                    .map_or("not measured".into(), |r| format!("{:.p$}", get(r)))
            );
        }
        let _ = writeln!(m);
        let _ = writeln!(
            m,
            "| kernel | tiles | input KiB | output KiB | compile ms | eval ms (median) | max rel. error vs ane-sim | status |\n|---|---:|---:|---:|---:|---:|---:|---|"
        );
        let f = |v: Option<f64>, p: usize| v.map_or("—".to_string(), |x| format!("{x:.p$}"));
        for k in &self.kernels {
            let status = match (&k.error, k.max_rel_error) {
                (Some(e), _) => format!("FAILED: {e}"),
                (None, Some(x)) if x <= KERNEL_TOL => "ok".into(),
                _ => "out of tolerance".into(),
            };
            let _ = writeln!(
                m,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                k.kernel,
                k.tiles,
                k.input_bytes / 1024,
                k.output_bytes / 1024,
                f(k.compile_ms, 0),
                f(k.eval_ms_median, 2),
                k.max_rel_error.map_or("—".into(), |x| format!("{x:.1e}")),
                status.replace('|', "/")
            );
        }
        if let Some(t) = &self.training {
            let _ = writeln!(
                m,
                "\n| step | loss on the device ({}) | loss on ane-sim |\n|---:|---:|---:|",
                self.device
            );
            for i in 0..t.device_losses.len().max(t.sim_losses.len()) {
                let g = |v: &[f64]| v.get(i).map_or("—".into(), |x| format!("{x:.4}"));
                let _ = writeln!(
                    m,
                    "| {} | {} | {} |",
                    i + 1,
                    g(&t.device_losses),
                    g(&t.sim_losses)
                );
            }
            if let Some(e) = &t.error {
                let _ = writeln!(m, "\ntraining stopped: {e}");
            }
        }
        if !self.failures.is_empty() {
            let _ = writeln!(m, "\nProblems:\n");
            for l in &self.failures {
                let _ = writeln!(m, "* {l}");
            }
        }
        let _ = writeln!(m, "\n**{}**", self.verdict);
        m
    }
}
