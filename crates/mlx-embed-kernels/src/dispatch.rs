//! Run-time choice between the AVX2+FMA and the generic build of a kernel.

pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(test)]
    if tests::FORCE_GENERIC.with(|force| force.get()) {
        return false;
    }
    detected()
}

#[cfg(target_arch = "x86_64")]
fn detected() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn detected() -> bool {
    false
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
/// which runs `body` compiled for AVX2+FMA (with the const `FMA` = true) when
/// the CPU has them, else compiled for the baseline target (`FMA` = false).
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident<$fma:ident>($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $vis fn $name($($arg: $ty),*) {
            // Inlined into each wrapper below, so it is compiled once with
            // each wrapper's target features.
            #[inline(always)]
            fn body<const $fma: bool>($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn with_avx2($($arg: $ty),*) {
                    body::<true>($($arg),*)
                }
                if $crate::dispatch::has_avx2_fma() {
                    // SAFETY: the CPU was just checked for AVX2 and FMA.
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            body::<false>($($arg),*)
        }
    };
}

pub(crate) use simd_dispatch;

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;

    thread_local! {
        pub(super) static FORCE_GENERIC: Cell<bool> = const { Cell::new(false) };
    }

    /// Runs `f` on this thread's generic (baseline) kernels, the ones a CPU
    /// without AVX2+FMA gets. Per thread: use one kernel thread inside.
    pub(crate) fn on_generic_kernels<R>(f: impl FnOnce() -> R) -> R {
        FORCE_GENERIC.with(|force| force.set(true));
        let out = f();
        FORCE_GENERIC.with(|force| force.set(false));
        out
    }

    /// Both builds this CPU can run: (name, run `f` on that build).
    pub(crate) fn each_build(mut f: impl FnMut(&str, usize)) {
        // The detected build with 1 and 2 kernel threads, then the generic one.
        f("detected", 1);
        f("detected", 2);
        on_generic_kernels(|| f("generic", 1));
    }

    #[test]
    fn the_generic_override_holds_for_its_closure_only() {
        assert!(!on_generic_kernels(super::has_avx2_fma));
        assert_eq!(super::has_avx2_fma(), super::detected());
    }
}
