use mil::linalg::{sgemm, MatRef};
use std::time::Instant;

fn time(name: &str, flops: f64, mut f: impl FnMut()) {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("{name:50} {:.3} s  {:.1} GFLOP/s", best, flops / best / 1e9);
}

fn main() {
    let (s, d, v) = (256usize, 1024usize, 151936usize);
    let head: Vec<f32> = (0..v * d)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-4)
        .collect();
    let xf: Vec<f32> = (0..d * s).map(|i| ((i * 31) % 100) as f32 * 1e-2).collect();
    let mut out = vec![0f32; s * v];
    let fl = 2.0 * (s * d * v) as f64;
    time("logits [S,V] = xfT . headT", fl, || {
        sgemm(
            MatRef::row_major(&xf, 0, d, s).t(),
            MatRef::row_major(&head, 0, v, d).t(),
            &mut out,
            0,
            v,
            false,
        )
    });
    time("logitsT [V,S] = head . xf", fl, || {
        sgemm(
            MatRef::row_major(&head, 0, v, d),
            MatRef::row_major(&xf, 0, d, s),
            &mut out,
            0,
            s,
            false,
        )
    });
    let mut dxf = vec![0f32; d * s];
    let lg = out.clone();
    time("dxf [D,S] = headT . dlogitsT (lg [S,V])", fl, || {
        sgemm(
            MatRef::row_major(&head, 0, v, d).t(),
            MatRef::row_major(&lg, 0, s, v).t(),
            &mut dxf,
            0,
            s,
            false,
        )
    });
    time("dxf [D,S] = headT . lgT (lg as [V,S])", fl, || {
        sgemm(
            MatRef::row_major(&head, 0, v, d).t(),
            MatRef::row_major(&lg, 0, v, s),
            &mut dxf,
            0,
            s,
            false,
        )
    });
    let mut dh = vec![0f32; v * d];
    time("dhead [V,D] += lgT . xfT (lg [S,V])", fl, || {
        sgemm(
            MatRef::row_major(&lg, 0, s, v).t(),
            MatRef::row_major(&xf, 0, d, s).t(),
            &mut dh,
            0,
            d,
            true,
        )
    });
    time("dhead [V,D] += lg . xfT (lg [V,S])", fl, || {
        sgemm(
            MatRef::row_major(&lg, 0, v, s),
            MatRef::row_major(&xf, 0, d, s).t(),
            &mut dh,
            0,
            d,
            true,
        )
    });
    // layer shapes
    let (h,) = (3072usize,);
    let w: Vec<f32> = (0..h * d).map(|i| ((i * 13) % 100) as f32 * 1e-3).collect();
    let x: Vec<f32> = (0..d * s).map(|i| ((i * 17) % 100) as f32 * 1e-2).collect();
    let mut y = vec![0f32; h * s];
    let fl = 2.0 * (s * d * h) as f64;
    time("fwd W[h,d] . x[d,S]", fl, || {
        sgemm(
            MatRef::row_major(&w, 0, h, d),
            MatRef::row_major(&x, 0, d, s),
            &mut y,
            0,
            s,
            false,
        )
    });
    let dy = y.clone();
    let mut dx = vec![0f32; d * s];
    time("bwd WT . dy", fl, || {
        sgemm(
            MatRef::row_major(&w, 0, h, d).t(),
            MatRef::row_major(&dy, 0, h, s),
            &mut dx,
            0,
            s,
            false,
        )
    });
    let mut dw = vec![0f32; h * d];
    time("wgrad dy . xT", fl, || {
        sgemm(
            MatRef::row_major(&dy, 0, h, s),
            MatRef::row_major(&x, 0, d, s).t(),
            &mut dw,
            0,
            d,
            true,
        )
    });
}
