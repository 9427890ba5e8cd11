//! CPU kernels for the element-wise work of an encoder (or a decoder's
//! feed-forward) forward pass.
//!
//! MLX's Linux CPU backend evaluates `exp`/`erf` one scalar at a time and its
//! compiled kernels are built without AVX, so on x86 the attention softmax
//! and the FFN's GELU cost as much as the GEMMs around them
//! (docs/benchmarks.md). These kernels work in place on a float32 buffer the
//! engine hands over between two MLX ops:
//!
//! * [`masked_softmax`]: scale, key-length mask and softmax over the last
//!   axis of attention scores, fused in three passes over each row;
//! * [`gelu`]: exact (erf) GELU through a rational erf;
//! * [`gated_linear_unit`]: the decoders' `silu(gate) * up` (SwiGLU) or
//!   `gelu_tanh(gate) * up` (GeGLU);
//! * [`add_layer_norm`]: residual add and layer norm in one pass pair;
//! * [`attention`]: multi-head attention from the fused q/k/v projection to
//!   merged heads, the softmax's masking and scale included;
//! * [`decoder_attention`]: a decoder's or an encoder's self-attention
//!   (causal or not, grouped-query heads, a window, a soft-cap or ALiBi's
//!   bias) per text from q, k and v as they lie, keys in tiles with a
//!   streaming softmax;
//! * [`linear`]: `x @ w^T + bias` (optionally GELU) on weights packed once
//!   by [`pack_weights`] (the BLAS re-packs them on every call);
//! * [`post_ln_encoder`]: a stack of BERT's post-LN blocks from the kernels
//!   above in one call (no round trip through Python between them).
//!
//! Each is compiled three times, generic, with AVX2+FMA and with AVX-512,
//! and picks at run time (the FMA builds give the same bits); the code is
//! written with 8- and 16-lane arrays the compiler maps onto SIMD registers,
//! so no intrinsics; `unsafe` only in the dispatch and where
//! [`linear`]'s, [`attention`]'s and [`decoder_attention`]'s threads write
//! disjoint parts of one
//! output buffer.

mod attention;
mod causal_attention;
mod dispatch;
mod encoder;
mod exp;
mod gelu;
mod glu;
mod layer_norm;
mod linear;
mod parallel;
mod pool;
mod softmax;

pub use attention::{attention, AttentionShape};
pub use causal_attention::{decoder_attention, DecoderMask, DecoderShape, Strided, KEY_TILE};
pub use encoder::{post_ln_encoder, Norm, PackedLinear, PostLnBlock};
pub use gelu::gelu;
pub use glu::{gated_linear_unit, GateActivation};
pub use layer_norm::add_layer_norm;
pub use linear::{linear, pack_weights, packed_len, Activation, LinearShape, PANEL};
pub use softmax::{masked_softmax, SoftmaxShape};

pub use dispatch::{check_simd_env, SIMD_ENV};

/// Which build of the kernels runs on this CPU (for logs and benchmarks),
/// within the [`SIMD_ENV`] cap.
pub fn simd_level() -> &'static str {
    if dispatch::has_avx512() {
        "avx512f"
    } else if dispatch::has_avx2_fma() {
        "avx2+fma"
    } else {
        "generic"
    }
}

/// The arguments every attention kernel shares: one key length per text
/// (`texts` of them), none past the `len` positions a text has room for,
/// and a finite positive scale.
pub(crate) fn check_keys(
    key_lengths: &[usize],
    texts: usize,
    len: usize,
    scale: f32,
) -> Result<(), KernelError> {
    if key_lengths.len() != texts {
        return Err(KernelError::Shape(format!(
            "{} key lengths for {texts} texts",
            key_lengths.len()
        )));
    }
    if let Some(&bad) = key_lengths.iter().find(|&&n| n > len) {
        return Err(KernelError::Shape(format!(
            "key length {bad} > text length {len}"
        )));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return Err(KernelError::Shape(format!(
            "scale must be positive, got {scale}"
        )));
    }
    Ok(())
}

/// Reasons a kernel refuses its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The buffer's length or the key lengths do not match the described shape.
    #[error("{0}")]
    Shape(String),
    /// An invalid setting (the [`SIMD_ENV`] variable).
    #[error("{0}")]
    Config(String),
}
