//! Gradients of a model's trainable parameters, reused from step to step.

use crate::model::Model;

/// Gradients parallel to `Model::trainable()`, reused from step to step.
///
/// [`Grads::reset`] starts a step without touching memory: the first
/// writer of each buffer in the step overwrites it (a product with β = 0)
/// and later writers accumulate, so a step neither zeroes 4 bytes per
/// parameter nor reads them back in its weight-gradient products.
/// [`Grads::finish`] zeroes whatever nothing wrote; reading a buffer
/// before that is a bug and panics.
#[derive(Debug, PartialEq)]
pub struct Grads {
    bufs: Vec<Vec<f32>>,
    /// Whether each buffer holds this step's gradient so far.
    written: Vec<bool>,
}

/// All-zero gradients for `model` (every buffer counts as written).
pub fn zero_grads(model: &Model) -> Grads {
    let bufs: Vec<Vec<f32>> = model
        .trainable()
        .iter()
        .map(|p| crate::util::mem::zeroed_huge(p.data.len()))
        .collect();
    Grads::from(bufs)
}

impl Grads {
    /// Starts a step: every buffer is stale until written.
    pub fn reset(&mut self) {
        self.written.fill(false);
    }

    /// The buffer a product writes parameter `id`'s gradient into, and
    /// whether it must accumulate (something already wrote it this step).
    pub fn product_target(&mut self, id: usize) -> (&mut [f32], bool) {
        let accumulate = std::mem::replace(&mut self.written[id], true);
        (&mut self.bufs[id], accumulate)
    }

    /// Parameter `id`'s buffer for element-wise `+=`, zeroed first when
    /// nothing wrote it this step.
    pub fn accumulator(&mut self, id: usize) -> &mut [f32] {
        if !std::mem::replace(&mut self.written[id], true) {
            use rayon::prelude::*;
            self.bufs[id]
                .par_chunks_mut(1 << 16)
                .for_each(|c| c.fill(0.0));
        }
        &mut self.bufs[id]
    }

    /// Ends a step's writes: zeroes every buffer nothing wrote.
    /// Moves gradients `ids` (with their written state) into a `Grads`
    /// of their own, the others left empty there, so another thread can
    /// write them while this one writes the rest; [`Grads::put_back`]
    /// returns them. Buffers move, nothing is copied.
    pub fn take(&mut self, ids: &[usize]) -> Grads {
        let mut out = Grads {
            bufs: vec![Vec::new(); self.bufs.len()],
            written: self.written.clone(),
        };
        for &id in ids {
            std::mem::swap(&mut out.bufs[id], &mut self.bufs[id]);
        }
        out
    }

    /// Returns gradients `ids` taken by [`Grads::take`], as `taken` left them.
    pub fn put_back(&mut self, mut taken: Grads, ids: &[usize]) {
        for &id in ids {
            self.bufs[id] = std::mem::take(&mut taken.bufs[id]);
            self.written[id] = taken.written[id];
        }
    }

    pub fn finish(&mut self) {
        for id in 0..self.bufs.len() {
            self.accumulator(id);
        }
    }

    fn check_finished(&self) {
        assert!(
            self.written.iter().all(|&w| w),
            "gradients read before Grads::finish"
        );
    }

    /// Every gradient (after [`Grads::finish`]).
    pub fn iter(&self) -> std::slice::Iter<'_, Vec<f32>> {
        self.check_finished();
        self.bufs.iter()
    }

    /// Every gradient, mutably (after [`Grads::finish`]).
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Vec<f32>> {
        self.check_finished();
        self.bufs.iter_mut()
    }

    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }
}

impl From<Vec<Vec<f32>>> for Grads {
    /// Given gradients (every buffer counts as written).
    fn from(bufs: Vec<Vec<f32>>) -> Self {
        Grads {
            written: vec![true; bufs.len()],
            bufs,
        }
    }
}

impl<'a> IntoIterator for &'a Grads {
    type Item = &'a Vec<f32>;
    type IntoIter = std::slice::Iter<'a, Vec<f32>>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl std::ops::Index<usize> for Grads {
    type Output = Vec<f32>;

    /// Parameter `id`'s gradient (written this step, or after `finish`).
    fn index(&self, id: usize) -> &Vec<f32> {
        assert!(self.written[id], "gradient {id} read before Grads::finish");
        &self.bufs[id]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grads_overwrite_first_then_accumulate_and_refuse_stale_reads() {
        let mut g = Grads::from(vec![vec![5.0f32; 3], vec![7.0f32; 2], vec![9.0f32; 4]]);
        g.reset();
        let (buf, accumulate) = g.product_target(0);
        assert!(!accumulate);
        buf.fill(1.0);
        assert!(g.product_target(0).1, "a second product accumulates");
        g.accumulator(1)[0] += 2.0;
        assert_eq!(g[1], vec![2.0, 0.0], "an accumulator starts from zero");
        let stale = std::panic::catch_unwind(|| g[2].clone());
        assert!(stale.is_err(), "reading an unwritten gradient is refused");
        g.finish();
        assert_eq!(g[0], vec![1.0; 3]);
        assert_eq!(g[2], vec![0.0; 4], "finish zeroes what nothing wrote");
    }
}
