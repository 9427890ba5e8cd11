//! Run-time choice between the AVX-512, the AVX2+FMA and the generic build
//! of a kernel.

/// Whether the AVX2+FMA (or a wider) build can run here.
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(test)]
    if tests::FORCE_GENERIC.with(|force| force.get()) {
        return false;
    }
    detected().avx2_fma
}

/// Whether the AVX-512 build can run here (AVX-512F besides AVX2 and FMA).
pub(crate) fn has_avx512() -> bool {
    #[cfg(test)]
    if tests::FORCE_NARROW.with(|force| force.get()) {
        return false;
    }
    has_avx2_fma() && detected().avx512
}

#[derive(Clone, Copy)]
struct Detected {
    avx2_fma: bool,
    avx512: bool,
}

/// The environment variable that caps the build the kernels run: `avx512`,
/// `avx2` or `generic` (a cap, never more than the CPU has). It measures how
/// the narrower builds run on a wide CPU, and sidesteps a build that
/// misbehaves on some CPU without a rebuild.
pub const SIMD_ENV: &str = "MLX_EMBED_SIMD";

/// The most a [`SIMD_ENV`] value allows: (AVX2+FMA, AVX-512).
fn cap_from(value: Option<&str>) -> Result<(bool, bool), String> {
    match value.map(str::trim) {
        None | Some("") | Some("avx512") => Ok((true, true)),
        Some("avx2") => Ok((true, false)),
        Some("generic") => Ok((false, false)),
        Some(other) => Err(format!(
            "{SIMD_ENV}={other:?}: expected avx512, avx2 or generic"
        )),
    }
}

/// The [`SIMD_ENV`] setting, read once.
fn cap_setting() -> &'static Result<(bool, bool), String> {
    use std::sync::OnceLock;
    static CAP: OnceLock<Result<(bool, bool), String>> = OnceLock::new();
    CAP.get_or_init(|| cap_from(std::env::var(SIMD_ENV).ok().as_deref()))
}

/// The [`SIMD_ENV`] cap; an invalid value caps nothing (the module that
/// loads the kernels refuses it through [`check_simd_env`]).
#[cfg(target_arch = "x86_64")]
fn cap() -> (bool, bool) {
    *cap_setting().as_ref().unwrap_or(&(true, true))
}

/// An error naming the valid values if [`SIMD_ENV`] holds an invalid one.
pub fn check_simd_env() -> Result<(), crate::KernelError> {
    match cap_setting() {
        Ok(_) => Ok(()),
        Err(message) => Err(crate::KernelError::Config(message.clone())),
    }
}

#[cfg(target_arch = "x86_64")]
fn detected() -> Detected {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<Detected> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        let (avx2_allowed, avx512_allowed) = cap();
        Detected {
            avx2_fma: avx2_allowed
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            avx512: avx512_allowed && std::arch::is_x86_feature_detected!("avx512f"),
        }
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn detected() -> Detected {
    Detected {
        avx2_fma: false,
        avx512: false,
    }
}

/// `a * b + c`, fused where the build has FMA. A plain `mul_add` without it
/// would call libm's software fma, far slower than the two operations.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `simd_dispatch! { fn name<FMA>(args) { body } }` defines `name(args)`,
/// which runs `body` compiled for AVX-512 or AVX2+FMA (with the const `FMA`
/// = true) when the CPU has them, else compiled for the baseline target
/// (`FMA` = false). `fn name<FMA, WIDE>` also gives the body a const `WIDE`,
/// true in the AVX-512 build only, for tiles sized to its 32 registers of 16
/// lanes. Every build does the same float operations in the same order (the
/// compiler does not reassociate them), so all give the same bits.
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident<$fma:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $crate::dispatch::simd_dispatch!($vis fn $name<$fma, _WIDE>($($arg: $ty),*) $(-> $ret)? $body);
    };
    ($vis:vis fn $name:ident<$fma:ident, $wide:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            // Inlined into each wrapper below, so it is compiled once with
            // each wrapper's target features.
            #[inline(always)]
            fn body<const $fma: bool, const $wide: bool>($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn with_avx512($($arg: $ty),*) $(-> $ret)? {
                    body::<true, true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn with_avx2($($arg: $ty),*) $(-> $ret)? {
                    body::<true, false>($($arg),*)
                }
                if $crate::dispatch::has_avx512() {
                    // SAFETY: the CPU was just checked for AVX-512F, AVX2
                    // and FMA.
                    return unsafe { with_avx512($($arg),*) };
                }
                if $crate::dispatch::has_avx2_fma() {
                    // SAFETY: the CPU was just checked for AVX2 and FMA.
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            body::<false, false>($($arg),*)
        }
    };
}

pub(crate) use simd_dispatch;

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;

    thread_local! {
        pub(super) static FORCE_GENERIC: Cell<bool> = const { Cell::new(false) };
        pub(super) static FORCE_NARROW: Cell<bool> = const { Cell::new(false) };
    }

    /// Runs `f` on this thread's generic (baseline) kernels, the ones a CPU
    /// without AVX2+FMA gets. Per thread: use one kernel thread inside.
    pub(crate) fn on_generic_kernels<R>(f: impl FnOnce() -> R) -> R {
        FORCE_GENERIC.with(|force| force.set(true));
        let out = f();
        FORCE_GENERIC.with(|force| force.set(false));
        out
    }

    /// Runs `f` on this thread's AVX2+FMA kernels where the CPU has AVX-512
    /// (else on what it has). Per thread: use one kernel thread inside.
    pub(crate) fn on_avx2_kernels<R>(f: impl FnOnce() -> R) -> R {
        FORCE_NARROW.with(|force| force.set(true));
        let out = f();
        FORCE_NARROW.with(|force| force.set(false));
        out
    }

    /// The builds this CPU can run: (name, kernel threads), with `f` run on
    /// that build.
    pub(crate) fn each_build(mut f: impl FnMut(&str, usize)) {
        // The detected build with 1 and 2 kernel threads, then the narrower
        // ones on one thread.
        f("detected", 1);
        f("detected", 2);
        if super::has_avx512() {
            on_avx2_kernels(|| f("avx2", 1));
        }
        on_generic_kernels(|| f("generic", 1));
    }

    #[test]
    fn the_simd_env_caps_the_build_and_names_its_values() {
        use super::cap_from;
        assert_eq!(cap_from(None), Ok((true, true)));
        assert_eq!(cap_from(Some("")), Ok((true, true)));
        assert_eq!(cap_from(Some("avx512")), Ok((true, true)));
        assert_eq!(cap_from(Some(" avx2 ")), Ok((true, false)));
        assert_eq!(cap_from(Some("generic")), Ok((false, false)));
        assert_eq!(
            cap_from(Some("sse4")),
            Err(r#"MLX_EMBED_SIMD="sse4": expected avx512, avx2 or generic"#.to_owned())
        );
    }

    #[test]
    fn the_overrides_hold_for_their_closure_only() {
        assert!(!on_generic_kernels(super::has_avx2_fma));
        assert!(!on_generic_kernels(super::has_avx512));
        assert!(!on_avx2_kernels(super::has_avx512));
        assert_eq!(
            on_avx2_kernels(super::has_avx2_fma),
            super::detected().avx2_fma
        );
        assert_eq!(super::has_avx2_fma(), super::detected().avx2_fma);
        assert_eq!(
            super::has_avx512(),
            super::detected().avx2_fma && super::detected().avx512
        );
    }
}
