//! What a Neural Engine evaluation costs, per chip family: the numbers a
//! training step's timeline (anetrain's `plan::timeline`) is played with.
//!
//!   evaluation = dispatch + flop / (η · gemm_rate(N)) · cliff(W)
//!   N = ∛(flop/2) (the GEMM of equal work), W = the surfaces' bytes
//!
//! Every constant is a published measurement, cited beside it; a family
//! nobody has measured takes the most conservative published row and says
//! so ([`Rates::unmeasured`]). Two numbers are not taken from a source but
//! fitted, on the M4 figures only ([`FITTED`], re-derived by a test): η,
//! what dynamic weights (weights read from the input surface, not compiled
//! in) leave of a compiled GEMM's rate, and the host's per-evaluation
//! overhead around a dispatch (surface locks, fp16 conversion beyond the
//! copy). `anetrain doctor` measures dispatch, a dynamic-weight matmul and
//! the staging bandwidth on a Mac and its profile replaces the table's
//! values ([`Measured`]).

use serde::{Deserialize, Serialize};

use crate::family::{Family, Measured, ScratchTiming};

/// `(N, milliseconds)` of an N×N×N fp16 GEMM on the engine (2N³ FLOPs),
/// dispatch included, or of an fp32 `sgemm` on the host's CPU.
pub type GemmTable = &'static [(f64, f64)];

// ANEForge `bench/results/rooflines/roofline-apple-m1-MacBookAir10_1-bb9e71be3ae6-22b6e4fa.json`
// ("perf_rooflines" → "gemm", field `lat_ms`; Apple M1, MacBook Air, macOS 15.6.1).
const M1_ANE_GEMM: GemmTable = &[
    (512.0, 0.3317),
    (1024.0, 0.9933),
    (2048.0, 4.9607),
    (4096.0, 31.739),
];
const M1_CPU_GEMM: GemmTable = &[
    (512.0, 0.2063),
    (1024.0, 1.8999),
    (2048.0, 19.869),
    (4096.0, 162.02),
];
// ANEForge `bench/results/rooflines/roofline-apple-m4-Mac16_12-d4109cd41a75-6779bad2.json`
// (Apple M4, MacBook Air, macOS 26.2): past 4096 the working set leaves
// the engine's memory and the rate falls by a third.
const M4_ANE_GEMM: GemmTable = &[
    (512.0, 0.2086),
    (1024.0, 0.7459),
    (2048.0, 3.5133),
    (4096.0, 25.286),
    (6144.0, 135.29),
    (8192.0, 313.50),
];
const M4_CPU_GEMM: GemmTable = &[
    (512.0, 0.2211),
    (1024.0, 1.5034),
    (2048.0, 11.957),
    (4096.0, 91.598),
];
// ANEForge `bench/results/rooflines/roofline-apple-m5-Mac17_3-019d3ac27339-dd5e5c95.json`
// (Apple M5, Mac17,3, macOS 26.5.2). Its CPU row at 512 (0.77 ms, a
// quarter of its neighbours' rate) is a cold start and left out: the 1024
// row's rate holds below it. Its engine rows (512: 0.1162, 1024: 0.4339,
// 2048: 1.9965, 4096: 18.930 ms) are a compiled GEMM's and are not used
// (see `Rates::of`).
const M5_CPU_GEMM: GemmTable = &[(1024.0, 1.1453), (2048.0, 8.2080), (4096.0, 67.082)];

// The other M1 ANEForge publishes: `roofline-apple-m1-MacBookPro17_1-dcf5b8a7dd09-4b3e72c0.json`
// (Apple M1, MacBook Pro, macOS 26.5.2), 1.5–2.3× slower than the Air's
// engine at every size and the slowest engine curve published, which the
// unmeasured M3 takes. The sources disagree, so M1 predictions show both
// ([`Rates::other_published`]).
const M1_PRO17_ANE_GEMM: GemmTable = &[
    (512.0, 0.73929),
    (1024.0, 2.26083),
    (2048.0, 9.71204),
    (4096.0, 50.9442),
];
const M1_PRO17_CPU_GEMM: GemmTable = &[
    (512.0, 0.34858),
    (1024.0, 1.86217),
    (2048.0, 18.5352),
    (4096.0, 158.707),
];
// ANEForge `roofline-apple-m2-pro-Mac14_12-723396ad9091-370b3d53.json`
// (Apple M2 Pro, Mac mini, macOS 26.5.2): the one M2 engine curve
// published, between the two M1s'. Its CPU rows (15.5 ms at 1024, 8× the M1's) are not used: the M2 and
// M3 take the M1 Air's host curve.
const M2_PRO_ANE_GEMM: GemmTable = &[
    (512.0, 0.66742),
    (1024.0, 2.06783),
    (2048.0, 9.56129),
    (4096.0, 42.1142),
];
// ANEForge `roofline-apple-m4-max-Mac16_6-c77b1414be16-d11ec8da.json`
// (Apple M4 Max): the chip rustane's published step ran on
// ([`Rates::m4_max`]; the M4 family's table keeps the base M4's curve).
const M4_MAX_ANE_GEMM: GemmTable = &[
    (512.0, 0.13908),
    (1024.0, 0.37083),
    (2048.0, 1.93658),
    (4096.0, 20.5641),
    (6144.0, 123.737),
    (8192.0, 296.526),
];
const M4_MAX_CPU_GEMM: GemmTable = &[
    (512.0, 0.31229),
    (1024.0, 0.68879),
    (2048.0, 5.23313),
    (4096.0, 45.8928),
    (6144.0, 136.135),
    (8192.0, 328.493),
];

/// The two fitted numbers (see the module comment), from maderix/ANE's
/// dynamic pipeline on the M4 (`training/README.md`: Stories110M 111 ms,
/// Qwen3-0.6B 412 ms at seq 256, ten evaluations a layer) costed with the
/// seed's own programs and host work. PR #35 of
/// maderix/ANE measured a dynamic-weight matmul at 4096 on an M5 at
/// 1.66–1.76 TFLOP/s, 0.23–0.24 of ANEForge's compiled GEMM at 4096 on
/// the same chip: an independent check of η, not used to fit it, which
/// disagrees with the fit by almost 3× (at 4096 the dynamic weights alone
/// are 32 MB, past the cliff, where our kernels at seq ≤ 1024 never go:
/// `doctor` measures η at our own shapes).
pub const FITTED: Fitted = Fitted {
    dynamic_efficiency: 0.563,
    host_ms_per_eval: 0.122,
};

/// The name [`Rates::unmeasured`] gives the scratch share (assumed, on
/// every family, until `doctor` measures it).
pub const SCRATCH_SHARE: &str = "scratch share";

/// The name [`Rates::unmeasured`] gives the power readings of a family no
/// source has read (`doctor` does not measure power).
pub const POWER: &str = "power";

/// What each name in [`Rates::unmeasured`] stands for, and what stands in
/// for it: printed under a prediction that carries one.
pub const UNMEASURED: &[(&str, &str)] = &[
    (
        "gemm curve",
        "no published GEMM curve of this family's engine: the M1 MacBook Pro's, the slowest published",
    ),
    (
        "dispatch",
        "no published dispatch time: the M1's 0.23 ms, the slowest published",
    ),
    (
        "on-chip bytes",
        "no published working-set threshold: the M1's 2 MB, the smallest published",
    ),
    (
        "compile",
        "no published compile time: the M1 Pro's, the slowest published",
    ),
    (
        POWER,
        "no published power readings of this family: the highest published, the M5's (8.5 W while its engine runs, 12.5 W while its CPU does)",
    ),
    (
        SCRATCH_SHARE,
        "whether a program's intermediate matrices (the fused attention backward's P, dP, dS) count in its working set as its surfaces do: no source has measured it, so they all count (the slower prediction); `anetrain doctor` on the Mac measures it and its profile replaces the assumption",
    ),
];

/// Numbers fitted to whole-step measurements rather than measured alone.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fitted {
    /// η: a dynamic-weight program's rate over a compiled GEMM's of equal work.
    pub dynamic_efficiency: f64,
    /// Host time around each evaluation besides copying bytes (ms).
    pub host_ms_per_eval: f64,
}

/// What a family's Neural Engine and host cost, every number cited.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    pub family: Family,
    /// Per evaluation, whatever the program does (ms).
    pub dispatch_ms: f64,
    /// The engine's compiled fp16 GEMM by size, dispatch included.
    #[serde(skip)]
    pub ane_gemm: GemmTable,
    /// The dispatch inside each `ane_gemm` measurement (the table's, kept
    /// when `doctor`'s measured dispatch replaces `dispatch_ms`).
    pub gemm_dispatch_ms: f64,
    /// The host's fp32 `sgemm` (Accelerate) by size.
    #[serde(skip)]
    pub cpu_gemm: GemmTable,
    /// Bytes of surfaces a program may touch before its rate falls.
    pub on_chip_bytes: f64,
    /// Past `on_chip_bytes`, the rate falls as (bytes / on_chip)^-this.
    pub cliff_exponent: f64,
    /// The share of a program's intermediate matrices (its scratch, such
    /// as the fused attention backward's P, dP and dS) counted in its
    /// working set beside its surfaces. No source measures whether the
    /// compiler keeps them on chip: the table assumes they all count (1,
    /// the slower prediction), and `doctor`'s scratch probe measures it
    /// ([`Measured::scratch`]).
    pub scratch_share: f64,
    /// Host copy into or out of a surface (GB/s), and host elementwise
    /// passes over f32 activations (norms, softmax, AdamW).
    pub copy_gbs: f64,
    /// Compiling and loading one program (ms).
    pub compile_ms: f64,
    /// Active package power (W) while the engine runs a GEMM of our
    /// programs' sizes, and while the CPU runs one: what a step's device
    /// time and its host time draw ([`Rates::joules`]).
    pub ane_package_w: f64,
    pub cpu_package_w: f64,
    pub fitted: Fitted,
    /// The constants no source measured on this family (each took the
    /// most conservative published value).
    pub unmeasured: Vec<&'static str>,
}

/// One evaluation's cost, split as the timeline reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct EvalCost {
    pub dispatch_ms: f64,
    pub device_ms: f64,
}

impl Rates {
    /// The table's row for `family`.
    pub fn of(family: Family) -> Rates {
        let (ane_gemm, cpu_gemm) = match family {
            Family::M1 => (M1_ANE_GEMM, M1_CPU_GEMM),
            Family::M2 => (M2_PRO_ANE_GEMM, M1_CPU_GEMM),
            // Unmeasured: the slowest engine curve published, at every size.
            Family::M3 => (M1_PRO17_ANE_GEMM, M1_PRO17_CPU_GEMM),
            Family::M4 => (M4_ANE_GEMM, M4_CPU_GEMM),
            // The M5's engine is the M4's H16 and trains no faster: its
            // `ane_ms` is "essentially flat across M4/M5/M5 Max", the step's
            // gains coming from the CPU (maderix/ANE PR #50), and its ANE
            // benchmark runs 9.1–9.8 ms against the M4 Pro's 8.9 and M4
            // Max's 10.2 (maderix/ANE `benchmarks/ANE_BENCHMARK_REPORT.md`).
            // ANEForge's M5 GEMM curve (1.3–1.75× the M4's) is a compiled
            // GEMM's, not what training measured: not used.
            Family::M5 => (M4_ANE_GEMM, M5_CPU_GEMM),
        };
        let mut unmeasured = vec![];
        if family == Family::M3 {
            unmeasured.extend(["gemm curve", POWER]);
        }
        if matches!(family, Family::M2 | Family::M3) {
            unmeasured.extend(["dispatch", "on-chip bytes"]);
        }
        if family == Family::M2 {
            unmeasured.push("compile");
        }
        unmeasured.push(SCRATCH_SHARE);
        let dispatch_ms = match family {
            Family::M1 | Family::M2 | Family::M3 => 0.23,
            Family::M4 => 0.095,
            Family::M5 => 0.08,
        };
        Rates {
            family,
            // M1: "a 0.23 ms floor" (the ANE guide, arXiv 2606.22283,
            // roofline chapter), also the value for the unmeasured M2/M3.
            // M4: 0.095 of 0.101 ms is XPC + IOKit (maderix, "Inside the M4
            // Apple Neural Engine"; rustane README "~0.095ms"). M5: 0.08 ms
            // averaged over ten evaluations at QoS 21, the QoS our runtime
            // asks for (0.06–0.08 at QoS 1–63, 0.11 at QoS 0: maderix/ANE
            // `training/m5result.md`, test_qos_sweep).
            dispatch_ms,
            gemm_dispatch_ms: dispatch_ms,
            ane_gemm,
            cpu_gemm,
            // M4: "~32 MB SRAM"; past it "performance drops 30%" (ncdrone/
            // rustane's ANE capability tests, relaying maderix's "Inside the
            // M4 Apple Neural Engine", part 2; AmiraniLabs/libane
            // `src/runtime/ane_runtime.mm`: "exceeds ~32 MB SRAM; expect ~30%
            // throughput drop"). (W/32 MB)^-0.515 is that 30% at twice the
            // knee; past it the same law is our choice (no source measured
            // beyond; a GEMM's own fall past its working set, ANEForge's M4
            // at 8192, is in its curve). maderix/ANE PR #25's "12.5 MB" is
            // not a knee: it is GFLOPS per MB of compiled weights, and most
            // of its points past it run faster. The M5 is the same H16
            // engine (maderix/ANE `benchmarks/ANE_BENCHMARK_REPORT.md`,
            // "M5"). M1: a "2 MB working-set threshold" (the ANE guide); the
            // M2/M3 take it, the most conservative, and the same fall.
            on_chip_bytes: match family {
                Family::M4 | Family::M5 => 32e6,
                _ => 2.0e6,
            },
            cliff_exponent: 0.515,
            scratch_share: 1.0,
            // 2560×2560 fp16 weights (13.1 MB) tiled and written into a
            // surface in 0.39 ms, 33.6 GB/s (apple-neural-engine-field-guide
            // README, measured on an M3 Max; its plain fp16 copy, 0.27 ms,
            // leaves out the tiling our staging does). No other family is
            // published; 33.6 GB/s is within every family's DRAM bandwidth
            // (the base M1's is 68 GB/s).
            copy_gbs: 13.1e6 / 0.39e-3 / 1e9,
            // The static pipeline recompiles its 60 weight-bearing kernels
            // every 10 steps: M1 Pro 7.9–8.5 s, M3 Ultra ~3.7 s, M4 Pro ~3.5 s,
            // M5 3.2–3.4 s (maderix/ANE `benchmarks/ANE_BENCHMARK_REPORT.md`,
            // "Compile/10"), per kernel. The M2 takes the M1's.
            compile_ms: match family {
                Family::M1 | Family::M2 => 8.2e3 / 60.0,
                Family::M3 => 3.7e3 / 60.0,
                Family::M4 => 3.5e3 / 60.0,
                Family::M5 => 3.3e3 / 60.0,
            },
            // powermetrics' active package power in ANEForge's rooflines
            // (the files the GEMM curves above come from, `power` →
            // `active_pkg_W`), the mean of the 1024 and 2048 GEMM rows, our
            // programs' sizes: the engine's row (its rail and the CPU thread
            // feeding it) and the CPU's `sgemm` row. M1 (Air): 5.09, 6.40 W
            // and 7.88, 5.60 W; M2 Pro: 2.66, 1.59 W for its engine, its CPU
            // rows not used (see its curve), the M1's in their place; M4:
            // 4.87, 5.26 W and 8.97, 8.71 W; M5: 8.76, 8.18 W and 13.23,
            // 11.76 W. The M3, unmeasured, takes the highest published.
            ane_package_w: match family {
                Family::M1 => (5.0865 + 6.396) / 2.0,
                Family::M2 => (2.664 + 1.5895) / 2.0,
                Family::M4 => (4.874 + 5.258) / 2.0,
                Family::M3 | Family::M5 => (8.7625 + 8.1835) / 2.0,
            },
            cpu_package_w: match family {
                Family::M1 | Family::M2 => (7.881 + 5.597) / 2.0,
                Family::M4 => (8.9725 + 8.7145) / 2.0,
                Family::M3 | Family::M5 => (13.2275 + 11.757) / 2.0,
            },
            fitted: FITTED,
            unmeasured,
        }
    }

    /// The M4 family's row on the M4 Max's curves (ANEForge): what a step
    /// published on an M4 Max is costed with.
    pub fn m4_max() -> Rates {
        Rates {
            ane_gemm: M4_MAX_ANE_GEMM,
            cpu_gemm: M4_MAX_CPU_GEMM,
            ..Rates::of(Family::M4)
        }
    }

    /// Where published curves of one family disagree, the row on the other
    /// curve, named: the M1's MacBook Pro (the table's is the MacBook
    /// Air's, the faster).
    pub fn other_published(family: Family) -> Option<(&'static str, Rates)> {
        match family {
            Family::M1 => Some((
                "the M1 MacBook Pro's curve",
                Rates {
                    ane_gemm: M1_PRO17_ANE_GEMM,
                    cpu_gemm: M1_PRO17_CPU_GEMM,
                    ..Rates::of(Family::M1)
                },
            )),
            _ => None,
        }
    }

    /// The table's row with `fitted` in place of [`FITTED`] (for the fit).
    pub fn with_fitted(mut self, fitted: Fitted) -> Rates {
        self.fitted = fitted;
        self
    }

    /// The row with what `doctor` measured in place of the table's
    /// dispatch, staging bandwidth and compile time, and η re-derived from
    /// the measured matmuls (their compute time against the curve's).
    pub fn with_measured(mut self, m: &Measured) -> Rates {
        // The curve nets out the table's own dispatch: η first.
        let ratios: Vec<f64> = m
            .matmuls
            .iter()
            .filter(|(f, ms)| *f > 0.0 && *ms > m.dispatch_ms)
            .map(|&(f, ms)| self.compiled_ms(f) / (ms - m.dispatch_ms))
            .collect();
        if !ratios.is_empty() {
            self.fitted.dynamic_efficiency = ratios.iter().sum::<f64>() / ratios.len() as f64;
        }
        self.dispatch_ms = m.dispatch_ms;
        self.copy_gbs = m.write_gbs;
        self.compile_ms = m.compile_ms;
        // `doctor` times the chip; it does not read its power.
        self.unmeasured.retain(|&u| u == POWER);
        match &m.scratch {
            Some(p) => self.scratch_share = self.scratch_share_of(p),
            // A profile from before the scratch probe.
            None => self.unmeasured.push(SCRATCH_SHARE),
        }
        self
    }

    /// The scratch share in [0, 1] for which the model gives the probe's
    /// measured time (0 where it ran no slower than its surfaces alone
    /// predict, 1 where it ran as slowly as all its scratch counting or
    /// slower); by bisection, the time growing with the share.
    fn scratch_share_of(&self, p: &ScratchTiming) -> f64 {
        let at = |share: f64| {
            let r = Rates {
                scratch_share: share,
                ..self.clone()
            };
            r.dispatch_ms
                + r.evaluation_of(p.flop, p.surface_bytes, p.scratch_bytes)
                    .device_ms
        };
        if p.ms <= at(0.0) {
            return 0.0;
        }
        if p.ms >= at(1.0) {
            return 1.0;
        }
        let (mut lo, mut hi) = (0.0, 1.0);
        for _ in 0..50 {
            let mid = 0.5 * (lo + hi);
            match at(mid) < p.ms {
                true => lo = mid,
                false => hi = mid,
            }
        }
        0.5 * (lo + hi)
    }

    /// Milliseconds of a compiled GEMM's compute for `flop` (dispatch
    /// taken out), from the family's curve at the GEMM of equal work.
    pub fn compiled_ms(&self, flop: f64) -> f64 {
        let n = (flop / 2.0).cbrt();
        let rate = rate_at(self.ane_gemm, n, self.gemm_dispatch_ms);
        flop / rate
    }

    /// One evaluation of a dynamic-weight program of `flop` whose surfaces
    /// hold `surface_bytes` and whose intermediate matrices hold
    /// `scratch_bytes` ([`Rates::scratch_share`] of them counted beside
    /// the surfaces).
    pub fn evaluation_of(&self, flop: f64, surface_bytes: f64, scratch_bytes: f64) -> EvalCost {
        self.evaluation(flop, surface_bytes + self.scratch_share * scratch_bytes)
    }

    /// One evaluation of a dynamic-weight program of `flop` whose input and
    /// output surfaces hold `surface_bytes`.
    pub fn evaluation(&self, flop: f64, surface_bytes: f64) -> EvalCost {
        // A GEMM of equal work already touches 3·N² fp16 values; a program
        // whose surfaces are larger pays the cliff on the excess.
        let n = (flop / 2.0).cbrt();
        let gemm_bytes = 6.0 * n * n;
        let over = surface_bytes / gemm_bytes.max(self.on_chip_bytes);
        let cliff = over.max(1.0).powf(self.cliff_exponent);
        EvalCost {
            dispatch_ms: self.dispatch_ms,
            device_ms: self.compiled_ms(flop) / self.fitted.dynamic_efficiency * cliff,
        }
    }

    /// Host fp32 matrix products of `flop` (one `sgemm` of equal work).
    pub fn host_gemm_ms(&self, flop: f64) -> f64 {
        if flop <= 0.0 {
            return 0.0;
        }
        let n = (flop / 2.0).cbrt();
        flop / rate_at(self.cpu_gemm, n, 0.0)
    }

    /// Joules of a step that keeps the engine busy `device_ms` (its
    /// dispatches included) and the CPU `host_ms` (staging and host work
    /// on the critical path), at the family's active package power. Work
    /// the host does beside the engine (weight gradients on the worker)
    /// draws more than this says.
    pub fn joules(&self, device_ms: f64, host_ms: f64) -> f64 {
        (self.ane_package_w * device_ms + self.cpu_package_w * host_ms) / 1e3
    }

    /// Host copies or elementwise passes over `bytes`.
    pub fn copy_ms(&self, bytes: f64) -> f64 {
        bytes / (self.copy_gbs * 1e6)
    }
}

/// FLOPs per millisecond of the table's GEMM at size `n`, `overhead_ms`
/// (the dispatch inside each measurement) taken out: interpolated in
/// log N between rows, the end rows' rates beyond them.
fn rate_at(table: GemmTable, n: f64, overhead_ms: f64) -> f64 {
    let rate = |&(size, ms): &(f64, f64)| {
        let compute = (ms - overhead_ms).max(0.1 * ms);
        2.0 * size * size * size / compute
    };
    let first = table.first().expect("a GEMM table has rows");
    let last = table.last().expect("a GEMM table has rows");
    if n <= first.0 {
        return rate(first);
    }
    if n >= last.0 {
        return rate(last);
    }
    let i = table
        .iter()
        .position(|r| r.0 >= n)
        .unwrap_or(table.len() - 1);
    let (a, b) = (&table[i - 1], &table[i]);
    let t = (n.ln() - a.0.ln()) / (b.0.ln() - a.0.ln());
    // Interpolate the rate's logarithm: rates change by factors.
    (rate(a).ln() * (1.0 - t) + rate(b).ln() * t).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_curves_reproduce_their_sources() {
        // ANEForge's M4 at 2048: 17.18 GFLOP in 3.513 ms; with the
        // dispatch taken out and added back, the table returns its row.
        let m4 = Rates::of(Family::M4);
        let f = 2.0 * 2048f64.powi(3);
        let ms = m4.compiled_ms(f) + m4.dispatch_ms;
        assert!((ms - 3.5133).abs() < 1e-9, "{ms}");
        // Between rows the rate lies between the rows' rates.
        let r = |n: f64| 2.0 * n.powi(3) / m4.compiled_ms(2.0 * n.powi(3));
        assert!(r(1500.0) > r(1024.0) && r(1500.0) < r(2048.0));
        // The host's sgemm: 4096 on an M1 in 162 ms.
        let m1 = Rates::of(Family::M1);
        assert!((m1.host_gemm_ms(2.0 * 4096f64.powi(3)) - 162.02).abs() < 1e-6);
    }

    #[test]
    fn surfaces_past_the_on_chip_memory_slow_an_evaluation() {
        let m4 = Rates::of(Family::M4);
        let f = 2.0 * 512f64.powi(3);
        let small = m4.evaluation(f, 1e6);
        let big = m4.evaluation(f, 64e6);
        // Twice the 32 MB knee: "performance drops 30%".
        let rate = small.device_ms / big.device_ms;
        assert!((rate - 0.7).abs() < 2e-3, "{rate}");
        assert_eq!(m4.evaluation(f, 31e6), small, "below the knee: no fall");
        assert_eq!(small.dispatch_ms, 0.095);
    }

    /// Every name a family's row can give as unmeasured is explained.
    #[test]
    fn every_unmeasured_name_is_explained() {
        for f in Family::ALL {
            for name in Rates::of(f).unmeasured {
                assert!(UNMEASURED.iter().any(|(n, _)| *n == name), "{name}");
            }
        }
    }

    #[test]
    fn unmeasured_families_say_so_and_are_no_faster_than_the_slowest_measured() {
        let (m1, m2) = (Rates::of(Family::M1), Rates::of(Family::M2));
        // Every family assumes the scratch share; the M2 takes more.
        assert_eq!(m1.unmeasured, [SCRATCH_SHARE]);
        assert!(m2.unmeasured.len() > 1 && m2.unmeasured.contains(&SCRATCH_SHARE));
        let f = 1e10;
        assert!(m2.compiled_ms(f) >= m1.compiled_ms(f));
        assert!(m2.dispatch_ms >= m1.dispatch_ms);
        // The M3, with no curve of its own, is no faster than any engine
        // curve published (it takes the slowest, the M1 MacBook Pro's);
        // the M1's two curves disagree, the table's is the faster.
        let (_, m1_pro) = Rates::other_published(Family::M1).unwrap();
        let m3 = Rates::of(Family::M3);
        for n in [512.0, 1024.0, 2048.0, 4096.0f64] {
            let f = 2.0 * n.powi(3);
            for r in [&m1, &m2, &Rates::of(Family::M4), &Rates::m4_max()] {
                assert!(m3.compiled_ms(f) >= 0.99 * r.compiled_ms(f), "{n}");
            }
            assert!(m1_pro.compiled_ms(f) > m1.compiled_ms(f), "{n}");
        }
        assert!(m3.unmeasured.contains(&"gemm curve") && !m2.unmeasured.contains(&"gemm curve"));
    }

    #[test]
    fn measured_constants_replace_the_table() {
        let m4 = Rates::of(Family::M4);
        let f = 2.0 * 1024f64.powi(3);
        // A matmul measured at twice the compiled curve's compute time: η = 0.5.
        let m = Measured {
            dispatch_ms: 0.2,
            matmuls: vec![(f, 0.2 + 2.0 * m4.compiled_ms(f))],
            write_gbs: 10.0,
            compile_ms: 40.0,
            scratch: None,
        };
        let r = m4.clone().with_measured(&m);
        assert!((r.fitted.dynamic_efficiency - 0.5).abs() < 1e-12);
        assert_eq!((r.dispatch_ms, r.copy_gbs, r.compile_ms), (0.2, 10.0, 40.0));
        assert!((r.copy_ms(1e7) - 1.0).abs() < 1e-12);
        assert_eq!(r.scratch_share, 1.0, "no probe: the table's assumption");
        assert_eq!(r.unmeasured, [SCRATCH_SHARE]);
    }

    /// The scratch probe's time gives back the share that predicts it:
    /// a time made with three quarters of the scratch counting reads as 0.75;
    /// one as fast as the surfaces alone as 0; one slower than all of it
    /// counting as 1. Its 64 MB of scratch (doctor's shape) moves the M4's
    /// prediction by more than 1.4×, so one run tells the cases apart.
    #[test]
    fn the_scratch_probe_measures_the_share_of_scratch_that_counts() {
        let m4 = Rates::of(Family::M4);
        // doctor's probe: d 128, 4096 × 4096 scores and probabilities.
        let (d, n) = (128.0, 4096.0);
        let (flop, surfaces, scratch) = (4.0 * n * n * d, 2.0 * d * 3.0 * n, 2.0 * 2.0 * n * n);
        let time = |share: f64| {
            let r = Rates {
                scratch_share: share,
                ..m4.clone()
            };
            r.dispatch_ms + r.evaluation_of(flop, surfaces, scratch).device_ms
        };
        assert!(
            time(1.0) > 1.4 * time(0.0),
            "{} vs {}",
            time(1.0),
            time(0.0)
        );
        let probe = |ms| Measured {
            dispatch_ms: m4.dispatch_ms,
            matmuls: vec![],
            write_gbs: m4.copy_gbs,
            compile_ms: m4.compile_ms,
            scratch: Some(ScratchTiming {
                flop,
                surface_bytes: surfaces,
                scratch_bytes: scratch,
                ms,
            }),
        };
        assert!(m4.clone().with_measured(&probe(1.0)).unmeasured.is_empty());
        let share = |ms| m4.clone().with_measured(&probe(ms)).scratch_share;
        // Shares that keep the working set under the knee cost alike; past
        // it the time tells the share.
        assert!((share(time(0.75)) - 0.75).abs() < 1e-9);
        assert_eq!(share(0.9 * time(0.0)), 0.0);
        assert_eq!(share(1.5 * time(1.0)), 1.0);
    }
}
