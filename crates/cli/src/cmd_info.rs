//! `anetrain info`: the platform, the matrix multiply, the Neural Engine
//! and the chip family in force.

use anetrain::util::choice::Choice;

pub fn run() {
    println!("anetrain {}", env!("CARGO_PKG_VERSION"));
    println!(
        "platform: {}-{}",
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    println!("cpu threads: {}", linalg::threads());
    println!("matrix multiply: {}", linalg::selected().describe());
    let others: Vec<&str> = linalg::Backend::ALL
        .iter()
        .filter(|l| l.available() && **l != linalg::selected() && **l != linalg::Backend::Naive)
        .map(|l| l.key())
        .collect();
    if !others.is_empty() {
        println!(
            "  also available (ANETRAIN_MATMUL=NAME): {}",
            others.join(", ")
        );
    }
    let stand_in = std::env::var_os(ane::apple::RUNTIME_ENV).filter(|p| !p.is_empty());
    match ane::AneDevice::open() {
        Ok(_) if stand_in.is_some() => println!(
            "neural engine: AneDevice over the stand-in runtime {} ({} is set: a testing aid, not the ANE)",
            std::path::Path::new(stand_in.as_deref().unwrap_or_default()).display(),
            ane::apple::RUNTIME_ENV
        ),
        Ok(_) => println!(
            "neural engine: the ANE framework loads (AppleNeuralEngine.framework, private API); \
             compile budget {} programs per process",
            ane::DEFAULT_COMPILE_BUDGET
        ),
        Err(e) => println!("neural engine: unavailable — {e}"),
    }
    println!(
        "simulated device (ane-sim): available; compile budget {} programs per process",
        ane::DEFAULT_COMPILE_BUDGET
    );
    match ane::family::Profile::in_force() {
        Ok(p) => {
            println!(
                "chip family: {} ({} sets it; kernels wider than the caps run in tiles, `anetrain kernels plan`){}",
                p.describe(),
                ane::family::FAMILY_ENV,
                match anetrain::kernels::tiling::min_tiles_from_env() {
                    1 => String::new(),
                    n => format!(
                        "; at least {n} tiles per kernel ({} is set: a testing aid)",
                        anetrain::kernels::tiling::MIN_TILES_ENV
                    ),
                }
            );
            for (what, v) in p.limits.describe() {
                println!("  {what:<26} {v}");
            }
            if std::env::var_os(ane::family::MAX_DIM_ENV).is_some() {
                println!("  (axis caps from {})", ane::family::MAX_DIM_ENV);
            }
        }
        Err(e) => println!("chip family: {e}"),
    }
    match ane::family::sim_family_from_env() {
        Ok(Some(f)) => println!(
            "simulated chip ({}): {f}, its faults played by ane-sim",
            ane::family::SIM_FAMILY_ENV
        ),
        Ok(None) => {}
        Err(e) => println!("simulated chip: {e}"),
    }
    println!(
        "default backend: {}",
        anetrain::device::backend::Backend::platform_default().name()
    );
}
