//! The embedding cache's memory, measured by the allocator: a full cache
//! holds no more live heap than `cache_bytes`. Its own test binary, since
//! the counting allocator sees every thread of the process.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Duration;

use common::*;
use mlx_embed_core::{BatcherConfig, EmbedOptions};

/// The system allocator, counting live bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Live heap growth across starting a batcher and embedding `n` distinct
/// texts, 50 per request, with the batcher still alive at the end.
fn growth(cache_bytes: usize, n: usize) -> (isize, mlx_embed_core::CacheMetrics) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = LIVE.load(Relaxed);
    let (batcher, record) = start(
        BatcherConfig {
            cache_bytes,
            ..BatcherConfig::default()
        },
        Duration::ZERO,
        None,
    );
    runtime.block_on(async {
        for i in 0..n / 50 {
            let texts: Vec<String> = (0..50)
                .map(|j| format!("a distinct text, number {i:05}-{j:02}"))
                .collect();
            batcher
                .embed(owned_texts(&texts), EmbedOptions::default())
                .await
                .unwrap();
        }
    });
    // The fake records every batch it saw; that is the test's memory, not the batcher's.
    record.batches.lock().unwrap().clear();
    record.batches.lock().unwrap().shrink_to_fit();
    let grown = LIVE.load(Relaxed) - before;
    let metrics = batcher.metrics().cache;
    drop(batcher);
    drop(runtime);
    // The model thread exits on its own after the batcher is gone; what it
    // frees must not land in the next run's count.
    std::thread::sleep(Duration::from_millis(200));
    (grown, metrics)
}

#[test]
fn a_full_cache_holds_no_more_heap_than_cache_bytes() {
    const CAPACITY: usize = 256 << 10;
    const TEXTS: usize = 20_000;
    // About every other run keeps ~14 KB more heap, with or without a cache
    // alike (buffers sized by how the batches happened to form): the least
    // of a few runs is the steady state.
    let least = |cache_bytes| {
        (0..5)
            .map(|_| growth(cache_bytes, TEXTS))
            .min_by_key(|(grown, _)| *grown)
            .unwrap()
    };
    let (without, _) = least(0);
    let (with, m) = least(CAPACITY);
    assert_eq!(m.misses, TEXTS as u64);
    assert!(
        m.bytes <= CAPACITY as u64 && m.bytes > CAPACITY as u64 * 9 / 10,
        "accounted {} of {CAPACITY}",
        m.bytes
    );
    assert!(m.entries > 100 && m.entries < TEXTS as u64 / 10, "{m:?}");
    let cache_heap = with - without;
    println!(
        "cache heap {cache_heap} bytes for {} entries ({} per entry); accounted {} of {CAPACITY}",
        m.entries,
        cache_heap / m.entries as isize,
        m.bytes
    );
    // The counting allocator sees requested sizes; the system allocator adds
    // a header of up to 16 bytes to each of an entry's three blocks.
    let with_headers = cache_heap + 48 * m.entries as isize;
    assert!(
        with_headers <= CAPACITY as isize,
        "the cache holds {with_headers} bytes of heap, over its {CAPACITY}"
    );
    // The measurement does see the cache: at least its vectors and ids.
    let payload = m.entries as isize * (4 * DIM as isize + 4 * 30);
    assert!(cache_heap >= payload, "{cache_heap} < {payload}");
}
