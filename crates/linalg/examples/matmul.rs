//! Times every available matrix-multiply implementation on the products a
//! training step runs (activations are stored feature-major, `[features,
//! tokens]`), best of a few runs, in GFLOP/s:
//!
//! ```bash
//! cargo run --release -p linalg --example matmul -- [TOKENS] [HIDDEN] [FFN] [VOCAB]
//! ```
//! Defaults are Qwen3-0.6B's shapes at 256 tokens; `MATMUL_LIBS=amx,mkl`
//! limits the comparison to those libraries.

use linalg::{Backend, MatMut, MatRef};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are positive integers"))
        .collect();
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (s, d, h, v) = (get(0, 256), get(1, 1024), get(2, 3072), get(3, 151936));
    let fill = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 997) as f32 * 1e-3 - 0.5)
            .collect()
    };
    let (x, dy, e) = (fill(d * s), fill(h * s), fill(v * d));
    // Weights as a training step sees them: a different matrix each call,
    // so none is in cache (copies enough to exceed any L3).
    let copies = (256 << 20) / (4 * h * d) + 1;
    let ws: Vec<Vec<f32>> = (0..copies).map(|_| fill(h * d)).collect();
    let turn = std::cell::Cell::new(0usize);
    let w = || {
        turn.set(turn.get() + 1);
        &ws[turn.get() % copies][..]
    };
    let (mut y, mut dw, mut dx, mut lt) = (
        vec![0.0; h * s],
        vec![0.0; h * d],
        vec![0.0; d * s],
        vec![0.0; v * s],
    );
    // `MATMUL_LIBS=amx,mkl` limits the comparison to those libraries.
    let wanted = std::env::var("MATMUL_LIBS").unwrap_or_default();
    let libs: Vec<Backend> = Backend::ALL
        .iter()
        .copied()
        .filter(|l| l.available() && *l != Backend::Naive)
        .filter(|l| wanted.is_empty() || wanted.split(',').any(|w| w == l.key()))
        .collect();
    println!(
        "{:<44}{}",
        "product [M×K · K×N]",
        libs.iter()
            .map(|l| format!("{:>11}", l.key()))
            .collect::<String>()
    );
    type Case<'a> = (String, usize, Box<dyn FnMut(Backend) + 'a>);
    let cases: Vec<Case> = vec![
        (
            format!("forward   W·x      {h}×{d}·{d}×{s}"),
            h * d * s,
            Box::new(|l| {
                l.matmul(
                    MatRef::row_major(w(), 0, h, d),
                    MatRef::row_major(&x, 0, d, s),
                    MatMut::row_major(&mut y, 0, h, s),
                    false,
                )
            }),
        ),
        (
            format!("input grad Wᵀ·dy   {d}×{h}·{h}×{s}"),
            h * d * s,
            Box::new(|l| {
                l.matmul(
                    MatRef::row_major(w(), 0, h, d).t(),
                    MatRef::row_major(&dy, 0, h, s),
                    MatMut::row_major(&mut dx, 0, d, s),
                    false,
                )
            }),
        ),
        (
            format!("weight grad dy·xᵀ  {h}×{s}·{s}×{d}"),
            h * d * s,
            Box::new(|l| {
                l.matmul(
                    MatRef::row_major(&dy, 0, h, s),
                    MatRef::row_major(&x, 0, d, s).t(),
                    MatMut::row_major(&mut dw, 0, h, d),
                    true,
                )
            }),
        ),
        (
            format!("LM head   E·x      {v}×{d}·{d}×{s}"),
            v * d * s,
            Box::new(|l| {
                l.matmul(
                    MatRef::row_major(&e, 0, v, d),
                    MatRef::row_major(&x, 0, d, s),
                    MatMut::row_major(&mut lt, 0, v, s),
                    false,
                )
            }),
        ),
    ];
    let hd = 64;
    let (q, k, v) = (fill(hd * s), fill(hd * s), fill(hd * s));
    let (pr, da) = (fill(s * s), fill(hd * s));
    let (mut att, mut scores, mut dv) = (vec![0.0; hd * s], vec![0.0; s * s], vec![0.0; hd * s]);
    let cases: Vec<Case> = cases
        .into_iter()
        .chain([
            (
                format!("attention V·Pᵀ     {hd}×{s}·{s}×{s}"),
                hd * s * s,
                Box::new(|l: Backend| {
                    l.matmul(
                        MatRef::row_major(&v, 0, hd, s),
                        MatRef::row_major(&pr, 0, s, s).t(),
                        MatMut::row_major(&mut att, 0, hd, s),
                        false,
                    )
                }) as Box<dyn FnMut(Backend)>,
            ),
            (
                format!("attention Qᵀ·K     {s}×{hd}·{hd}×{s}"),
                hd * s * s,
                Box::new(|l| {
                    l.matmul(
                        MatRef::row_major(&q, 0, hd, s).t(),
                        MatRef::row_major(&k, 0, hd, s),
                        MatMut::row_major(&mut scores, 0, s, s),
                        false,
                    )
                }),
            ),
            (
                format!("attention dA·P     {hd}×{s}·{s}×{s}"),
                hd * s * s,
                Box::new(|l| {
                    l.matmul(
                        MatRef::row_major(&da, 0, hd, s),
                        MatRef::row_major(&pr, 0, s, s),
                        MatMut::row_major(&mut dv, 0, hd, s),
                        true,
                    )
                }),
            ),
        ])
        .collect();
    // Libraries take turns within each round, so a noisy spell on the
    // machine hits them alike; the best round counts.
    for (name, macs, mut f) in cases {
        print!("{name:<44}");
        let mut best = vec![f64::MAX; libs.len()];
        for &l in &libs {
            f(l);
        }
        let mut best_cpu = vec![f64::MAX; libs.len()];
        for _ in 0..10 {
            for (i, &l) in libs.iter().enumerate() {
                let (t, c) = (Instant::now(), cpu_seconds());
                f(l);
                best[i] = best[i].min(t.elapsed().as_secs_f64());
                best_cpu[i] = best_cpu[i].min(cpu_seconds() - c);
            }
        }
        for t in best {
            print!("{:>11.0}", 2.0 * macs as f64 / t / 1e9);
        }
        print!("   per CPU-second:");
        for t in best_cpu {
            print!("{:>7.0}", 2.0 * macs as f64 / t / 1e9);
        }
        println!();
    }
}

/// CPU time of the whole process (every thread), which on a virtual
/// machine excludes time the host gave to other guests.
fn cpu_seconds() -> f64 {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out-pointer.
    unsafe {
        clock_gettime(2 /* CLOCK_PROCESS_CPUTIME_ID */, &mut ts)
    };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}
