//! Neural Engine generations and what each is known to accept.
//!
//! Apple ships one ANE compiler for every chip; what differs between an M1
//! and an M5 is per-chip target data, and published measurements group the
//! chips into capability families (ANEForge `docs/cross-chip.md`, "The
//! family model" and "The M(n) = H(n+12) ladder"):
//!
//! | chip | ANE arch | family |
//! |---|---|---|
//! | M1 | H13 | A13 |
//! | M2 | H14 | A14 |
//! | M3 | H15 | A15 |
//! | M4 | H16 | A16 |
//! | M5 | H17s | A16 (A17/A18 add cores, no op capability) |
//!
//! Every limit is data in [`Family::limits`], its source cited beside it.
//! The limits in force ([`Profile::in_force`]) come, in order, from
//! `ANETRAIN_ANE_FAMILY`, a profile `anetrain doctor` measured and saved
//! on this machine, the CPU brand string on macOS, and otherwise the most
//! conservative row (every family's limits at once), which runs on any
//! chip: a program for a lower family runs on every higher one (ANEForge
//! `docs/cross-chip.md`, "Host detection and the env override" item 3).

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Names the family whose limits kernels are built for (`m1` … `m5`).
pub const FAMILY_ENV: &str = "ANETRAIN_ANE_FAMILY";
/// Makes the simulated device play a family's faults (`m1` … `m5`).
pub const SIM_FAMILY_ENV: &str = "ANETRAIN_SIM_FAMILY";
/// Directory holding the saved device profile (default: the user's
/// configuration directory, see [`profile_path`]).
pub const CONFIG_DIR_ENV: &str = "ANETRAIN_CONFIG_DIR";

/// An Apple Silicon generation, by its M-series chip.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    M1,
    M2,
    M3,
    M4,
    M5,
}

/// What a device accepts and where it computes wrong numbers: the numbers
/// the rules ([`crate::rules`]) measure programs against and the faults the
/// simulator plays.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest extent of a spatial axis (axes 2 and 3 of a rank-4 tensor,
    /// every axis of other ranks) and of a matmul contraction.
    pub max_spatial: usize,
    /// Largest extent of the channel axis (axis 1 of a rank-4 tensor).
    pub max_channel: usize,
    /// Largest tensor rank.
    pub max_rank: usize,
    /// Smallest width (last axis) of an input or output surface.
    pub min_width: usize,
    /// A matmul's contraction must be a multiple of this (1: any).
    pub inner_multiple: usize,
    /// A `slice_by_size` with a nonzero last-axis begin turns values above
    /// this magnitude into ±inf (`None`: exact).
    pub width_slice_clamp: Option<f32>,
    /// A matmul output above this magnitude becomes ±inf (`None`: fp16's
    /// own overflow at 65504).
    pub matmul_cliff: Option<f32>,
    /// Whether the compiler accepts `concat`.
    pub concat: bool,
}

/// The width-offset slice clamp, 65504 / 16: ANEForge
/// `docs/numeric-cliffs.md` "Width-offset slice saturation" and
/// `docs/cross-chip.md` "The h13 slice-saturation warning".
pub const WIDTH_SLICE_CLAMP: f32 = 4094.0;
/// The matmul output cliff, ≈ 65504 / 2, measured on M2 Pro and M5 for
/// every contraction size: ANEForge `docs/numeric-cliffs.md` "Matmul output
/// saturation" (its issue #115).
pub const MATMUL_CLIFF: f32 = 32752.0;

impl Family {
    pub const ALL: [Family; 5] = [Family::M1, Family::M2, Family::M3, Family::M4, Family::M5];

    /// `m1` … `m5`.
    pub fn name(self) -> &'static str {
        match self {
            Family::M1 => "m1",
            Family::M2 => "m2",
            Family::M3 => "m3",
            Family::M4 => "m4",
            Family::M5 => "m5",
        }
    }

    /// The ANE architecture and capability family (ANEForge
    /// `docs/cross-chip.md`, "The M(n) = H(n+12) ladder").
    pub fn arch(self) -> (&'static str, &'static str) {
        match self {
            Family::M1 => ("H13", "A13"),
            Family::M2 => ("H14", "A14"),
            Family::M3 => ("H15", "A15"),
            Family::M4 => ("H16", "A16"),
            Family::M5 => ("H17s", "A16"),
        }
    }

    /// Parses `m1` … `m5` (any case); an error lists the accepted names.
    pub fn parse(s: &str) -> Result<Family, Error> {
        Family::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Error::UnknownFamily { given: s.into() })
    }

    /// The family of a CPU brand string (`Apple M2 Pro` → M2). The
    /// Pro/Max/Ultra variants change core counts, not the family; the
    /// model identifier (`MacBookPro17,1`) is no guide (ANEForge
    /// `docs/cross-chip.md`, "Host detection and the env override").
    pub fn from_brand(brand: &str) -> Option<Family> {
        let rest = brand.trim().strip_prefix("Apple M")?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        match digits.parse::<u32>().ok()? {
            1 => Some(Family::M1),
            2 => Some(Family::M2),
            3 => Some(Family::M3),
            4 => Some(Family::M4),
            5 => Some(Family::M5),
            _ => None,
        }
    }

    /// This family's row of the table.
    pub fn limits(self) -> Limits {
        let a16 = matches!(self, Family::M4 | Family::M5);
        Limits {
            // Spatial/contraction 16384 through A15, 65536 at A16; channel
            // 65536 on all (the A13 row measured on an M1 equals A14's):
            // ANEForge docs/cross-chip.md, "oversize".
            max_spatial: if a16 { 65_536 } else { 16_384 },
            max_channel: 65_536,
            // "Rank ... must be between 0 and 5": ANEForge
            // docs/developer/op-quirks.md, "Global constraints".
            max_rank: 5,
            // Runtime input surfaces need W >= 32 (W = 16 gave garbage or a
            // nonzero status, no compile error): apple-neural-engine-field-guide
            // README.md, "The SP=32 Constraint" (measured on an M3 Max; no
            // family is reported to accept less, so every row carries it).
            min_width: 32,
            // A contraction that is not a multiple of 32 gave silent zeros:
            // maderix/ANE PR #47 (one report; `doctor` probes it).
            inner_multiple: 32,
            // Pre-A16 width-offset slices clamp |v| > 4094 to ±inf:
            // ANEForge docs/numeric-cliffs.md (table: "pre-A16; absent on
            // A16/M5"); docs/cross-chip.md names A13 only, and
            // docs/developer/op-quirks.md ("Gather") says width-axis slices
            // return wrong elements on A13/A14. Every pre-A16 row carries
            // it: the sources disagree and the M3 is unmeasured.
            width_slice_clamp: (!a16).then_some(WIDTH_SLICE_CLAMP),
            // Measured on M2 Pro (A14) and M5 (A16); unmeasured families
            // are assumed to share it (the accumulator width is uniform
            // across chips: ANEForge docs/cross-chip.md, "fp16 portability").
            matmul_cliff: Some(MATMUL_CLIFF),
            // maderix/ANE's training kernels, run on an M4, pack outputs with
            // concat (training/training_dynamic/mil_dynamic.h); Orion
            // docs/ane_constraints.md §1 saw ANECCompile() fail on it. No
            // family is known to reject it for sure: `doctor` probes it.
            concat: true,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (arch, fam) = self.arch();
        write!(f, "{} ({arch}, family {fam})", self.name())
    }
}

impl Limits {
    /// The most conservative row: what every family accepts, each cliff as
    /// the worst family has it.
    pub fn conservative() -> Limits {
        let rows: Vec<Limits> = Family::ALL.iter().map(|f| f.limits()).collect();
        let min = |f: fn(&Limits) -> usize| rows.iter().map(f).min().unwrap_or(0);
        let max = |f: fn(&Limits) -> usize| rows.iter().map(f).max().unwrap_or(1);
        let lowest =
            |f: fn(&Limits) -> Option<f32>| rows.iter().filter_map(f).min_by(|a, b| a.total_cmp(b));
        Limits {
            max_spatial: min(|l| l.max_spatial),
            max_channel: min(|l| l.max_channel),
            max_rank: min(|l| l.max_rank),
            min_width: max(|l| l.min_width),
            inner_multiple: max(|l| l.inner_multiple),
            width_slice_clamp: lowest(|l| l.width_slice_clamp),
            matmul_cliff: lowest(|l| l.matmul_cliff),
            concat: rows.iter().all(|l| l.concat),
        }
    }

    /// The largest extent of any axis (the channel cap is never below the
    /// spatial one).
    pub fn max_dim(&self) -> usize {
        self.max_spatial.max(self.max_channel)
    }

    /// The same limits with both axis caps set to `n` (`ANETRAIN_ANE_MAX_DIM`).
    pub fn with_max_dim(mut self, n: usize) -> Limits {
        self.max_spatial = n;
        self.max_channel = n;
        self
    }

    /// One line per limit, for `info` and `doctor`.
    pub fn describe(&self) -> Vec<(String, String)> {
        let cliff = |v: Option<f32>| match v {
            Some(x) => format!("|v| > {x} becomes ±inf"),
            None => "none".to_string(),
        };
        vec![
            (
                "spatial/contraction axes".into(),
                format!("≤ {}", self.max_spatial),
            ),
            ("channel axis".into(), format!("≤ {}", self.max_channel)),
            ("rank".into(), format!("≤ {}", self.max_rank)),
            ("surface width".into(), format!("≥ {}", self.min_width)),
            (
                "matmul contraction".into(),
                format!("multiple of {}", self.inner_multiple),
            ),
            ("width-offset slice".into(), cliff(self.width_slice_clamp)),
            ("matmul output".into(), cliff(self.matmul_cliff)),
            (
                "concat".into(),
                if self.concat { "accepted" } else { "rejected" }.into(),
            ),
        ]
    }
}

/// Where the limits in force came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Source {
    /// `ANETRAIN_ANE_FAMILY`.
    Env,
    /// A profile `doctor` measured, at this path.
    Saved(String),
    /// The CPU brand string.
    Detected(String),
    /// No family known: the intersection of all rows (the reason).
    Conservative(String),
    /// A family a command was asked to plan for (how it was asked).
    Asked(String),
}

/// The family and limits kernels are built for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// `None` when the chip is unknown.
    pub family: Option<Family>,
    pub limits: Limits,
    pub source: Source,
    /// Timing constants `doctor` measured on this chip, if any.
    #[serde(default)]
    pub timing: Option<Measured>,
}

/// What `doctor` saves: the measured limits and what they were measured on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedProfile {
    pub format: u32,
    /// The family the table assigns the chip (the simulated one on a
    /// machine without a Neural Engine).
    pub family: Option<Family>,
    /// The CPU brand string, or `simulated` (so a profile measured on the
    /// simulator is not taken for hardware facts).
    pub chip: String,
    pub device: String,
    pub limits: Limits,
    /// When it was measured (seconds since the Unix epoch).
    pub measured_at: u64,
    /// Dispatch, dynamic-weight matmul, staging and compile times measured
    /// by [`crate::timing::measure`] (absent in profiles of older builds).
    #[serde(default)]
    pub timing: Option<Measured>,
}

/// The saved profile's format version.
pub const PROFILE_FORMAT: u32 = 1;

/// Where `doctor` saves the device profile: `$ANETRAIN_CONFIG_DIR`, else
/// `~/Library/Application Support/anetrain` on macOS, else
/// `$XDG_CONFIG_HOME/anetrain` or `~/.config/anetrain`.
pub fn profile_path() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = if let Some(d) = env(CONFIG_DIR_ENV) {
        d
    } else if cfg!(target_os = "macos") {
        env("HOME")?.join("Library/Application Support/anetrain")
    } else if let Some(x) = env("XDG_CONFIG_HOME") {
        x.join("anetrain")
    } else {
        env("HOME")?.join(".config/anetrain")
    };
    Some(dir.join("device-profile.json"))
}

/// The CPU brand string (`sysctl -n machdep.cpu.brand_string`) on macOS.
pub fn cpu_brand() -> Option<String> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    let out = std::process::Command::new("sysctl")
        .args(["-n", "machdep.cpu.brand_string"])
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// The chip this profile is saved for: the brand string, or `simulated`.
pub fn chip_key() -> String {
    cpu_brand().unwrap_or_else(|| SIMULATED_CHIP.into())
}

/// The chip key of a machine without an Apple chip (the simulator's).
pub const SIMULATED_CHIP: &str = "simulated";

/// `ANETRAIN_SIM_FAMILY` as a family; an unusable value is an error.
pub fn sim_family_from_env() -> Result<Option<Family>, Error> {
    family_env(SIM_FAMILY_ENV)
}

fn family_env(var: &'static str) -> Result<Option<Family>, Error> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Family::parse(&v).map(Some).map_err(|e| Error::Variable {
            var,
            reason: Box::new(e),
        }),
    }
}

/// Reads the saved profile at `path` if there is one for this chip; a
/// profile that does not parse is an error naming the file.
pub fn load_saved(path: &std::path::Path) -> Result<Option<SavedProfile>, Error> {
    let problem = |problem: String| Error::Profile {
        path: path.into(),
        problem,
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(problem(e.to_string())),
    };
    let p: SavedProfile = serde_json::from_str(&text).map_err(|e| {
        problem(format!(
            "not a device profile ({e}); delete it or rerun `anetrain doctor`"
        ))
    })?;
    if p.format != PROFILE_FORMAT {
        return Err(problem(format!(
            "device profile format {} (this build reads {PROFILE_FORMAT}); rerun `anetrain doctor`",
            p.format
        )));
    }
    Ok(Some(p))
}

/// Saves `p` at `path` atomically (a temporary file renamed into place).
pub fn save(p: &SavedProfile, path: &std::path::Path) -> Result<(), Error> {
    let at = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| Error::Profile {
            path,
            problem: e.to_string(),
        }
    };
    let dir = path.parent().ok_or_else(|| Error::Profile {
        path: path.into(),
        problem: "no parent directory".into(),
    })?;
    std::fs::create_dir_all(dir).map_err(at(dir))?;
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(p).map_err(|e| Error::Profile {
        path: path.into(),
        problem: e.to_string(),
    })?;
    std::fs::write(&tmp, text + "\n").map_err(at(&tmp))?;
    std::fs::rename(&tmp, path).map_err(at(path))
}

impl Profile {
    /// The profile of a family's table row.
    pub fn of(family: Family, source: Source) -> Profile {
        Profile {
            family: Some(family),
            limits: family.limits(),
            source,
            timing: None,
        }
    }

    /// The profile of `family` a command was asked for (`how`: the flag),
    /// whatever chip this is; `ANETRAIN_ANE_MAX_DIM` overrides both axis
    /// caps as it does for the family in force.
    pub fn asked(family: Family, how: &str) -> Result<Profile, Error> {
        let mut p = Profile::of(family, Source::Asked(how.into()));
        if let Some(n) = max_dim_from_env()? {
            p.limits = p.limits.with_max_dim(n);
        }
        Ok(p)
    }

    /// The most conservative row.
    pub fn conservative(reason: &str) -> Profile {
        Profile {
            family: None,
            limits: Limits::conservative(),
            source: Source::Conservative(reason.into()),
            timing: None,
        }
    }

    /// The limits in force on this machine: `ANETRAIN_ANE_FAMILY`, else the
    /// profile `doctor` saved for this chip, else the family of the CPU
    /// brand string, else the conservative row. `ANETRAIN_ANE_MAX_DIM`
    /// then overrides both axis caps. An unusable variable or a corrupt
    /// profile is an error naming it.
    pub fn in_force() -> Result<Profile, Error> {
        let mut p = Profile::unclamped()?;
        if let Some(n) = max_dim_from_env()? {
            p.limits = p.limits.with_max_dim(n);
        }
        Ok(p)
    }

    fn unclamped() -> Result<Profile, Error> {
        if let Some(f) = family_env(FAMILY_ENV)? {
            return Ok(Profile::of(f, Source::Env));
        }
        let chip = chip_key();
        if let Some(path) = profile_path() {
            if let Some(saved) = load_saved(&path)? {
                // A profile taken on the simulator (older builds saved one)
                // is no measurement of a chip.
                if saved.chip == chip && saved.chip != SIMULATED_CHIP {
                    return Ok(Profile {
                        family: saved.family,
                        limits: saved.limits,
                        source: Source::Saved(path.display().to_string()),
                        timing: saved.timing,
                    });
                }
            }
        }
        if let Some(brand) = cpu_brand() {
            return Ok(match Family::from_brand(&brand) {
                Some(f) => Profile::of(f, Source::Detected(brand)),
                None => Profile::conservative(&format!("unknown chip '{brand}'")),
            });
        }
        Ok(Profile::conservative("no Apple chip detected"))
    }

    /// `m4 (H16, family A16), from ANETRAIN_ANE_FAMILY`, for reports.
    pub fn describe(&self) -> String {
        let fam = match self.family {
            Some(f) => f.to_string(),
            None => "unknown chip: every family's limits at once".into(),
        };
        let from = match &self.source {
            Source::Env => format!("from {FAMILY_ENV}"),
            Source::Saved(p) => format!("measured by `anetrain doctor`, saved in {p}"),
            Source::Detected(b) => format!("detected from '{b}'"),
            Source::Conservative(why) => why.clone(),
            Source::Asked(how) => how.clone(),
        };
        format!("{fam}, {from}")
    }
}

impl Default for Limits {
    /// The most conservative row of the family table ([`Limits::conservative`]),
    /// both axis caps overridden by `ANETRAIN_ANE_MAX_DIM` when it holds a
    /// usable number (see [`Profile::in_force`] for the
    /// limits of the chip at hand).
    fn default() -> Limits {
        let l = Limits::conservative();
        match max_dim_from_env() {
            Ok(Some(n)) => l.with_max_dim(n),
            _ => l,
        }
    }
}

/// Overrides both axis caps: for chips that accept less (one report from
/// an M5 says 4096), and to force tiling in tests.
pub const MAX_DIM_ENV: &str = "ANETRAIN_ANE_MAX_DIM";

/// `ANETRAIN_ANE_MAX_DIM` when set; an unusable value is an error naming
/// the variable.
pub fn max_dim_from_env() -> Result<Option<usize>, Error> {
    match std::env::var(MAX_DIM_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 16 => Ok(Some(n)),
            _ => Err(Error::NotADimension {
                var: MAX_DIM_ENV,
                value: v,
            }),
        },
    }
}

/// Timing constants `anetrain doctor` measured on this machine's engine;
/// they replace the table's ([`crate::cost::Rates::with_measured`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Median evaluation of a minimal program (ms).
    pub dispatch_ms: f64,
    /// `(flop, milliseconds)` of dynamic-weight matmul programs, dispatch
    /// included, at shapes the kernels use.
    pub matmuls: Vec<(f64, f64)>,
    /// Host writes into an input surface (GB/s).
    pub write_gbs: f64,
    /// Compiling and loading one program (ms).
    pub compile_ms: f64,
    /// A program whose intermediate matrices are far larger than its
    /// surfaces, timed (absent in profiles of older builds).
    #[serde(default)]
    pub scratch: Option<ScratchTiming>,
}

/// One timed evaluation of a program with large intermediates
/// (`timing::scratch_chain`): what [`crate::cost::Rates::with_measured`] reads the
/// scratch share from.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScratchTiming {
    pub flop: f64,
    /// Bytes of its input and output surfaces.
    pub surface_bytes: f64,
    /// Bytes of its intermediate matrices.
    pub scratch_bytes: f64,
    /// Median evaluation, dispatch included (ms).
    pub ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brand_strings_map_to_families() {
        assert_eq!(Family::from_brand("Apple M1"), Some(Family::M1));
        assert_eq!(Family::from_brand("Apple M2 Pro"), Some(Family::M2));
        assert_eq!(Family::from_brand("Apple M3 Max"), Some(Family::M3));
        assert_eq!(Family::from_brand("Apple M4"), Some(Family::M4));
        assert_eq!(Family::from_brand("Apple M5 Pro"), Some(Family::M5));
        assert_eq!(Family::from_brand("Apple M12"), None);
        assert_eq!(Family::from_brand("Intel(R) Core(TM) i9"), None);
        assert_eq!(Family::parse("M3"), Ok(Family::M3));
        assert!(Family::parse("a16")
            .unwrap_err()
            .to_string()
            .contains("m1, m2"));
    }

    #[test]
    fn the_conservative_row_is_every_rows_worst() {
        let c = Limits::conservative();
        assert_eq!(c.max_spatial, 16_384);
        assert_eq!(c.max_channel, 65_536);
        assert_eq!(c.width_slice_clamp, Some(WIDTH_SLICE_CLAMP));
        assert_eq!(c.matmul_cliff, Some(MATMUL_CLIFF));
        for f in Family::ALL {
            let l = f.limits();
            assert!(c.max_spatial <= l.max_spatial && c.max_channel <= l.max_channel);
            assert!(c.min_width >= l.min_width && c.inner_multiple >= l.inner_multiple);
        }
        assert_eq!(Family::M4.limits().width_slice_clamp, None);
        assert_eq!(Family::M1.limits().max_spatial, 16_384);
        assert_eq!(Family::M5.limits().max_spatial, 65_536);
    }

    #[test]
    fn saved_profiles_round_trip_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p/device-profile.json");
        assert_eq!(load_saved(&path).unwrap(), None);
        let p = SavedProfile {
            format: PROFILE_FORMAT,
            family: Some(Family::M2),
            chip: "simulated".into(),
            device: "ane-sim".into(),
            limits: Family::M2.limits(),
            measured_at: 1,
            timing: Some(Measured {
                dispatch_ms: 0.2,
                matmuls: vec![(1e9, 0.5), (2e9, 0.9)],
                write_gbs: 30.0,
                compile_ms: 45.0,
                scratch: Some(ScratchTiming {
                    flop: 8.6e9,
                    surface_bytes: 3.1e6,
                    scratch_bytes: 6.7e7,
                    ms: 4.5,
                }),
            }),
        };
        save(&p, &path).unwrap();
        assert_eq!(load_saved(&path).unwrap(), Some(p.clone()));
        // Profiles of older builds, without the scratch probe or without
        // timing, still read.
        let mut old = serde_json::to_value(&p).unwrap();
        old["timing"].as_object_mut().unwrap().remove("scratch");
        std::fs::write(&path, old.to_string()).unwrap();
        let timing = load_saved(&path).unwrap().unwrap().timing.unwrap();
        assert_eq!((timing.scratch, timing.compile_ms), (None, 45.0));
        old.as_object_mut().unwrap().remove("timing");
        std::fs::write(&path, old.to_string()).unwrap();
        assert_eq!(load_saved(&path).unwrap().unwrap().timing, None);
        std::fs::write(&path, "{").unwrap();
        let e = load_saved(&path).unwrap_err().to_string();
        assert!(
            e.contains("device-profile.json") && e.contains("doctor"),
            "{e}"
        );
    }
}
