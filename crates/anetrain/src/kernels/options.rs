//! What the kernels are built for besides the shape: the layer they
//! compute parts of, RoPE and its scaling, the score scale and cap, LoRA,
//! the device's limits and cost family, tiling overrides.

use super::*;

/// Everything besides the shapes that changes what a kernel computes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelOptions {
    pub rope: Rope,
    pub rope_theta: f64,
    /// RoPE's frequency scaling (the checkpoint's `rope_type`).
    pub rope_scaling: RopeScaling,
    /// The base of a [`LayerClass::local_rope`] layer's RoPE (Gemma's
    /// `rope_local_base_freq`), unscaled.
    pub local_rope_theta: Option<f64>,
    /// The layer the kernels compute parts of: which kernels a layer runs
    /// ([`KernelKind::serves`]) and what they compute (QK-norm inside
    /// sdpa_forward).
    pub layer: LayerSpec,
    /// RMSNorm epsilon (QK-norm inside sdpa_forward).
    pub eps: f64,
    /// Scale α of each residual branch: 1 for most Hugging Face models
    /// (Granite's `residual_multiplier`), 1/sqrt(2·layers) in the seed
    /// (DeepNet).
    pub residual_scale: f64,
    /// The attention scores' scale: 1/√head_dim, or the model's own
    /// (Granite's `attention_multiplier`, `ModelConfig::score_scale`).
    pub score_scale: f64,
    /// The scores' tanh soft cap c (Gemma 2's `attn_logit_softcapping`):
    /// scores ← c·tanh(scores/c) after the scale, before the mask.
    pub score_cap: Option<f64>,
    /// The class of the layer the kernels run for (its RoPE and attention
    /// window: [`LayerClass`]); [`KernelOptions::for_layer`] sets it. A
    /// model-wide use (a plan, a cost) reads the first layer's.
    pub class: LayerClass,
    /// Reproduce the seed's layouts (sdpa_forward also passes xnorm through).
    pub seed_compat: bool,
    /// CPU twin only: compute with the constants exactly as the MIL program
    /// stores them (fp16 RoPE tables, score scale, eps, residual scale), so
    /// the interpreter's fp32 mode can be compared bit for bit with the
    /// maths. The CPU engine leaves this off and uses exact constants.
    pub fp16_constants: bool,
    /// LoRA adapters as extra dynamic-weight regions, if any.
    pub lora: Option<LoraKernel>,
    /// Smallest input and output surface in bytes: the layout pads the
    /// input with unused columns and the output with zero channels up to
    /// it (the device rejects smaller surfaces; see
    /// [`ane::rules::MIN_SURFACE_BYTES`]). 0 in seed-compatible mode.
    pub min_surface_bytes: usize,
    /// The device's limits (its chip family's, see [`ane::family`]):
    /// padding never widens an input past the spatial cap, and [`tiling`]
    /// splits kernels whose programs would break a limit.
    pub limits: ane::family::Limits,
    /// Tile every kernel at least this many times where its axis allows
    /// (`ANETRAIN_ANE_MIN_TILES`; 1 unless set): exercises tiled execution
    /// on models too small to need it.
    pub min_tiles: usize,
    /// Split the sequence of every kernel that may split it into at least
    /// this many blocks, where the length allows (`ANETRAIN_ANE_SEQ_TILES`;
    /// 1 unless set): exercises sequence tiling at short lengths.
    pub min_seq_tiles: usize,
    /// Tile a kernel further, where an axis allows, until one tile's input
    /// and output surfaces are at most this many bytes each (`None`: only as far as the
    /// device's limits need; Hugging Face models: [`MAX_TILE_BYTES`]).
    pub max_tile_bytes: Option<usize>,
    /// The chip family whose cost model ([`ane::cost::Rates`]) chooses
    /// among the tilings that pass the rules within the cap: the family
    /// in force, else the M1 (the slowest measured row).
    pub cost_family: ane::family::Family,
    /// What `anetrain doctor` measured on this machine's engine (its
    /// profile's family and timing): used in place of the table's rates
    /// when `cost_family` is that family ([`KernelOptions::cost_rates`]).
    pub cost_measured: Option<(ane::family::Family, ane::family::Measured)>,
    /// Run a tiled attention backward as the fused `sdpa_backward` (P and
    /// dP kept on the device) where the cost model predicts it faster
    /// than the pair; off, `sdpa_backward1`/`sdpa_backward2` always run
    /// (tests of the pair's tile hand-off). Whole layers keep the pair.
    pub fuse_attention_backward: bool,
}

/// The largest tile surface (input or output) the device kernels are built for (where an axis
/// allows cutting further): what a device buffer holds at most, so it
/// bounds streamed buffers, the host's staging copy and the simulator's
/// working set to a few tens of megabytes per kernel whatever the model's
/// size (see `device::DeviceBuffers`). Tiles share a program, so this
/// adds device evaluations, not compiles. Both buffer modes run the same
/// tiles, which is what makes them give the same bits.
pub const MAX_TILE_BYTES: usize = 16 << 20;

/// What the kernels need to know about LoRA adapters: every adapted
/// projection `W` gains regions `A [r, in]` and `B [out, r]` and computes
/// `W·x + scale·B·(A·x)` (forward) or `Wᵀ·dy + scale·Aᵀ·(Bᵀ·dy)` (backward).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoraKernel {
    pub rank: usize,
    pub scale: f64,
    pub targets: Vec<Projection>,
    /// The last layers adapted (`--lora-layers`), `None` every one: the
    /// programs are the same, the backward stops below them (what the
    /// plan counts).
    pub layers: Option<usize>,
}

impl LoraKernel {
    /// What the kernels need of adapters configured as `cfg`.
    pub fn of(cfg: &LoraConfig) -> LoraKernel {
        LoraKernel {
            rank: cfg.rank,
            scale: cfg.scale(),
            targets: cfg.targets.clone(),
            layers: cfg.layers,
        }
    }

    /// The layers of `n` whose backward runs: the adapted ones.
    pub fn backward_layers(&self, n: usize) -> usize {
        self.layers.map_or(n, |l| l.min(n))
    }
}

impl KernelOptions {
    /// Hugging Face semantics for `cfg`.
    pub fn hf(cfg: &ModelConfig) -> KernelOptions {
        let profile = ane::family::Profile::in_force();
        let measured = profile
            .as_ref()
            .ok()
            .and_then(|p| p.family.zip(p.timing.clone()));
        KernelOptions {
            rope: Rope::HalfSplit {
                rotary: cfg.rotary_dim(),
            },
            rope_theta: cfg.rope_theta,
            rope_scaling: cfg.rope_scaling.clone(),
            local_rope_theta: cfg.local_rope_theta,
            layer: cfg.layer(),
            eps: cfg.rms_norm_eps,
            residual_scale: cfg.scales.residual,
            score_scale: cfg.score_scale(),
            score_cap: cfg.scales.attention_cap,
            class: cfg.layer_class(0),
            seed_compat: false,
            fp16_constants: false,
            lora: None,
            min_surface_bytes: ane::rules::MIN_SURFACE_BYTES,
            limits: profile.as_ref().map(|p| p.limits).unwrap_or_default(),
            min_tiles: tiling::min_tiles_from_env(),
            min_seq_tiles: tiling::min_seq_tiles_from_env(),
            max_tile_bytes: Some(MAX_TILE_BYTES),
            cost_family: profile
                .ok()
                .and_then(|p| p.family)
                .unwrap_or(ane::family::Family::M1),
            cost_measured: measured,
            // A bad value stops the CLI before any command (`main`).
            fuse_attention_backward: tiling::fuse_attention_backward_from_env().unwrap_or(true),
        }
    }

    /// Built for `profile`'s chip instead of the one in force: its limits,
    /// and its family's rates to choose plans by.
    pub fn for_profile(mut self, profile: &ane::family::Profile) -> KernelOptions {
        self.limits = profile.limits;
        if let Some(f) = profile.family {
            self.cost_family = f;
        }
        self
    }

    /// The rates plans are chosen by: `cost_family`'s row of the table,
    /// with what `doctor` measured on this chip in its place when the
    /// chip is of that family.
    pub fn cost_rates(&self) -> ane::cost::Rates {
        let table = ane::cost::Rates::of(self.cost_family);
        match &self.cost_measured {
            Some((f, m)) if *f == self.cost_family => table.with_measured(m),
            _ => table,
        }
    }

    /// Hugging Face semantics for a model of `cfg` with adapters of `lora`
    /// (the one place a run's kernel options are built).
    pub fn for_run(cfg: &ModelConfig, lora: Option<&LoraConfig>) -> KernelOptions {
        KernelOptions::hf(cfg).with_lora(lora)
    }

    /// These options with adapters of `lora` on the projections (none for
    /// `None`).
    pub fn with_lora(mut self, lora: Option<&LoraConfig>) -> KernelOptions {
        self.lora = lora.map(LoraKernel::of);
        self
    }

    /// [`KernelOptions::for_run`] for `model` and its adapters, if any.
    pub fn for_model(model: &crate::model::Model) -> KernelOptions {
        KernelOptions::for_run(&model.cfg, model.lora.as_ref().map(|l| &l.cfg))
    }

    /// Whether a program joins its output blocks into one output with
    /// `concat` (and pads it to the minimum surface with zero channels):
    /// unless the device rejects `concat` (Orion docs/ane_constraints.md
    /// §1), when each block is an output of its own and the device
    /// allocates the surfaces (§2). The seed's programs always join.
    pub fn joins_outputs(&self) -> bool {
        self.limits.concat || self.seed_compat
    }

    /// The power of two a residual branch's product input is scaled by
    /// before the product and its output by the inverse after, on devices
    /// whose matmul outputs turn to ±inf past 32752 (every measured chip:
    /// ANEForge docs/numeric-cliffs.md, "Matmul output saturation": "Scale
    /// activations or weights before the matmul and undo the scale
    /// afterwards"). With ½ every output fp16 can hold (up to 65504) stays
    /// under the cliff inside the product; scaling by a power of two is
    /// exact for fp16 normal values. `None`: no cliff, or seed programs.
    pub fn cliff_prescale(&self) -> Option<f64> {
        (self.limits.matmul_cliff.is_some() && !self.seed_compat).then_some(0.5)
    }

    /// Whether the attention normalises queries and keys per head.
    pub fn qk_norm(&self) -> bool {
        self.layer.qk_norm()
    }

    /// The adapter (rank, scale) of projection `t`, if it has one.
    pub fn adapter(&self, t: Projection) -> Option<(usize, f64)> {
        let l = self.lora.as_ref()?;
        l.targets.contains(&t).then_some((l.rank, l.scale))
    }

    /// The seed's conventions: interleaved RoPE with θ = 10000, no QK-norm,
    /// DeepNet residual scaling, seed layouts.
    pub fn seed(cfg: &ModelConfig) -> KernelOptions {
        KernelOptions {
            rope: Rope::Interleaved,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            local_rope_theta: None,
            layer: LayerSpec {
                mixer: Mixer::Attention {
                    qk_norm: crate::model::layer::QkNorm::None,
                    qkv_bias: false,
                },
                ..cfg.layer()
            },
            eps: cfg.rms_norm_eps,
            residual_scale: 1.0 / (2.0 * cfg.num_hidden_layers as f64).sqrt(),
            score_scale: 1.0 / (cfg.head_dim as f64).sqrt(),
            score_cap: None,
            class: LayerClass::default(),
            seed_compat: true,
            fp16_constants: false,
            lora: None,
            min_surface_bytes: 0,
            limits: ane::rules::Limits::default().with_max_dim(ane::rules::MAX_DIM),
            min_tiles: 1,
            min_seq_tiles: 1,
            max_tile_bytes: None,
            // Untiled: nothing to choose.
            cost_family: ane::family::Family::M4,
            cost_measured: None,
            // The seed's six programs per multi-head layer, its ten otherwise.
            fuse_attention_backward: false,
        }
    }
}

impl KernelOptions {
    /// A constant as the twin should use it (rounded to fp16 when
    /// `fp16_constants` is set).
    pub fn constant(&self, v: f64) -> f32 {
        if self.fp16_constants {
            mil::tensor::round_f16(v as f32)
        } else {
            v as f32
        }
    }

    /// The epsilon QK-norm adds on the device: the config's, raised to
    /// fp16's smallest normal value (2⁻¹⁴ ≈ 6.1e-5) when smaller. Qwen3's
    /// 1e-6 is an fp16 *subnormal*: a device that flushes subnormals would
    /// read it as 0, and a zero-padded position would then normalise as
    /// 0·(0)^(−1/2) = 0·∞ = NaN, which attention spreads into real rows.
    /// For a row whose mean square is above 0.12 the change is below fp16's
    /// rounding (2⁻¹¹ relative); the CPU engine keeps the config's value.
    /// As `(k·ε, k)` with k = 1 ([`Gen::head_rms_norm`]).
    pub fn device_eps(&self) -> (f64, f64) {
        (self.eps.max(F16_MIN_NORMAL), 1.0)
    }

    /// The epsilon of a norm over a whole projection (OLMo 2's QK-norm) on
    /// the device, as `(k·ε, k)`: k the smallest power of 4 that makes
    /// k·ε an fp16 normal value, and the program computes
    /// (k·mean(x²) + k·ε)^(−1/2)·√k — the config's ε, not a raised one
    /// (OLMo 2's layers read the residual stream unnormed, so a mean square
    /// of 1e-4 is ordinary and a raised ε would move it by a tenth). k·mean(x²)
    /// stays in fp16 up to a mean square of 65504/k (1023 for ε = 1e-6, an
    /// RMS of 32): [`KernelOptions::whole_norm_bound`].
    pub fn whole_norm_eps(&self) -> (f64, f64) {
        let mut k = 1.0;
        while self.eps * k < F16_MIN_NORMAL {
            k *= 4.0;
        }
        (self.eps * k, k)
    }

    /// The largest mean square of a projection the device's whole-projection
    /// norm holds ([`KernelOptions::whole_norm_eps`]).
    pub fn whole_norm_bound(&self) -> f64 {
        F16_MAX / self.whole_norm_eps().1
    }

    /// The QK-norm epsilon as the twin should use it: the device's (as
    /// the program's fp16 constant, k·ε, over k) when computing with the
    /// program's constants, else the config's (Hugging Face parity).
    pub fn norm_eps(&self) -> f32 {
        if !self.fp16_constants {
            return self.eps as f32;
        }
        let (eps, k) = match self.layer.qk_norm_kind() {
            crate::model::layer::QkNorm::Whole => self.whole_norm_eps(),
            _ => self.device_eps(),
        };
        self.constant(eps) / k as f32
    }

    /// These options for layer `layer` of a model of `cfg`: its class's
    /// RoPE and window.
    pub fn for_layer(&self, cfg: &ModelConfig, layer: usize) -> KernelOptions {
        KernelOptions {
            class: cfg.layer_class(layer),
            ..self.clone()
        }
    }

    /// [`KernelOptions::for_layer`], borrowing these options when the
    /// layer's class is theirs.
    pub fn of_layer(&self, cfg: &ModelConfig, layer: usize) -> std::borrow::Cow<'_, KernelOptions> {
        match cfg.layer_class(layer) == self.class {
            true => std::borrow::Cow::Borrowed(self),
            false => std::borrow::Cow::Owned(self.for_layer(cfg, layer)),
        }
    }

    /// RoPE tables of the model's θ and scaling (what a program's
    /// constants hold before fp16); a layer without RoPE's are cos = 1,
    /// sin = 0 (see [`LayerClass::rope`]).
    pub fn exact_rope_tables(&self, seq: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        match self.class.rope {
            true => {
                let (theta, scaling) = self.class_rope();
                rope_tables(seq, hd, theta, &scaling, self.rope)
            }
            false => (vec![1.0; seq * hd], vec![0.0; seq * hd]),
        }
    }

    /// The RoPE base and scaling of the class in force.
    fn class_rope(&self) -> (f64, RopeScaling) {
        match (self.class.local_rope, self.local_rope_theta) {
            (true, Some(local)) => (local, RopeScaling::Default),
            _ => (self.rope_theta, self.rope_scaling.clone()),
        }
    }

    /// One position's RoPE row (`cos, sin [HD]`) of
    /// [`KernelOptions::exact_rope_tables`] of `len` positions.
    pub fn rope_row(&self, pos: usize, len: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        match self.class.rope {
            true => {
                let (theta, scaling) = self.class_rope();
                rope_row(pos, len, hd, theta, &scaling, self.rope)
            }
            false => (vec![1.0; hd], vec![0.0; hd]),
        }
    }

    /// RoPE tables as the twin should use them.
    pub fn rope_tables(&self, seq: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut c, mut s) = self.exact_rope_tables(seq, hd);
        if self.fp16_constants {
            mil::tensor::round_to_f16_in_place(&mut c);
            mil::tensor::round_to_f16_in_place(&mut s);
        }
        (c, s)
    }
}
